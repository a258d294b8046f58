// AMX (Advanced Matrix Extensions) tile kernels for paged decode over a bf16 cache (and an fp32 MLA cache of 16 heads,
// its rows split into three bf16 terms by split_rows), in builds for the amx ISA level.
// TDPBF16PS multiplies bf16 pairs exactly and adds the products to fp32 tiles with fp32 additions, as vdpbf16ps does,
// so results are those of fp32 arithmetic on the same values. Operands that are not exactly bf16 (an fp32 query
// absorbed through w_uk, the fp32 probabilities) are split into sums of bf16 terms first: x = hi + lo leaves at
// most 2^-16 |x| behind, x = hi + mid + lo nothing (8 + 8 + 8 significant bits hold fp32's 24). Two three-term
// operands keep the six products whose term orders sum to at most 2 (score_block3, pv_rows_block).
//
// Tiles: tmm0-3 accumulate C (16 rows x 16 fp32), tmm4-5 hold A (16 rows x 32 bf16), tmm6-7 hold B (16 pairs of rows
// x 16 columns, "VNNI": B[2r + e][n] at pair r, column n, element e); score_block3 takes tmm5 for a third B tile.
//   scores: S^T [tokens x heads] = K [tokens x Dk] * Q^T [Dk x heads]; A read from the cache rows in place (or from a
//           copy where 16 rows are not evenly strided), Q^T packed once per query.
//   P.V:    O [heads x Dv] += P [heads x tokens] * V [tokens x Dv], P transposed from the softmax's S^T layout and
//           split hi + lo, in one of two ways:
//           - V's B tiles are the cache rows themselves (pv_rows, up to kRowsVMaxHeads heads per KV head): a row holds
//             pairs of adjacent dims, so P goes in the low half of each dword against the even dims and in the high
//             half against the odd ones (the other half zero), two products per tile and term, O's columns kept
//             even / odd apart per 32 (interleave_row puts them back); at most 8 heads (pv_stacked) fit both halves
//             in one A tile, the low halves in rows 0-7 and the high halves in rows 8-15, one product per tile and
//             term;
//           - V packed in pairs of token rows (pack_v, pv): one product per tile and term, for many heads per KV head,
//             where the packing is shared by all their tiles.
#pragma once

#include "cpu/level.h"

