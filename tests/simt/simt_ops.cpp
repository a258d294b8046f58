// Test-only extension: the CUDA kernel sources compiled by the host compiler (DCP_SIMT) and run by the SIMT
// executor on CPU tensors, exposed as torch.ops.dcp_ops_simt.*.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>

#include "kernels/merge.cuh"
#include "ops.h"
#include "selftest_kernels.cuh"

using at::Tensor;
namespace k = dcp_ops::kernels;

static std::tuple<Tensor, Tensor> merge_partials(const Tensor& outs, const Tensor& lses, double lse_base) {
  dcp_ops::validate_merge(outs, lses, lse_base, "merge_partials");
  const int64_t N = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  Tensor out = at::full({T, H, D}, NAN, outs.options());  // poisoned: unwritten elements fail the test
  Tensor lse = at::full({T, H}, NAN, lses.options());
  k::MergeParams p{outs.data_ptr(), outs.stride(0), outs.stride(1), outs.stride(2),
                   lses.data_ptr<float>(), lses.stride(0), lses.stride(1), lses.stride(2),
                   out.data_ptr(), lse.data_ptr<float>(),
                   static_cast<int>(N), static_cast<int>(T), static_cast<int>(H), static_cast<int>(D),
                   static_cast<float>(std::log(lse_base))};
  switch (outs.scalar_type()) {
    case at::kFloat: k::merge_partials<float>(p, nullptr); break;
    case at::kBFloat16: k::merge_partials<__nv_bfloat16>(p, nullptr); break;
    default: k::merge_partials<__half>(p, nullptr); break;
  }
  return {out, lse};
}

static std::tuple<Tensor, Tensor> warp_reduce(const Tensor& x) {
  const int n = x.numel(), warps = (n + 31) / 32;
  Tensor sums = at::full({warps}, NAN, x.options());
  Tensor ballots = at::zeros({warps}, x.options().dtype(at::kInt));
  DCP_LAUNCH(simt_selftest::warp_reduce, dim3((n + 63) / 64), dim3(64), 0, nullptr, x.data_ptr<float>(),
             sums.data_ptr<float>(), reinterpret_cast<unsigned*>(ballots.data_ptr<int>()), n);
  return {sums, ballots};
}

static Tensor transpose32(const Tensor& x) {  // [tiles, 32, 32]
  Tensor out = at::full_like(x, NAN);
  DCP_LAUNCH(simt_selftest::transpose32, dim3(x.size(0)), dim3(32, 8), 0, nullptr, x.data_ptr<float>(),
             out.data_ptr<float>(), static_cast<int>(x.size(0)));
  return out;
}

static Tensor histogram(const Tensor& x, int64_t bins) {
  Tensor out = at::zeros({bins}, x.options());
  DCP_LAUNCH(simt_selftest::histogram, dim3(3), dim3(64), bins * sizeof(int), nullptr, x.data_ptr<int>(),
             static_cast<int>(x.numel()), static_cast<int>(bins), out.data_ptr<int>());
  return out;
}

static Tensor block_sum(const Tensor& x, bool sync) {
  Tensor out = at::full({1}, NAN, x.options());
  DCP_LAUNCH(simt_selftest::block_sum, dim3(1), dim3(x.numel()), 0, nullptr, x.data_ptr<float>(),
             out.data_ptr<float>(), sync);
  return out;
}

static Tensor divergent_barrier() {
  Tensor out = at::zeros({32});
  DCP_LAUNCH(simt_selftest::divergent_barrier, dim3(1), dim3(32), 0, nullptr, out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY(dcp_ops_simt, m) {
  m.def("merge_partials(Tensor outs, Tensor lses, float lse_base) -> (Tensor, Tensor)", &merge_partials);
  m.def("warp_reduce(Tensor x) -> (Tensor, Tensor)", &warp_reduce);
  m.def("transpose32(Tensor x) -> Tensor", &transpose32);
  m.def("histogram(Tensor x, int bins) -> Tensor", &histogram);
  m.def("block_sum(Tensor x, bool sync) -> Tensor", &block_sum);
  m.def("divergent_barrier() -> Tensor", &divergent_barrier);
}
