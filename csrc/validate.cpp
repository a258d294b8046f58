// Shape, dtype, device and stride validation shared by the CPU and CUDA implementations of every op.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>

#include "checks.h"
#include "ops.h"

namespace dcp_ops {

Precision parse_precision(c10::string_view precision, const char* op) {
  if (precision == "native") return Precision::kNative;
  if (precision == "fp32") return Precision::kFp32;
  TORCH_CHECK_VALUE(false, op, ": precision must be one of ('native', 'fp32'), got '", std::string(precision), "'");
}

bool parse_nonfinite_lse(c10::string_view nonfinite_lse, const char* op) {
  if (nonfinite_lse == "empty") return false;
  if (nonfinite_lse == "propagate") return true;
  TORCH_CHECK_VALUE(false, op, ": nonfinite_lse must be one of ('empty', 'propagate'), got '",
                    std::string(nonfinite_lse), "'");
}

// cu_seqlens_q's checks (its values where it is on the CPU); returns the block table's expected rows: B with
// cu_seqlens_q, else T.
static int64_t check_cu_seqlens_q(const Tensor& block_table, const std::optional<Tensor>& cu_seqlens_q, int64_t T,
                                  const char* op) {
  if (!cu_seqlens_q.has_value()) return T;
  const Tensor& cu = *cu_seqlens_q;
  check_dim(block_table, 2, op, "block_table", "[B, max_blocks]");
  check_dim(cu, 1, op, "cu_seqlens_q", "[B + 1]");
  check_dtype(cu, at::kInt, op, "cu_seqlens_q");
  check_same_device(cu, block_table, op, "cu_seqlens_q", "block_table");
  check_contiguous(cu, op, "cu_seqlens_q");
  const int64_t B = block_table.size(0);
  check_size(cu, 0, B + 1, op, "cu_seqlens_q", "B + 1, one more than block_table's rows");
  if (cu.device().is_cpu()) {
    const int32_t* c = cu.data_ptr<int32_t>();
    DCP_CHECK(c[0] == 0, op, "cu_seqlens_q[0] must be 0, got ", c[0]);
    for (int64_t b = 0; b < B; ++b)
      DCP_CHECK(c[b + 1] >= c[b], op, "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[", b + 1, "] = ",
                c[b + 1], " < cu_seqlens_q[", b, "] = ", c[b]);
    DCP_CHECK(c[B] == T, op, "cu_seqlens_q[B = ", B, "] must be the number of query tokens T = ", T, ", got ", c[B]);
  }
  return B;
}

// An output or cache written in place must not overlap itself (an expanded, stride-0 view would be written once per
// alias); docs/design.md §2.
static void check_no_internal_overlap(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
                    " is written in place and must not overlap itself (an expanded or stride-0 view), got strides ",
                    t.strides());
}

static void check_scale(double scale, const char* op) {
  DCP_CHECK(std::isfinite(scale) && scale > 0, op, "scale must be a finite positive number, got ", scale);
}

