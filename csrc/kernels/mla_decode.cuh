// Paged MLA decode attention, split-KV (torch-free). One latent "KV head" shared by every query head: keys are whole
// cache rows (latent then rope), values their latent part. Pass 1: a block attends a work item's kMlaHeads query rows
// ((query token, head) pairs, each masked at its own length) over its range of local tokens (split_plan.cuh); a warp
// loads each row once per step (16-byte latent packs, one rope load per lane) and uses it for every head of the tile,
// scores and values alike; fp32 online softmax in base 2. It writes a normalised fp32 partial and its natural LSE. The
// query comes in fp32, already absorbed (w_uk) and scaled by head_project; the launcher merges the splits
// (merge_kernel) and applies w_uv (head_project). Block ids outside the cache, or lengths past the block table, are
// never read: those tokens are skipped (a GPU kernel cannot raise; the CPU op rejects them).
#pragma once

#include "kernels/common.cuh"
#include "kernels/split_kv.cuh"

namespace dcp_ops::kernels {

struct MlaParams {
  const float* q;            // [T, H, DL + DR] fp32, contiguous, scaled by softmax scale * log2(e)
  const void* q16;           // precision "native" on tensor cores: [T, H, DL + DR] in the cache's type, unscaled
  float scale_log2;          // with q16: softmax scale * log2(e), applied to the fp32 scores
  const void* kv;            // [num_blocks, block_size, DL + DR], element strides below
  int64_t kv_sb, kv_st;
  const int32_t* block_table;
  int64_t bt_st;
  const int32_t* seq_lens;
  int T, H, num_blocks, block_size, max_blocks;
  const int32_t* work;  // the split plan's work items (split_plan.cuh), `items` of them
  int items;
  float* part_o;    // [items, R, DL] fp32, normalised; R the kernel's rows per block
  float* part_lse;  // [items, R] natural log
  const float* k_scale = nullptr;  // an FP8 cache's scale (1 element, on the device): the SIMT kernel's q times it
};

constexpr int kMlaWarps = 4, kMlaHeads = 4;  // token streams per block, query heads per block

// Lane l holds latent elements (c * 32 + l) * VEC + e of every row and rope elements DL + l * RP + e. T: the cache's
// type (fp32, bf16, fp16 or fp8_e4m3); the query is fp32.
template <typename T, int DL, int DR>
__global__ void mla_split_kernel(MlaParams p) {
  constexpr int VEC = (16 / sizeof(T)) < (DL / 32) ? (16 / sizeof(T)) : (DL / 32), NC = DL / (32 * VEC);
  constexpr int LP = NC * VEC, RP = DR / 32, GT = kMlaHeads, DK = DL + DR;
  static_assert(DL % (32 * VEC) == 0 && DR % 32 == 0, "latent and rope dims must split evenly over 32 lanes");
  const int item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int seq = wi.b, j0 = wi.begin, j1 = wi.end, ng = wi.n;
  DCP_DYNAMIC_SMEM(float, smem);
  const SlotState st(smem, kMlaWarps, GT);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float qr[GT][LP + RP], acc[GT][LP], m[GT], l[GT];
  int len[GT];  // each row's own length: the query tokens of a sequence share the tile (multi-token decode)
  const float ks = p.k_scale != nullptr ? *p.k_scale : 1.f;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const int gr = min(g, ng - 1);  // padding rows: a copy of the last row, never stored
    const float* qh = p.q + (static_cast<int64_t>(wi.token(gr, p.H)) * p.H + wi.head(gr, p.H)) * DK;
    len[g] = row_len(wi, g, p.H, p.seq_lens, p.max_blocks * p.block_size);
    m[g] = -INFINITY;
    l[g] = 0.f;
    lane_columns<NC, VEC, 32>(qh, lane, qr[g]);
#pragma unroll
    for (int w = 0; w < LP; ++w) acc[g][w] = 0.f;
#pragma unroll
    for (int e = 0; e < RP; ++e) qr[g][LP + e] = qh[DL + lane * RP + e];
#pragma unroll
    for (int w = 0; w < LP + RP; ++w) qr[g][w] *= ks;
  }
  const T* kv = static_cast<const T*>(p.kv);
  for (int j = j0 + warp; j < j1; j += kMlaWarps) {  // one token per warp and step: warp-uniform branches
    const int64_t block = p.block_table[seq * p.bt_st + j / p.block_size];
    if (block < 0 || block >= p.num_blocks) continue;
    const T* row = kv + block * p.kv_sb + static_cast<int64_t>(j % p.block_size) * p.kv_st;
    float kf[LP + RP];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(row + (c * 32 + lane) * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) kf[c * VEC + e] = to_f32(pk.v[e]);
    }
    if constexpr (RP > 0) {
      const Pack<T, RP> pr = *reinterpret_cast<const Pack<T, RP>*>(row + DL + lane * RP);
#pragma unroll
      for (int e = 0; e < RP; ++e) kf[LP + e] = to_f32(pr.v[e]);
    }
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < LP + RP; ++w) s += qr[g][w] * kf[w];
      s = group_sum<32>(s);
      if (j < len[g]) online_update<LP>(s, kf, m[g], l[g], acc[g]);  // values: the lane's first LP elements
    }
  }
  store_slot<GT, NC, VEC, 32>(st, warp, lane, DL, m, l, acc);
  __syncthreads();
  const int64_t first = static_cast<int64_t>(item) * GT;
  combine_slots(st, kMlaWarps, GT, ng, DL, p.part_o + first * DL, p.part_lse + first);
}

template <typename T, int DL, int DR>
cudaError_t mla_launch(const MlaParams& p, cudaStream_t stream) {
  const dim3 grid(p.items);
  auto kernel = mla_split_kernel<T, DL, DR>;
  DCP_LAUNCH(kernel, grid, dim3(32 * kMlaWarps), slot_smem_bytes(kMlaWarps, kMlaHeads, DL), stream, p);
  return cudaGetLastError();
}

// Latent dims 128, 256 and 512 (DeepSeek-V2/V3: 512), rope dims 0 and 64, for every dtype.
inline bool mla_supported_dims(int latent, int rope) {
  return (latent == 128 || latent == 256 || latent == 512) && (rope == 0 || rope == 64);
}

template <typename T, int DL>
cudaError_t mla_by_rope(const MlaParams& p, int rope, cudaStream_t stream) {
  return rope == 64 ? mla_launch<T, DL, 64>(p, stream) : mla_launch<T, DL, 0>(p, stream);
}

template <typename T>
cudaError_t mla_split(const MlaParams& p, int latent, int rope, cudaStream_t stream) {
  if (latent == 512) return mla_by_rope<T, 512>(p, rope, stream);
  if (latent == 256) return mla_by_rope<T, 256>(p, rope, stream);
  return mla_by_rope<T, 128>(p, rope, stream);
}

}  // namespace dcp_ops::kernels
