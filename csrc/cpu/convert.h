// Element conversions between fp32 and the cache / output types (fp32, bf16, fp16, and float8_e4m3fn caches read),
// exact where the value fits and rounded to nearest even otherwise, as c10's operators. fp16 goes through F16C's
// scalar instructions where the build has them: c10::Half's operators inline the 512-bit conversions with an
// undefined operand (cpu/avx512.h).
#pragma once

#include "cpu/level.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu/avx512.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

template <typename T>
inline float to_f32(T x) {
  if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__F16C__)
    return _cvtsh_ss(x.x);
#else
    return static_cast<float>(x);
#endif
  } else {
    return static_cast<float>(x);
  }
}

template <typename T>
inline T from_f32(float x) {
  if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__F16C__)
    return c10::Half(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
#else
    return static_cast<T>(x);
#endif
  } else {
    return static_cast<T>(x);
  }
}

// dst[i] = src[i] rounded to bf16 (to nearest even; a NaN becomes 0x7FC0), bitwise as c10::BFloat16(float); 16
// elements at a time in AVX-512 builds, by the zero-masked intrinsics.
inline void round_to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_maskz_and_epi32(kAll16, _mm512_maskz_srli_epi32(kAll16, b, 16), one);
    __m512i r = _mm512_maskz_srli_epi32(kAll16, _mm512_add_epi32(_mm512_add_epi32(b, bias), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_maskz_cvtepi32_epi16(kAll16, r));
  }
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// float8_e4m3fn bytes (one per 32-bit lane, zero-extended) to fp32, exactly, as c10::Float8_e4m3fn's conversion:
// a normal magnitude's exponent and mantissa move into fp32's fields with the bias changed from 7 to 127 (+120); a
// subnormal one (exponent 0) is its mantissa x 2^-9, converted as an integer, so that no fp32 denormal is formed
// (a flush-to-zero mode would lose it); magnitude 0x7F is NaN (e4m3fn has no infinities).
#if defined(__AVX512F__)
inline __m512 e4m3_to_f32(__m512i b) {
  const __m512i mag = _mm512_maskz_and_epi32(kAll16, b, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_maskz_slli_epi32(kAll16, _mm512_maskz_and_epi32(kAll16, b, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_maskz_slli_epi32(kAll16, mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, mag), _mm512_set1_ps(1.f / 512));
  __m512i bits = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)),
                                       _mm512_castps_si512(sub));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                               _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}
#endif
#if defined(__AVX2__)
inline __m256 e4m3_to_f32(__m256i b) {
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}
#endif

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
