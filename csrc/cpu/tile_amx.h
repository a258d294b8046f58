// The AMX tile kernel of paged decode (amx level): for a bf16 cache with K and V rows of multiples of 32 (amx::fits),
// and an fp32 cache of 16 heads per KV head with V in K's rows (MLA 16 heads), one KV head's scores, online softmax
// and P.V over a tile of cache rows on AMX tiles (cpu/amx.h). The driver is cpu/paged_decode.cpp.
#pragma once

#include "cpu/level.h"

#if defined(DCP_OPS_AMX)

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "cpu/amx.h"
#include "cpu/convert.h"
#include "cpu/line_vector.h"
#include "cpu/online_softmax.h"
#include "cpu/paged_decode.h"
#include "cpu/tile_prefetch.h"
#include "cpu_levels.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// st[i * Ga + g] = K_i . q_g in fp32 FMAs for i < n (0 for the padded heads g >= G): the AMX scores of a tile whose K
// holds an inf or NaN in a valid slot, for a query split into three bf16 terms, whose zero or opposite-signed terms
// would make q x inf a NaN where the reference has +-inf.
template <typename Rows>
inline void exact_scores(int64_t n, int64_t G, int64_t Ga, int64_t Dk, const Rows& rows, const float* q, int64_t q_sh,
                  float* st) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < Ga; ++g) {
      float s = 0.f;
      if (g < G)
        for (int64_t d = 0; d < Dk; ++d) s = std::fma(q[g * q_sh + d], to_f32(rows(i)[d]), s);
      st[i * Ga + g] = s;
    }
}

// Whether and how a problem runs on the AMX kernels: a bf16 cache whose rows fit, both GEMMs on AMX tiles, an fp32
// query as three bf16 terms and the probabilities as two. An fp32 cache with 16 heads per KV head and V in K's rows
// (MLA 16 heads) too (split): each tile's rows are split into three bf16 terms (amx::split_rows, exact), scored
// against the query's three, and P's three terms multiplied by V's (the same split rows): six tile products for each,
// fp32 accuracy. (32K tokens, batch 16, alternated: MLA 16 heads 127-135 -> 118-124 ms, with w_uk 133-141 -> 124-127
// ms; GQA 32q/2kv d128 84 -> 123 ms, which splits V's rows too and keeps the FMA kernels.)
struct AmxPlan {
  bool on = false, split = false;
  int qterms = 1;              // bf16 terms of the query (score_block3 takes K in three terms against three)
  int kterms = 1;              // ... of each cache element in the tiles
  int64_t G = 0, Ga = 0;       // heads per KV head, and as the running state lays them out: whole tiles of 16, the
                               // heads past G (zero queries) computed and dropped
  bool v_rows = false;         // P.V by pv_rows: O's columns even / odd apart per 32
  // ... or, for at most 8 heads of a bf16 cache, by pv_stacked: both halves of P's dwords in one A tile, half the
  // products and P's tiles (32K tokens, GQA 16q/2kv d128, alternated: batch 1 3.0 -> 2.8 ms, batch 16 45.6 -> 40.3).
  bool stack_fits = false;
  int64_t qb_size = 0;         // elements of one KV head's packed Q^T (16 columns per KV head whatever G)
  bool v_in_k = false;         // V rows are the first Dv elements of the K rows

  template <typename scalar_t>
  static AmxPlan make(const PagedDecodeParams& p, int64_t G, bool v_in_k) {
    AmxPlan a;
    a.G = G;
    a.Ga = G;
    a.v_in_k = v_in_k;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, float>) {
      a.split = std::is_same_v<scalar_t, float> && G == 16 && v_in_k && amx::fits(p.Dk, p.Dv);
      a.on = (std::is_same_v<scalar_t, c10::BFloat16> && amx::fits(p.Dk, p.Dv)) || a.split;
    }
    if (!a.on) return a;
    // The amx level is chosen only where Linux grants the tile state (cpu_levels.cpp).
    TORCH_CHECK(amx_tile_permitted(), "paged_decode: Linux refused this process the AMX tile state "
                "(arch_prctl ARCH_REQ_XCOMP_PERM); set DCP_OPS_CPU_CAPABILITY=avx512bf16");
    a.qterms = p.q_exact_bf16 && !a.split ? 1 : 3;
    a.kterms = a.split ? 3 : 1;
    a.Ga = amx::padded_heads(G);
    a.v_rows = a.Ga <= amx::kRowsVMaxHeads;
    a.stack_fits = !a.split && G <= amx::kStackedMaxHeads;
    a.qb_size = a.qterms * amx::q_size(a.Ga, p.Dk);
    return a;
  }
};

// One thread's AMX state: the tile configuration, copies of unevenly strided K rows (bf16) or the three terms of
// every K row (fp32); V for P.V (pack_v's pairs, or copies of unevenly strided V rows for pv_rows / pv_stacked);
// the packed queries of a unit's tokens; P's terms (pack_p's, or pack_p_halves' or pack_p_stacked's dwords).
template <typename scalar_t>
struct AmxTile {
  const AmxPlan& a;
  const PagedDecodeParams& p;
  std::optional<amx::TileScope> tiles;
  LineVector<amx::bf16> kbuf, vbuf, qb;
  LineVector<uint32_t> pbuf;

