// Warp-level tensor-core product mma.sync m16n8k16 (bf16 or fp16 inputs, fp32 accumulators, sm_80 and later) and
// the 16-bit packing helpers around it. Under DCP_SIMT the executor computes the same product from the warp's
// fragments, so the tests run the kernels that use it.
//
// Fragment layout (PTX ISA, mma.m16n8k16 with .bf16 / .f16), for lane = 4 * g + t:
//   A 16 x 16 (row):  a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]
//                     a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//   B 16 x 8 (col):   b[0] = B[2t, 2t+1][g]  b[1] = B[2t+8, 2t+9][g]
//   C 16 x 8 (fp32):  c[0], c[1] = C[g][2t, 2t+1]  c[2], c[3] = C[g+8][2t, 2t+1]
// A register holds two elements, the lower k (or column) in its low 16 bits.
#pragma once

#include <type_traits>

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

template <typename T> __device__ __forceinline__ uint32_t bits16(T x);
#ifdef DCP_SIMT
template <> inline uint32_t bits16<__nv_bfloat16>(__nv_bfloat16 x) { return x.bits; }
template <> inline uint32_t bits16<__half>(__half x) { return x.bits; }
#else
template <> __device__ __forceinline__ uint32_t bits16<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}
template <> __device__ __forceinline__ uint32_t bits16<__half>(__half x) { return __half_as_ushort(x); }
#endif

// 16 bytes of 16-bit elements as 4 registers of pairs, the lower index in the low half (pack2's order): one load
// gives the fragment registers of 8 consecutive elements.
using Pairs4 = Pack<uint32_t, 4>;

// Two elements in one register: lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) { return bits16(lo) | bits16(hi) << 16; }

// Two float8_e4m3fn values (the low byte first) as a register of two T (fp16 or bf16), exactly (e4m3 fits both): by
// cuda_fp8.h's pair conversion to fp16 (one instruction on sm_89 and later), then, for bf16, through fp32.
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_to(unsigned short two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>)
    return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
  else
    return pack2(from_f32<T>(__half2float(__ushort_as_half(h.x))), from_f32<T>(__half2float(__ushort_as_half(h.y))));
}

// x0, x1 as N registers of T pairs: term i is what terms 0 .. i-1 left of x, rounded to T. Two terms carry about
// 17 bits (bf16) of x, three about 25: a product with all of them is as accurate as one with fp32 inputs to that
// precision, at N times the tensor-core work.
template <typename T, int N>
__device__ __forceinline__ void split_terms(float x0, float x1, uint32_t (&terms)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T a = from_f32<T>(x0), b = from_f32<T>(x1);
    terms[i] = pack2(a, b);
    x0 -= to_f32(a);
    x1 -= to_f32(b);
  }
}

// One online-softmax update of fragment row g + 8 r over the 16 tokens of a step: x[u][e] is this lane's score of
// token 8u + 2t + e (log2 units; -inf: no token), and the 4 lanes of a row group share the row's max m and (at the
// end) sum l, summed from the unrounded P. Rescales the row's accumulator columns, and writes P's A-fragment
// registers 2u + r as PT terms (split_terms): PT = 1 rounds P to T (precision "native"); PT = 2 puts the hi parts
// in ph and the lo parts in pl ("fp32"). With PT = 1, pl is left alone.
template <typename T, int PT, int NACC>
__device__ __forceinline__ void softmax_step(const float (&x)[2][2], int r, float& m, float& l, float (&acc)[NACC][4],
                                             uint32_t (&ph)[4], uint32_t (&pl)[4]) {
  float mx = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx), base = m_new == -INFINITY ? 0.f : m_new;
  const float a = exp2f(m - base);
  float pw[2][2], sum = 0.f;
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      pw[u][e] = exp2f(x[u][e] - base);
      sum += pw[u][e];
    }
  l = l * a + sum;
  m = m_new;
#pragma unroll
  for (int n = 0; n < NACC; ++n) {
    acc[n][2 * r] *= a;
    acc[n][2 * r + 1] *= a;
  }
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint32_t terms[PT];
    split_terms<T, PT>(pw[u][0], pw[u][1], terms);
    ph[2 * u + r] = terms[0];
    if constexpr (PT == 2) pl[2 * u + r] = terms[PT - 1];
  }
}

// Element j (0..7) of the 8 packed 16-bit elements w[0..3] of row x and of row y, as the pair (x_j, y_j): the B
// fragment register of two consecutive k (rows) in one column.
__device__ __forceinline__ uint32_t pair_rows(const uint32_t (&x)[4], const uint32_t (&y)[4], int j) {
  return __byte_perm(x[j / 2], y[j / 2], j % 2 ? 0x7632 : 0x5410);
}

