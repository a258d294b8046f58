// CUDA launcher of gqa_decode_partial: the split plan (made on the device from seq_lens and cu_seqlens_q), the
// split-KV pass (on tensor cores for 16-bit queries with head dims 64 and 128 on sm_80 and later, on caches of the
// query's type or FP8 ones; else the SIMT kernel), then the merge of the splits. An FP8 cache's scales are read on
// the device: K's folded into the scores' scale, V's into the merged output. No host synchronisation.
#include "cuda/launch.h"
#include "cuda/split_choice.h"
#include "cuda/split_plan.h"
#include "kernels/gqa_decode_mma.cuh"
#include "ops.h"

namespace dcp_ops {

std::tuple<Tensor, Tensor> gqa_decode_partial_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                                   const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                   c10::string_view precision,
                                                   const std::optional<Tensor>& cu_seqlens_q,
                                                   const std::optional<Tensor>& k_scale,
                                                   const std::optional<Tensor>& v_scale) {
  const bool native = parse_precision(precision, "gqa_decode_partial") == Precision::kNative;
  const DecodeDims d =
      validate_gqa(q, k_cache, v_cache, block_table, seq_lens, scale, cu_seqlens_q, k_scale, v_scale);
  DCP_CUDA_GUARD(q);
  TORCH_CHECK(kernels::gqa_supported_head_dim(static_cast<int>(d.Dk), static_cast<int>(q.element_size())),
              "gqa_decode_partial: the CUDA kernel takes head dims 64, 128 and 256, got ", d.Dk);
  check_rows_aligned(k_cache, "gqa_decode_partial", "k_cache");
  check_rows_aligned(v_cache, "gqa_decode_partial", "v_cache");
  Tensor out = new_output({d.T, d.Hq, d.Dv}, q.options());
  Tensor lse = new_output({d.T, d.Hq}, q.options().dtype(at::kFloat));
  if (d.T == 0 || d.Hq == 0) return {out, lse};  // an empty grid is a launch error
  // the query rows of a sequence per KV head: G heads x its query tokens (the batch's mean)
  const int64_t G = d.Hq / d.Hkv, B = std::max<int64_t>(block_table.size(0), 1);
  const int64_t rows = G * (cu_seqlens_q.has_value() ? (d.T + B - 1) / B : 1);
  const SplitPass pass = gqa_split_choice(static_cast<int>(d.Dk), static_cast<int>(q.element_size()), rows,
                                          current_device());
  const int R = pass.rows;
  const int64_t seqs = cu_seqlens_q.has_value() ? block_table.size(0) : d.T;
  const SplitPlan plan = plan_splits(seq_lens, cu_seqlens_q, d.T, seqs, d.max_blocks * d.block_size, pass.granule, G,
                                     d.Hkv, R, "gqa_decode_partial");
  DCP_CHECK_LAUNCH(plan.err, "gqa_decode_partial");
  auto f32 = q.options().dtype(at::kFloat);
  Tensor part_o = new_output({plan.items, R, d.Dv}, f32);
  Tensor part_lse = new_output({plan.items, R}, f32);
  kernels::GqaParams p{q.data_ptr(), q.stride(0), q.stride(1),
                       k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                       block_table.data_ptr<int32_t>(), block_table.stride(0), seq_lens.data_ptr<int32_t>(),
                       static_cast<int>(d.T), static_cast<int>(d.Hq), static_cast<int>(d.Hkv), static_cast<int>(d.Dk),
                       static_cast<int>(d.block_size), static_cast<int>(d.num_blocks), static_cast<int>(d.max_blocks),
                       plan.work.data_ptr<int32_t>(), plan.items, R,
                       static_cast<float>(scale * 1.4426950408889634), part_o.data_ptr<float>(),
                       part_lse.data_ptr<float>(), d.fp8 ? k_scale->data_ptr<float>() : nullptr};
  const kernels::MergeParams m =
      split_merge_params(plan, part_o, part_lse, out, lse, G, R, d.fp8 ? v_scale->data_ptr<float>() : nullptr);
  const cudaError_t err = DCP_DISPATCH_FLOAT(q.scalar_type(), "gqa_decode_partial", [&] {
    cudaError_t e = kernels::gqa_split_pass<scalar_t>(p, current_stream(), pass.kernel == SplitKernel::kGqaMma, native,
                                                      d.fp8);
    return e != cudaSuccess ? e : kernels::merge<float, scalar_t>(m, current_stream());
  });
  DCP_CHECK_LAUNCH(err, "gqa_decode_partial");
  return {out, lse};
}

}  // namespace dcp_ops
