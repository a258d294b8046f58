// Register-blocked GEMM micro-kernels for the CPU kernels, fp32 accumulation; cache rows (fp32, bf16, fp16 or e4m3)
// are converted to fp32 in registers and read in place.
//   gemm_acc: C += A * B, with A and B views (strided, or row pointers into a paged cache) and C row-major.
//   gemm_nt:  C = A * B^T for a few B rows packed by pack_nt: each A row is read once, as contiguous chunks.
#pragma once

#include "cpu/level.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "cpu/avx512.h"
#include "cpu/convert.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// The micro-kernels keep their accumulators in arrays of vectors; they must be inlined into their callers so that the
// compiler keeps those arrays in registers (an out-of-line call would spill them to the stack on every iteration).
#define DCP_INLINE inline __attribute__((always_inline))

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVL = fVec::size();

// The lane-wise maximum with NaN propagated (at::vec::maximum's result); in AVX-512 builds by the zero-masked max,
// since _mm512_max_ps has an undefined operand (cpu/avx512.h).
inline fVec vmax(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 m = _mm512_maskz_max_ps(kAll16, a, b);
  return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
#else
  return at::vec::maximum(a, b);
#endif
}

// n (<= kVL) consecutive elements of T as one fp32 vector; lanes past n are 0.
template <typename T>
inline fVec load_f32(const T* p, int64_t n = kVL) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p, n);
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {  // one byte an element (convert.h's e4m3_to_f32)
#if defined(CPU_CAPABILITY_AVX512)
    const __m128i raw = n == kVL ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                 : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
    return e4m3_to_f32(_mm512_maskz_cvtepu8_epi32(kAll16, raw));
#else
#if defined(CPU_CAPABILITY_AVX2)
    if (n == kVL) return e4m3_to_f32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
    __at_align__ float tmp[kVL] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = to_f32(p[i]);
    return fVec::loadu(tmp);
#endif
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    // A masked load for a partial vector: lanes past n are neither read nor faulted on.
    const __m256i raw = n == kVL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, _mm512_maskz_cvtepu16_epi32(kAll16, raw), 16));
    else
      return _mm512_maskz_cvtph_ps(kAll16, raw);
#else
#if defined(CPU_CAPABILITY_AVX2)
    if (n == kVL) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      else
        return _mm256_cvtph_ps(raw);
    }
#endif
    __at_align__ float tmp[kVL] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = to_f32(p[i]);
    return fVec::loadu(tmp);
#endif
  }
}

// dst[0 .. n) = src[0 .. n) converted to fp32.
template <typename T>
inline void convert_row(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) load_f32(src + i).store(dst + i);
  if (i < n) load_f32(src + i, n - i).store(dst + i, n - i);
}

// Read-only matrix views for the micro-kernels. A view gives element (i, k) and a pointer to row i (for a view whose
// rows are contiguous).
template <typename T>
struct Strided {  // element (i, k) at p[i * rs + k * cs]
  const T* p;
  int64_t rs, cs;
  const T& operator()(int64_t i, int64_t k) const { return p[i * rs + k * cs]; }
  const T* row(int64_t i) const { return p + i * rs; }
  Strided rows_from(int64_t i) const { return {p + i * rs, rs, cs}; }
};

template <typename T>
struct RowPtrs {  // element (i, k) at rows[i][off + k]: the rows of a paged cache tile, wherever their blocks are
  const T* const* rows;
  int64_t off;
  const T& operator()(int64_t i, int64_t k) const { return rows[i][off + k]; }
  const T* row(int64_t i) const { return rows[i] + off; }
  RowPtrs rows_from(int64_t i) const { return {rows + i, off}; }
};

// Called between register blocks of the micro-kernels, e.g. to spread software prefetches through the arithmetic.
struct NoHook {
  void operator()() const {}
};

// Products summed in registers before the partial sum is added into C. One register summing all of K (MLA scores:
// 576 products) rounds an ever larger sum. MLA 16 heads, 512 + 64, w_uk, fp32, at 3x DeepSeek's softmax scale: the
// worst output error was 1.0-1.6x the tolerance table's fp32 bound with all of K in one sum, 0.2-0.4x in sums of 64
// (plain torch in fp32: up to 0.6x). No speed change beyond this VM's noise.
constexpr int64_t kSumDepth = 64;