#if defined(DCP_OPS_AMX)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/avx512.h"
#include "cpu_levels.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)
namespace amx {

using bf16 = c10::BFloat16;

constexpr int64_t kRows = 16;  // tile rows (tokens of an A tile of K; heads of an A tile of P)
constexpr int64_t kPair = 32;  // bf16 elements of an A tile row: the K extent of one TDPBF16PS

// Whether these kernels take a problem: K and V row widths multiples of 32. Any number of heads per KV head: the score
// tiles of fewer than 16 leave columns idle, yet at 32K tokens, batch 1 and 16, d128, they ran faster than the
// FMA kernels (bf16 dot products) for 1, 2, 4 and 6 heads too (1.3x, 1.3x, 1.5x, 1.5-1.7x), P.V by pv_stacked.
inline bool fits(int64_t Dk, int64_t Dv) { return Dk % kPair == 0 && Dv % kPair == 0; }

// Most heads per KV head (padded) whose P.V reads V's B tiles from the cache rows in place (pv_rows), at twice the
// tile products of pv over V packed by pack_v, whose cost more head tiles share. Per 64 tokens, one thread, rows in
// L2: MLA 16 heads 9.3 -> 5.4 us, 32 heads 12.6 -> 9.2 us, GQA (8 heads, d128) 2.1 -> 1.5 us.
constexpr int64_t kRowsVMaxHeads = 32;

// Heads per KV head rounded up to whole tiles of 16; the kernels compute the heads past G from zero queries.
inline int64_t padded_heads(int64_t G) { return (G + 15) / 16 * 16; }

// Loads the one tile configuration (every tile 16 rows of 64 bytes) on this thread for the lifetime of the object.
struct TileScope {
  TileScope() {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      const uint16_t colsb = 64;
      std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
      cfg[48 + t] = 16;
    }
    asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  }
  ~TileScope() { asm volatile("tilerelease" ::: "memory"); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Tile instructions with the tile numbers as template arguments (the assembler takes them as literals). Loads and
// stores clobber memory so that the compiler orders them with the plain stores and loads around them (GCC's own
// _tile_loadd does not).
template <int T> inline void load(const void* base, int64_t stride);
template <int T> inline void store(void* base, int64_t stride);
template <int T> inline void zero();
template <int C, int A, int B> inline void dp();
#define DCP_AMX_TILE(T)                                                                                     \
  template <> inline void load<T>(const void* base, int64_t stride) {                                      \
    asm volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(stride) : "memory");                     \
  }                                                                                                         \
  template <> inline void store<T>(void* base, int64_t stride) {                                           \
    asm volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory");                 \
  }                                                                                                         \
  template <> inline void zero<T>() { asm volatile("tilezero %%tmm" #T ::); }
DCP_AMX_TILE(0)
DCP_AMX_TILE(1)
DCP_AMX_TILE(2)
DCP_AMX_TILE(3)
DCP_AMX_TILE(4)
DCP_AMX_TILE(5)
DCP_AMX_TILE(6)
DCP_AMX_TILE(7)
#undef DCP_AMX_TILE
#define DCP_AMX_DP(C, A, B) \
  template <> inline void dp<C, A, B>() { asm volatile("tdpbf16ps %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::); }
#define DCP_AMX_DP_C(C) \
  DCP_AMX_DP(C, 4, 5) DCP_AMX_DP(C, 4, 6) DCP_AMX_DP(C, 4, 7) DCP_AMX_DP(C, 5, 6) DCP_AMX_DP(C, 5, 7)
DCP_AMX_DP_C(0)
DCP_AMX_DP_C(1)
DCP_AMX_DP_C(2)
DCP_AMX_DP_C(3)
#undef DCP_AMX_DP_C
#undef DCP_AMX_DP

template <typename F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unrolled(F&& f) {
  unrolled(std::forward<F>(f), std::make_integer_sequence<int, N>{});
}

// Elements of packed Q^T for one KV head and one bf16 term: Dk / 2 pairs of rows by G heads by 2.
inline int64_t q_size(int64_t G, int64_t Dk) { return Dk * G; }

// x = t[0] + ... + t[terms - 1] in bf16 terms, each the remainder rounded to nearest even: two leave at most 2^-16 |x|
// behind, three nothing.
inline void split(__m512 x, int terms, __m256i* t) {
  for (int s = 0; s < terms; ++s) {
    t[s] = (__m256i)_mm512_cvtneps_pbh(x);
    if (s + 1 < terms) {
      const __m512i wide = _mm512_maskz_cvtepu16_epi32(kAll16, t[s]);
      x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, wide, 16)));  // t[s] as fp32
    }
  }
}

// Packs Q^T of G heads (q rows of Dk fp32 at stride q_sh, times mult; Dk a multiple of 32) for the score tiles as
// `terms` bf16 terms, in Ga >= G columns: qb[(s * Dk / 2 + r) * Ga + g][e] = term s of q[g][2r + e] * mult. Each term
// is the remainder rounded to nearest even (split), and the remainder after it is exact. Columns past G are zero, so that the
// padded heads' scores (computed and dropped) stay finite and send no tile to the recomputes for non-finite values.
// (Vectorised, one scatter of 16 pairs per term: at 64 tokens, batch 1, rows in cache, an MLA call with 16 heads went
// 0.055 -> 0.033 ms, 0.182 -> 0.147 with w_uk's three terms.)
inline void pack_q(int64_t G, int64_t Ga, int64_t Dk, const float* q, int64_t q_sh, float mult, int terms, bf16* qb) {
  if (G < Ga) std::memset(static_cast<void*>(qb), 0, terms * Dk * Ga * sizeof(bf16));
  auto* qd = reinterpret_cast<int32_t*>(qb);  // dword (s * Dk / 2 + r) * Ga + g: the pair (2r, 2r + 1) of head g
  const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(Ga)));  // 16 pairs of dims, Ga apart
  const __m512 mv = _mm512_set1_ps(mult);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < Dk; d += 32) {
      __m256i lo[3], hi[3];  // the terms of dims d .. d + 15 and d + 16 .. d + 31
      split(_mm512_mul_ps(_mm512_loadu_ps(q + g * q_sh + d), mv), terms, lo);
      split(_mm512_mul_ps(_mm512_loadu_ps(q + g * q_sh + d + 16), mv), terms, hi);
      for (int s = 0; s < terms; ++s)
        _mm512_i32scatter_epi32(qd + (s * Dk / 2 + d / 2) * Ga + g, pairs,
                                _mm512_maskz_inserti64x4(kAll8, _mm512_castsi256_si512(lo[s]), hi[s], 1), 4);
    }
}

