// CUDA launcher of the split plan that every decode launcher makes first (kernels/split_plan.cuh).
#include <climits>

#include "cuda/launch.h"
#include "cuda/split_plan.h"
#include "kernels/split_plan.cuh"

namespace dcp_ops {

SplitPlan plan_splits(const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q, int64_t T, int64_t B,
                      int64_t capacity, int granule, int64_t G, int64_t Hkv, int R, const char* op) {
  const int64_t ctas = current_device().sms;
  // units: Hkv * sum_b ceil(n_b G / R) <= Hkv * (T G + B (R - 1)) / R, and Hkv * T * ceil(G / R) with one token each
  const int64_t units = cu_seqlens_q.has_value() ? Hkv * ((T * G + B * (R - 1)) / R) : Hkv * T * ((G + R - 1) / R);
  TORCH_CHECK(units + ctas <= INT_MAX / kernels::kWorkInts && T * G <= INT_MAX, op,
              ": too many query rows for one launch: ", T, " query tokens x ", G * Hkv, " heads");
  const int items = static_cast<int>(ctas + units - 1);
  auto i32 = seq_lens.options().dtype(at::kInt);
  SplitPlan plan{at::empty({items, kernels::kWorkInts}, i32), at::empty({std::max<int64_t>(units, 1), 2}, i32),
                 at::empty({T, 3}, i32), items, cudaSuccess};
  const kernels::SplitPlanParams p{seq_lens.data_ptr<int32_t>(),
                                   cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int32_t>() : nullptr,
                                   static_cast<int>(T), static_cast<int>(B),
                                   static_cast<int>(std::min<int64_t>(capacity, INT_MAX)), static_cast<int>(G),
                                   static_cast<int>(Hkv), R, granule, static_cast<int>(ctas), items,
                                   static_cast<int>(units), plan.work.data_ptr<int32_t>(),
                                   plan.unit.data_ptr<int32_t>(), plan.tok.data_ptr<int32_t>()};
  plan.err = kernels::split_plan(p, current_stream());
  return plan;
}

}  // namespace dcp_ops
