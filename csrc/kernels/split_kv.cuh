// Pieces shared by the split-KV decode kernels (GQA and MLA): the lane-group sum of a dot product, a lane's share of
// a row, the online-softmax update of one token, and the store and combine of a block's token streams (slots) into
// one normalised partial per head at the end of a split.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

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

// One token of a head's online softmax, scores in log2 units: acc = acc * 2^(m - m_new) + 2^(s - m_new) * v.
template <int W>
__device__ __forceinline__ void online_update(float s, const float* v, float& m, float& l, float* acc) {
  const float m_new = fmaxf(m, s);
  const float a = exp2f(m - m_new), pw = exp2f(s - m_new);
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
// LSE lse[g]; a head with no token in the split gets o = 0, lse = -inf. All threads of the block take part.
__device__ __forceinline__ void combine_slots(const SlotState& s, int slots, int GT, int ng, int D, float* o,
                                              float* lse) {
  for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float mx = -INFINITY;
    for (int k = 0; k < slots; ++k) mx = fmaxf(mx, s.m[k * GT + g]);
    if (mx == -INFINITY) {
      o[g * D + d] = 0.f;
      if (d == 0) lse[g] = -INFINITY;
      continue;
    }
    float total = 0.f, sum = 0.f;
    for (int k = 0; k < slots; ++k) {
      const float w = s.m[k * GT + g] == -INFINITY ? 0.f : exp2f(s.m[k * GT + g] - mx);
      total += w * s.l[k * GT + g];
      sum += w * s.o[(k * GT + g) * D + d];
    }
    o[g * D + d] = sum / total;
    if (d == 0) lse[g] = (mx + log2f(total)) * 0.69314718f;
  }
}

}  // namespace dcp_ops::kernels
