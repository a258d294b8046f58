// CUDA launcher of write_kv (owner-only KV append).
#include "cuda/launch.h"
#include "kernels/write_kv.cuh"
#include "ops.h"

namespace dcp_ops {

void write_kv_cuda(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping,
                   const std::optional<Tensor>& scale) {
  validate_write_kv(cache, new_kv, slot_mapping, scale);
  DCP_CUDA_GUARD(cache);
  const int64_t es = cache.element_size(), T = new_kv.size(0), n = T == 0 ? 0 : new_kv.numel() / T;
  const bool fp8 = scale.has_value();  // a float8_e4m3fn cache (validate_write_kv): new / scale, quantized here
  const kernels::WriteKvParams p{static_cast<unsigned char*>(cache.data_ptr()), cache.stride(0) * es,
                                 cache.stride(1) * es, new_kv.data_ptr(), new_kv.stride(0) * (fp8 ? 1 : es),
                                 fp8 ? scale->data_ptr<float>() : nullptr, slot_mapping.data_ptr(),
                                 slot_mapping.scalar_type() == at::kLong, cache.size(0) * cache.size(1),
                                 cache.size(1), fp8 ? n : n * es, T};
  if (fp8) {
    const cudaError_t err = DCP_DISPATCH_FLOAT(new_kv.scalar_type(), "write_kv",
                                               [&] { return kernels::write_kv_fp8<scalar_t>(p, current_stream()); });
    DCP_CHECK_LAUNCH(err, "write_kv");
    return;
  }
  DCP_CHECK_LAUNCH(kernels::write_kv(p, current_stream()), "write_kv");
}

}  // namespace dcp_ops
