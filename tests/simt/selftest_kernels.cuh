// Kernels that test the SIMT executor itself: warp shuffles, shared memory + barriers, atomics, a missing barrier.
#pragma once

#include "kernels/common.cuh"
#include "kernels/cp_async.cuh"
#include "kernels/mma.cuh"

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

// Each thread writes its slot, then thread `reader` sums all slots. With `sync` false the barrier is missing: a race.
__global__ void block_sum(const float* x, float* out, bool sync, unsigned reader) {
  __shared__ float slots[256];
  slots[threadIdx.x] = x[threadIdx.x];
  if (sync) __syncthreads();
  if (threadIdx.x == reader) {
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

// cp.async in two commit groups: thread i copies 4 floats of x into group A, then 4 more into group B. It reads its
// shared slots before any wait (seen[0]), after wait_group 1 (seen[1]: A landed, B in flight) and after wait_group 0
// (seen[2]). seen: [3][threads][8].
__global__ void async_copy(const float* x, float* seen) {
  DCP_DYNAMIC_SMEM(float, slots);
  const int i = threadIdx.x, n = blockDim.x;
  float* mine = slots + 8 * i;
  dcp_ops::kernels::cp_async16(mine, x + 8 * i, true);
  dcp_ops::kernels::cp_async_commit();
  dcp_ops::kernels::cp_async16(mine + 4, x + 8 * i + 4, true);
  dcp_ops::kernels::cp_async_commit();
  auto record = [&](int k) {
    for (int e = 0; e < 8; ++e) seen[(k * n + i) * 8 + e] = mine[e];
  };
  record(0);
  dcp_ops::kernels::cp_async_wait<1>();
  record(1);
  dcp_ops::kernels::cp_async_wait<0>();
  record(2);
}

// One warp-wide 32-bit shared store per row of a 32 x `stride` word tile: lane l stores word l * stride of row 0
// (the bank-conflict counter's test: stride 1 is conflict-free, stride 2 two-way, stride 32 32-way).
__global__ void strided_store(int stride, float* out) {
  DCP_DYNAMIC_SMEM(uint32_t, words);
  dcp_ops::kernels::st_shared_u32(words + threadIdx.x * stride, threadIdx.x);
  __syncwarp();
  out[threadIdx.x] = static_cast<float>(words[threadIdx.x * stride]);
}

}  // namespace simt_selftest
