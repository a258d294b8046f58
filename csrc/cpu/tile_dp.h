// The bf16 dot-product tile kernel of paged decode (avx512bf16 and amx levels): for a bf16 cache and an exact bf16
// query, one KV head's scores over a tile of cache rows by vdpbf16ps on the unscaled query, scaled after in fp32
// (gemm_dp for whole vectors of heads, MLA; gemm_dp8 for at most 8, GQA). P.V is the FMA kernel's (cpu/tile_fma.h).
#pragma once

#include "cpu/level.h"

#if defined(DCP_OPS_AVX512_BF16)

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/convert.h"
#include "cpu/gemm.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// x[0 .. n) *= mult: scores of the unscaled bf16 query brought to base-2 softmax units.
inline void scale_scores(float* x, int64_t n, float mult) {
  const fVec mv(mult);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) (fVec::loadu(x + i) * mv).store(x + i);
  if (i < n) (fVec::loadu(x + i, n - i) * mv).store(x + i, n - i);
}

// One KV head's query as gemm_dp / gemm_dp8 take it: pair i of head g, (q_g[2i], q_g[2i + 1]) in bf16 (0 past an odd
// K), at qp[i * qheads + g] for the G heads. q's rows are a bf16 query times q_mult in fp32, so times inv = 1 / q_mult
// they round back to it. Each row is scaled into row32 and rounded by round_to_bf16 (as c10::BFloat16 rounds, 16
// elements at a time; NaN stays NaN) into row16, then copied a pair at a time: converted one element at a time, the
// query took 0.2 ms of a 0.43 ms call for MLA's 128 heads at 64 tokens. row32 and row16 hold K rounded up to even.
inline void pack_query_pairs(int64_t G, int64_t K, const float* q, int64_t q_sh, float inv, int64_t qheads, float* row32,
                      c10::BFloat16* row16, uint32_t* qp) {
  const int64_t pairs = (K + 1) / 2;
  const fVec iv(inv);
  for (int64_t g = 0; g < G; ++g) {
    const float* src = q + g * q_sh;
    int64_t d = 0;
    for (; d + kVL <= K; d += kVL) (fVec::loadu(src + d) * iv).store(row32 + d);
    for (; d < K; ++d) row32[d] = src[d] * inv;
    if (K % 2) row32[K] = 0.f;
    round_to_bf16(row32, row16, 2 * pairs);
    for (int64_t i = 0; i < pairs; ++i) std::memcpy(qp + i * qheads + g, row16 + 2 * i, 4);
  }
}

struct DpTile {
  int64_t G, Dk;
  bool eight;    // gemm_dp8 (G <= 8), else gemm_dp (G a multiple of the vector)
  float q_mult;  // the scale * log2(e) that the fp32 query rows carry

  int64_t qheads() const { return eight ? 8 : G; }
  // 32-bit pairs of one KV head's packed query (gemm_dp8's heads past G must be zero: allocate its buffer zeroed).
  int64_t qpairs() const { return (Dk + 1) / 2 * qheads(); }

  // One KV head's query (G rows of Dk floats, q_sh apart, times q_mult) as the bf16 pairs qp; row32 and row16 hold
  // Dk rounded up to even.
  void pack_query(const float* q, int64_t q_sh, float* row32, c10::BFloat16* row16, uint32_t* qp) const {
    pack_query_pairs(G, Dk, q, q_sh, 1.f / q_mult, qheads(), row32, row16, qp);
  }

  // st [n x G] = the n tile rows of K against qp, times q_mult (base-2 softmax units).
  template <typename Hook>
  void scores(int64_t n, const RowPtrs<c10::BFloat16>& k, const uint32_t* qp, float* st, Hook& hook) const {
    const auto* pairs = reinterpret_cast<const c10::BFloat16*>(qp);
    if (eight) {
      gemm_dp8(n, Dk, k, pairs, st, G, G, hook);
    } else {
      std::fill(st, st + n * G, 0.f);
      gemm_dp(n, G, Dk, k, pairs, G, st, G, hook);
    }
    scale_scores(st, n * G, q_mult);
  }
};

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu

#endif  // DCP_OPS_AVX512_BF16
