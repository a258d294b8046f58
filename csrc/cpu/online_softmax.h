// The online base-2 softmax of the decode kernels, shared by every tile kernel family: a tile's scores become
// probabilities, the running max and sum are updated, and the running outputs are rescaled to the new max.
#pragma once

#include "cpu/level.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/avx512.h"
#include "cpu/gemm.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (a score minus the running max), -inf and x < -126 giving 0, NaN giving NaN: x = n + f with n the
// nearest integer, |f| <= 1/2, a degree-6 polynomial for 2^f (relative error ~1e-7, as Cephes' exp2f) and n added to
// the exponent.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
inline __m256 exp2_nonpos(__m256 v) {
  const __m256 tiny = _mm256_cmp_ps(v, _mm256_set1_ps(-126.f), _CMP_LT_OQ);  // true for -inf, false for NaN
  const __m256 c = _mm256_max_ps(_mm256_set1_ps(-126.f), v);                 // NaN stays NaN (second operand)
  const __m256 n = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(c, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

inline fVec exp2_nonpos(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  return exp2_nonpos(static_cast<__m256>(x));
#elif defined(CPU_CAPABILITY_AVX512)
  const __m512 v = x;
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_LT_OQ);
  const __m512 c = _mm512_maskz_max_ps(kAll16, _mm512_set1_ps(-126.f), v);
  const __m512 n = _mm512_maskz_roundscale_ps(kAll16, c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(c, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i biased = _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll16, n), _mm512_set1_epi32(127));
  const __m512i e = _mm512_maskz_slli_epi32(kAll16, biased, 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(e));
#else
  return x.exp2();
#endif
}

// Whether x[0 .. n) are all finite: x - x is 0 for a finite x and NaN for an inf or a NaN, and a NaN survives the sum.
inline bool all_finite(const float* x, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) {
    const fVec v = fVec::loadu(x + i);
    acc = acc + (v - v);
  }
  float total = 0.f;
  for (; i < n; ++i) total += x[i] - x[i];
  alignas(64) float lanes[kVL];
  acc.store(lanes);
  for (float f : lanes) total += f;
  return total == 0.f;
}

// The first Dv elements of rows g < G of o (rows `stride` floats apart) times alpha[g]: the running outputs brought to
// a new running max.
inline void rescale_rows(float* o, int64_t G, int64_t Dv, int64_t stride, const float* alpha) {
  for (int64_t g = 0; g < G; ++g) {
    if (alpha[g] == 1.f) continue;
    float* orow = o + g * stride;
    const fVec av(alpha[g]);
    int64_t d = 0;
    for (; d + kVL <= Dv; d += kVL) (fVec::loadu(orow + d) * av).store(orow + d);
    for (; d < Dv; ++d) orow[d] *= alpha[g];
  }
}

// Online softmax over one tile of transposed base-2 scores st[n x G] times mult (1, or q_mult for the scores of an
// unscaled bf16 query, as scale_scores would have scaled them first): st becomes probabilities, m and l are updated,
// and alpha[g] is what head g's running output must be multiplied by (rescale_rows). Vectorised across the G heads;
// the running max in four partial maxima, since one chain of them (max, compare, or: 5 cycles a row) took 40% of the
// function's time (AMX GQA bf16, cache resident). hook() runs every 16 rows of the max and every 8 of the
// exponentials: the AMX kernels' prefetches of the next tile, which would otherwise pause here (32K, medians, each
// call after what precedes it in bench_cpu.py: GQA 16q/2kv bf16 batch 1 2.33-2.35 -> 2.10-2.11 ms, batch 16 33.3 ->
// 30.8; MLA 16 heads bf16 batch 1 the same, batch 16 41.3 -> 39.2, with w_uk 44.7 / 45.4).
template <typename Hook = NoHook>
inline void softmax_update(float* st, int64_t G, int64_t n, float* m, float* l, float* alpha, float mult = 1.f,
                    Hook&& hook = NoHook{}) {
  constexpr int64_t VL = fVec::size();
  const fVec mv(mult);
  for (int64_t g0 = 0; g0 < G; g0 += VL) {
    const int64_t w = std::min(VL, G - g0);
    auto row = [&](int64_t i) { return fVec::loadu(st + i * G + g0, w) * mv; };
    const fVec m_old = fVec::loadu(m + g0, w);
    fVec mx[4] = {m_old, m_old, m_old, m_old};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (int r = 0; r < 4; ++r) mx[r] = vmax(mx[r], row(i + r));
      if (i % 16 == 12) hook();
    }
    for (; i < n; ++i) mx[0] = vmax(mx[0], row(i));
    const fVec top = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
    const fVec base = fVec::blendv(top, fVec(0.f), top == fVec(kNegInf));  // only -inf so far: every e is 0
    const fVec a = exp2_nonpos(m_old - base);  // 0 on the first tile (m = -inf)
    fVec sum(0.f);
    for (i = 0; i < n; ++i) {
      const fVec e = exp2_nonpos(row(i) - base);
      e.store(st + i * G + g0, w);
      sum = sum + e;
      if (i % 8 == 7) hook();
    }
    (fVec::loadu(l + g0, w) * a + sum).store(l + g0, w);
    top.store(m + g0, w);
    a.store(alpha + g0, w);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// softmax_update for G <= 8 heads in AVX-512 builds: one 256-bit vector per token row of st rather than a half-empty
// 512-bit one.
inline void softmax_update8(float* st, int64_t G, int64_t n, float* m, float* l, float* alpha) {
  const __mmask8 mk = static_cast<__mmask8>((1u << G) - 1);
  auto load = [&](const float* p) { return G == 8 ? _mm256_loadu_ps(p) : _mm256_maskz_loadu_ps(mk, p); };
  auto store = [&](float* p, __m256 x) { G == 8 ? _mm256_storeu_ps(p, x) : _mm256_mask_storeu_ps(p, mk, x); };
  const __m256 m_old = load(m);
  __m256 mx = m_old;
  for (int64_t i = 0; i < n; ++i) {  // a NaN score propagates, as vmax does
    const __m256 x = load(st + i * G);
    mx = _mm256_or_ps(_mm256_max_ps(mx, x), _mm256_cmp_ps(mx, x, _CMP_UNORD_Q));
  }
  const __m256 base =  // only -inf so far: every e is 0
      _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ));
  const __m256 a = exp2_nonpos(_mm256_sub_ps(m_old, base));  // 0 on the first tile (m = -inf)
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 e = exp2_nonpos(_mm256_sub_ps(load(st + i * G), base));
    store(st + i * G, e);
    sum = _mm256_add_ps(sum, e);
  }
  store(l, _mm256_fmadd_ps(load(l), a, sum));
  store(m, mx);
  store(alpha, a);
}
#endif

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