DecodeDims validate_gqa(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table,
                        const Tensor& seq_lens, double scale, const std::optional<Tensor>& cu_seqlens_q,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  constexpr const char* op = "gqa_decode_partial";
  check_dim(q, 3, op, "q", "[T, H_q, D]");
  check_dim(k_cache, 4, op, "k_cache", "[num_blocks, block_size, H_kv, D]");
  check_dim(v_cache, 4, op, "v_cache", "[num_blocks, block_size, H_kv, D]");
  check_float(q, op, "q");
  // The caches have q's dtype, or are both float8_e4m3fn with their scales (docs/design.md §6).
  const bool fp8 = check_kv_scale(k_cache, k_scale, op, "k_cache", "k_scale");
  check_dtype(k_cache, fp8 ? at::kFloat8_e4m3fn : q.scalar_type(), op, "k_cache");
  check_dtype(v_cache, k_cache.scalar_type(), op, "v_cache");
  check_kv_scale(v_cache, v_scale, op, "v_cache", "v_scale");
  check_same_device(k_cache, q, op, "k_cache", "q");
  check_same_device(v_cache, q, op, "v_cache", "q");
  DCP_CHECK(k_cache.sizes() == v_cache.sizes(), op, "v_cache must have the shape of k_cache ", k_cache.sizes(),
            ", got ", v_cache.sizes());
  DecodeDims d{};
  d.fp8 = fp8;
  d.T = q.size(0);
  d.Hq = q.size(1);
  d.Dk = d.Dv = q.size(2);
  d.num_blocks = k_cache.size(0);
  d.block_size = k_cache.size(1);
  d.Hkv = k_cache.size(2);
  check_size(k_cache, 3, d.Dk, op, "k_cache", "head dim, equal to q's");
  TORCH_CHECK_VALUE(d.Hkv > 0, op, ": k_cache has 0 KV heads (k_cache.shape[2]); it must be positive");
  DCP_CHECK(d.Hq % d.Hkv == 0, op, "q heads (", d.Hq, ") must be a multiple of the cache's KV heads (", d.Hkv, ")");
  DCP_CHECK(d.block_size > 0, op, "k_cache block_size (dim 1) must be positive, got ", d.block_size);
  TORCH_CHECK_VALUE(d.Dk > 0, op, ": q head dim (q.shape[2]) must be positive, got ", d.Dk);
  check_last_contiguous(q, op, "q");
  check_last_contiguous(k_cache, op, "k_cache");
  check_last_contiguous(v_cache, op, "v_cache");
  check_paged_meta(block_table, seq_lens, k_cache, check_cu_seqlens_q(block_table, cu_seqlens_q, d.T, op), d.T, op);
  d.max_blocks = block_table.size(1);
  check_scale(scale, op);
  return d;
}

DecodeDims validate_mla(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache, const Tensor& block_table,
                        const Tensor& seq_lens, double scale, const std::optional<Tensor>& w_uk,
                        const std::optional<Tensor>& w_uv, const std::optional<Tensor>& cu_seqlens_q,
                        const std::optional<Tensor>& kv_scale) {
  constexpr const char* op = "mla_decode_partial";
  check_dim(q_nope, 3, op, "q_nope", "[T, H, D_latent] or [T, H, D_nope] with w_uk");
  check_dim(q_pe, 3, op, "q_pe", "[T, H, D_rope]");
  check_dim(kv_cache, 3, op, "kv_cache", "[num_blocks, block_size, D_latent + D_rope]");
  check_float(q_nope, op, "q_nope");
  check_dtype(q_pe, q_nope.scalar_type(), op, "q_pe");
  // kv_cache has q's dtype, or is float8_e4m3fn with its kv_scale (docs/design.md §6)
  const bool fp8 = check_kv_scale(kv_cache, kv_scale, op, "kv_cache", "kv_scale");
  if (!fp8) check_dtype(kv_cache, q_nope.scalar_type(), op, "kv_cache");
  check_same_device(q_pe, q_nope, op, "q_pe", "q_nope");
  check_same_device(kv_cache, q_nope, op, "kv_cache", "q_nope");
  DecodeDims d{};
  d.fp8 = fp8;
  d.T = q_nope.size(0);
  d.Hq = q_nope.size(1);
  d.Hkv = 1;
  check_size(q_pe, 0, d.T, op, "q_pe", "tokens, equal to q_nope's");
  check_size(q_pe, 1, d.Hq, op, "q_pe", "heads, equal to q_nope's");
  const int64_t rope = q_pe.size(2);
  d.Dk = kv_cache.size(2);
  const int64_t latent = d.Dk - rope;
  TORCH_CHECK_VALUE(latent > 0, op, ": kv_cache last dim (", d.Dk, ") must exceed q_pe's rope dim (", rope,
                    "): D_latent must be positive");
  d.Dv = latent;
  if (w_uk.has_value()) {
    check_dim(*w_uk, 3, op, "w_uk", "[H, D_nope, D_latent]");
    check_dtype(*w_uk, q_nope.scalar_type(), op, "w_uk");
    check_same_device(*w_uk, q_nope, op, "w_uk", "q_nope");
    check_size(*w_uk, 0, d.Hq, op, "w_uk", "heads, equal to q_nope's");
    check_size(*w_uk, 1, q_nope.size(2), op, "w_uk", "D_nope, equal to q_nope's last dim");
    check_size(*w_uk, 2, latent, op, "w_uk", "D_latent = kv_cache last dim - rope dim");
    TORCH_CHECK_VALUE(q_nope.size(2) > 0, op, ": q_nope's last dim (D_nope, absorbed through w_uk) must be positive, "
                      "got 0");
  } else {
    check_size(q_nope, 2, latent, op, "q_nope",
               "D_latent = kv_cache last dim - q_pe rope dim (pass w_uk for a pre-absorption query)");
  }
  if (w_uv.has_value()) {
    check_dim(*w_uv, 3, op, "w_uv", "[H, D_latent, D_v]");
    check_dtype(*w_uv, q_nope.scalar_type(), op, "w_uv");
    check_same_device(*w_uv, q_nope, op, "w_uv", "q_nope");
    check_size(*w_uv, 0, d.Hq, op, "w_uv", "heads, equal to q_nope's");
    check_size(*w_uv, 1, latent, op, "w_uv", "D_latent = kv_cache last dim - rope dim");
  }
  d.num_blocks = kv_cache.size(0);
  d.block_size = kv_cache.size(1);
  DCP_CHECK(d.block_size > 0, op, "kv_cache block_size (dim 1) must be positive, got ", d.block_size);
  check_last_contiguous(q_nope, op, "q_nope");
  check_last_contiguous(q_pe, op, "q_pe");
  check_last_contiguous(kv_cache, op, "kv_cache");
  check_paged_meta(block_table, seq_lens, kv_cache, check_cu_seqlens_q(block_table, cu_seqlens_q, d.T, op), d.T, op);
  d.max_blocks = block_table.size(1);
  check_scale(scale, op);
  return d;
}

