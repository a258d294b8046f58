// Per-head projection (torch-free): y[t, h, n] = scale * sum_k x[t, h, k] * w[h, k, n], fp32 accumulation. The MLA
// op uses it twice: w_uk absorption of the query (x = q_nope, y = the fp32 scaled latent query) and the w_uv
// up-projection of the merged latent output (x fp32, y in the output dtype). With no w it is a scaled copy
// (the rope part of the query, and the latent query when there is no w_uk).
// Block (head h, column tile, token tile): the x rows of kTok tokens sit in shared memory, each thread owns one
// column n and reads w[h, :, n] once for all of them (coalesced across the threads).
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

struct ProjectParams {
  const void* x;     // [T, H, K], element strides below, last dim contiguous
  int64_t x_st, x_sh;
  const void* w;     // [H, K, N], element strides below, last dim contiguous; nullptr: identity (K == N)
  int64_t w_sh, w_sk;
  void* y;           // [T, H, N] at element strides below, last dim contiguous
  int64_t y_st, y_sh;
  int T, H, K, N;
  float scale;
};

constexpr int kProjectThreads = 128, kProjectTokens = 8;
constexpr int kProjectMaxK = 1536;  // kProjectTokens * K floats of shared memory: 48 KiB at most

template <typename TX, typename TW, typename TY>
__global__ void head_project_kernel(ProjectParams p) {
  const int h = blockIdx.x, n = blockIdx.y * kProjectThreads + threadIdx.x, t0 = blockIdx.z * kProjectTokens;
  const int nt = min(kProjectTokens, p.T - t0);
  DCP_DYNAMIC_SMEM(float, xs);  // [kProjectTokens][K]
  for (int i = threadIdx.x; i < nt * p.K; i += kProjectThreads) {
    const int t = i / p.K, k = i % p.K;
    xs[t * p.K + k] = to_f32(static_cast<const TX*>(p.x)[(t0 + t) * p.x_st + h * p.x_sh + k]);
  }
  __syncthreads();
  if (n >= p.N) return;
  float acc[kProjectTokens];
#pragma unroll
  for (int t = 0; t < kProjectTokens; ++t) acc[t] = 0.f;
  if (p.w == nullptr) {
#pragma unroll
    for (int t = 0; t < kProjectTokens; ++t)
      if (t < nt) acc[t] = xs[t * p.K + n];
  } else {
    const TW* w = static_cast<const TW*>(p.w) + h * p.w_sh + n;
    for (int k = 0; k < p.K; ++k) {
      const float wk = to_f32(w[k * p.w_sk]);
#pragma unroll
      for (int t = 0; t < kProjectTokens; ++t) acc[t] += xs[t * p.K + k] * wk;  // rows past nt are never stored
    }
  }
#pragma unroll
  for (int t = 0; t < kProjectTokens; ++t)
    if (t < nt) static_cast<TY*>(p.y)[(t0 + t) * p.y_st + h * p.y_sh + n] = from_f32<TY>(acc[t] * p.scale);
}

template <typename TX, typename TW, typename TY>
cudaError_t head_project(const ProjectParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.H == 0 || p.N == 0) return cudaSuccess;
  const dim3 grid(p.H, (p.N + kProjectThreads - 1) / kProjectThreads, (p.T + kProjectTokens - 1) / kProjectTokens);
  const int smem = kProjectTokens * p.K * static_cast<int>(sizeof(float));
  auto kernel = head_project_kernel<TX, TW, TY>;
  DCP_LAUNCH(kernel, grid, dim3(kProjectThreads), smem, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
