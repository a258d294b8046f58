// Owner-only KV append on the CPU: token t's entry goes to flat slot slot_mapping[t]; -1 is skipped.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "checks.h"
#include "ops.h"

namespace dcp_ops {

namespace {
template <typename index_t>
void write_kv_impl(Tensor& cache, const Tensor& new_kv, const index_t* slots) {
  const int64_t T = new_kv.size(0), num_slots = cache.size(0) * cache.size(1), bs = cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    DCP_CHECK(slots[t] >= -1 && slots[t] < num_slots, "write_kv", "slot_mapping[", t, "] = ", slots[t],
              " must be -1 (not this rank's token) or in [0, num_blocks * block_size = ", num_slots, ")");
  const int64_t bytes = new_kv.numel() / std::max<int64_t>(T, 1) * new_kv.element_size();
  const int64_t es = cache.element_size();
  char* c = static_cast<char*>(cache.data_ptr());
  const char* n = static_cast<const char*>(new_kv.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(c + ((slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1)) * es,
                  n + t * new_kv.stride(0) * es, bytes);
    }
  });
}
}  // namespace

void write_kv_cpu(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping) {
  validate_write_kv(cache, new_kv, slot_mapping);
  if (new_kv.numel() == 0) return;
  if (slot_mapping.scalar_type() == at::kInt)
    write_kv_impl(cache, new_kv, slot_mapping.data_ptr<int32_t>());
  else
    write_kv_impl(cache, new_kv, slot_mapping.data_ptr<int64_t>());
}

}  // namespace dcp_ops
