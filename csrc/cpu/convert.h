// Element conversions between fp32 and the cache / output types (fp32, bf16, fp16), exact where the value fits and
// rounded to nearest even otherwise, as c10's operators. fp16 goes through F16C's scalar instructions where the build
// has them: c10::Half's operators inline the 512-bit conversions with an undefined operand (cpu/avx512.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu/avx512.h"

namespace dcp_ops::cpu {

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

}  // namespace dcp_ops::cpu
