// Launcher helpers shared by csrc/cuda/*.cu: the cache-row alignment check, the launch-status check and the dtype
// dispatch; the device (cuda/device.h) comes with them. The launchers compile under nvcc for the GPU, and under the
// host compiler with DCP_SIMT for the SIMT executor (tests/simt), so the tests run this exact code.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "cuda/device.h"

namespace dcp_ops {

// The CUDA decode kernels read cache rows in 16-byte packs: the cache's data pointer and every stride but the last
// (the row's own) must be 16-byte multiples. Refuses `name` otherwise.
inline void check_rows_aligned(const at::Tensor& cache, const char* op, const char* name) {
  const int64_t pack = 16 / cache.element_size();
  bool ok = reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < cache.dim(); ++d) ok = ok && cache.stride(d) % pack == 0;
  TORCH_CHECK(ok, op, ": on CUDA the rows of ", name, " must be 16-byte aligned (its data pointer and its strides but "
              "the last in multiples of ", pack, " elements), got strides ", cache.strides());
}
}  // namespace dcp_ops

#define DCP_CHECK_LAUNCH(err, op) TORCH_CHECK((err) == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err))

// Runs __VA_ARGS__ with scalar_t the CUDA type of a float dtype.
#define DCP_DISPATCH_FLOAT(dtype, op, ...)                                            \
  [&] {                                                                              \
    switch (dtype) {                                                                 \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }             \
      case at::kBFloat16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }  \
      case at::kHalf: { using scalar_t = __half; return __VA_ARGS__(); }             \
      default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);                \
    }                                                                                \
  }()
