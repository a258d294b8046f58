// Register-blocked GEMM micro-kernel for the CPU kernels: C += A * B with fp32 accumulation.
// B and C are row-major; A is addressed A[i * a_rs + k * a_cs], so a transposed A needs no copy. A and B may be
// fp32, bf16 or fp16 (converted to fp32 in registers), so cache rows are read in place, never staged.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dcp_ops::cpu {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVL = fVec::size();

// n (<= kVL) consecutive elements of T as one fp32 vector; lanes past n are 0.
template <typename T>
inline fVec load_f32(const T* p, int64_t n = kVL) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
    if (n == kVL) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      else
        return _mm256_cvtph_ps(raw);
    }
#endif
    __at_align__ float tmp[kVL] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
    return fVec::loadu(tmp);
  }
}

// C[MR x N] += A[MR x K] * B[K x N]: MR rows x two vectors of accumulators, B streamed along N.
template <int MR, typename TA, typename TB>
inline void gemm_rows(int64_t N, int64_t K, const TA* A, int64_t a_rs, int64_t a_cs, const TB* B, int64_t ldb,
                      float* C, int64_t ldc) {
  int64_t j = 0;
  for (; j + 2 * kVL <= N; j += 2 * kVL) {
    fVec c0[MR], c1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      c0[i] = fVec::loadu(C + i * ldc + j);
      c1[i] = fVec::loadu(C + i * ldc + j + kVL);
    }
    for (int64_t k = 0; k < K; ++k) {
      const fVec b0 = load_f32(B + k * ldb + j);
      const fVec b1 = load_f32(B + k * ldb + j + kVL);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const fVec a(static_cast<float>(A[i * a_rs + k * a_cs]));
        c0[i] = at::vec::fmadd(a, b0, c0[i]);
        c1[i] = at::vec::fmadd(a, b1, c1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      c0[i].store(C + i * ldc + j);
      c1[i].store(C + i * ldc + j + kVL);
    }
  }
  for (; j < N; j += kVL) {  // tail: one (possibly partial) vector
    const int64_t n = std::min(kVL, N - j);
    fVec c[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) c[i] = fVec::loadu(C + i * ldc + j, n);
    for (int64_t k = 0; k < K; ++k) {
      const fVec b = n == kVL ? load_f32(B + k * ldb + j) : load_f32(B + k * ldb + j, n);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        c[i] = at::vec::fmadd(fVec(static_cast<float>(A[i * a_rs + k * a_cs])), b, c[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) c[i].store(C + i * ldc + j, n);
  }
}

// C[M x N] += A[M x K] * B[K x N]; rows are split into near-equal blocks of at most 6.
template <typename TA, typename TB>
inline void gemm_acc(int64_t M, int64_t N, int64_t K, const TA* A, int64_t a_rs, int64_t a_cs, const TB* B,
                     int64_t ldb, float* C, int64_t ldc) {
  const int64_t blocks = (M + 5) / 6;
  const int64_t rows_per_block = blocks ? (M + blocks - 1) / blocks : 0;
  for (int64_t i = 0; i < M; i += rows_per_block) {
    const int64_t mr = std::min(rows_per_block, M - i);
    const TA* a = A + i * a_rs;
    float* c = C + i * ldc;
    switch (mr) {
      case 1: gemm_rows<1>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
      case 2: gemm_rows<2>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
      case 3: gemm_rows<3>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
      case 4: gemm_rows<4>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
      case 5: gemm_rows<5>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
      default: gemm_rows<6>(N, K, a, a_rs, a_cs, B, ldb, c, ldc); break;
    }
  }
}

}  // namespace dcp_ops::cpu
