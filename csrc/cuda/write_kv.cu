// CUDA launcher of write_kv (owner-only KV append).
#include "cuda/launch.h"
#include "kernels/write_kv.cuh"
#include "ops.h"

namespace dcp_ops {

void write_kv_cuda(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping) {
  validate_write_kv(cache, new_kv, slot_mapping);
  DCP_CUDA_GUARD(cache);
  const int64_t es = cache.element_size(), T = new_kv.size(0);
  const kernels::WriteKvParams p{static_cast<unsigned char*>(cache.data_ptr()), cache.stride(0) * es,
                                 cache.stride(1) * es, static_cast<const unsigned char*>(new_kv.data_ptr()),
                                 new_kv.stride(0) * es, slot_mapping.data_ptr(),
                                 slot_mapping.scalar_type() == at::kLong, cache.size(0) * cache.size(1),
                                 cache.size(1), T == 0 ? 0 : new_kv.numel() / T * es, T};
  DCP_CHECK_LAUNCH(kernels::write_kv(p, current_stream()), "write_kv");
}

}  // namespace dcp_ops