// Groups of 16 tokens in n tokens (a tile of at most 64 tokens has at most 4).
inline int64_t groups_of(int64_t n) { return (n + kRows - 1) / kRows; }

// Where the tiles of a group of 16 token rows read them (A tiles of K, B tiles of V): in place when the rows are evenly
// strided and all present, else from a zero-padded copy (rows of `width` elements). from(g): the groups from g on.
struct TileRows {
  const bf16* base[4];
  int64_t stride[4];  // bytes
  TileRows from(int64_t g) const {
    TileRows a{};
    for (int64_t i = g; i < 4; ++i) a.base[i - g] = base[i], a.stride[i - g] = stride[i];
    return a;
  }
};

// rows(i): token row i (i < n <= 64) of one KV head, `width` elements read from each; copies go to buf (64 rows of
// width).
template <typename Rows>
inline TileRows tile_rows(const Rows& rows, int64_t n, int64_t width, int64_t row_stride, bf16* buf) {
  TileRows a{};
  for (int64_t g = 0; g < groups_of(n); ++g) {
    const int64_t i0 = g * kRows;
    bool even = i0 + kRows <= n;
    for (int64_t r = 1; even && r < kRows; ++r) even = rows(i0 + r) == rows(i0) + r * row_stride;
    if (even) {
      a.base[g] = rows(i0);
      a.stride[g] = row_stride * static_cast<int64_t>(sizeof(bf16));
      continue;
    }
    bf16* dst = buf + i0 * width;
    for (int64_t r = 0; r < kRows; ++r) {
      if (i0 + r < n)
        std::memcpy(dst + r * width, rows(i0 + r), width * sizeof(bf16));
      else
        std::memset(static_cast<void*>(dst + r * width), 0, width * sizeof(bf16));
    }
    a.base[g] = dst;
    a.stride[g] = width * static_cast<int64_t>(sizeof(bf16));
  }
  return a;
}

// Copies of rows(i) (fp32, i < n <= 64, `width` elements, a multiple of 32) as three bf16 terms, term s row-major at
// buf + s * 64 * width (rows n up to the group of 16 zero), and terms[s] its tiles. Each term is the remainder
// truncated to bf16 (its low 16 bits cleared), so each difference is exact and the last remainder, at most 8
// significant bits, is a bf16 itself: x = hi + mid + lo exactly (an inf gives NaN terms, a tile that exact_scores
// rescores). (Prefetching rows 2 or 4 ahead into L1 or L2 here ran no faster: MLA 16 heads, 32K, batch 16.)
template <typename Rows>
inline void split_rows(const Rows& rows, int64_t n, int64_t width, bf16* buf, TileRows (&terms)[3]) {
  const int64_t plane = 64 * width;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto truncate = [&](__m512 x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), high)); };
  for (int64_t i = 0; i < groups_of(n) * kRows; ++i) {
    bf16* dst = buf + i * width;
    if (i >= n) {
      for (int s = 0; s < 3; ++s) std::memset(static_cast<void*>(dst + s * plane), 0, width * sizeof(bf16));
      continue;
    }
    const float* src = rows(i);
    for (int64_t d = 0; d < width; d += 32) {
      __m512 x0 = _mm512_loadu_ps(src + d), x1 = _mm512_loadu_ps(src + d + 16);
      unrolled<3>([&](auto s) {
        constexpr int S = decltype(s)::value;
        const __m512 t0 = S < 2 ? truncate(x0) : x0, t1 = S < 2 ? truncate(x1) : x1;
        _mm512_storeu_si512(dst + S * plane + d, (__m512i)_mm512_cvtne2ps_pbh(t1, t0));  // exact: t0, t1 are bf16
        if (S < 2) x0 = _mm512_sub_ps(x0, t0), x1 = _mm512_sub_ps(x1, t1);
      });
    }
  }
  for (int s = 0; s < 3; ++s)
    for (int64_t g = 0; g < 4; ++g) {
      terms[s].base[g] = buf + s * plane + g * kRows * width;
      terms[s].stride[g] = width * static_cast<int64_t>(sizeof(bf16));
    }
}