// C[MR x NV*kVL] += A[MR x K] * B[K x NV*kVL] at column j: MR x NV accumulators, B rows streamed. The first
// kSumDepth products are summed onto C itself, each further kSumDepth from zero and then added into C (so a K of at
// most kSumDepth, as in P.V over a tile, is one pass that loads and stores C once).
template <int MR, int NV, typename MA, typename MB>
DCP_INLINE void gemm_strip(int64_t j, int64_t K, const MA& A, const MB& B, float* C, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kSumDepth) {
    const int64_t k1 = std::min(K, k0 + kSumDepth);
    fVec c[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] = k0 == 0 ? fVec::loadu(C + i * ldc + j + v * kVL) : fVec(0.f);
    for (int64_t k = k0; k < k1; ++k) {
      const auto* brow = B.row(k) + j;
      fVec b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = load_f32(brow + v * kVL);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const fVec a(to_f32(A(i, k)));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[i][v] = at::vec::fmadd(a, b[v], c[i][v]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* dst = C + i * ldc + j + v * kVL;
        (k0 == 0 ? c[i][v] : fVec::loadu(dst) + c[i][v]).store(dst);
      }
  }
}

// C[MR x N] += A[MR x K] * B[K x N]: strips of NV vectors (MR * NV <= 12 accumulators), then single (possibly
// partial) vectors.
template <int MR, typename MA, typename MB, typename Hook>
inline void gemm_rows(int64_t N, int64_t K, const MA& A, const MB& B, float* C, int64_t ldc, Hook& hook) {
  constexpr int NV = MR <= 4 ? 3 : 2;
  int64_t j = 0;
  for (; j + NV * kVL <= N; j += NV * kVL) {
    gemm_strip<MR, NV>(j, K, A, B, C, ldc);
    hook();
  }
  for (; j + kVL <= N; j += kVL) {
    gemm_strip<MR, 1>(j, K, A, B, C, ldc);
    hook();
  }
  if (j < N) {  // tail: one partial vector
    const int64_t n = N - j;
    for (int64_t k0 = 0; k0 < K; k0 += kSumDepth) {
      const int64_t k1 = std::min(K, k0 + kSumDepth);
      fVec c[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) c[i] = k0 == 0 ? fVec::loadu(C + i * ldc + j, n) : fVec(0.f);
      for (int64_t k = k0; k < k1; ++k) {
        const fVec bv = load_f32(B.row(k) + j, n);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) c[i] = at::vec::fmadd(fVec(to_f32(A(i, k))), bv, c[i]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) (k0 == 0 ? c[i] : fVec::loadu(C + i * ldc + j, n) + c[i]).store(C + i * ldc + j, n);
    }
    hook();
  }
}

// C[M x N] += A[M x K] * B[K x N] for views A and B (B's rows contiguous); rows are split into near-equal blocks of
// at most 6.
template <typename MA, typename MB, typename Hook = NoHook>
inline void gemm_acc(int64_t M, int64_t N, int64_t K, const MA& A, const MB& B, float* C, int64_t ldc,
                     Hook&& hook = Hook{}) {
  const int64_t blocks = (M + 5) / 6;
  const int64_t rows_per_block = blocks ? (M + blocks - 1) / blocks : 0;
  for (int64_t i = 0; i < M; i += rows_per_block) {
    const int64_t mr = std::min(rows_per_block, M - i);
    const MA a = A.rows_from(i);
    float* c = C + i * ldc;
    switch (mr) {
      case 1: gemm_rows<1>(N, K, a, B, c, ldc, hook); break;
      case 2: gemm_rows<2>(N, K, a, B, c, ldc, hook); break;
      case 3: gemm_rows<3>(N, K, a, B, c, ldc, hook); break;
      case 4: gemm_rows<4>(N, K, a, B, c, ldc, hook); break;
      case 5: gemm_rows<5>(N, K, a, B, c, ldc, hook); break;
      default: gemm_rows<6>(N, K, a, B, c, ldc, hook); break;
    }
  }
}

#if defined(DCP_OPS_AVX512_BF16)
// bf16 dot products (AVX512_BF16): vdpbf16ps multiplies bf16 pairs exactly and adds both products to fp32 lanes,
// two products per lane and instruction against one for an fp32 FMA, with no conversion of the bf16 operands. Used
// only where both operands are exactly bf16 (a bf16 cache and a bf16 query), so the sums are those of fp32
// arithmetic on the same values.
constexpr bool kDpBf16 = true;

