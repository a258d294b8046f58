// The split-KV plan of a decode launch (kernels/split_plan.cuh makes it on the device; cuda/split_plan.cu launches it).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "cuda/device.h"
#include "kernels/merge.cuh"

namespace dcp_ops {

// The plan, launched on the current
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

// The merge of a split pass's partials, part_o [items, R, D] fp32 and part_lse [items, R], into out [T, H, D] (the
// output's type) and lse [T, H] (contiguous), rows located by the plan (G query heads per plan unit's KV head).
// Propagate: the splits' LSE are ours (an empty split is -inf), so a NaN one poisons its row. out_scale: an FP8
// cache's V scale, or null.
inline kernels::MergeParams split_merge_params(const SplitPlan& plan, const at::Tensor& part_o,
                                               const at::Tensor& part_lse, at::Tensor& out, at::Tensor& lse, int64_t G,
                                               int R, const float* out_scale) {
  const int64_t T = out.size(0), H = out.size(1), D = out.size(2);
  return {part_o.data_ptr(), R * D, 0, D,
          {part_lse.data_ptr<float>(), R, 0, 1},
          out.data_ptr(), H * D, D, lse.data_ptr<float>(), H, 1,
          plan.items, static_cast<int>(T), static_cast<int>(H), static_cast<int>(D), 1.f, /*propagate=*/true,
          {plan.tok.data_ptr<int32_t>(), plan.unit.data_ptr<int32_t>(), static_cast<int>(G), R},
          out_scale};
}

}  // namespace dcp_ops
