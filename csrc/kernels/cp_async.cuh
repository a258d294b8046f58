// Asynchronous 16-byte copies global -> shared (cp.async, sm_80 and later): issue, commit a group, wait until at most
// N groups are in flight. Under DCP_SIMT the executor keeps each thread's copies in flight until a wait retires
// their group (simt::async_copy16), so a read before its wait sees what was there before, as it may on the GPU.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

// dst <- 16 bytes at src, or zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef DCP_SIMT
  simt::async_copy16(dst, src, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launchers choose the kernels that copy this way on sm_80 and later only
#else
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef DCP_SIMT
  simt::async_commit();
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef DCP_SIMT
  simt::async_wait(N);
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

}  // namespace dcp_ops::kernels
