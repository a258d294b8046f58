// CUDA launcher of the split plan that every decode launcher makes first (kernels/split_plan.cuh).
#include <climits>

#include "cuda/launch.h"
#include "kernels/split_plan.cuh"

namespace dcp_ops {

SplitPlan plan_splits(const at::Tensor& seq_lens, int64_t T, int64_t capacity, int granule, int64_t tiles,
                      const char* op) {
  const int64_t ctas = std::max<int64_t>(1, sm_count() / std::max<int64_t>(1, tiles));
  TORCH_CHECK(T + ctas - 1 <= INT_MAX / 4, op, ": too many query tokens for one launch: ", T);
  const int items = static_cast<int>(ctas + T - 1);
  auto i32 = seq_lens.options().dtype(at::kInt);
  SplitPlan plan{at::empty({items, 3}, i32), at::empty({2, T}, i32), items, cudaSuccess};
  const kernels::SplitPlanParams p{seq_lens.data_ptr<int32_t>(), static_cast<int>(T),
                                   static_cast<int>(std::min<int64_t>(capacity, INT_MAX)), granule,
                                   static_cast<int>(ctas), items, plan.work.data_ptr<int32_t>(),
                                   plan.rows.data_ptr<int32_t>()};
  plan.err = kernels::split_plan(p, current_stream());
  return plan;
}

}  // namespace dcp_ops