// S^T rows [16 * TM] x heads [16 * TN] of one block: C tile (m, h) in tmm(m * TN + h). Per 32-wide chunk of Dk and
// per bf16 term of Q: the TN B tiles of Q^T, then each A tile of K against them. hook() runs after every A tile's
// products (the prefetches of the next tile, a few lines at a time).
template <int TM, int TN, typename Hook>
inline void score_block(const TileRows& a, int64_t Dk, const bf16* qb, int64_t G, int64_t h0, int terms, float* st,
                        Hook& hook) {
  static_assert(TM * TN <= 4 && TN <= 2, "four accumulator tiles, two B tiles");
  unrolled<TM * TN>([&](auto c) { zero<decltype(c)::value>(); });
  const int64_t qstride = G * 2 * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < Dk; k += kPair) {
    for (int s = 0; s < terms; ++s) {
      const bf16* qk = qb + s * Dk * G + ((k / 2) * G + h0) * 2;
      unrolled<TN>([&](auto h) { load<6 + decltype(h)::value>(qk + decltype(h)::value * 16 * 2, qstride); });
      unrolled<TM>([&](auto m) {
        constexpr int M = decltype(m)::value, at = 4 + (M & 1);
        load<at>(a.base[M] + k, a.stride[M]);
        unrolled<TN>([&](auto h) { dp<M * TN + decltype(h)::value, at, 6 + decltype(h)::value>(); });
        hook();
      });
    }
  }
  unrolled<TM>([&](auto m) {
    unrolled<TN>([&](auto h) {
      constexpr int M = decltype(m)::value, H = decltype(h)::value;
      store<M * TN + H>(st + (M * kRows) * G + h0 + H * 16, G * static_cast<int64_t>(sizeof(float)));
    });
  });
}

// score_block<TM, 1> for a query of three bf16 terms: the three B tiles of Q^T stay in tmm5-7 over each chunk of K,
// so that each A tile of K is loaded once per chunk rather than once per term (one thread, 64 tokens, MLA 16 heads,
// rows in L2: 1.8 -> 1.5 us). a[0 .. KT): K's bf16 terms (one for a bf16 cache, three for an fp32 one, split_rows),
// term i against the query's terms j <= 2 - i. The products left out sum to under 2^-21 |q| |k| (fp32 rounds each
// operation to 2^-24): a rounded term i is at most 2^(-8i) of the value, a truncated one under 2^(-7i).
template <int TM, int KT, typename Hook>
inline void score_block3(const TileRows* a, int64_t Dk, const bf16* qb, int64_t G, float* st, Hook& hook) {
  static_assert(TM <= 4, "four accumulator tiles");
  unrolled<TM>([&](auto c) { zero<decltype(c)::value>(); });
  const int64_t qstride = G * 2 * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < Dk; k += kPair) {
    const bf16* qk = qb + (k / 2) * G * 2;
    load<5>(qk, qstride);
    load<6>(qk + Dk * G, qstride);
    load<7>(qk + 2 * Dk * G, qstride);
    unrolled<TM>([&](auto m) {
      constexpr int M = decltype(m)::value;
      load<4>(a[0].base[M] + k, a[0].stride[M]);
      dp<M, 4, 5>();
      dp<M, 4, 6>();
      dp<M, 4, 7>();
      if constexpr (KT == 3) {
        load<4>(a[1].base[M] + k, a[1].stride[M]);
        dp<M, 4, 5>();
        dp<M, 4, 6>();
        load<4>(a[2].base[M] + k, a[2].stride[M]);
        dp<M, 4, 5>();
      }
      hook();
    });
  }
  unrolled<TM>([&](auto m) {
    constexpr int M = decltype(m)::value;
    store<M>(st + (M * kRows) * G, G * static_cast<int64_t>(sizeof(float)));
  });
}