// (row[2p], row[2p + 1]) as the 32 bits vdpbf16ps takes; the last pair of an odd K is (row[K - 1], 0), so nothing past
// the row is read.
DCP_INLINE int32_t bf16_pair(const c10::BFloat16* row, int64_t p, int64_t K) {
  int32_t v = 0;
  std::memcpy(&v, row + 2 * p, 2 * p + 1 < K ? 4 : 2);
  return v;
}

// C[MR x NV*16] += A[MR x K] * B[K x NV*16] at column j, for bf16 A rows and B packed in pairs of rows: bp[(q * ldb +
// n) * 2 + e] = B[2q + e][n] (0 past K). Each pair of an A row is broadcast against a vector of 16 B column pairs.
// Pairs are summed in runs of kSumDepth / 2 as gemm_strip sums products.
template <int MR, int NV, typename MA>
DCP_INLINE void gemm_dp_strip(int64_t j, int64_t K, const MA& A, const c10::BFloat16* bp, int64_t ldb, float* C,
                              int64_t ldc) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  for (int64_t q0 = 0; q0 < pairs; q0 += kSumDepth / 2) {
    const int64_t q1 = std::min(pairs, q0 + kSumDepth / 2);
    __m512 c[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] = q0 == 0 ? _mm512_loadu_ps(C + i * ldc + j + v * kVL) : _mm512_setzero_ps();
    auto step = [&](int64_t q, auto&& pair_of_row) {
      __m512bh b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bp + (q * ldb + j + v * kVL) * 2);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_of_row(i));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[i][v] = _mm512_dpbf16_ps(c[i][v], a, b[v]);
      }
    };
    for (int64_t q = q0; q < std::min(q1, whole); ++q)
      step(q, [&](int i) { int32_t v; std::memcpy(&v, A.row(i) + 2 * q, 4); return v; });
    if (q1 > whole) step(whole, [&](int i) { return bf16_pair(A.row(i), whole, K); });  // odd K's last pair
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* dst = C + i * ldc + j + v * kVL;
        _mm512_storeu_ps(dst, q0 == 0 ? c[i][v] : _mm512_add_ps(_mm512_loadu_ps(dst), c[i][v]));
      }
  }
}

template <int MR, typename MA, typename Hook>
inline void gemm_dp_rows(int64_t N, int64_t K, const MA& A, const c10::BFloat16* bp, int64_t ldb, float* C,
                         int64_t ldc, Hook& hook) {
  constexpr int NV = MR <= 4 ? 3 : 2;
  int64_t j = 0;
  for (; j + NV * kVL <= N; j += NV * kVL) {
    gemm_dp_strip<MR, NV>(j, K, A, bp, ldb, C, ldc);
    hook();
  }
  for (; j < N; j += kVL) {
    gemm_dp_strip<MR, 1>(j, K, A, bp, ldb, C, ldc);
    hook();
  }
}

// C[M x N] += A[M x K] * B[K x N] for a view A of bf16 rows and B packed in pairs of rows (see gemm_dp_strip); N a
// multiple of 16. Rows in near-equal blocks of at most 6, as gemm_acc.
template <typename MA, typename Hook = NoHook>
inline void gemm_dp(int64_t M, int64_t N, int64_t K, const MA& A, const c10::BFloat16* bp, int64_t ldb, float* C,
                    int64_t ldc, Hook&& hook = Hook{}) {
  const int64_t blocks = (M + 5) / 6;
  const int64_t rows_per_block = blocks ? (M + blocks - 1) / blocks : 0;
  for (int64_t i = 0; i < M; i += rows_per_block) {
    const int64_t mr = std::min(rows_per_block, M - i);
    const MA a = A.rows_from(i);
    float* c = C + i * ldc;
    switch (mr) {
      case 1: gemm_dp_rows<1>(N, K, a, bp, ldb, c, ldc, hook); break;
      case 2: gemm_dp_rows<2>(N, K, a, bp, ldb, c, ldc, hook); break;
      case 3: gemm_dp_rows<3>(N, K, a, bp, ldb, c, ldc, hook); break;
      case 4: gemm_dp_rows<4>(N, K, a, bp, ldb, c, ldc, hook); break;
      case 5: gemm_dp_rows<5>(N, K, a, bp, ldb, c, ldc, hook); break;
      default: gemm_dp_rows<6>(N, K, a, bp, ldb, c, ldc, hook); break;
    }
  }
}

