// Pieces shared by the split-KV decode kernels (GQA and MLA): the lane-group sum of a dot product, a lane's share of
// a row, the online-softmax update of one token, and the store and combine of a block's token streams (slots) into
// one normalised partial per head at the end of a split.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

// Work item i of a split pass, from the split plan (split_plan.cuh): block-table row b's local tokens [begin, end)
// for the block's rows r < n, row r being query token t0 + (rho0 + r) / G's query head kvh * G + (rho0 + r) % G (G
// query heads per KV head); each row attends its own length of tokens (row_len). Written as partial rows
// [i * R, i * R + n). b < 0: an unused item, whose block returns at once.
constexpr int kWorkInts = 7;
struct WorkItem {
  int b, t0, n, kvh, rho0, begin, end;
  __device__ __forceinline__ int token(int r, int G) const { return t0 + (rho0 + r) / G; }
  __device__ __forceinline__ int head(int r, int G) const { return kvh * G + (rho0 + r) % G; }
};
__device__ __forceinline__ WorkItem work_item(const int32_t* work, int i) {
  const int32_t* w = work + kWorkInts * i;
  return {w[0], w[1], w[2], w[3], w[4], w[5], w[6]};
}
// A length as the split passes read it: clamped to [0, the block table's capacity] (a GPU kernel cannot raise).
__device__ __forceinline__ int clamp_len(int len, int capacity) { return max(0, min(len, capacity)); }

// How many local tokens row r of the item attends (its query token's clamped length); 0 for a row past n.
__device__ __forceinline__ int row_len(const WorkItem& it, int r, int G, const int32_t* seq_lens, int capacity) {
  return r < it.n ? clamp_len(seq_lens[it.token(r, G)], capacity) : 0;
}

// Multi-token decode on tensor cores: P.V is one product over 16 tokens for the 16 rows of an A tile, and 0 x NaN is
// NaN, so a token that one row of the tile attends and another masks must not reach the masking row through its V.
// For the tile of rows r0 .. r0 + 15 (those below it.n), the least of its rows' lengths where it is below j1 (the
// tokens from there up to j1 are read, for this tile or another of the item, and masked for some row of this one),
// else kNotRagged. A P.V step over tokens [s, s + 16) needs per-token masking (mma.cuh's mma_rows_upto) iff
// s + 16 > ragged_from: never where the tile's rows share one length (single-token decode: j1 <= that length).
constexpr int kNotRagged = 0x7fffffff;
__device__ __forceinline__ int ragged_from(const WorkItem& it, int r0, int G, const int32_t* seq_lens, int capacity,
                                           int j1) {
  if (r0 >= it.n) return kNotRagged;
  const int last = it.token(min(r0 + 15, it.n - 1), G);
  int lo = kNotRagged;
  for (int q = it.token(r0, G); q <= last; ++q) lo = min(lo, clamp_len(seq_lens[q], capacity));
  return lo < j1 ? lo : kNotRagged;
}

