// Register-blocked fp32 GEMM micro-kernel for the CPU attention and merge kernels: C += A * B.
// All operands row-major with explicit leading dimensions; tiles are small and L1/L2 resident.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace dcp_ops::cpu {

using fVec = at::vec::Vectorized<float>;

// C[MR x N] += A[MR x K] * B[K x N]: MR rows x two vectors of accumulators, B streamed along N.
template <int MR>
inline void gemm_rows(int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                      float* C, int64_t ldc) {
  constexpr int64_t VL = fVec::size();
  int64_t j = 0;
  for (; j + 2 * VL <= N; j += 2 * VL) {
    fVec c0[MR], c1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      c0[i] = fVec::loadu(C + i * ldc + j);
      c1[i] = fVec::loadu(C + i * ldc + j + VL);
    }
    for (int64_t k = 0; k < K; ++k) {
      const fVec b0 = fVec::loadu(B + k * ldb + j);
      const fVec b1 = fVec::loadu(B + k * ldb + j + VL);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const fVec a(A[i * lda + k]);
        c0[i] = at::vec::fmadd(a, b0, c0[i]);
        c1[i] = at::vec::fmadd(a, b1, c1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      c0[i].store(C + i * ldc + j);
      c1[i].store(C + i * ldc + j + VL);
    }
  }
  for (; j < N; j += VL) {  // tail: one (possibly partial) vector
    const int64_t n = std::min(VL, N - j);
    fVec c[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) c[i] = fVec::loadu(C + i * ldc + j, n);
    for (int64_t k = 0; k < K; ++k) {
      const fVec b = fVec::loadu(B + k * ldb + j, n);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) c[i] = at::vec::fmadd(fVec(A[i * lda + k]), b, c[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) c[i].store(C + i * ldc + j, n);
  }
}

// C[M x N] += A[M x K] * B[K x N]; rows are split into near-equal blocks of at most 6.
inline void gemm_acc(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                     float* C, int64_t ldc) {
  const int64_t blocks = (M + 5) / 6;
  const int64_t rows_per_block = blocks ? (M + blocks - 1) / blocks : 0;
  for (int64_t i = 0; i < M; i += rows_per_block) {
    const int64_t mr = std::min(rows_per_block, M - i);
    const float* a = A + i * lda;
    float* c = C + i * ldc;
    switch (mr) {
      case 1: gemm_rows<1>(N, K, a, lda, B, ldb, c, ldc); break;
      case 2: gemm_rows<2>(N, K, a, lda, B, ldb, c, ldc); break;
      case 3: gemm_rows<3>(N, K, a, lda, B, ldb, c, ldc); break;
      case 4: gemm_rows<4>(N, K, a, lda, B, ldb, c, ldc); break;
      case 5: gemm_rows<5>(N, K, a, lda, B, ldb, c, ldc); break;
      default: gemm_rows<6>(N, K, a, lda, B, ldb, c, ldc); break;
    }
  }
}

}  // namespace dcp_ops::cpu