// st[i * G + h] = K_i . Q_h for i < round_up(n, 16) (rows past n score zero rows), h < G, over every bf16 term of Q;
// a[0 .. kterms): the tile's K rows (tile_rows), or their three bf16 terms (split_rows: G == 16 and three query terms).
// hook() runs after every A tile's products (prefetches of the next tile).
template <typename Hook>
inline void scores(int64_t n, int64_t G, int64_t Dk, const TileRows* a, int kterms, const bf16* qb, int terms,
                   float* st, Hook& hook) {
  const int64_t groups = groups_of(n);
  if (G == 16 && terms == 3) {
    auto block3 = [&](auto kt) {
      constexpr int KT = decltype(kt)::value;
      switch (groups) {
        case 1: score_block3<1, KT>(a, Dk, qb, G, st, hook); break;
        case 2: score_block3<2, KT>(a, Dk, qb, G, st, hook); break;
        case 3: score_block3<3, KT>(a, Dk, qb, G, st, hook); break;
        default: score_block3<4, KT>(a, Dk, qb, G, st, hook); break;
      }
    };
    kterms == 3 ? block3(std::integral_constant<int, 3>{}) : block3(std::integral_constant<int, 1>{});
    return;
  }
  if (G == 16) {  // one head tile: every token group (at most 4) against it
    switch (groups) {
      case 1: score_block<1, 1>(a[0], Dk, qb, G, 0, terms, st, hook); break;
      case 2: score_block<2, 1>(a[0], Dk, qb, G, 0, terms, st, hook); break;
      case 3: score_block<3, 1>(a[0], Dk, qb, G, 0, terms, st, hook); break;
      default: score_block<4, 1>(a[0], Dk, qb, G, 0, terms, st, hook); break;
    }
    return;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 2) {  // pairs of token groups against pairs of head tiles
    const bool tm2 = g0 + 2 <= groups;
    const TileRows ag = a[0].from(g0);
    float* s = st + g0 * kRows * G;
    for (int64_t h0 = 0; h0 < G; h0 += 32) {
      const bool two = h0 + 32 <= G;
      if (tm2)
        two ? score_block<2, 2>(ag, Dk, qb, G, h0, terms, s, hook)
            : score_block<2, 1>(ag, Dk, qb, G, h0, terms, s, hook);
      else
        two ? score_block<1, 2>(ag, Dk, qb, G, h0, terms, s, hook)
            : score_block<1, 1>(ag, Dk, qb, G, h0, terms, s, hook);
    }
  }
}

// Tokens of a P.V tile rounded up to whole A tiles of P.
inline int64_t padded(int64_t n) { return (n + kPair - 1) / kPair * kPair; }

// In-register transpose of 16 rows of 16 floats.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_ps(kAll16, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_ps(kAll16, r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + j
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 v02 = _mm512_maskz_shuffle_f32x4(kAll16, u[j], u[4 + j], 0x88);
    const __m512 w02 = _mm512_maskz_shuffle_f32x4(kAll16, u[8 + j], u[12 + j], 0x88);
    const __m512 v13 = _mm512_maskz_shuffle_f32x4(kAll16, u[j], u[4 + j], 0xDD);
    const __m512 w13 = _mm512_maskz_shuffle_f32x4(kAll16, u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_maskz_shuffle_f32x4(kAll16, v02, w02, 0x88);
    r[8 + j] = _mm512_maskz_shuffle_f32x4(kAll16, v02, w02, 0xDD);
    r[4 + j] = _mm512_maskz_shuffle_f32x4(kAll16, v13, w13, 0x88);
    r[12 + j] = _mm512_maskz_shuffle_f32x4(kAll16, v13, w13, 0xDD);
  }
}

// r[h] = probabilities of head g0 + h over tokens i0 .. i0 + 15 from st [n x G] (S^T layout), zero past token n.
inline void load_transposed(const float* st, int64_t n, int64_t G, int64_t i0, int64_t g0, __m512 (&r)[16]) {
  for (int64_t i = 0; i < 16; ++i) r[i] = i0 + i < n ? _mm512_loadu_ps(st + (i0 + i) * G + g0) : _mm512_setzero_ps();
  transpose16(r);
}

// P [G x np] as hi + lo bf16 terms from the probabilities st [n x G] (S^T layout); columns n .. np are zero.
inline void pack_p(const float* st, int64_t n, int64_t G, int64_t np, bf16* hi, bf16* lo) {
  for (int64_t g0 = 0; g0 < G; g0 += 16)
    for (int64_t i0 = 0; i0 < np; i0 += 16) {
      __m512 r[16];
      load_transposed(st, n, G, i0, g0, r);
      for (int64_t h = 0; h < 16; ++h) {
        __m256i t[2];
        split(r[h], 2, t);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + (g0 + h) * np + i0), t[0]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + (g0 + h) * np + i0), t[1]);
      }
    }
}

// Dwords of the A tiles pack_p_halves writes for G heads, n tokens and `terms` bf16 terms of P: per head tile and group
// of 16 tokens, two tiles of 16 heads x 16 dwords per term.
inline int64_t p_halves_size(int64_t G, int64_t n, int terms) { return G / 16 * groups_of(n) * 2 * terms * 256; }

