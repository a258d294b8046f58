// Paged GQA decode attention, split-KV (torch-free). Pass 1: a block attends a work item's GT query rows ((query token,
// head) pairs of one KV head, each masked at its own length) over its range of local tokens (split_plan.cuh), loading
// each K/V row once for the whole tile with 16-byte loads; fp32 online softmax in base 2; writes a normalised fp32
// partial and its natural LSE. Pass 2 merges the splits (merge_kernel) into out [T, Hq, D] in the cache dtype and lse
// [T, Hq]. Block ids outside the cache, or lengths past the block table, are never read: those tokens are skipped (a
// GPU kernel cannot raise; the CPU op rejects them).
#pragma once

#include <cstring>

#include "kernels/common.cuh"
#include "kernels/merge.cuh"
#include "kernels/split_kv.cuh"

namespace dcp_ops::kernels {

struct GqaParams {
  const void* q;
  int64_t q_st, q_sh;
  const void* k;
  int64_t k_sb, k_st, k_sh;
  const void* v;
  int64_t v_sb, v_st, v_sh;
  const int32_t* block_table;
  int64_t bt_st;
  const int32_t* seq_lens;
  int T, Hq, Hkv, D, block_size, num_blocks, max_blocks;
  const int32_t* work;  // the split plan's work items (split_plan.cuh), `items` of them
  int items, R;         // R query rows per item: the kernel's GT
  float scale_log2;  // softmax scale * log2(e)
  float* part_o;     // [items, R, D] fp32, normalised
  float* part_lse;   // [items, R] natural log
  const float* k_scale = nullptr;  // an FP8 cache's K scale (1 element, on the device), folded into scale_log2
};

constexpr int kGqaWarps = 4;

// The K and V packs of 8 e4m3 elements, columns [8 sl, 8 sl + 8), of one token's rows (at element offsets k_at, v_at
// of k, v) by 16-byte loads: lanes sl and sl ^ 1 (one row's) each load 16 bytes, columns [16 (sl / 2), + 16), the
// even lane K's and the odd lane V's, and swap the halves the other needs by two shuffles. Every lane of the warp
// calls this (the caller's loop is warp-uniform); where the token is not read (valid false) both get zeros.
__device__ __forceinline__ void load_kv_fp8_paired(Pack<fp8_e4m3, 8>& kp, Pack<fp8_e4m3, 8>& vp, bool valid,
                                                   const fp8_e4m3* k, int64_t k_at, const fp8_e4m3* v, int64_t v_at,
                                                   int sl) {
  const bool odd = sl & 1;
  Pack<uint32_t, 4> w{};
  if (valid)
    w = *reinterpret_cast<const Pack<uint32_t, 4>*>(odd ? v + v_at + 8 * (sl & ~1) : k + k_at + 8 * (sl & ~1));
  Pack<uint32_t, 2> kw, vw;
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // out: the half of this lane's load the partner needs; in: the one it loaded for us
    const uint32_t in = __shfl_xor_sync(0xffffffffu, odd ? w.v[i] : w.v[i + 2], 1);
    kw.v[i] = odd ? in : w.v[i];
    vw.v[i] = odd ? w.v[i + 2] : in;
  }
  memcpy(&kp, &kw, sizeof(kp));
  memcpy(&vp, &vw, sizeof(vp));
}

