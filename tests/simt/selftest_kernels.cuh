// Kernels that test the SIMT executor itself: warp shuffles, shared memory + barriers, atomics, a missing barrier,
// cp.async, bank counting, wgmma, named barriers and mbarriers.
#pragma once

#include "kernels/barriers.cuh"
#include "kernels/common.cuh"
#include "kernels/cp_async.cuh"
#include "kernels/mma.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace simt_selftest {

// Sum of each warp's 32 values by butterfly shuffles; lane 0 writes it. Also a ballot of odd values.
__global__ void warp_reduce(const float* x, float* sums, unsigned* odd_ballots, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
  const unsigned odd = __ballot_sync(0xffffffffu, i < n && (static_cast<int>(x[i]) & 1));
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const float down = __shfl_down_sync(0xffffffffu, v, 1);  // every lane already holds the sum
  if (threadIdx.x % 32 == 0) {
    sums[i / 32] = v + 0.f * down;
    odd_ballots[i / 32] = odd;
  }
}

// out = in^T for a 32 x 32 tile per block, through static shared memory with a barrier.
__global__ void transpose32(const float* in, float* out, int tiles) {
  __shared__ float tile[32][33];
  const int t = blockIdx.x;
  if (t >= tiles) return;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) tile[r][threadIdx.x] = in[t * 1024 + r * 32 + threadIdx.x];
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) out[t * 1024 + r * 32 + threadIdx.x] = tile[threadIdx.x][r];
}

// Histogram with shared-memory atomics per block, then global atomics; dynamic shared memory for the bins.
__global__ void histogram(const int* x, int n, int bins, int* out) {
  DCP_DYNAMIC_SMEM(int, local);
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) atomicAdd(&local[x[i]], 1);
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) atomicAdd(&out[b], local[b]);
}

// Each thread writes its slot, then thread `reader` sums all slots. With `sync` false the barrier is missing: a race.
__global__ void block_sum(const float* x, float* out, bool sync, unsigned reader) {
  __shared__ float slots[256];
  slots[threadIdx.x] = x[threadIdx.x];
  if (sync) __syncthreads();
  if (threadIdx.x == reader) {
    float s = 0.f;
    for (unsigned i = 0; i < blockDim.x; ++i) s += slots[i];
    *out = s;
  }
}

// A barrier only some threads reach: undefined in CUDA, reported by the executor.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.f;
}

// cp.async in two commit groups: thread i copies 4 floats of x into group A, then 4 more into group B. It reads its
// shared slots before any wait (seen[0]), after wait_group 1 (seen[1]: A landed, B in flight) and after wait_group 0
// (seen[2]). seen: [3][threads][8].
__global__ void async_copy(const float* x, float* seen) {
  DCP_DYNAMIC_SMEM(float, slots);
  const int i = threadIdx.x, n = blockDim.x;
  float* mine = slots + 8 * i;
  dcp_ops::kernels::cp_async16(mine, x + 8 * i, true);
  dcp_ops::kernels::cp_async_commit();
  dcp_ops::kernels::cp_async16(mine + 4, x + 8 * i + 4, true);
  dcp_ops::kernels::cp_async_commit();
  auto record = [&](int k) {
    for (int e = 0; e < 8; ++e) seen[(k * n + i) * 8 + e] = mine[e];
  };
  record(0);
  dcp_ops::kernels::cp_async_wait<1>();
  record(1);
  dcp_ops::kernels::cp_async_wait<0>();
  record(2);
}

// One warp-wide 32-bit shared store per row of a 32 x `stride` word tile: lane l stores word l * stride of row 0
// (the bank-conflict counter's test: stride 1 is conflict-free, stride 2 two-way, stride 32 32-way).
__global__ void strided_store(int stride, float* out) {
  DCP_DYNAMIC_SMEM(uint32_t, words);
  dcp_ops::kernels::st_shared_u32(words + threadIdx.x * stride, threadIdx.x);
  __syncwarp();
  out[threadIdx.x] = static_cast<float>(words[threadIdx.x * stride]);
}

constexpr int kWgmmaMaxSteps = 4;

