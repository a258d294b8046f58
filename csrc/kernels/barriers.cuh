// Barriers for warp-specialised kernels: named barriers (a subset of the block's warps syncs without the others),
// mbarriers (arrival counts and transaction bytes in shared memory, phase by phase) and the asynchronous copies that
// complete on them (cp.async's arrive-on, bulk copies). Under DCP_SIMT the executor emulates them (simt/barriers.h):
// attached copies land late or early by the schedule, so a read without a wait, or a copy into a buffer still in
// use, gives a wrong answer in the tests.
//
// What a kernel must keep (the GPU's rules):
//   - named barriers: ids 1 .. 15 (0 is __syncthreads'), a thread count that is a multiple of 32 and the same at
//     every arrival of one instance, all lanes of a warp arriving together;
//   - an mbarrier is a uint64_t in shared memory (8-byte aligned), initialised by one thread (mbarrier_init) and made
//     visible by a __syncthreads before any other use; not re-initialised while work is attached or threads wait;
//   - a phase completes when `count` arrivals and every expected transaction byte (mbarrier_arrive_expect_tx, then
//     the bulk copies' bytes) are in; a waiter names the parity of the phase it waits for (0 for the first) and flips
//     it after each completion; a consumer waits before it reads what the phase brings, a producer waits for the
//     consumers' release of a buffer before it copies into it again;
//   - shared memory that a wgmma reads after a bulk copy needs no proxy fence (the copy is in the async proxy);
//     after cp.async or the threads' own stores, fence_proxy_async (kernels/wgmma.cuh) before the arrival.
// mbarrier.expect_tx and bulk copies are sm_90 instructions (they trap before); named barriers, mbarrier.init, arrive,
// test_wait (try_wait's sm_80 form) and the cp.async arrive-on are sm_80's.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/mma.cuh"  // smem_addr

namespace dcp_ops::kernels {

// bar.sync id, threads (WAIT: waits until `threads` threads, whole warps, have arrived at barrier id) or bar.arrive
// (arrives without waiting: a producer's signal to the threads in bar.sync).
template <bool WAIT>
__device__ __forceinline__ void named_barrier(int id, int threads) {
#ifdef DCP_SIMT
  simt::named_barrier(id, threads, WAIT);
#elif defined(__CUDA_ARCH__)
  if constexpr (WAIT)
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  else
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) { named_barrier<true>(id, threads); }
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) { named_barrier<false>(id, threads); }

// mbarrier.init: phase 0 expects `count` arrivals.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
#ifdef DCP_SIMT
  simt::mbarrier_init(bar, count);
#elif defined(__CUDA_ARCH__)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}

// mbarrier.arrive: one arrival (release semantics: this thread's earlier writes are visible to the waiters).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#ifdef DCP_SIMT
  simt::mbarrier_arrive(bar, 0);
#elif defined(__CUDA_ARCH__)
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// mbarrier.arrive.expect_tx: the phase also waits for `bytes` transaction bytes (the bulk copies'), then one arrival.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef DCP_SIMT
  simt::mbarrier_arrive(bar, bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();  // sm_90 and later
#endif
}

// mbarrier.try_wait.parity: whether the phase of this parity has completed (the barrier's phase is past it).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, int parity) {
#ifdef DCP_SIMT
  return simt::mbarrier_try_wait(bar, parity);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
#elif defined(__CUDA_ARCH__)
  unsigned done;  // sm_80's form, which does not suspend the thread
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
#else
  return true;
#endif
}

// Waits until the phase of this parity has completed (acquire: the phase's writes and copies are visible after it).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
#ifdef DCP_SIMT
  simt::mbarrier_wait(bar, parity);
#else
  while (!mbarrier_try_wait(bar, parity)) {
  }
#endif
}

// cp.async.mbarrier.arrive.noinc: one arrival on bar once every cp.async this thread issued before it has landed (it
// counts against the phase's expected arrivals).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* bar) {
#ifdef DCP_SIMT
  simt::cp_async_mbarrier_arrive(bar, true);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// cp.async.bulk global -> shared: `bytes` (a multiple of 16; both addresses 16-byte aligned) from src to dst, one
// thread issuing, completing `bytes` transaction bytes on bar when they land.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef DCP_SIMT
  simt::bulk_copy(dst, src, static_cast<int>(bytes), bar);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();  // sm_90 and later
#endif
}

}  // namespace dcp_ops::kernels