void validate_merge(const Tensor& outs, const Tensor& lses, double lse_base, const char* op) {
  check_dim(outs, 4, op, "outs", "[N, T, H, D]");
  check_dim(lses, 3, op, "lses", "[N, T, H]");
  check_float(outs, op, "outs");
  check_dtype(lses, at::kFloat, op, "lses");
  check_same_device(lses, outs, op, "lses", "outs");
  for (int64_t d = 0; d < 3; ++d) check_size(lses, d, outs.size(d), op, "lses", "must match outs[N, T, H]");
  check_last_contiguous(outs, op, "outs");
  DCP_CHECK(std::isfinite(lse_base) && lse_base > 1.0, op, "lse_base must be e or 2 (a finite base > 1), got ",
            lse_base);
}

void validate_correct(const Tensor& out, const Tensor& lses, int64_t rank, double lse_base) {
  constexpr const char* op = "correct_partial";
  check_dim(out, 3, op, "out", "[T, H, D]");
  check_dim(lses, 3, op, "lses", "[N, T, H]");
  check_float(out, op, "out");
  check_dtype(lses, at::kFloat, op, "lses");
  check_same_device(lses, out, op, "lses", "out");
  check_size(lses, 1, out.size(0), op, "lses", "tokens, equal to out's");
  check_size(lses, 2, out.size(1), op, "lses", "heads, equal to out's");
  check_last_contiguous(out, op, "out");
  DCP_CHECK(rank >= 0 && rank < lses.size(0), op, "rank must be in [0, N = ", lses.size(0), "), got ", rank);
  check_no_internal_overlap(out, op, "out");
  DCP_CHECK(std::isfinite(lse_base) && lse_base > 1.0, op, "lse_base must be e or 2 (a finite base > 1), got ",
            lse_base);
}

int64_t exchange_pad(at::ScalarType dtype) { return kExchangePadBytes / static_cast<int64_t>(c10::elementSize(dtype)); }