// One warpgroup's wgmmas (kernels/wgmma.cuh) on a byte image of shared memory: the 128 threads copy `image` into
// dynamic shared memory, then issue `nsteps` wgmmas in order. Step s takes the descriptors descs[2 s] (A, unused when
// A comes from a_regs: [nsteps][128][4] registers) and descs[2 s + 1] (B), accumulates into accumulator
// steps[3 s] (0 or 1) with scale-d steps[3 s + 1], and commits after it when steps[3 s + 2]. Then, for each i,
// wgmma_wait<waits[i]> and every thread writes both accumulators to out[i][0 or 1][thread][N / 2]. The accumulators
// start as c ([2][128][N / 2]). misuse: 1 zeroes shared memory between the issues and the first wait, 2 records
// out[0] before the first wait (reads the accumulators in flight), 3 adds 1 to accumulator 0 before the first wait,
// 4 leaves out the wgmma.fence, 5 has thread 127 exit before the wgmmas.
template <int N, typename T>
__global__ void wgmma_steps(const unsigned char* image, int bytes, const int64_t* descs, const int* steps, int nsteps,
                            const int* waits, int nwaits, const uint32_t* a_regs, bool trans_a, bool trans_b,
                            const float* c, float* out, int misuse) {
  using namespace dcp_ops::kernels;
  DCP_DYNAMIC_SMEM(unsigned char, smem);
  const int tid = threadIdx.x;
  for (int i = tid; i < bytes; i += blockDim.x) smem[i] = image[i];
  fence_proxy_async();
  __syncthreads();
  if (misuse == 5 && tid == 127) return;
  float acc[2][N / 2];
  uint32_t a[kWgmmaMaxSteps][4];  // alive until the last wait, as the wgmmas read them there
  for (int x = 0; x < 2; ++x)
    for (int i = 0; i < N / 2; ++i) acc[x][i] = c[(x * 128 + tid) * (N / 2) + i];
  for (int s = 0; a_regs != nullptr && s < nsteps; ++s)
    for (int j = 0; j < 4; ++j) a[s][j] = a_regs[(s * 128 + tid) * 4 + j];
  wgmma_fence_operand(acc[0]);
  wgmma_fence_operand(acc[1]);
  if (misuse != 4) wgmma_fence();
  for (int s = 0; s < nsteps; ++s) {
    float(&d)[N / 2] = acc[steps[3 * s]];
    const uint64_t da = static_cast<uint64_t>(descs[2 * s]), db = static_cast<uint64_t>(descs[2 * s + 1]);
    const int scale_d = steps[3 * s + 1];
    if (a_regs != nullptr) {
      if (trans_b)
        wgmma_m64nNk16<N, T, true>(d, a[s], db, scale_d);
      else
        wgmma_m64nNk16<N, T, false>(d, a[s], db, scale_d);
    } else if (trans_a) {
      if (trans_b)
        wgmma_m64nNk16<N, T, true, true>(d, da, db, scale_d);
      else
        wgmma_m64nNk16<N, T, false, true>(d, da, db, scale_d);
    } else {
      if (trans_b)
        wgmma_m64nNk16<N, T, true>(d, da, db, scale_d);
      else
        wgmma_m64nNk16<N, T, false>(d, da, db, scale_d);
    }
    if (steps[3 * s + 2]) wgmma_commit();
  }
  auto record = [&](int i) {
    for (int x = 0; x < 2; ++x)
      for (int e = 0; e < N / 2; ++e) out[((i * 2 + x) * 128 + tid) * (N / 2) + e] = acc[x][e];
  };
  if (misuse == 1)
    for (int i = tid; i < bytes; i += blockDim.x) smem[i] = 0;
  if (misuse == 3)
    for (int e = 0; e < N / 2; ++e) acc[0][e] += 1.f;
  if (misuse == 2) record(0);
  for (int i = 0; i < nwaits; ++i) {
    switch (waits[i]) {
      case 0: wgmma_wait<0>(); break;
      case 1: wgmma_wait<1>(); break;
      case 2: wgmma_wait<2>(); break;
      default: wgmma_wait<3>(); break;
    }
    wgmma_fence_operand(acc[0]);
    wgmma_fence_operand(acc[1]);
    if (misuse != 2 || i > 0) record(i);
  }
}

// make_smem_desc of the dynamic shared-memory byte `offset` (one thread): its descriptor in *out.
__global__ void wgmma_desc(int offset, int swizzle, int lbo, int sbo, int64_t* out) {
  DCP_DYNAMIC_SMEM(unsigned char, smem);
  *out = static_cast<int64_t>(dcp_ops::kernels::make_smem_desc(smem + offset, swizzle, lbo, sbo));
}

// The bytes of mbarrier_ring's barriers, rounded up to 16 (the buffers after them are 16-byte aligned).
__host__ __device__ constexpr int ring_head(int stages) { return (2 * stages * 8 + 15) / 16 * 16; }

