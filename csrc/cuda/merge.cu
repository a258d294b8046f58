// CUDA launchers of the merge family: merge_partials, correct_partial, pack_exchange, merge_exchange.
#include "cuda/launch.h"
#include "kernels/merge.cuh"
#include "ops.h"

namespace dcp_ops {

std::tuple<Tensor, Tensor> merge_partials_cuda(const Tensor& outs, const Tensor& lses, double lse_base,
                                               c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "merge_partials");
  validate_merge(outs, lses, lse_base, "merge_partials");
  DCP_CUDA_GUARD(outs);
  const int64_t N = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  Tensor out = new_output({T, H, D}, outs.options());
  Tensor lse = new_output({T, H}, lses.options());
  const kernels::MergeParams p{outs.data_ptr(), outs.stride(0), outs.stride(1), outs.stride(2),
                               {lses.data_ptr<float>(), lses.stride(0), lses.stride(1), lses.stride(2)},
                               out.data_ptr(), H * D, D, lse.data_ptr<float>(), H, 1,
                               static_cast<int>(N), static_cast<int>(T), static_cast<int>(H), static_cast<int>(D),
                               static_cast<float>(std::log(lse_base)), propagate};
  const cudaError_t err = DCP_DISPATCH_FLOAT(outs.scalar_type(), "merge_partials",
                                             [&] { return kernels::merge_partials<scalar_t>(p, current_stream()); });
  DCP_CHECK_LAUNCH(err, "merge_partials");
  return {out, lse};
}

Tensor correct_partial_cuda(Tensor& out, const Tensor& lses, int64_t rank, double lse_base,
                            c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "correct_partial");
  validate_correct(out, lses, rank, lse_base);
  DCP_CUDA_GUARD(out);
  const int64_t T = out.size(0), H = out.size(1);
  Tensor total = new_output({T, H}, lses.options());
  const kernels::CorrectParams p{out.data_ptr(), out.stride(0), out.stride(1),
                                 {lses.data_ptr<float>(), lses.stride(0), lses.stride(1), lses.stride(2)},
                                 total.data_ptr<float>(), static_cast<int>(rank), static_cast<int>(lses.size(0)),
                                 static_cast<int>(T), static_cast<int>(H), static_cast<int>(out.size(2)),
                                 static_cast<float>(std::log(lse_base)), propagate};
  const cudaError_t err = DCP_DISPATCH_FLOAT(out.scalar_type(), "correct_partial",
                                             [&] { return kernels::correct_partial<scalar_t>(p, current_stream()); });
  DCP_CHECK_LAUNCH(err, "correct_partial");
  return total;
}

void pack_exchange_cuda(const Tensor& out, const Tensor& lse, Tensor& send) {
  validate_pack_exchange(out, lse, send);
  DCP_CUDA_GUARD(out);
  const kernels::PackParams p{out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr<float>(), lse.stride(0),
                              lse.stride(1), send.data_ptr(), static_cast<int>(send.size(0)),
                              static_cast<int>(out.size(0)), static_cast<int>(send.size(2)),
                              static_cast<int>(out.size(2)), static_cast<int>(exchange_pad(out.scalar_type()))};
  const cudaError_t err = DCP_DISPATCH_FLOAT(out.scalar_type(), "pack_exchange",
                                             [&] { return kernels::pack_exchange<scalar_t>(p, current_stream()); });
  DCP_CHECK_LAUNCH(err, "pack_exchange");
}

void merge_exchange_cuda(const Tensor& recv, Tensor& out, Tensor& lse, c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "merge_exchange");
  validate_merge_exchange(recv, out, lse);
  DCP_CUDA_GUARD(recv);
  const int64_t N = recv.size(0), T = recv.size(1), Hl = recv.size(2), row = recv.size(3);
  const int64_t D = out.size(2), es = recv.element_size();
  const auto* bytes = static_cast<const unsigned char*>(recv.data_ptr());
  const kernels::MergeArgs<kernels::PackedLse> p{
      recv.data_ptr(), T * Hl * row, Hl * row, row,
      {bytes + D * es, T * Hl * row * es, Hl * row * es, row * es},
      out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr<float>(), lse.stride(0), lse.stride(1),
      static_cast<int>(N), static_cast<int>(T), static_cast<int>(Hl), static_cast<int>(D), 1.f, propagate};
  const cudaError_t err = DCP_DISPATCH_FLOAT(recv.scalar_type(), "merge_exchange", [&] {
    return kernels::merge<scalar_t, scalar_t>(p, current_stream());
  });
  DCP_CHECK_LAUNCH(err, "merge_exchange");
}

}  // namespace dcp_ops
