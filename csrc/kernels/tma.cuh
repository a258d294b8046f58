// Tensor-map bulk copies (TMA, sm_90): one thread copies a box of a global tensor (up to 5 dimensions, with byte
// strides, zeros outside it) into shared memory in one instruction, swizzled as a wgmma descriptor reads it, and
// completes the box's bytes on an mbarrier (kernels/barriers.cuh): the consumers wait there. Under DCP_SIMT the
// executor emulates the tensor map and the copy (simt/tma.h), landing it late or early by the schedule.
//
// What a kernel must keep (the GPU's rules):
//   - the tensor map is a kernel parameter (`const __grid_constant__ TmaMap`), made on the host by
//     cuTensorMapEncodeTiled (SIMT: simt::encode_tiled, with the same rules);
//   - the destination is 128-byte aligned (1024 for a 128-byte swizzle that a descriptor reads from its start);
//   - the phase expects the box's whole size (mbarrier_arrive_expect_tx), out-of-bound parts included.
// sm_90 and later; earlier architectures trap.
#pragma once

#include <cstdint>

#include "kernels/barriers.cuh"

#if !defined(DCP_SIMT)
#include <cuda.h>  // CUtensorMap
#endif

namespace dcp_ops::kernels {

#ifdef DCP_SIMT
using TmaMap = simt::TensorMap;
#else
using TmaMap = CUtensorMap;
#endif

// The box of `map` at coordinates c (dimension 0 first, signed) into shared dst, completing its bytes on bar.
template <int RANK>
__device__ __forceinline__ void tma_load(void* dst, const TmaMap& map, const int (&c)[RANK], uint64_t* bar) {
  static_assert(RANK >= 1 && RANK <= 5, "tensor maps have 1 to 5 dimensions");
#ifdef DCP_SIMT
  simt::tma_load(dst, map, c, bar);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint64_t m = reinterpret_cast<uint64_t>(&map);
  const unsigned d = smem_addr(dst), b = smem_addr(bar);
  if constexpr (RANK == 1)
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], "
                 "[%3];\n" ::"r"(d), "l"(m), "r"(c[0]), "r"(b)
                 : "memory");
  else if constexpr (RANK == 2)
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                 "%3}], [%4];\n" ::"r"(d), "l"(m), "r"(c[0]), "r"(c[1]), "r"(b)
                 : "memory");
  else if constexpr (RANK == 3)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                 "%3, %4}], [%5];\n" ::"r"(d), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(b)
                 : "memory");
  else if constexpr (RANK == 4)
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                 "%3, %4, %5}], [%6];\n" ::"r"(d), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(b)
                 : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                 "%3, %4, %5, %6}], [%7];\n" ::"r"(d), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]),
                 "r"(b)
                 : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();  // sm_90 and later
#endif
}

}  // namespace dcp_ops::kernels