// A ring of `stages` shared buffers of `chunk` floats between one producer (thread 0, bulk copies) and the
// consumers (threads 32 .. blockDim.x - 1): full[s] takes the producer's arrival and the copy's bytes, empty[s] each
// consumer's arrival once it has copied the buffer to out (tile k at out[k * chunk]). misuse: 1 the consumers do not
// wait on full, 2 the producer does not wait on empty, 3 empty expects one arrival more than there are consumers, 4
// the producer arrives on full before any thread initialised it.
__global__ void mbarrier_ring(const float* x, float* out, int tiles, int stages, int chunk, int misuse) {
  using namespace dcp_ops::kernels;
  DCP_DYNAMIC_SMEM(unsigned char, smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // [stages], then empty [stages], then the buffers
  uint64_t* empty = full + stages;
  float* buf = reinterpret_cast<float*>(smem + ring_head(stages));
  const int consumers = static_cast<int>(blockDim.x) - 32, tid = threadIdx.x;
  if (tid == 0 && misuse != 4)
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], consumers + (misuse == 3));
    }
  __syncthreads();
  if (tid == 0) {
    for (int k = 0; k < tiles; ++k) {
      const int s = k % stages;
      if (k >= stages && misuse != 2) mbarrier_wait(&empty[s], (k / stages - 1) & 1);
      mbarrier_arrive_expect_tx(&full[s], chunk * 4);
      bulk_copy_g2s(buf + s * chunk, x + static_cast<int64_t>(k) * chunk, chunk * 4, &full[s]);
    }
  } else if (tid >= 32) {
    for (int k = 0; k < tiles; ++k) {
      const int s = k % stages;
      if (misuse != 1) mbarrier_wait(&full[s], (k / stages) & 1);
      for (int i = tid - 32; i < chunk; i += consumers) out[static_cast<int64_t>(k) * chunk + i] = buf[s * chunk + i];
      mbarrier_arrive(&empty[s]);
    }
  }
}

// Each thread copies its 8 floats of x by cp.async and arrives on one mbarrier (expecting every thread) when they
// land; thread `reader` waits on it (unless !wait) and writes all of shared memory to out.
__global__ void cp_async_arrive(const float* x, float* out, unsigned reader, bool wait) {
  using namespace dcp_ops::kernels;
  DCP_DYNAMIC_SMEM(unsigned char, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  float* slots = reinterpret_cast<float*>(smem + 16);
  const int i = threadIdx.x, n = blockDim.x;
  if (i == 0) mbarrier_init(bar, n);
  __syncthreads();
  cp_async16(slots + 8 * i, x + 8 * i, true);
  cp_async16(slots + 8 * i + 4, x + 8 * i + 4, true);
  cp_async_commit();
  cp_async_mbarrier_arrive(bar);
  if (threadIdx.x == reader) {
    if (wait) mbarrier_wait(bar, 0);
    for (int e = 0; e < 8 * n; ++e) out[e] = slots[e];
  }
}

// Warp 0 writes a shared value per lane and arrives at named barrier `id` for `count` threads; warp 1 syncs there for
// `sync_count` (unless !sync) and copies the values to out. Then the other way round at barrier id + 1 (out[32 ..]):
// a warp that arrives at a barrier and moves on must not arrive at the same instance again.
__global__ void named_handoff(const float* x, float* out, int id, int count, int sync_count, bool sync) {
  using namespace dcp_ops::kernels;
  __shared__ float slot[2][32];
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  for (int round = 0; round < 2; ++round) {
    if (w == round) {
      slot[round][l] = x[32 * round + l];
      named_barrier_arrive(id + round, count);
    } else if (w == 1 - round) {
      if (sync) named_barrier_sync(id + round, sync_count);
      out[32 * round + l] = slot[round][l];
    }
  }
}

struct TmaCoords {
  int v[5];
};

// One box of `map` at coordinates c by a tensor-map copy (thread 0) to dynamic shared byte `dst`, completing `bytes`
// on an mbarrier that every thread waits on (unless !wait); then the threads copy all `smem_bytes` of shared memory
// to out (the poison outside the box included).
template <int RANK>
__global__ void tma_box(const __grid_constant__ dcp_ops::kernels::TmaMap map, TmaCoords c, int dst, int bytes,
                        unsigned char* out, int smem_bytes, bool wait) {
  using namespace dcp_ops::kernels;
  DCP_DYNAMIC_SMEM(unsigned char, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  if (threadIdx.x == 0) mbarrier_init(bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int at[RANK];
    for (int i = 0; i < RANK; ++i) at[i] = c.v[i];
    mbarrier_arrive_expect_tx(bar, bytes);
    tma_load<RANK>(smem + dst, map, at, bar);
  }
  if (wait) mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < smem_bytes; i += blockDim.x) out[i] = smem[i];
}

}  // namespace simt_selftest