// P for pv_rows from the probabilities st [n x G] (S^T layout), zero past token n, as `terms` bf16 terms (2, or 3 for
// an fp32 V): per head tile and group of 16 tokens (tiles from ((h0 / 16) * groups + grp) * 2 * terms), tile 2s + e
// holds term s of P[h][token k] in dword k of head row h, in its low half (e = 0; against the even dims of a V row) or
// its high half (e = 1; the odd dims), the other half zero.
inline void pack_p_halves(const float* st, int64_t n, int64_t G, int terms, uint32_t* pa) {
  const int64_t groups = groups_of(n);
  for (int64_t g0 = 0; g0 < G; g0 += 16)
    for (int64_t grp = 0; grp < groups; ++grp) {
      __m512 r[16];
      load_transposed(st, n, G, grp * kRows, g0, r);
      uint32_t* t = pa + ((g0 / 16) * groups + grp) * 2 * terms * 256;
      for (int64_t h = 0; h < 16; ++h) {
        __m256i parts[3];
        split(r[h], terms, parts);
        for (int s = 0; s < terms; ++s) {
          const __m512i low = _mm512_maskz_cvtepu16_epi32(kAll16, parts[s]);
          _mm512_storeu_si512(t + 2 * s * 256 + h * 16, low);
          _mm512_storeu_si512(t + (2 * s + 1) * 256 + h * 16, _mm512_maskz_slli_epi32(kAll16, low, 16));
        }
      }
    }
}

// O rows of one head tile, NC chunks of 32 dims from column d0 (o's columns even / odd apart per chunk: C tiles
// 2c, 2c + 1): load, add P.V over the groups of 16 tokens, store. B tiles: V's rows in place (32 dims), v[0 .. VT)
// its bf16 terms (one for a bf16 V, three for an fp32 one); A tiles: pack_p_halves' PT terms of P, term i of P
// against V's terms j <= 2 - i (the products left out sum to under 2^-21 |p| |v|, as in score_block3). hook() runs
// after every group's products.
template <int NC, int PT, int VT, typename Hook>
inline void pv_rows_block(const uint32_t* pa, int64_t groups, const TileRows* v, int64_t Dv, int64_t d0, float* o,
                          Hook& hook) {
  const int64_t ostride = Dv * static_cast<int64_t>(sizeof(float));
  constexpr int64_t pstride = 16 * sizeof(uint32_t);
  unrolled<2 * NC>([&](auto c) { load<decltype(c)::value>(o + d0 + decltype(c)::value * 16, ostride); });
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* t = pa + g * 2 * PT * 256;
    unrolled<VT>([&](auto j) {
      constexpr int J = decltype(j)::value;
      unrolled<NC>([&](auto c) {
        load<6 + decltype(c)::value>(v[J].base[g] + d0 + decltype(c)::value * 32, v[J].stride[g]);
      });
      unrolled<PT>([&](auto i) {
        constexpr int I = decltype(i)::value;
        if constexpr (I + J <= 2) {
          load<4>(t + 2 * I * 256, pstride);        // P in the low halves: even dims
          load<5>(t + (2 * I + 1) * 256, pstride);  // high halves: odd dims
          unrolled<NC>([&](auto c) {
            constexpr int C = decltype(c)::value;
            dp<2 * C, 4, 6 + C>();
            dp<2 * C + 1, 5, 6 + C>();
          });
        }
      });
    });
    hook();
  }
  unrolled<2 * NC>([&](auto c) { store<decltype(c)::value>(o + d0 + decltype(c)::value * 16, ostride); });
}

// O [G x Dv] += P [G x n] * V with V's B tiles read from its rows (v[0 .. VT): tile_rows or split_rows, width >= Dv)
// and P from pack_p_halves (PT terms: 2 against a bf16 V, 3 against an fp32 one's three); O's columns even / odd apart
// per 32 (interleave_row). hook() runs after every group of 16 tokens' products.
template <int PT, int VT, typename Hook>
inline void pv_rows(int64_t G, int64_t Dv, int64_t n, const uint32_t* pa, const TileRows* v, float* o, Hook& hook) {
  const int64_t groups = groups_of(n);
  for (int64_t h0 = 0; h0 < G; h0 += 16) {
    const uint32_t* ph = pa + (h0 / 16) * groups * 2 * PT * 256;
    float* oh = o + h0 * Dv;
    int64_t d0 = 0;
    for (; d0 + 64 <= Dv; d0 += 64) pv_rows_block<2, PT, VT>(ph, groups, v, Dv, d0, oh, hook);
    if (d0 < Dv) pv_rows_block<1, PT, VT>(ph, groups, v, Dv, d0, oh, hook);  // Dv is a multiple of 32
  }
}

