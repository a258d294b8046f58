// CUDA launcher of the merge family: picks the element type and launches on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "kernels/merge.cuh"
#include "ops.h"

namespace dcp_ops {

std::tuple<Tensor, Tensor> merge_partials_cuda(const Tensor& outs, const Tensor& lses, double lse_base) {
  validate_merge(outs, lses, lse_base, "merge_partials");
  const c10::cuda::CUDAGuard guard(outs.device());
  const int64_t N = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  Tensor out = at::empty({T, H, D}, outs.options());
  Tensor lse = at::empty({T, H}, lses.options());
  kernels::MergeParams p{outs.data_ptr(), outs.stride(0), outs.stride(1), outs.stride(2),
                         lses.data_ptr<float>(), lses.stride(0), lses.stride(1), lses.stride(2),
                         out.data_ptr(), lse.data_ptr<float>(),
                         static_cast<int>(N), static_cast<int>(T), static_cast<int>(H), static_cast<int>(D),
                         static_cast<float>(std::log(lse_base))};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  switch (outs.scalar_type()) {
    case at::kFloat: err = kernels::merge_partials<float>(p, stream); break;
    case at::kBFloat16: err = kernels::merge_partials<__nv_bfloat16>(p, stream); break;
    case at::kHalf: err = kernels::merge_partials<__half>(p, stream); break;
    default: TORCH_CHECK(false, "merge_partials: unsupported dtype ", outs.scalar_type());
  }
  TORCH_CHECK(err == cudaSuccess, "merge_partials: CUDA launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace dcp_ops
