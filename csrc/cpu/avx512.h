// GCC 12's AVX-512 headers implement the unmasked forms of some intrinsics (_mm512_cvtph_ps, _mm512_cvtepu16_epi32,
// _mm512_slli_epi32, _mm512_shuffle_f32x4, ...) with an undefined merge source (`__Y = __Y`), which
// -Wmaybe-uninitialized reports once they are inlined into a kernel: about 270 warnings a build. Their zero-masked
// forms with every lane selected compute the same and have no undefined operand; the CPU kernels call those, with
// these masks.
#pragma once

#include "cpu/level.h"

#include <immintrin.h>

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)
#if defined(__AVX512F__)
constexpr __mmask16 kAll16 = 0xFFFF;
constexpr __mmask8 kAll8 = 0xFF;
#endif
}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