// Most heads per KV head (padded or not) whose P.V runs as pv_stacked: both halves of P's dwords in one A tile.
constexpr int64_t kStackedMaxHeads = 8;

// Dwords of the A tiles pack_p_stacked writes for n tokens and `terms` bf16 terms of P: one tile per group of 16
// tokens and term.
inline int64_t p_stacked_size(int64_t n, int terms) { return groups_of(n) * terms * 256; }

// P for pv_stacked from the probabilities st [n x G] (S^T layout; heads 0-7 taken), zero past token n, as `terms`
// bf16 terms: tile grp * terms + s holds term s of P[h][token k] in dword k of row h in its low half (against the
// even dims of a V row) and of row 8 + h in its high half (the odd dims), the other half zero.
inline void pack_p_stacked(const float* st, int64_t n, int64_t G, int terms, uint32_t* pa) {
  for (int64_t grp = 0; grp < groups_of(n); ++grp) {
    __m512 r[16];
    load_transposed(st, n, G, grp * kRows, 0, r);
    uint32_t* t = pa + grp * terms * 256;
    for (int64_t h = 0; h < kStackedMaxHeads; ++h) {
      __m256i parts[3];
      split(r[h], terms, parts);
      for (int s = 0; s < terms; ++s) {
        const __m512i low = _mm512_maskz_cvtepu16_epi32(kAll16, parts[s]);
        _mm512_storeu_si512(t + s * 256 + h * 16, low);
        _mm512_storeu_si512(t + s * 256 + (h + kStackedMaxHeads) * 16, _mm512_maskz_slli_epi32(kAll16, low, 16));
      }
    }
  }
}

// O of NC chunks of 32 dims from dim d0 (C tiles 0 .. NC): load, add P.V over the groups of 16 tokens, store. Chunk c
// is the 16 columns from (d0 + 32c) / 2 of o's rows: the even dims of head h in row h, its odd dims in row 8 + h.
// hook() runs after every group's products.
template <int NC, int PT, typename Hook>
inline void pv_stacked_block(const uint32_t* pa, int64_t groups, const TileRows& v, int64_t Dv, int64_t d0, float* o,
                             Hook& hook) {
  static_assert(PT <= 2, "two A tiles");
  const int64_t ostride = Dv * static_cast<int64_t>(sizeof(float));
  constexpr int64_t pstride = 16 * sizeof(uint32_t);
  unrolled<NC>([&](auto c) { load<decltype(c)::value>(o + d0 / 2 + decltype(c)::value * 16, ostride); });
  for (int64_t g = 0; g < groups; ++g) {
    unrolled<PT>([&](auto i) { load<4 + decltype(i)::value>(pa + (g * PT + decltype(i)::value) * 256, pstride); });
    unrolled<NC>([&](auto c) {
      constexpr int C = decltype(c)::value, bt = 6 + (C & 1);
      load<bt>(v.base[g] + d0 + C * 32, v.stride[g]);
      unrolled<PT>([&](auto i) { dp<C, 4 + decltype(i)::value, bt>(); });
    });
    hook();
  }
  unrolled<NC>([&](auto c) { store<decltype(c)::value>(o + d0 / 2 + decltype(c)::value * 16, ostride); });
}

// O [16 x Dv] += P [8 x n] * V for at most 8 heads, V's B tiles read from its rows (tile_rows, width >= Dv) and P
// from pack_p_stacked (PT terms); O as pv_stacked_block lays it out (interleave_row(o + h * Dv, o + (8 + h) * Dv, 16,
// ...) gives head h). hook() runs after every group of 16 tokens' products.
template <int PT, typename Hook>
inline void pv_stacked(int64_t Dv, int64_t n, const uint32_t* pa, const TileRows& v, float* o, Hook& hook) {
  const int64_t groups = groups_of(n);
  for (int64_t d0 = 0; d0 < Dv; d0 += 128) {
    switch (std::min<int64_t>(4, (Dv - d0) / 32)) {  // Dv is a multiple of 32
      case 1: pv_stacked_block<1, PT>(pa, groups, v, Dv, d0, o, hook); break;
      case 2: pv_stacked_block<2, PT>(pa, groups, v, Dv, d0, o, hook); break;
      case 3: pv_stacked_block<3, PT>(pa, groups, v, Dv, d0, o, hook); break;
      default: pv_stacked_block<4, PT>(pa, groups, v, Dv, d0, o, hook); break;
    }
  }
}