void validate_pack_exchange(const Tensor& out, const Tensor& lse, const Tensor& send) {
  constexpr const char* op = "pack_exchange";
  check_dim(out, 3, op, "out", "[T, H, D]");
  check_dim(lse, 2, op, "lse", "[T, H]");
  check_dim(send, 4, op, "send", "[N, T, H/N, D + pad]");
  check_float(out, op, "out");
  check_dtype(lse, at::kFloat, op, "lse");
  check_dtype(send, out.scalar_type(), op, "send");
  check_same_device(lse, out, op, "lse", "out");
  check_same_device(send, out, op, "send", "out");
  check_size(lse, 0, out.size(0), op, "lse", "tokens, equal to out's");
  check_size(lse, 1, out.size(1), op, "lse", "heads, equal to out's");
  const int64_t n = send.size(0);
  DCP_CHECK(n > 0 && out.size(1) % n == 0, op, "out heads (", out.size(1), ") must divide into send.shape[0] = ", n,
            " ranks");
  check_size(send, 1, out.size(0), op, "send", "tokens, equal to out's");
  check_size(send, 2, out.size(1) / n, op, "send", "heads per rank H/N");
  check_size(send, 3, out.size(2) + exchange_pad(out.scalar_type()), op, "send", "D + pad (16 bytes)");
  check_last_contiguous(out, op, "out");
  check_contiguous(send, op, "send");
}

void validate_merge_exchange(const Tensor& recv, const Tensor& out, const Tensor& lse) {
  constexpr const char* op = "merge_exchange";
  check_dim(recv, 4, op, "recv", "[N, T, H_loc, D + pad]");
  check_float(recv, op, "recv");
  check_contiguous(recv, op, "recv");
  const int64_t pad = exchange_pad(recv.scalar_type());
  DCP_CHECK(recv.size(3) > pad, op, "recv last dim must be D + ", pad, " (16 bytes of LSE pad), got ", recv.size(3));
  check_dim(out, 3, op, "out", "[T, H_loc, D]");
  check_dim(lse, 2, op, "lse", "[T, H_loc]");
  check_dtype(out, recv.scalar_type(), op, "out");
  check_dtype(lse, at::kFloat, op, "lse");
  check_same_device(out, recv, op, "out", "recv");
  check_same_device(lse, recv, op, "lse", "recv");
  check_size(out, 0, recv.size(1), op, "out", "tokens");
  check_size(out, 1, recv.size(2), op, "out", "heads per rank");
  check_size(out, 2, recv.size(3) - pad, op, "out", "D");
  check_size(lse, 0, recv.size(1), op, "lse", "tokens");
  check_size(lse, 1, recv.size(2), op, "lse", "heads per rank");
  check_last_contiguous(out, op, "out");
  check_no_internal_overlap(out, op, "out");
  check_no_internal_overlap(lse, op, "lse");
}

void validate_write_kv(const Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping,
                       const std::optional<Tensor>& scale) {
  constexpr const char* op = "write_kv";
  DCP_CHECK(cache.dim() >= 3, op, "cache must be [num_blocks, block_size, *E] (at least 3-D), got shape ",
            cache.sizes());
  DCP_CHECK(new_kv.dim() == cache.dim() - 1, op, "new must be [T, *E] with E = cache.shape[2:] ",
            cache.sizes().slice(2), ", got shape ", new_kv.sizes());
  for (int64_t d = 2; d < cache.dim(); ++d)
    DCP_CHECK(new_kv.size(d - 1) == cache.size(d), op, "new must be [T, *E] with E = cache.shape[2:] ",
              cache.sizes().slice(2), ", got shape ", new_kv.sizes());
  if (check_kv_scale(cache, scale, op, "cache", "scale"))  // an FP8 cache stores new / scale (docs/design.md §6)
    check_float(new_kv, op, "new");
  else
    check_dtype(new_kv, cache.scalar_type(), op, "new");
  check_dim(slot_mapping, 1, op, "slot_mapping", "[T]");
  DCP_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong, op,
            "slot_mapping must have dtype int32 (or int64), got ", slot_mapping.scalar_type());
  check_size(slot_mapping, 0, new_kv.size(0), op, "slot_mapping", "tokens, equal to new's");
  check_same_device(new_kv, cache, op, "new", "cache");
  check_same_device(slot_mapping, cache, op, "slot_mapping", "cache");
  check_contiguous(slot_mapping, op, "slot_mapping");
  check_dense_tail(cache, 2, op, "cache");
  check_dense_tail(new_kv, 1, op, "new");
  check_no_internal_overlap(cache, op, "cache");
}

}  // namespace dcp_ops
