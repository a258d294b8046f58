// The split-KV plan of a decode launch (included by csrc/cuda/split_plan.cu only), made on the device from the
// actual lengths and cu_seqlens_q, with no host synchronisation (a decode step can be captured in a CUDA graph).
//
// Rows and units. A block of the split pass computes R query rows, a row being a (query token, query head) pair: for
// sequence b (block-table row b; query tokens cu[b] .. cu[b+1]-1, or token b alone without cu_seqlens_q) and KV head
// kvh, its n_b * G rows (G query heads per KV head) in token-major order are cut into RT_b = ceil(n_b G / R) row
// tiles. A unit is one (b, kvh, row tile): it reads the sequence's KV rows of head kvh once for all its rows (the
// several query tokens of multi-token decode share them), up to the longest of its rows' lengths; each row is masked
// at its own length by the split pass.
//
// Budgets. The work of a unit is its token tiles (ceil(len / granule)); the units' tiles, laid end to end, are cut
// into `ctas` budgets of B = ceil(total / ctas) tiles, one per block of a wave. Budget i and unit u meet in at most
// one piece, the work item i + u: so items are numbered without a search, a unit's items are consecutive, and there
// are at most ctas + U - 1 of them. Each item is one block of the split pass (an item no piece maps to is marked
// unused and its block returns at once). A long sequence thus gets many splits and a short one few, for any mix of
// batch, lengths and query tokens per sequence.
//
// The merge reads, for query token t, its unit base, its first row and its sequence's RT (tok), and for unit u its
// first item and item count (units): head h of t is row rho = rho_t + h % G of unit base + (h / G) RT + rho / R,
// partial row rho % R of each of that unit's items.
#pragma once

#include "kernels/common.cuh"
#include "kernels/split_kv.cuh"

namespace dcp_ops::kernels {

struct SplitPlanParams {
  const int32_t* seq_lens;     // [T]
  const int32_t* cu;           // [B + 1], or null: B = T, one query token per sequence
  int T, B, capacity;          // query tokens; sequences; the block table's capacity in tokens (lengths clamp to it)
  int G, Hkv, R;               // query heads per KV head; KV heads; rows per block
  int granule, ctas;           // tokens per tile; budgets
  int items, units;            // sizes of work and units (upper bounds from shapes)
  int32_t* work;               // [items][kWorkInts]: WorkItem
  int32_t* unit;               // [units][2]: first item, item count
  int32_t* tok;                // [T][3]: unit base (-1: in no sequence), first row, RT of its sequence
};

constexpr int kPlanThreads = 256;

// Sequence b's query tokens [t0, t0 + n), clamped to [0, T) (a malformed cu_seqlens_q on the device stays in bounds).
__device__ __forceinline__ void plan_seq(const SplitPlanParams& p, int b, int& t0, int& n) {
  if (p.cu == nullptr) {
    t0 = b;
    n = 1;
    return;
  }
  t0 = min(max(p.cu[b], 0), p.T);
  n = min(max(p.cu[b + 1] - t0, 0), p.T - t0);
}

__device__ __forceinline__ int plan_len(const SplitPlanParams& p, int t) {
  return clamp_len(p.seq_lens[t], p.capacity);
}

// The longest length among the query tokens of row tile rt of a sequence with n tokens from t0.
__device__ __forceinline__ int tile_len(const SplitPlanParams& p, int t0, int n, int rt) {
  const int first = rt * p.R / p.G, last = min(n * p.G, (rt + 1) * p.R) - 1;
  int len = 0;
  for (int q = first; q <= last / p.G; ++q) len = max(len, plan_len(p, t0 + q));
  return len;
}

// Block-wide exclusive scan of one value per thread (kPlanThreads threads); total gets the sum.
__device__ __forceinline__ long long block_scan(long long v, long long* warp_sums, long long& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long run = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      const long long s = warp_sums[w];
      warp_sums[w] = run;
      run += s;
    }
    warp_sums[kPlanThreads / 32] = run;
  }
  __syncthreads();
  total = warp_sums[kPlanThreads / 32];
  const long long excl = warp_sums[warp] + incl - v;
  // mutate_sync: needed on hardware, not seen by the executor. The next scan's lane 31 stores warp_sums[warp], which
  // the other lanes of this warp load just above; that scan's __shfl_up_sync orders the lanes' execution but is no
  // memory fence, so without this barrier the load may see the next scan's value. The executor runs every lane to
  // the shuffle before any lane goes on, so the mutant passes there.
  __syncthreads();  // warp_sums is reused by the next scan
  return excl;
}

