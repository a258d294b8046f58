// The split-KV plan of a decode launch (included by csrc/cuda/split_plan.cu only), made on the device from the actual lengths (no host synchronisation, so a
// decode step can be captured in a CUDA graph). The work of query token t is its tiles(t) = ceil(len_t / granule)
// token tiles; the tiles of all query tokens, laid end to end, are cut into `ctas` budgets of B = ceil(total / ctas)
// tiles, one per block that a wave of the split pass holds. Budget i and query token t meet in at most one piece, the
// work item i + t: so items are numbered without a search, a query token's items are consecutive, and there are at
// most ctas + T - 1 of them. Every item is a launch block (per head tile) of the split pass; an item no piece maps to
// is marked unused (seq -1) and its block returns at once. The merge reads, for each query token, its first item and
// its item count. A long sequence thus gets many splits and a short one few, for any mix of batch and lengths.
#pragma once

#include "kernels/common.cuh"
#include "kernels/split_kv.cuh"

namespace dcp_ops::kernels {

struct SplitPlanParams {
  const int32_t* seq_lens;  // [T]
  int T, capacity;          // query tokens; the block table's capacity in tokens (longer lengths are clamped to it)
  int granule, ctas, items; // tokens per tile; budgets; work items (ctas + T - 1)
  int32_t* work;            // [items][3]: seq, first token, end token
  int32_t* rows;            // [2][T]: first item and item count of each query token
};

constexpr int kPlanThreads = 256;

__device__ __forceinline__ int plan_len(const SplitPlanParams& p, int t) {
  return max(0, min(p.seq_lens[t], p.capacity));
}

// One block: thread k walks the query tokens [k * per, (k + 1) * per), first to sum their tiles, then (after a block
// scan of the sums) to write their items.
__global__ void __launch_bounds__(kPlanThreads) split_plan_kernel(SplitPlanParams p) {
  __shared__ long long warp_sums[kPlanThreads / 32];
  __shared__ long long total_tiles;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (p.T + kPlanThreads - 1) / kPlanThreads, t0 = min(p.T, tid * per), t1 = min(p.T, t0 + per);
  long long mine = 0;
  for (int t = t0; t < t1; ++t) mine += (plan_len(p, t) + p.granule - 1) / p.granule;
  long long incl = mine;  // inclusive scan within the warp, then over the warps' sums
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  for (int i = tid; i < p.items; i += kPlanThreads) p.work[3 * i] = -1;
  __syncthreads();
  if (tid == 0) {
    long long run = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      const long long s = warp_sums[w];
      warp_sums[w] = run;
      run += s;
    }
    total_tiles = run;
  }
  __syncthreads();
  const long long B = max(1LL, (total_tiles + p.ctas - 1) / p.ctas);
  long long start = warp_sums[warp] + incl - mine;  // tiles before query token t0
  for (int t = t0; t < t1; ++t) {
    const int len = plan_len(p, t);
    const long long tiles = (len + p.granule - 1) / p.granule;
    if (tiles == 0) {
      p.rows[t] = 0;
      p.rows[p.T + t] = 0;
      continue;
    }
    const long long f = start / B, l = (start + tiles - 1) / B;
    p.rows[t] = static_cast<int>(f + t);
    p.rows[p.T + t] = static_cast<int>(l - f + 1);
    for (long long i = f; i <= l; ++i) {
      const long long a = max(start, i * B) - start, b = min(start + tiles, (i + 1) * B) - start;
      int32_t* w = p.work + 3 * (i + t);
      w[0] = t;
      w[1] = static_cast<int>(a * p.granule);
      w[2] = static_cast<int>(min(static_cast<long long>(len), b * p.granule));
    }
    start += tiles;
  }
}

inline cudaError_t split_plan(const SplitPlanParams& p, cudaStream_t stream) {
  DCP_LAUNCH(split_plan_kernel, dim3(1), dim3(kPlanThreads), 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
