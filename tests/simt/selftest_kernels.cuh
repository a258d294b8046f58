// Kernels that test the SIMT executor itself: warp shuffles, shared memory + barriers, atomics, a missing barrier.
#pragma once

#include "kernels/common.cuh"

namespace simt_selftest {

// Sum of each warp's 32 values by butterfly shuffles; lane 0 writes it. Also a ballot of odd values.
__global__ void warp_reduce(const float* x, float* sums, unsigned* odd_ballots, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
  const unsigned odd = __ballot_sync(0xffffffffu, i < n && (static_cast<int>(x[i]) & 1));
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const float down = __shfl_down_sync(0xffffffffu, v, 1);  // every lane already holds the sum
  if (threadIdx.x % 32 == 0) {
    sums[i / 32] = v + 0.f * down;
    odd_ballots[i / 32] = odd;
  }
}

// out = in^T for a 32 x 32 tile per block, through static shared memory with a barrier.
__global__ void transpose32(const float* in, float* out, int tiles) {
  __shared__ float tile[32][33];
  const int t = blockIdx.x;
  if (t >= tiles) return;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) tile[r][threadIdx.x] = in[t * 1024 + r * 32 + threadIdx.x];
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) out[t * 1024 + r * 32 + threadIdx.x] = tile[threadIdx.x][r];
}

// Histogram with shared-memory atomics per block, then global atomics; dynamic shared memory for the bins.
__global__ void histogram(const int* x, int n, int bins, int* out) {
  DCP_DYNAMIC_SMEM(int, local);
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) atomicAdd(&local[x[i]], 1);
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) atomicAdd(&out[b], local[b]);
}

// Each thread writes its slot, then thread 0 sums all slots. With `sync` false the barrier is missing: a race.
__global__ void block_sum(const float* x, float* out, bool sync) {
  __shared__ float slots[256];
  slots[threadIdx.x] = x[threadIdx.x];
  if (sync) __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (unsigned i = 0; i < blockDim.x; ++i) s += slots[i];
    *out = s;
  }
}

// A barrier only some threads reach: undefined in CUDA, reported by the executor.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.f;
}

}  // namespace simt_selftest