// One block: thread k takes the sequences [k * per, (k + 1) * per), first to count their units and tiles, then
// (after block scans of the counts) to write their items, units and query tokens.
__global__ void __launch_bounds__(kPlanThreads) split_plan_kernel(SplitPlanParams p) {
  __shared__ long long warp_sums[kPlanThreads / 32 + 1];
  const int per = (p.B + kPlanThreads - 1) / kPlanThreads;
  const int b0 = min(p.B, static_cast<int>(threadIdx.x) * per), b1 = min(p.B, b0 + per);
  for (int i = threadIdx.x; i < p.items; i += kPlanThreads) p.work[kWorkInts * i] = -1;
  for (int i = threadIdx.x; i < p.units; i += kPlanThreads) p.unit[2 * i] = p.unit[2 * i + 1] = 0;
  for (int i = threadIdx.x; i < p.T; i += kPlanThreads) p.tok[3 * i] = -1;
  long long my_units = 0, my_tiles = 0;
  for (int b = b0; b < b1; ++b) {
    int t0, n;
    plan_seq(p, b, t0, n);
    const int rts = (n * p.G + p.R - 1) / p.R;
    my_units += static_cast<long long>(p.Hkv) * rts;
    for (int rt = 0; rt < rts; ++rt)
      my_tiles += static_cast<long long>(p.Hkv) * ((tile_len(p, t0, n, rt) + p.granule - 1) / p.granule);
  }
  long long total_units, total_tiles;
  long long u = block_scan(my_units, warp_sums, total_units);  // the first unit of sequence b0
  long long start = block_scan(my_tiles, warp_sums, total_tiles);  // tiles before it
  const long long budget = max(1LL, (total_tiles + p.ctas - 1) / p.ctas);
  for (int b = b0; b < b1; ++b) {
    int t0, n;
    plan_seq(p, b, t0, n);
    const int rts = (n * p.G + p.R - 1) / p.R;
    if (u + static_cast<long long>(p.Hkv) * rts > p.units) return;  // only a malformed cu_seqlens_q gets here
    for (int q = 0; q < n; ++q) {
      int32_t* tk = p.tok + 3 * (t0 + q);
      tk[0] = static_cast<int>(u);
      tk[1] = q * p.G;
      tk[2] = rts;
    }
    for (int kvh = 0; kvh < p.Hkv; ++kvh)
      for (int rt = 0; rt < rts; ++rt, ++u) {
        const int len = tile_len(p, t0, n, rt);
        const long long tiles = (len + p.granule - 1) / p.granule;
        if (tiles == 0) continue;
        const long long f = start / budget, l = (start + tiles - 1) / budget;
        p.unit[2 * u] = static_cast<int>(f + u);
        p.unit[2 * u + 1] = static_cast<int>(l - f + 1);
        for (long long i = f; i <= l; ++i) {
          const long long a = max(start, i * budget) - start, e = min(start + tiles, (i + 1) * budget) - start;
          if (i + u >= p.items) break;  // cannot happen for a well-formed plan; stays in bounds regardless
          int32_t* w = p.work + kWorkInts * (i + u);
          w[0] = b;
          w[1] = t0;
          w[2] = min(p.R, n * p.G - rt * p.R);
          w[3] = kvh;
          w[4] = rt * p.R;
          w[5] = static_cast<int>(a * p.granule);
          w[6] = static_cast<int>(min(static_cast<long long>(len), e * p.granule));
        }
        start += tiles;
      }
  }
}

inline cudaError_t split_plan(const SplitPlanParams& p, cudaStream_t stream) {
  DCP_LAUNCH(split_plan_kernel, dim3(1), dim3(kPlanThreads), 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
