// Input checks shared by every op and backend. Messages name the op, the argument, the expected and the actual value.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

namespace dcp_ops {

#define DCP_CHECK(cond, op, ...) TORCH_CHECK((cond), op, ": ", __VA_ARGS__)

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_float(const at::Tensor& t, const char* op, const char* name) {
  DCP_CHECK(is_float_dtype(t.scalar_type()), op, name, " must be float32, bfloat16 or float16, got ",
            t.scalar_type());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  DCP_CHECK(t.scalar_type() == want, op, name, " must have dtype ", want, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name, const char* shape) {
  DCP_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D ", shape, ", got shape ", t.sizes());
}

inline void check_size(const at::Tensor& t, int64_t d, int64_t want, const char* op, const char* name,
                       const char* what) {
  DCP_CHECK(t.size(d) == want, op, name, ".shape[", d, "] (", what, ") must be ", want, ", got ", t.size(d),
            " (shape ", t.sizes(), ")");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  DCP_CHECK(t.device() == ref.device(), op, name, " must be on the same device as ", ref_name, " (",
            ref.device(), "), got ", t.device());
}

inline void check_last_contiguous(const at::Tensor& t, const char* op, const char* name) {
  DCP_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, name, " must have a contiguous last dimension (stride 1), got strides ",
            t.strides());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  DCP_CHECK(t.is_contiguous(), op, name, " must be contiguous, got shape ", t.sizes(), " strides ", t.strides());
}

// Trailing dims from `from` on form one dense block (the cache entry of one token), so it can be copied flat.
inline void check_dense_tail(const at::Tensor& t, int64_t from, const char* op, const char* name) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= from; --d) {
    DCP_CHECK(t.size(d) <= 1 || t.stride(d) == expected, op, name, " must be dense from dim ", from,
              " on (a token's entry contiguous), got shape ", t.sizes(), " strides ", t.strides());
    expected *= t.size(d);
  }
}

// The scale of a cache (docs/design.md §6): a float8_e4m3fn cache needs one, a 1-element fp32 tensor on its device
// (stored value x scale is the dequantized value); any other cache takes none. Returns whether the cache is FP8.
inline bool check_kv_scale(const at::Tensor& cache, const std::optional<at::Tensor>& scale, const char* op,
                           const char* cache_name, const char* scale_name) {
  if (cache.scalar_type() != at::kFloat8_e4m3fn) {
    DCP_CHECK(!scale.has_value(), op, scale_name, " is for float8_e4m3fn caches only, got one with a ",
              cache.scalar_type(), " ", cache_name);
    return false;
  }
  DCP_CHECK(scale.has_value(), op, scale_name, " is required with a float8_e4m3fn ", cache_name,
            " (stored value x ", scale_name, " is the dequantized value), got None");
  check_dtype(*scale, at::kFloat, op, scale_name);
  DCP_CHECK(scale->numel() == 1 && scale->dim() <= 1, op, scale_name,
            " must be a 1-element tensor (shape [] or [1]), got shape ", scale->sizes());
  check_same_device(*scale, cache, op, scale_name, cache_name);
  return true;
}

// Paged-cache metadata: block_table [rows, max_blocks] int32, seq_lens [batch] int32, on the cache's device; rows is
// batch, or B with cu_seqlens_q.
inline void check_paged_meta(const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& cache,
                             int64_t rows, int64_t batch, const char* op) {
  check_dim(block_table, 2, op, "block_table", "[B, max_blocks]");
  check_dtype(block_table, at::kInt, op, "block_table");
  check_dim(seq_lens, 1, op, "seq_lens", "[B]");
  check_dtype(seq_lens, at::kInt, op, "seq_lens");
  check_same_device(block_table, cache, op, "block_table", "the cache");
  check_same_device(seq_lens, cache, op, "seq_lens", "the cache");
  check_size(block_table, 0, rows, op, "block_table", "batch, one row per query token (decode: T == B)");
  check_size(seq_lens, 0, batch, op, "seq_lens", "batch, one length per query token (decode: T == B)");
  check_last_contiguous(block_table, op, "block_table");
  check_contiguous(seq_lens, op, "seq_lens");
}

}  // namespace dcp_ops
