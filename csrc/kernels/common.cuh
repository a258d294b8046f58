// What every kernel header includes: the CUDA headers under nvcc, the SIMT executor under DCP_SIMT (host
// compiler, tests), the launch macro that works for both, and small conversion helpers.
#pragma once

#ifdef DCP_SIMT
#include "simt/simt.h"
#define DCP_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::dcp_ops::simt::launch(kernel, grid, block, smem, __VA_ARGS__)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#define DCP_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define DCP_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

#include <cstdint>

namespace dcp_ops::kernels {

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
// A float8_e4m3fn cache element (the bits torch stores), read exactly: a normal magnitude's exponent and mantissa move
// into fp32's fields with the bias 7 -> 127; a subnormal one (exponent 0) is its mantissa x 2^-9; magnitude 0x7F is
// NaN (e4m3fn has no infinities). Plain integer and float arithmetic, so the SIMT executor runs exactly this.
struct fp8_e4m3 {
  unsigned char bits;
};
template <> __device__ __forceinline__ float to_f32<fp8_e4m3>(fp8_e4m3 x) {
  const unsigned mag = x.bits & 0x7Fu;
  const float v = mag == 0x7Fu ? NAN
                  : mag < 8u   ? static_cast<float>(mag) * 0.001953125f
                               : __uint_as_float((mag << 20) + (120u << 23));
  return x.bits & 0x80u ? -v : v;
}
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }

// VEC elements of T moved as one load/store (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

}  // namespace dcp_ops::kernels