// ldmatrix .x4 (.b16): lane l gives the address of row l % 8 of 8 x 8 matrix l / 8 (16 bytes a row, in shared
// memory); register i of lane l gets row l / 4, elements 2 (l % 4), + 1 of matrix i, or with TRANS column l / 4,
// rows 2 (l % 4), + 1 (the matrix transposed). The A fragment of a 16 x 16 tile is matrices (rows 0-7 | 8-15) x
// (k 0-7 | 8-15) in the order of a[]; a B fragment pair is a row-major [n][k] (or, TRANS, [k][n]) tile's matrices.
// SmemAddr is a shared-window address on the GPU (byte offsets add to it), a host pointer under the executor.
#ifdef DCP_SIMT
using SmemAddr = const unsigned char*;
inline SmemAddr smem_addr(const void* p) { return static_cast<SmemAddr>(p); }
template <bool TRANS>
inline void ldmatrix_x4(uint32_t (&d)[4], SmemAddr row) {
  const int lane = simt::lane(), g = lane / 4, t = lane % 4;
  uint32_t out[4];
  simt::warp_view(&row, [&](auto at) {
    if (lane == 0)  // the warp's one request: 4 phases of 8 rows of 16 bytes
      simt::count_banks(32, 8, 16, [&](int l) { return *static_cast<const SmemAddr*>(at(l)); });
    auto elem = [&](int m, int r, int c) {  // element (r, c) of matrix m
      const SmemAddr p = *static_cast<const SmemAddr*>(at(8 * m + r));
      uint16_t v;
      std::memcpy(&v, p + 2 * c, 2);
      return static_cast<uint32_t>(v);
    };
    for (int m = 0; m < 4; ++m)
      out[m] = TRANS ? elem(m, 2 * t, g) | elem(m, 2 * t + 1, g) << 16 : elem(m, g, 2 * t) | elem(m, g, 2 * t + 1) << 16;
  });
  for (int m = 0; m < 4; ++m) d[m] = out[m];
}
#else
using SmemAddr = uint32_t;
__device__ __forceinline__ SmemAddr smem_addr(const void* p) {
  return static_cast<SmemAddr>(__cvta_generic_to_shared(p));
}
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], SmemAddr row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launchers choose the kernels that use it on sm_80 and later only
#else
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(row));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(row));
#endif
}
#endif

// A warp-wide 32-bit store to shared memory (every lane of the warp stores): under the executor its bank
// conflicts are counted (simt::g_bank_stats).
__device__ __forceinline__ void st_shared_u32(void* p, uint32_t v) {
#ifdef DCP_SIMT
  simt::warp_view(&p, [&](auto at) {
    if (simt::lane() == 0) simt::count_banks(32, 32, 4, [&](int l) { return *static_cast<void* const*>(at(l)); });
  });
#endif
  *static_cast<uint32_t*>(p) = v;
}

// c += A * B.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

#ifdef DCP_SIMT
template <typename T>
inline float half_of(uint32_t r, int high) {
  T x;
  x.bits = static_cast<uint16_t>(high ? r >> 16 : r & 0xffffu);
  return to_f32(x);
}

template <typename T>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  const int lane = simt::lane(), g = lane / 4, t = lane % 4;
  float out[4];
  simt::warp_view(&mine, [&](auto at) {
    auto A = [&](int row, int k) {
      const Frag& f = *static_cast<const Frag*>(at(4 * (row % 8) + (k % 8) / 2));
      return half_of<T>(f.a[(row >= 8) + 2 * (k >= 8)], k % 2);
    };
    auto B = [&](int k, int n) {
      const Frag& f = *static_cast<const Frag*>(at(4 * n + (k % 8) / 2));
      return half_of<T>(f.b[k >= 8], k % 2);
    };
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
      float s = 0.f;
      for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
      out[i] = c[i] + s;
    }
  });
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}
#else
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launchers choose these kernels on sm_80 and later only
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#endif

// One P.V product (k = a step's 16 tokens) for one query token's rows of the A tile, in a step whose tokens some rows
// of the tile attend and others mask (multi-token decode, split_kv.cuh's ragged_from): V's halves of the tokens
// k >= lim are zeroed in registers (this lane's B halves hold k = 2t, 2t + 1 in b[0] and 2t + 8, 2t + 9 in b[1], the
// lower k in the low half), d = c + P V (P in PT terms: ph, then pl), and c takes d in rows g (row0) and g + 8 (row1)
// only, by a select. Those rows' P is 0 at every zeroed token, so they get what c += P V gives them when V is finite,
// and no NaN or inf of a token they mask; a NaN or inf of a token they attend still reaches them. The caller runs it
// once per query token of the tile (each row is one token's), warp-uniformly.
template <typename T, int PT>
__device__ __forceinline__ void mma_rows_upto(float (&c)[4], const uint32_t (&ph)[4], const uint32_t (&pl)[4],
                                              const uint32_t (&b)[2], int lim, int t, bool row0, bool row1) {
  uint32_t bm[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int k = 2 * t + 8 * i;
    bm[i] = k + 1 < lim ? b[i] : k < lim ? b[i] & 0xffffu : 0u;
  }
  float d[4] = {c[0], c[1], c[2], c[3]};
  mma_16816<T>(d, ph, bm);
  if constexpr (PT == 2) mma_16816<T>(d, pl, bm);
  c[0] = row0 ? d[0] : c[0];
  c[1] = row0 ? d[1] : c[1];
  c[2] = row1 ? d[2] : c[2];
  c[3] = row1 ? d[3] : c[3];
}

}  // namespace dcp_ops::kernels
