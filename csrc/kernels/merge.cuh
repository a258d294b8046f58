// Merge of N normalised partial attention outputs by their LSE (torch-free; raw pointers and element strides).
// out[t,h,:] = sum_r exp(lse_r - L) * outs[r,t,h,:],  L = logsumexp_r lse_r; NaN/+inf LSE count as -inf.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

__device__ __forceinline__ float sanitize_lse(float x, float ln_base) {
  const float v = x * ln_base;
  return (isnan(v) || v == INFINITY) ? -INFINITY : v;
}

struct MergeParams {
  const void* outs;
  int64_t so_n, so_t, so_h;  // element strides of outs [N, T, H, D]; last dim contiguous
  const float* lses;
  int64_t sl_n, sl_t, sl_h;
  void* out;        // [T, H, D] contiguous
  float* lse;       // [T, H]
  int N, T, H, D;
  float ln_base;
};

// blockDim.x threads cover one row's D / VEC packs; blockDim.y rows per block.
template <typename T, int VEC>
__global__ void merge_partials_kernel(MergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= static_cast<int64_t>(p.T) * p.H) return;
  const int64_t t = row / p.H, h = row % p.H;
  const float* l = p.lses + t * p.sl_t + h * p.sl_h;
  float mx = -INFINITY;
  for (int r = 0; r < p.N; ++r) mx = fmaxf(mx, sanitize_lse(l[r * p.sl_n], p.ln_base));
  float sum = 0.f;
  if (mx != -INFINITY)
    for (int r = 0; r < p.N; ++r) sum += __expf(sanitize_lse(l[r * p.sl_n], p.ln_base) - mx);
  const float inv = mx == -INFINITY ? 0.f : 1.f / sum;
  if (threadIdx.x == 0) p.lse[row] = mx == -INFINITY ? -INFINITY : mx + __logf(sum);
  const T* src = static_cast<const T*>(p.outs) + t * p.so_t + h * p.so_h;
  T* dst = static_cast<T*>(p.out) + row * p.D;
  for (int d = threadIdx.x * VEC; d < p.D; d += blockDim.x * VEC) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    for (int r = 0; r < p.N; ++r) {
      const float w = mx == -INFINITY ? 0.f : __expf(sanitize_lse(l[r * p.sl_n], p.ln_base) - mx) * inv;
      if (w == 0.f) continue;  // an empty partial may hold NaN; it must not leak
      const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(src + r * p.so_n + d);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += w * to_f32(x.v[i]);
    }
    Pack<T, VEC> y;
#pragma unroll
    for (int i = 0; i < VEC; ++i) y.v[i] = from_f32<T>(acc[i]);
    *reinterpret_cast<Pack<T, VEC>*>(dst + d) = y;
  }
}

// Launches with 16-byte packs when every row start is 16-byte aligned, else one element per thread.
template <typename T>
cudaError_t merge_partials(const MergeParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = p.D % kVec == 0 && p.so_n % kVec == 0 && p.so_t % kVec == 0 && p.so_h % kVec == 0 &&
                       reinterpret_cast<uintptr_t>(p.outs) % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const int vec = aligned ? kVec : 1;
  int tx = 1;
  while (tx < 32 && tx * vec < p.D) tx *= 2;
  const int ty = 128 / tx;
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  if (rows == 0) return cudaSuccess;
  const dim3 block(tx, ty), grid(static_cast<unsigned>((rows + ty - 1) / ty));
  auto kernel = aligned ? merge_partials_kernel<T, kVec> : merge_partials_kernel<T, 1>;
  DCP_LAUNCH(kernel, grid, block, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
