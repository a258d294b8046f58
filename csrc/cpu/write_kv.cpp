// Owner-only KV append on the CPU: token t's entry goes to flat slot slot_mapping[t]; -1 is skipped. Into a
// float8_e4m3fn cache it goes as new / scale, saturated to +-448 and rounded to nearest even (NaN stays NaN).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/level.h"
#include "checks.h"
#include "cpu/convert.h"
#include "ops.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

namespace {
// Calls store(dst, t) for each token t with a slot, dst its entry's first byte, after checking every slot.
template <typename index_t, typename Store>
void for_each_slot(Tensor& cache, int64_t T, const index_t* slots, Store&& store) {
  const int64_t num_slots = cache.size(0) * cache.size(1), bs = cache.size(1), es = cache.element_size();
  for (int64_t t = 0; t < T; ++t)
    DCP_CHECK(slots[t] >= -1 && slots[t] < num_slots, "write_kv", "slot_mapping[", t, "] = ", slots[t],
              " must be -1 (not this rank's token) or in [0, num_blocks * block_size = ", num_slots, ")");
  char* c = static_cast<char*>(cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot >= 0) store(c + ((slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1)) * es, t);
    }
  });
}

// x as e4m3: saturated to +-448 (the type's largest finite value; torch's own conversion makes NaN of 480 and more)
// and rounded to nearest even by c10's conversion; NaN stays NaN.
inline c10::Float8_e4m3fn to_e4m3(float x) {
  return c10::Float8_e4m3fn(std::isnan(x) ? x : std::clamp(x, -448.f, 448.f));
}

template <typename index_t>
void write_kv_impl(Tensor& cache, const Tensor& new_kv, const index_t* slots, const std::optional<Tensor>& scale) {
  const int64_t T = new_kv.size(0), E = new_kv.numel() / std::max<int64_t>(T, 1);
  if (!scale.has_value()) {  // same dtype: a byte copy
    const int64_t bytes = E * new_kv.element_size(), es = new_kv.element_size();
    const char* n = static_cast<const char*>(new_kv.data_ptr());
    for_each_slot(cache, T, slots,
                  [&](char* dst, int64_t t) { std::memcpy(dst, n + t * new_kv.stride(0) * es, bytes); });
    return;
  }
  const float s = scale->item<float>();  // a CPU tensor here: no device sync
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, new_kv.scalar_type(), "write_kv", [&] {
    const scalar_t* n = new_kv.data_ptr<scalar_t>();
    for_each_slot(cache, T, slots, [&](char* dst, int64_t t) {
      auto* out = reinterpret_cast<c10::Float8_e4m3fn*>(dst);
      const scalar_t* src = n + t * new_kv.stride(0);
      for (int64_t i = 0; i < E; ++i) out[i] = to_e4m3(cpu::to_f32(src[i]) / s);
    });
  });
}
}  // namespace

void write_kv_cpu(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping, const std::optional<Tensor>& scale) {
  validate_write_kv(cache, new_kv, slot_mapping, scale);
  if (new_kv.numel() == 0) return;
  if (slot_mapping.scalar_type() == at::kInt)
    write_kv_impl(cache, new_kv, slot_mapping.data_ptr<int32_t>(), scale);
  else
    write_kv_impl(cache, new_kv, slot_mapping.data_ptr<int64_t>(), scale);
}

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
