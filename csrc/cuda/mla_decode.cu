// CUDA launcher of mla_decode_partial: query staging (w_uk absorption, head_project), the split-KV pass, the merge of
// the splits, and the optional w_uv up-projection (head_project). The split pass is cuda/split_choice.h's
// mla_split_choice (precision "native": mla_decode_tiled.cuh, or its wgmma twin mla_decode_wgmma.cuh on sm_90a, on
// the absorbed query rounded to its type where the device's shared memory holds their tiles, else mla_decode_mma.cuh,
// within the native bound too; "fp32":
// mla_decode_mma.cuh on the fp32 scaled query; else the SIMT kernel of mla_decode.cuh), on a cache of the query's type
// or an FP8 one (converted in shared memory). An FP8 cache's scale is read on the device: applied to the scores (the
// fp32-query kernels: to their query) and to the merged output. The splits come from the split plan, made on the
// device from seq_lens (split_plan.cuh): no host synchronisation.
#include "cuda/launch.h"
#include "cuda/split_choice.h"
#include "cuda/split_plan.h"
#include "kernels/head_project.cuh"
#include "kernels/merge.cuh"
#include "kernels/mla_decode_mma.cuh"
#include "kernels/mla_decode_tiled.cuh"
#include "ops.h"

namespace dcp_ops {

namespace {
// Project x [T, H, K] by w [H, K, N] (or copy it, w absent) into y at element strides (y_st, y_sh), times scale.
template <typename TX, typename TW, typename TY>
cudaError_t project(const Tensor& x, const std::optional<Tensor>& w, void* y, int64_t y_st, int64_t y_sh,
                    int64_t N, float scale) {
  const Tensor wc = !w.has_value() || w->stride(2) == 1 ? w.value_or(Tensor()) : w->contiguous();
  const kernels::ProjectParams p{x.data_ptr(), x.stride(0), x.stride(1),
                                 wc.defined() ? wc.data_ptr() : nullptr, wc.defined() ? wc.stride(0) : 0,
                                 wc.defined() ? wc.stride(1) : 0, y, y_st, y_sh,
                                 static_cast<int>(x.size(0)), static_cast<int>(x.size(1)),
                                 static_cast<int>(x.size(2)), static_cast<int>(N), scale};
  return kernels::head_project<TX, TW, TY>(p, current_stream());
}

}  // namespace

std::tuple<Tensor, Tensor> mla_decode_partial_cuda(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache,
                                                   const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                   const std::optional<Tensor>& w_uk,
                                                   const std::optional<Tensor>& w_uv, c10::string_view precision,
                                                   const std::optional<Tensor>& cu_seqlens_q,
                                                   const std::optional<Tensor>& kv_scale) {
  const bool native = parse_precision(precision, "mla_decode_partial") == Precision::kNative;
  const DecodeDims d =
      validate_mla(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk, w_uv, cu_seqlens_q, kv_scale);
  DCP_CUDA_GUARD(q_nope);
  const int64_t latent = d.Dv, rope = q_pe.size(2), es = q_nope.element_size();
  TORCH_CHECK(kernels::mla_supported_dims(static_cast<int>(latent), static_cast<int>(rope)),
              "mla_decode_partial: the CUDA kernel takes D_latent 128, 256 or 512 and rope dim 0 or 64, got ",
              latent, " + ", rope);
  TORCH_CHECK(q_nope.size(2) <= kernels::kProjectMaxK, "mla_decode_partial: on CUDA q_nope's last dim must be at most ",
              kernels::kProjectMaxK, ", got ", q_nope.size(2));
  check_rows_aligned(kv_cache, "mla_decode_partial", "kv_cache");
  const int64_t d_out = w_uv.has_value() ? w_uv->size(2) : latent, DK = latent + rope;
  auto f32 = q_nope.options().dtype(at::kFloat);
  Tensor out = new_output({d.T, d.Hq, d_out}, q_nope.options());
  Tensor lse = new_output({d.T, d.Hq}, f32);
  if (d.T == 0 || d.Hq == 0) return {out, lse};
  const SplitPass pass = mla_split_choice(static_cast<int>(latent), static_cast<int>(rope), static_cast<int>(es),
                                          native, current_device());
  const bool q16 = pass.q16;  // the staged query: 16-bit (rounded, unscaled) or fp32 (scaled)
  const int R = pass.rows;
  const int64_t B = cu_seqlens_q.has_value() ? block_table.size(0) : d.T;
  const SplitPlan plan = plan_splits(seq_lens, cu_seqlens_q, d.T, B, d.max_blocks * d.block_size, pass.granule, d.Hq,
                                     1, R, "mla_decode_partial");
  DCP_CHECK_LAUNCH(plan.err, "mla_decode_partial");
  Tensor qs = new_output({d.T, d.Hq, DK}, q16 ? q_nope.options() : f32);  // the staged query
  Tensor part_o = new_output({plan.items, R, latent}, f32);
  Tensor part_lse = new_output({plan.items, R}, f32);
  Tensor merged = w_uv.has_value() ? new_output({d.T, d.Hq, latent}, f32) : out;
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const kernels::MlaParams p{q16 ? nullptr : qs.data_ptr<float>(), q16 ? qs.data_ptr() : nullptr,
                             scale_log2, kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
                             block_table.data_ptr<int32_t>(), block_table.stride(0), seq_lens.data_ptr<int32_t>(),
                             static_cast<int>(d.T), static_cast<int>(d.Hq), static_cast<int>(d.num_blocks),
                             static_cast<int>(d.block_size), static_cast<int>(d.max_blocks),
                             plan.work.data_ptr<int32_t>(), plan.items, part_o.data_ptr<float>(),
                             part_lse.data_ptr<float>(), d.fp8 ? kv_scale->data_ptr<float>() : nullptr};
  const kernels::MergeParams m = split_merge_params(plan, part_o, part_lse, merged, lse, d.Hq, R,
                                                    d.fp8 ? kv_scale->data_ptr<float>() : nullptr);
  const cudaError_t err = DCP_DISPATCH_FLOAT(q_nope.scalar_type(), "mla_decode_partial", [&] {
    cudaError_t e = cudaSuccess;
    if (q16) {  // the absorbed query rounded once to the cache's type, unscaled (the kernel scales the scores)
      scalar_t* qp = static_cast<scalar_t*>(qs.data_ptr());
      e = project<scalar_t, scalar_t, scalar_t>(q_nope, w_uk, qp, d.Hq * DK, DK, latent, 1.f);
      if (e == cudaSuccess && rope > 0)
        e = project<scalar_t, scalar_t, scalar_t>(q_pe, std::nullopt, qp + latent, d.Hq * DK, DK, rope, 1.f);
      const int L = static_cast<int>(latent), Rp = static_cast<int>(rope), bn = pass.tokens;
      if (e == cudaSuccess && pass.kernel == SplitKernel::kMlaWgmma)
        e = d.fp8 ? kernels::mla_wgmma_pass<scalar_t, true>(p, L, Rp, bn, current_stream())
                  : kernels::mla_wgmma_pass<scalar_t>(p, L, Rp, bn, current_stream());
      else if (e == cudaSuccess)
        e = d.fp8 ? kernels::mla_tiled_pass<scalar_t, true>(p, L, Rp, bn, current_stream())
                  : kernels::mla_tiled_pass<scalar_t>(p, L, Rp, bn, current_stream());
    } else {  // the fp32 query, scaled
      float* qp = qs.data_ptr<float>();
      e = project<scalar_t, scalar_t, float>(q_nope, w_uk, qp, d.Hq * DK, DK, latent, scale_log2);
      if (e == cudaSuccess && rope > 0)
        e = project<scalar_t, scalar_t, float>(q_pe, std::nullopt, qp + latent, d.Hq * DK, DK, rope, scale_log2);
      if (e == cudaSuccess)
        e = kernels::mla_split_pass<scalar_t>(p, static_cast<int>(latent), static_cast<int>(rope), current_stream(),
                                              pass.kernel == SplitKernel::kMlaSplitTerm, d.fp8);
    }
    if (!w_uv.has_value()) return e != cudaSuccess ? e : kernels::merge<float, scalar_t>(m, current_stream());
    if (e == cudaSuccess) e = kernels::merge<float, float>(m, current_stream());
    return e != cudaSuccess ? e
                            : project<float, scalar_t, scalar_t>(merged, w_uv, out.data_ptr(), d.Hq * d_out, d_out,
                                                                 d_out, 1.f);
  });
  DCP_CHECK_LAUNCH(err, "mla_decode_partial");
  return {out, lse};
}

}  // namespace dcp_ops