template <int LANES>
__device__ __forceinline__ float group_sum(float x) {  // sum over aligned groups of LANES lanes
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Shared memory of a block with `slots` token streams over GT heads: running max (log2 units) and sum per
// (slot, head), then the unnormalised accumulator rows [slots][GT][D].
struct SlotState {
  float *m, *l, *o;
  __device__ SlotState(float* smem, int slots, int GT) : m(smem), l(smem + slots * GT), o(smem + 2 * slots * GT) {}
};
inline int slot_smem_bytes(int slots, int GT, int D) { return (2 * slots * GT + slots * GT * D) * 4; }

// Lane sl's columns of an fp32 row, in the layout store_slot uses: dst[c * VEC + e] = src[(c * LANES + sl) * VEC + e].
template <int NC, int VEC, int LANES>
__device__ __forceinline__ void lane_columns(const float* src, int sl, float* dst) {
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[c * VEC + e] = src[(c * LANES + sl) * VEC + e];
}

// Non-finite scores in every split pass (docs/design.md §2): the running max m is taken by fmaxf, which skips a NaN
// score; the exponentials are taken against m, or 0 while m is -inf, so a -inf score adds 0 even as a row's first
// (exp2(-inf - -inf) would be NaN); a NaN score makes the row's sum l NaN, and a +inf one makes m +inf (and l NaN).
// finish_row then reads the row's state.

// The end of a row's online softmax, m its max score (log2 units) and l its sum of 2^(s - m): the factor that
// normalises its accumulator and its natural LSE. A +inf score: out NaN and LSE +inf, as the float64 reference; a
// NaN score: out and LSE NaN; no token, or only -inf scores (l = 0): an empty row, out 0 and LSE -inf.
__device__ __forceinline__ void finish_row(float m, float l, float& inv, float& lse) {
  if (m == INFINITY) {
    inv = NAN;
    lse = INFINITY;
  } else if (l > 0.f) {
    inv = 1.f / l;
    lse = (m + log2f(l)) * 0.69314718f;
  } else {
    inv = l == 0.f ? 0.f : NAN;
    lse = l == 0.f ? -INFINITY : NAN;
  }
}

// One token of a head's online softmax, scores in log2 units: acc = acc * 2^(m - m_new) + 2^(s - m_new) * v.
template <int W>
__device__ __forceinline__ void online_update(float s, const float* v, float& m, float& l, float* acc) {
  const float m_new = fmaxf(m, s), base = m_new == -INFINITY ? 0.f : m_new;
  const float a = exp2f(m - base), pw = exp2f(s - base);
  l = l * a + pw;
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = acc[w] * a + pw * v[w];
  m = m_new;
}

// Stores a stream's state for GT heads in `slot`. The stream's LANES lanes hold NC packs of VEC accumulator columns
// each: lane sl's pack c covers columns (c * LANES + sl) * VEC + e.
template <int GT, int NC, int VEC, int LANES>
__device__ __forceinline__ void store_slot(const SlotState& st, int slot, int sl, int D, const float (&m)[GT],
                                           const float (&l)[GT], const float (&acc)[GT][NC * VEC]) {
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (sl == 0) {
      st.m[slot * GT + g] = m[g];
      st.l[slot * GT + g] = l[g];
    }
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int e = 0; e < VEC; ++e) st.o[(slot * GT + g) * D + (c * LANES + sl) * VEC + e] = acc[g][c * VEC + e];
  }
}

// After __syncthreads: writes heads 0..ng-1 of the block as normalised rows o[g * D + d] (fp32) and their natural
// LSE lse[g], as finish_row reads the slots together: a head with no token in the split gets o = 0, lse = -inf; a
// NaN score in any slot makes the head NaN, a +inf one its LSE +inf. All threads of the block take part.
__device__ __forceinline__ void combine_slots(const SlotState& s, int slots, int GT, int ng, int D, float* o,
                                              float* lse) {
  for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float mx = -INFINITY;
    bool nan = false;
    for (int k = 0; k < slots; ++k) {
      mx = fmaxf(mx, s.m[k * GT + g]);
      nan |= isnan(s.l[k * GT + g]);
    }
    float total = nan ? NAN : 0.f, sum = 0.f;
    if (isfinite(mx) && !nan)
      for (int k = 0; k < slots; ++k) {
        const float w = s.m[k * GT + g] == -INFINITY ? 0.f : exp2f(s.m[k * GT + g] - mx);
        total += w * s.l[k * GT + g];
        sum += w * s.o[(k * GT + g) * D + d];
      }
    float inv, row_lse;
    finish_row(mx, total, inv, row_lse);
    o[g * D + d] = sum * inv;  // 0 for an empty head, whose slots are never read
    if (d == 0) lse[g] = row_lse;
  }
}

}  // namespace dcp_ops::kernels