// Rows of A that gemm_dp8 takes at a time.
constexpr int64_t kDp8Rows = 8;

// C[i * ldc + g] = A_i . Q_g for i < M and at most 8 heads g < G (GQA), the heads along a 256-bit vector: qp holds
// the query in pairs, qp[(q * 8 + g) * 2 + e] = Q[g][2q + e] (0 past K and past G). Each pair of an A row is
// broadcast against the 8 heads' pairs, so no horizontal sums are needed (gemm_nt's are a quarter of its
// instructions at K = 128 with 512-bit vectors).
template <int MR, typename MA, typename Hook>
DCP_INLINE void gemm_dp8_block(int64_t K, const MA& A, const c10::BFloat16* qp, float* C, int64_t ldc, int64_t G,
                               Hook& hook) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  __m256 c[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) c[r] = _mm256_setzero_ps();
  for (int64_t q0 = 0; q0 < pairs; q0 += kSumDepth / 2) {
    const int64_t q1 = std::min(pairs, q0 + kSumDepth / 2);
    __m256 s[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s[r] = _mm256_setzero_ps();
    auto step = [&](int64_t q, auto&& pair_of_row) {
      const __m256bh b = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + q * 16));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) s[r] = _mm256_dpbf16_ps(s[r], (__m256bh)_mm256_set1_epi32(pair_of_row(r)), b);
    };
    for (int64_t q = q0; q < std::min(q1, whole); ++q)
      step(q, [&](int r) { int32_t v; std::memcpy(&v, A.row(r) + 2 * q, 4); return v; });
    if (q1 > whole) step(whole, [&](int r) { return bf16_pair(A.row(r), whole, K); });  // odd K's last pair
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) c[r] = _mm256_add_ps(c[r], s[r]);
    hook();
  }
  const __mmask8 m = static_cast<__mmask8>((1u << G) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    if (G == 8)
      _mm256_storeu_ps(C + r * ldc, c[r]);
    else
      _mm256_mask_storeu_ps(C + r * ldc, m, c[r]);
  }
}

template <typename MA, typename Hook = NoHook>
inline void gemm_dp8(int64_t M, int64_t K, const MA& A, const c10::BFloat16* qp, float* C, int64_t ldc, int64_t G,
                     Hook&& hook = Hook{}) {
  int64_t i = 0;
  for (; i + kDp8Rows <= M; i += kDp8Rows) gemm_dp8_block<kDp8Rows>(K, A.rows_from(i), qp, C + i * ldc, ldc, G, hook);
  for (; i < M; ++i) gemm_dp8_block<1>(K, A.rows_from(i), qp, C + i * ldc, ldc, G, hook);
}
#else
constexpr bool kDpBf16 = false;
constexpr int64_t kDp8Rows = 1;
#endif

// Number of floats pack_nt writes for N rows of length K.
inline int64_t packed_nt_size(int64_t N, int64_t K) { return (K + kVL - 1) / kVL * N * kVL; }

// Packs B [N x K] (fp32, row stride ldb) for gemm_nt, chunk-interleaved so that one chunk of an A row meets the same
// chunk of every B row in one run: bp[(c * N + n) * kVL + lane] = B[n][c * kVL + lane], 0 past K.
inline void pack_nt(int64_t N, int64_t K, const float* B, int64_t ldb, float* bp) {
  for (int64_t c = 0; c * kVL < K; ++c)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t lane = 0; lane < kVL; ++lane) {
        const int64_t k = c * kVL + lane;
        bp[(c * N + n) * kVL + lane] = k < K ? B[n * ldb + k] : 0.f;
      }
}

