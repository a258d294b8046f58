// Launcher helpers shared by csrc/cuda/*.cu. The launchers compile under nvcc for the GPU, and under the host
// compiler with DCP_SIMT for the SIMT executor (tests/simt), so the tests run this exact code.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#ifdef DCP_SIMT
#include "simt/simt.h"
#define DCP_CUDA_GUARD(t)
namespace dcp_ops {
inline cudaStream_t current_stream() { return nullptr; }
// Under the executor outputs start as NaN, so an element a kernel never writes fails its test.
inline at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& o) { return at::full(shape, NAN, o); }
inline bool has_mma_sync() { return true; }  // the executor runs the tensor-core kernels too
inline int sm_count() { return 8; }           // what the split plans fill under the executor
}  // namespace dcp_ops
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DCP_CUDA_GUARD(t) const c10::cuda::CUDAGuard dcp_cuda_guard_((t).device())
namespace dcp_ops {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
inline at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& o) { return at::empty(shape, o); }
// Whether the current device runs mma.sync m16n8k16 with bf16 / fp16 inputs (sm_80 and later). A cached attribute
// read, no synchronisation. (ATen/cuda/CUDAContext.h would need the cuSPARSE headers, which a toolkit may lack.)
inline bool has_mma_sync() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
}
// The current device's SM count (a cached attribute read), 1 if it cannot be read.
inline int sm_count() {
  int device = 0, sms = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
                 cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && sms > 0
             ? sms
             : 1;
}
}  // namespace dcp_ops
#endif

namespace dcp_ops {
// The split-KV plan of a decode launch (kernels/split_plan.cuh; csrc/cuda/split_plan.cu), launched on the current
// stream from seq_lens [T] and cu_seqlens_q [B + 1] (when given; read on the device only): work items of R query
// rows (query token, head) over tiles of `granule` tokens, budgeted so that one wave of the split pass (one block per
// SM) covers the batch. G query heads per KV head, Hkv KV heads. `work` is what the split pass reads, `unit` and
// `tok` what the merge reads (kernels::PlanRows); `err` the planner's launch status.
struct SplitPlan {
  at::Tensor work, unit, tok;
  int items;
  cudaError_t err;
};
SplitPlan plan_splits(const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q, int64_t T, int64_t B,
                      int64_t capacity, int granule, int64_t G, int64_t Hkv, int R, const char* op);

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