  AmxTile(const AmxPlan& plan, const PagedDecodeParams& params, int64_t unit_tokens, int64_t tile_max)
      : a(plan),
        p(params),
        kbuf(a.on ? a.kterms * tile_max * p.Dk : 0),
        vbuf(a.on ? p.Dv / 16 * amx::v_tile(tile_max) : 0),
        qb(a.on ? unit_tokens * p.Hkv * a.qb_size : 0),
        pbuf(a.on ? std::max({a.Ga * tile_max, amx::p_halves_size(a.Ga, tile_max, a.kterms == 3 ? 3 : 2),
                              amx::p_stacked_size(tile_max, 2)})
                  : 0) {
    if (a.on) tiles.emplace();
  }

  // Packs query token qi of the unit (its fp32 row qtok, every KV head).
  void pack_query(int64_t qi, const float* qtok) {
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
      amx::pack_q(a.G, a.Ga, p.Dk, qtok + kvh * a.G * p.q_sh, p.q_sh, p.q_exact_bf16 ? 1.f / p.q_mult : 1.f,
                  a.qterms, qb.data() + (qi * p.Hkv + kvh) * a.qb_size);
  }

  // One KV head's tile for query token t (the unit's qi): n rows (krows / vrows, KV head kvh's at k_off / v_off),
  // scores into st, the running state m, l and o (Ga heads) updated. rows_v: P.V on V's rows in place.
  template <typename Hook>
  void tile(int64_t n, const scalar_t* const* krows, const scalar_t* const* vrows, int64_t kvh, int64_t qi, int64_t t,
            bool rows_v, float* st, float* m, float* l, float* alpha, float* o, Hook& pf) {
    const bool stacked = rows_v && a.stack_fits;
    auto krow = [&](int64_t i) { return krows[i] + kvh * p.k_sh; };
    auto vrow = [&](int64_t i) { return vrows[i] + kvh * p.v_sh; };
    amx::TileRows kt[3];  // K's tiles: the cache rows (bf16), or their three bf16 terms (fp32)
    if constexpr (std::is_same_v<scalar_t, float>)
      amx::split_rows(krow, n, p.Dk, kbuf.data(), kt);
    else
      kt[0] = amx::tile_rows(krow, n, p.Dk, p.k_st, kbuf.data());
    amx::scores(n, a.Ga, p.Dk, kt, a.kterms, qb.data() + (qi * p.Hkv + kvh) * a.qb_size, a.qterms, st, pf);
    if (a.qterms > 1 && !all_finite(st, n * a.Ga))
      exact_scores(n, a.G, a.Ga, p.Dk, krow, p.q + t * p.q_st + kvh * a.G * p.q_sh, p.q_sh, st);
    softmax_update(st, a.Ga, n, m, l, alpha, p.q_exact_bf16 ? p.q_mult : 1.f, pf);
    if (stacked) {  // rows h and 8 + h of O are head h's even and odd dims
      rescale_rows(o, a.G, p.Dv / 2, p.Dv, alpha);
      rescale_rows(o + amx::kStackedMaxHeads * p.Dv, a.G, p.Dv / 2, p.Dv, alpha);
    } else {
      rescale_rows(o, a.Ga, p.Dv, p.Dv, alpha);
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
      // P's three terms against V's: the first Dv elements of K's split rows (split takes v_in_k)
      amx::pack_p_halves(st, n, a.Ga, 3, pbuf.data());
      amx::pv_rows<3, 3>(a.Ga, p.Dv, n, pbuf.data(), kt, o, pf);
    } else if (rows_v) {  // P's two terms against V's rows: K's (their first Dv elements) or their own
      const amx::TileRows vt = a.v_in_k ? kt[0] : amx::tile_rows(vrow, n, p.Dv, p.v_st, vbuf.data());
      if (stacked) {
        amx::pack_p_stacked(st, n, a.Ga, 2, pbuf.data());
        amx::pv_stacked<2>(p.Dv, n, pbuf.data(), vt, o, pf);
      } else {
        amx::pack_p_halves(st, n, a.Ga, 2, pbuf.data());
        amx::pv_rows<2, 1>(a.Ga, p.Dv, n, pbuf.data(), &vt, o, pf);
      }
    } else {
      const int64_t np = amx::padded(n);
      auto* hi = reinterpret_cast<amx::bf16*>(pbuf.data());
      amx::pack_p(st, n, a.Ga, np, hi, hi + a.Ga * np);
      amx::pack_v(vrow, n, np, p.Dv, vbuf.data());
      amx::pv(a.Ga, p.Dv, np, hi, hi + a.Ga * np, vbuf.data(), o, pf);
    }
  }

  // The first G heads of one KV head's running output o (Ga rows of Dv) into dst [G x Dv], in dim order: P.V on V's
  // rows (rows_v) leaves the odd dims 16 columns on (pv_rows) or 8 rows down (pv_stacked).
  void copy_out(const float* o, bool rows_v, float* dst) const {
    if (!rows_v) {
      std::copy(o, o + a.G * p.Dv, dst);
      return;
    }
    const int64_t odd = a.stack_fits ? amx::kStackedMaxHeads * p.Dv : 16, step = a.stack_fits ? 16 : 32;
    for (int64_t g = 0; g < a.G; ++g) {
      const float* even = o + g * p.Dv;
      amx::interleave_row(even, even + odd, step, p.Dv, dst + g * p.Dv);
    }
  }
};

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu

#endif  // DCP_OPS_AMX