// dst [Dv] = one head's row of P.V in the natural column order from its even and odd dims, 16 of each per chunk of 32
// dims, `step` floats apart from chunk to chunk: dst[c * 32 + 2j] = even[c * step + j], dst[c * 32 + 2j + 1] =
// odd[c * step + j] (pv_rows: even = a row, odd = even + 16, step 32; pv_stacked: rows h and 8 + h, step 16).
inline void interleave_row(const float* even, const float* odd, int64_t step, int64_t Dv, float* dst) {
  alignas(64) static const int32_t kLo[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  for (int64_t c = 0; c < Dv / 32; ++c) {
    const __m512 e = _mm512_loadu_ps(even + c * step), o = _mm512_loadu_ps(odd + c * step);
    _mm512_storeu_ps(dst + c * 32, _mm512_permutex2var_ps(e, lo_idx, o));
    _mm512_storeu_ps(dst + c * 32 + 16, _mm512_permutex2var_ps(e, hi_idx, o));
  }
}

// Elements of one column tile of pack_v's V: np / 2 pairs of rows, and one more line, so that the runs of successive
// column tiles (which pack_v writes in step) start in different L1 sets (MLA, 64 tokens: 3.7 -> 2.9 us a tile).
inline int64_t v_tile(int64_t np) { return np / 2 * 32 + 32; }

// V [np x Dv] in pairs of token rows for the B tiles, each column tile of 16 its own contiguous run (a B tile's rows
// 64 bytes apart, not Dv * 4, whose power-of-two stride lands a tile's rows in a few L1 sets):
// vb[(d / 16) * v_tile(np) + r * 32 + (d % 16) * 2 + e] = V[2r + e][d], rows n .. np zero.
template <typename Rows>
inline void pack_v(const Rows& rows, int64_t n, int64_t np, int64_t Dv, bf16* vb) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t r = 0; r < np / 2; ++r) {
    const bf16* a = 2 * r < n ? rows(2 * r) : nullptr;
    const bf16* b = 2 * r + 1 < n ? rows(2 * r + 1) : nullptr;
    bf16* dst = vb + r * 32;
    const int64_t tile = v_tile(np);
    for (int64_t d = 0; d < Dv; d += 32) {
      const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (d / 16) * tile, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(dst + (d / 16 + 1) * tile, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
}

// O rows of one head tile, ND dim tiles from column d0: load, add P_hi.V + P_lo.V over the np tokens, store.
template <int ND>
inline void pv_block(const bf16* hi, const bf16* lo, int64_t np, const bf16* vb, int64_t Dv, int64_t d0, float* o) {
  const int64_t ostride = Dv * static_cast<int64_t>(sizeof(float));
  const int64_t pstride = np * static_cast<int64_t>(sizeof(bf16));
  const int64_t vstride = 32 * static_cast<int64_t>(sizeof(bf16));
  unrolled<ND>([&](auto d) { load<decltype(d)::value>(o + d0 + decltype(d)::value * 16, ostride); });
  for (int64_t k = 0; k < np; k += kPair) {
    load<4>(hi + k, pstride);
    load<5>(lo + k, pstride);
    unrolled<ND>([&](auto d) {
      constexpr int D = decltype(d)::value, bt = 6 + (D & 1);
      load<bt>(vb + (d0 / 16 + D) * v_tile(np) + k / 2 * 32, vstride);
      dp<D, 4, bt>();
      dp<D, 5, bt>();
    });
  }
  unrolled<ND>([&](auto d) { store<decltype(d)::value>(o + d0 + decltype(d)::value * 16, ostride); });
}

// O [G x Dv] += (hi + lo) [G x np] * V, V packed by pack_v.
template <typename Hook>
inline void pv(int64_t G, int64_t Dv, int64_t np, const bf16* hi, const bf16* lo, const bf16* vb, float* o,
               Hook& hook) {
  for (int64_t h0 = 0; h0 < G; h0 += 16) {
    const bf16* ph = hi + h0 * np;
    const bf16* pl = lo + h0 * np;
    float* oh = o + h0 * Dv;
    int64_t d0 = 0;
    for (; d0 + 64 <= Dv; d0 += 64) {
      pv_block<4>(ph, pl, np, vb, Dv, d0, oh);
      hook();
    }
    if (d0 < Dv) pv_block<2>(ph, pl, np, vb, Dv, d0, oh);  // Dv is a multiple of 32
  }
}

}  // namespace amx
}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu

#endif  // DCP_OPS_AMX