// LANES lanes cover one token's row, each NC packs of VEC elements; 32 / LANES tokens per warp step. T: the query's
// type; C: the cache's (T, or fp8_e4m3).
template <typename T, typename C, int VEC, int LANES, int NC, int GT>
__global__ void gqa_split_kernel(GqaParams p) {
  constexpr int SUBS = 32 / LANES, SLOTS = kGqaWarps * SUBS, W = VEC * NC;
  const int G = p.Hq / p.Hkv, item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int seq = wi.b, j0 = wi.begin, j1 = wi.end, kvh = wi.kvh, ng = wi.n, D = p.D;
  DCP_DYNAMIC_SMEM(float, smem);
  float* qs = smem;                             // [GT][D] scaled query
  const SlotState st(qs + GT * D, SLOTS, GT);   // token streams' softmax states
  const float q_mult = p.k_scale != nullptr ? p.scale_log2 * *p.k_scale : p.scale_log2;
  for (int i = threadIdx.x; i < GT * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    qs[i] = g < ng ? to_f32(static_cast<const T*>(p.q)[wi.token(g, G) * p.q_st + wi.head(g, G) * p.q_sh + d]) * q_mult
                   : 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int sub = lane / LANES, sl = lane % LANES, slot = warp * SUBS + sub;
  float qr[GT][W], acc[GT][W], m[GT], l[GT];
  int len[GT];  // each row's own length: the query tokens of a sequence share the tile (multi-token decode)
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    len[g] = row_len(wi, g, G, p.seq_lens, p.max_blocks * p.block_size);
    m[g] = -INFINITY;
    l[g] = 0.f;
    lane_columns<NC, VEC, LANES>(qs + g * D, sl, qr[g]);
#pragma unroll
    for (int w = 0; w < W; ++w) acc[g][w] = 0.f;
  }
  const C* kbase = static_cast<const C*>(p.k) + kvh * p.k_sh;
  const C* vbase = static_cast<const C*>(p.v) + kvh * p.v_sh;
  for (int base = j0 + warp * SUBS; base < j1; base += kGqaWarps * SUBS) {  // warp-uniform trip count
    const int j = base + sub;
    const int64_t block = j < j1 ? p.block_table[seq * p.bt_st + j / p.block_size] : -1;
    const bool valid = block >= 0 && block < p.num_blocks;
    const int64_t off = j % p.block_size;
    float kf[W], vf[W];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      Pack<C, VEC> kp, vp;
      if constexpr (sizeof(C) == 1) {  // 8-byte packs, read two lanes' at a time (load_kv_fp8_paired)
        static_assert(VEC == 8 && NC == 1 && LANES % 2 == 0, "fp8: one 8-byte pack a lane, lanes in pairs");
        load_kv_fp8_paired(kp, vp, valid, kbase, block * p.k_sb + off * p.k_st, vbase, block * p.v_sb + off * p.v_st,
                           sl);
      } else if (valid) {
        const int64_t col = (c * LANES + sl) * VEC;
        kp = *reinterpret_cast<const Pack<C, VEC>*>(kbase + block * p.k_sb + off * p.k_st + col);
        vp = *reinterpret_cast<const Pack<C, VEC>*>(vbase + block * p.v_sb + off * p.v_st + col);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        kf[c * VEC + e] = valid ? to_f32(kp.v[e]) : 0.f;
        vf[c * VEC + e] = valid ? to_f32(vp.v[e]) : 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) s += qr[g][w] * kf[w];
      s = group_sum<LANES>(s);
      if (valid && j < len[g]) online_update<W>(s, vf, m[g], l[g], acc[g]);
    }
  }
  store_slot<GT, NC, VEC, LANES>(st, slot, sl, D, m, l, acc);
  __syncthreads();
  const int64_t row = static_cast<int64_t>(item) * GT;
  combine_slots(st, SLOTS, GT, ng, D, p.part_o + row * D, p.part_lse + row);
}

inline int gqa_smem_bytes(int GT, int D, int slots) { return GT * D * 4 + slot_smem_bytes(slots, GT, D); }

template <typename T, typename C, int VEC, int LANES, int NC, int GT>
cudaError_t gqa_launch(const GqaParams& p, cudaStream_t stream) {
  const dim3 grid(p.items);
  const int smem = gqa_smem_bytes(GT, p.D, kGqaWarps * (32 / LANES));
  auto kernel = gqa_split_kernel<T, C, VEC, LANES, NC, GT>;
  DCP_LAUNCH(kernel, grid, dim3(32 * kGqaWarps), smem, stream, p);
  return cudaGetLastError();
}

// Rows per block GT = p.R, which gqa_rows (gqa_decode_mma.cuh) chooses.
template <typename T, typename C, int VEC, int LANES, int NC>
cudaError_t gqa_by_group(const GqaParams& p, cudaStream_t stream) {
  if (p.R == 1) return gqa_launch<T, C, VEC, LANES, NC, 1>(p, stream);
  if (p.R == 2) return gqa_launch<T, C, VEC, LANES, NC, 2>(p, stream);
  if (p.R == 4) return gqa_launch<T, C, VEC, LANES, NC, 4>(p, stream);
  return gqa_launch<T, C, VEC, LANES, NC, 8>(p, stream);
}

// Head dims 64, 128 and 256, for every dtype.
inline bool gqa_supported_head_dim(int D, int /*elem_size*/) { return D == 64 || D == 128 || D == 256; }

// T: the query's type; C: the cache's, T or fp8_e4m3 (8-byte packs, as many lanes to a row as a 16-bit cache's, read
// by 16-byte loads that two lanes share: load_kv_fp8_paired).
template <typename T, typename C = T>
cudaError_t gqa_split(const GqaParams& p, cudaStream_t stream) {
  constexpr int V = sizeof(C) == 1 ? 8 : 16 / sizeof(C);  // elements per load
  if constexpr (V == 4) {            // fp32: 16, 32 or 64 packs per row
    if (p.D == 64) return gqa_by_group<T, C, V, 16, 1>(p, stream);
    if (p.D == 128) return gqa_by_group<T, C, V, 32, 1>(p, stream);
    return gqa_by_group<T, C, V, 32, 2>(p, stream);
  } else {                           // bf16 / fp16 / fp8: 8, 16 or 32 packs per row
    if (p.D == 64) return gqa_by_group<T, C, V, 8, 1>(p, stream);
    if (p.D == 128) return gqa_by_group<T, C, V, 16, 1>(p, stream);
    return gqa_by_group<T, C, V, 32, 1>(p, stream);
  }
}

}  // namespace dcp_ops::kernels