// Lane r of the result is the sum of the lanes of a[r].
DCP_INLINE fVec reduce_lanes(const fVec (&a)[kVL]) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#elif defined(CPU_CAPABILITY_AVX512)
  // A transposing tree: 16 -> 8 vectors with rows interleaved within each 128-bit lane, 8 -> 4 holding four rows'
  // sums per lane, then the four lanes of each row summed across lanes.
  __m512 s[8], y[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll16, a[2 * i], a[2 * i + 1]),
                         _mm512_maskz_unpackhi_ps(kAll16, a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(s[2 * i]), hi = _mm512_castps_pd(s[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, lo, hi)),
                         _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, lo, hi)));
  }
  auto even = [](__m512 a, __m512 b) { return _mm512_maskz_shuffle_f32x4(kAll16, a, b, 0x88); };
  auto odd = [](__m512 a, __m512 b) { return _mm512_maskz_shuffle_f32x4(kAll16, a, b, 0xDD); };
  const __m512 z0 = _mm512_add_ps(even(y[0], y[1]), odd(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(even(y[2], y[3]), odd(y[2], y[3]));
  return _mm512_add_ps(even(z0, z1), odd(z0, z1));
#else
  __at_align__ float lanes[kVL][kVL];
  __at_align__ float sums[kVL];
  for (int64_t r = 0; r < kVL; ++r) a[r].store(lanes[r]);
  for (int64_t r = 0; r < kVL; ++r) {
    sums[r] = 0.f;
    for (int64_t lane = 0; lane < kVL; ++lane) sums[r] += lanes[r][lane];
  }
  return fVec::loadu(sums);
#endif
}

// Lane r dots A row ap[r] with packed B row bq[r] over K (B advances by chunk_stride per chunk).
template <typename TA>
DCP_INLINE fVec dot_lanes(int64_t K, const TA* const (&ap)[kVL], const float* const (&bq)[kVL], int64_t chunk_stride) {
  fVec acc[kVL];
#pragma GCC unroll 16
  for (int r = 0; r < kVL; ++r) acc[r] = fVec(0.f);
  const float* b = bq[0];
  int64_t boff[kVL];  // B rows relative to bq[0]
#pragma GCC unroll 16
  for (int r = 0; r < kVL; ++r) boff[r] = bq[r] - b;
  int64_t c = 0;
  for (; c + kVL <= K; c += kVL, b += chunk_stride) {
#pragma GCC unroll 16
    for (int r = 0; r < kVL; ++r) acc[r] = at::vec::fmadd(load_f32(ap[r] + c), fVec::loadu(b + boff[r]), acc[r]);
  }
  if (c < K) {  // tail chunk: A lanes past K load as 0
#pragma GCC unroll 16
    for (int r = 0; r < kVL; ++r) acc[r] = at::vec::fmadd(load_f32(ap[r] + c, K - c), fVec::loadu(b + boff[r]), acc[r]);
  }
  return reduce_lanes(acc);
}

// Two A rows against kVL / 2 consecutive packed B rows (starting at b): lane t * kVL / 2 + h is A row t . B row h.
// Each chunk costs two A loads and kVL / 2 B loads for kVL FMAs, so the loads keep up with the FMA units.
template <typename TA>
DCP_INLINE fVec dot_pair(int64_t K, const TA* a0, const TA* a1, const float* b, int64_t chunk_stride) {
  constexpr int RH = kVL / 2;
  fVec acc[kVL];
#pragma GCC unroll 16
  for (int r = 0; r < kVL; ++r) acc[r] = fVec(0.f);
  auto step = [&](const fVec& x0, const fVec& x1) {
#pragma GCC unroll 8
    for (int h = 0; h < RH; ++h) {
      const fVec bh = fVec::loadu(b + h * kVL);
      acc[h] = at::vec::fmadd(x0, bh, acc[h]);
      acc[RH + h] = at::vec::fmadd(x1, bh, acc[RH + h]);
    }
  };
  int64_t c = 0;
  for (; c + kVL <= K; c += kVL, b += chunk_stride) step(load_f32(a0 + c), load_f32(a1 + c));
  if (c < K) step(load_f32(a0 + c, K - c), load_f32(a1 + c, K - c));  // tail chunk: A lanes past K load as 0
  return reduce_lanes(acc);
}

// Three A rows against kVL / 2 (= 4 with AVX2) consecutive packed B rows: out[t * kVL / 2 + h] = A row t . B row h.
template <typename TA>
DCP_INLINE void dot_triple(int64_t K, const TA* a0, const TA* a1, const TA* a2, const float* b, int64_t chunk_stride,
                           float* out) {
  constexpr int RH = kVL / 2;
  fVec acc[3 * RH];
#pragma GCC unroll 16
  for (int r = 0; r < 3 * RH; ++r) acc[r] = fVec(0.f);
  auto step = [&](const fVec& x0, const fVec& x1, const fVec& x2) {
#pragma GCC unroll 8
    for (int h = 0; h < RH; ++h) {
      const fVec bh = fVec::loadu(b + h * kVL);
      acc[h] = at::vec::fmadd(x0, bh, acc[h]);
      acc[RH + h] = at::vec::fmadd(x1, bh, acc[RH + h]);
      acc[2 * RH + h] = at::vec::fmadd(x2, bh, acc[2 * RH + h]);
    }
  };
  int64_t c = 0;
  for (; c + kVL <= K; c += kVL, b += chunk_stride) step(load_f32(a0 + c), load_f32(a1 + c), load_f32(a2 + c));
  if (c < K) step(load_f32(a0 + c, K - c), load_f32(a1 + c, K - c), load_f32(a2 + c, K - c));  // tail: zeros past K
  const fVec lo[kVL] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
  reduce_lanes(lo).store(out);
  const fVec z(0.f);
  const fVec hi[kVL] = {acc[8], acc[9], acc[10], acc[11], z, z, z, z};
  reduce_lanes(hi).store(out + kVL);
}

// Rows of A that gemm_nt takes at a time against N B rows: with M a multiple of it, no call leaves lanes idle.
constexpr int64_t gemm_nt_row_block(int64_t N) { return N >= kVL / 2 ? (kVL == 8 ? 3 : 2) : kVL / N; }

// C[i * ldc + n] = A_i . B_n for i < M, n < N, with B packed by pack_nt and A a view with contiguous rows. B rows are
// taken kVL / 2 at a time against threes of A rows (dot_triple, AVX2) and then pairs (dot_pair); fewer than kVL / 2
// B rows left are paired with as many A rows as fill the lanes.
template <typename MA, typename Hook = NoHook>
inline void gemm_nt(int64_t M, int64_t N, int64_t K, const MA& A, const float* bp, float* C, int64_t ldc,
                    Hook&& hook = Hook{}) {
  using TA = std::remove_cv_t<std::remove_reference_t<decltype(A(0, 0))>>;
  constexpr int64_t RH = kVL / 2;
  const int64_t chunk_stride = N * kVL;
  __at_align__ float out[kVL];
  int64_t n0 = 0;
  for (; n0 + RH <= N; n0 += RH) {
    int64_t i = 0;
    if constexpr (kVL == 8) {  // 12 accumulators fit in the 16 AVX2 registers: rows in threes, then a pair
      for (; i + 3 <= M; i += 3) {
        __at_align__ float o3[2 * kVL];
        dot_triple(K, A.row(i), A.row(i + 1), A.row(i + 2), bp + n0 * kVL, chunk_stride, o3);
        std::memcpy(C + i * ldc + n0, o3, RH * sizeof(float));
        std::memcpy(C + (i + 1) * ldc + n0, o3 + RH, RH * sizeof(float));
        std::memcpy(C + (i + 2) * ldc + n0, o3 + 2 * RH, RH * sizeof(float));
        hook();
      }
    }
    for (; i < M; i += 2) {
      const bool two = i + 1 < M;
      dot_pair(K, A.row(i), A.row(two ? i + 1 : i), bp + n0 * kVL, chunk_stride).store(out);
      std::memcpy(C + i * ldc + n0, out, RH * sizeof(float));
      if (two) std::memcpy(C + (i + 1) * ldc + n0, out + RH, RH * sizeof(float));
      hook();
    }
  }
  if (n0 == N) return;
  const int64_t w = N - n0, rows = kVL / w;  // w B rows against `rows` A rows
  const TA* ap[kVL];
  const float* bq[kVL];
  for (int64_t r = 0; r < kVL; ++r) bq[r] = bp + (n0 + (r < rows * w ? r % w : 0)) * kVL;
  for (int64_t i = 0; i < M; i += rows) {
    // Lanes past the last full row, or past row M - 1, repeat row i; their results are not stored.
    for (int64_t r = 0; r < kVL; ++r) {
      const int64_t row = i + r / w;
      ap[r] = A.row(r < rows * w && row < M ? row : i);
    }
    dot_lanes(K, ap, bq, chunk_stride).store(out);
    for (int64_t r = 0; r < rows * w && i + r / w < M; ++r) C[(i + r / w) * ldc + n0 + r % w] = out[r];
    hook();
  }
}

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
