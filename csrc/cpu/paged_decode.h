// Split-KV paged decode attention on the CPU, shared by the GQA and MLA partial ops.
#pragma once

#include "cpu/level.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// One decode problem: Hq query heads over Hkv KV heads (MLA: Hkv = 1, K row = latent + rope, V = its first Dv).
struct PagedDecodeParams {
  const float* q;  // [T, Hq, Dk] fp32, already multiplied by scale * log2(e)
  int64_t q_st, q_sh;
  float q_mult;       // the scale * log2(e) that q was multiplied by
  bool q_exact_bf16;  // whether q / q_mult is exactly the op's bf16 query (a bf16 query, not absorbed through w_uk)
  const void* k;  // cache element type; element strides per block, token and KV head
  int64_t k_sb, k_st, k_sh;
  const void* v;
  int64_t v_sb, v_st, v_sh;
  int64_t T, Hq, Hkv, Dk, Dv;
  const int32_t* block_table;  // [B, max_blocks]: row b is sequence b's
  int64_t bt_stride;
  int64_t block_size;
  const int32_t* seq_lens;       // [T]: each query token's length
  const int32_t* cu_seqlens_q;   // [B + 1]: sequence b's query tokens are cu[b] .. cu[b+1]-1; null: token b (T = B)
  int64_t B;
  void* out;  // [T, Hq, Dv] contiguous, of out_dtype (fp32, or the query's type), normalised, times out_mult
  float out_mult;  // 1, or an FP8 cache's V scale
  at::ScalarType out_dtype;
  float* lse;  // [T, Hq] fp32, natural log; -inf for an empty sequence
};

// Reads every (query token, block) entry the kernel will touch and fails on an index outside the cache or table;
// with cu_seqlens_q (checked by the validators) query token t reads the block-table row of its sequence.
void check_paged_indices(const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_blocks, int64_t block_size,
                         const char* op);

// cache_dtype: the query's type (fp32, bf16, fp16), or float8_e4m3fn, whose rows are converted to fp32 in registers
// (exact) and computed as an fp32 cache's; its scales are folded into q_mult and out_mult by the caller.
void paged_decode(const PagedDecodeParams& p, at::ScalarType cache_dtype);

// out[offset .. offset + n) = src, converted to dtype (fp32, bf16 or fp16; rounded to nearest even, as Tensor::to).
void store_row(void* out, at::ScalarType dtype, int64_t offset, const float* src, int64_t n);

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
