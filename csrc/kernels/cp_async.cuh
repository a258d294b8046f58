// Asynchronous 16-byte copies global -> shared (cp.async, sm_80 and later): issue, commit a group, wait until at most
// N groups are in flight. Under DCP_SIMT a copy completes at issue and the waits do nothing; the kernel's barriers
// still order one thread's copies before another thread's reads, as on the GPU.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

// dst <- 16 bytes at src, or zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef DCP_SIMT
  if (valid)
    std::memcpy(dst, src, 16);
  else
    std::memset(dst, 0, 16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launchers choose the kernels that copy this way on sm_80 and later only
#else
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !defined(DCP_SIMT) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(DCP_SIMT) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

}  // namespace dcp_ops::kernels
