// Op declarations: shape validation shared by all backends, and the per-backend implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace dcp_ops {

using at::Tensor;

// Sizes of a paged decode problem after validation.
// fp8: the cache is float8_e4m3fn, read with its scale(s) (docs/design.md §6).
struct DecodeDims {
  int64_t T, Hq, Hkv, Dk, Dv, num_blocks, block_size, max_blocks;
  bool fp8;
};

// Numerics of the decode ops on 16-bit caches (docs/design.md §2): kNative feeds the tensor cores 16-bit operands (the
// absorbed query and P rounded to the cache's type), kFp32 computes as if every product were fp32. fp32 caches, and
// kernels without tensor cores, compute in fp32 under both.
enum class Precision { kNative, kFp32 };
Precision parse_precision(c10::string_view precision, const char* op);  // refuses any other value, naming it
// The merges' nonfinite_lse (docs/design.md §2): "empty" (false; NaN and +inf LSE are empty partials) or "propagate"
// (true; they poison the row); any other value is refused by name.
bool parse_nonfinite_lse(c10::string_view nonfinite_lse, const char* op);

// Multi-token decode (docs/design.md §6): with cu_seqlens_q [B + 1] (checked by validate_gqa / validate_mla; its
// values where it is on the CPU), query token t belongs to block-table row b with cu[b] <= t < cu[b + 1], and
// seq_lens [T] holds each query's causal length. The kernels take block_table and cu_seqlens_q as they are and give
// a sequence's query tokens the same KV reads (CPU: cpu/paged_decode.cpp's units; CUDA: the split plan's blocks).

// Validation (csrc/validate.cpp): dtypes, ranks, shapes, devices and strides; no tensor values are read.
DecodeDims validate_gqa(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table,
                        const Tensor& seq_lens, double scale, const std::optional<Tensor>& cu_seqlens_q,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale);
DecodeDims validate_mla(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache, const Tensor& block_table,
                        const Tensor& seq_lens, double scale, const std::optional<Tensor>& w_uk,
                        const std::optional<Tensor>& w_uv, const std::optional<Tensor>& cu_seqlens_q,
                        const std::optional<Tensor>& kv_scale);
void validate_merge(const Tensor& outs, const Tensor& lses, double lse_base, const char* op);
void validate_correct(const Tensor& out, const Tensor& lses, int64_t rank, double lse_base);
void validate_pack_exchange(const Tensor& out, const Tensor& lse, const Tensor& send);
void validate_merge_exchange(const Tensor& recv, const Tensor& out, const Tensor& lse);
void validate_write_kv(const Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping,
                       const std::optional<Tensor>& scale);
// A packed a2a row (pack_exchange, merge_exchange) is D elements and a pad of kExchangePadBytes, the fp32 LSE in its
// first 4 bytes; exchange_pad is the pad in elements. dcp_ops.ops.exchange_pad reads the same constant (_C).
constexpr int64_t kExchangePadBytes = 16;
int64_t exchange_pad(at::ScalarType dtype);

// CPU kernels. Declared here for their signatures: each is defined once per ISA level, as
// dcp_ops::cpu::isa_<level>::<name> (the same name) in csrc/cpu/attention.cpp (the decode ops), csrc/cpu/merge.cpp
// (the merge family) and csrc/cpu/write_kv.cpp, and ops.cpp registers the level chosen at import through its table
// (csrc/cpu/level_ops.cpp; cpu_levels.h's Forward<&Ops::name>). No dcp_ops::<name>_cpu exists to call.
std::tuple<Tensor, Tensor> gqa_decode_partial_cpu(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                  c10::string_view precision,
                                                  const std::optional<Tensor>& cu_seqlens_q,
                                                  const std::optional<Tensor>& k_scale,
                                                  const std::optional<Tensor>& v_scale);
std::tuple<Tensor, Tensor> mla_decode_partial_cpu(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                  const std::optional<Tensor>& w_uk,
                                                  const std::optional<Tensor>& w_uv, c10::string_view precision,
                                                  const std::optional<Tensor>& cu_seqlens_q,
                                                  const std::optional<Tensor>& kv_scale);
std::tuple<Tensor, Tensor> merge_partials_cpu(const Tensor& outs, const Tensor& lses, double lse_base,
                                              c10::string_view nonfinite_lse);
Tensor correct_partial_cpu(Tensor& out, const Tensor& lses, int64_t rank, double lse_base,
                           c10::string_view nonfinite_lse);
void pack_exchange_cpu(const Tensor& out, const Tensor& lse, Tensor& send);
void merge_exchange_cpu(const Tensor& recv, Tensor& out, Tensor& lse, c10::string_view nonfinite_lse);
void write_kv_cpu(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping, const std::optional<Tensor>& scale);

// CUDA launchers (csrc/cuda/*.cu; also built for the SIMT executor in tests/simt).
std::tuple<Tensor, Tensor> gqa_decode_partial_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                                   const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                   c10::string_view precision,
                                                   const std::optional<Tensor>& cu_seqlens_q,
                                                   const std::optional<Tensor>& k_scale,
                                                   const std::optional<Tensor>& v_scale);
std::tuple<Tensor, Tensor> mla_decode_partial_cuda(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache,
                                                   const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                   const std::optional<Tensor>& w_uk,
                                                   const std::optional<Tensor>& w_uv, c10::string_view precision,
                                                   const std::optional<Tensor>& cu_seqlens_q,
                                                   const std::optional<Tensor>& kv_scale);
std::tuple<Tensor, Tensor> merge_partials_cuda(const Tensor& outs, const Tensor& lses, double lse_base,
                                               c10::string_view nonfinite_lse);
Tensor correct_partial_cuda(Tensor& out, const Tensor& lses, int64_t rank, double lse_base,
                            c10::string_view nonfinite_lse);
void pack_exchange_cuda(const Tensor& out, const Tensor& lse, Tensor& send);
void merge_exchange_cuda(const Tensor& recv, Tensor& out, Tensor& lse, c10::string_view nonfinite_lse);
void write_kv_cuda(Tensor& cache, const Tensor& new_kv, const Tensor& slot_mapping, const std::optional<Tensor>& scale);

// The split pass a decode op takes on a described device (csrc/cuda/split_choice.cu, by cuda/split_choice.h's one
// decision), for tools that read the SASS without a GPU (_C.split_choice, bench/gpu/sass_budget.py). op "mla": dims
// (latent, rope); op "gqa": dims (head dim, 0) and `rows` query rows per KV head. smem_optin 0: the arch's flagship's
// (device.h's flagship_smem_optin).
struct SplitPassInfo {
  std::string kernel;
  int rows, granule, tokens, smem;
};
SplitPassInfo describe_split_pass(const std::string& op, int dim0, int dim1, int q_elem_bytes, bool native,
                                  int64_t rows, int arch, int smem_optin);

}  // namespace dcp_ops
