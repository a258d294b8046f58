// Paged MLA decode attention on tensor cores (bf16 / fp16 caches, latent 256 or 512, rope 0 or 64, sm_80 and later):
// the split pass of mla_decode.cuh with 16 query heads per block as the rows of mma.sync m16n8k16 products (fragment
// layouts in mma.cuh). A block's DL / 64 warps take 16-token steps together:
//   - the step's cache rows go to shared memory by cp.async, in two stages: the next step's copy is in flight during
//     this step's arithmetic;
//   - each warp computes partial scores over its key chunk groups (32 dims each: groups warp, warp + warps, ...), in
//     the permuted k order of gqa_decode_mma.cuh, and the block sums the partials in shared memory, in fragment order;
//   - every warp runs the same softmax update on the same sums (so the same m and l), and accumulates P.V for its 64
//     latent dims.
// The absorbed fp32 query enters as 3 16-bit terms and P as 2 (split_terms), so the scores are as accurate as fp32
// ones and P.V as with fp32 probabilities: with 2 query terms the LSE misses the tolerance table at sharp softmax.
// Shared rows are swizzled: 16-byte chunk c of row r sits at c ^ swizzle(r), which keeps both the key reads (8 rows x
// 4 chunks per quarter-warp) and the value reads (4 rows x 2 chunks) on distinct banks. Tokens past the split, past
// seq_len, or in blocks outside the cache are never read (zeros) and get P = 0; so do a row's tokens past its own
// length, and where the rows (several query tokens) disagree on a step's tokens, V is masked per query token
// (mla_mma_pv_ragged), since P = 0 does not keep a NaN or inf in V out (0 x NaN is NaN). Writes the normalised fp32
// partial and natural LSE of each split, as mla_split_kernel does.
// An FP8 cache (F8; T the query's 16-bit type): the e4m3 rows go by cp.async into two raw stages (half the bytes),
// and each step's rows, once in, are converted exactly to T into one 16-bit stage that the products read as above
// (one more barrier a step; the same shared memory); the cache's scale multiplies the summed scores (not the query
// before its split: a small scale would push fp16's lower terms below its normal range).
#pragma once

#include "kernels/cp_async.cuh"
#include "kernels/mla_decode.cuh"
#include "kernels/mma.cuh"

namespace dcp_ops::kernels {

__device__ __forceinline__ int mla_swizzle(int r) { return (((r >> 1) & 3) << 1) ^ ((r & 1) << 2); }

// The kernel's shapes: its warps; a row of DK elements as 16-byte chunks (16-bit: 8 elements; e4m3: 16); the key
// chunk groups of 32 dims the warps share (group warp + kWarps i), and the most one warp takes.
template <int DL, int DR>
struct MlaMmaShape {
  static constexpr int kWarps = DL / 64, DK = DL + DR, kChunks = DK / 8, kRawChunks = DK / 16;
  static constexpr int kKeyGroups = DK / 32, kKeyGroupsPerWarp = (kKeyGroups + kWarps - 1) / kWarps;
};

template <int NW, int DK, typename T>
constexpr int mla_mma_smem_bytes() {  // partial scores, row offsets of 3 steps, two stages of 16 rows (F8: one, and
                                      // two raw e4m3 stages of half the bytes)
  return NW * 2 * 32 * 4 * 4 + 3 * 16 * 8 + 2 * 16 * DK * static_cast<int>(sizeof(T));
}

// Token j's element offset in the cache (a row of wi's sequence), or -1 when it is not read: past the split's end, or
// in a block outside the cache.
__device__ __forceinline__ int64_t mla_token_offset(const MlaParams& p, const WorkItem& wi, int j) {
  if (j >= wi.end) return -1;
  const int64_t block = p.block_table[wi.b * p.bt_st + j / p.block_size];
  return block >= 0 && block < p.num_blocks ? block * p.kv_sb + static_cast<int64_t>(j % p.block_size) * p.kv_st : -1;
}

// The query fragments (3 terms, split_terms) of this warp's key chunk groups: q_frag[i][h][term][r4] is A register r4
// (row lane_row + 8 (r4 & 1), dims + 2 (r4 >> 1)) of k-half h of group warp + kWarps i; zeros in rows past the item's
// n and in groups past DK.
template <typename T, int DL, int DR>
__device__ __forceinline__ void mla_mma_stage_query(
    uint32_t (&q_frag)[MlaMmaShape<DL, DR>::kKeyGroupsPerWarp][2][3][4], const MlaParams& p, const WorkItem& wi,
    int warp, int lane_row, int lane_col) {
  using S = MlaMmaShape<DL, DR>;
  const float* q_row[2] = {
      p.q + (static_cast<int64_t>(wi.token(lane_row, p.H)) * p.H + wi.head(lane_row, p.H)) * S::DK,
      p.q + (static_cast<int64_t>(wi.token(lane_row + 8, p.H)) * p.H + wi.head(lane_row + 8, p.H)) * S::DK};
#pragma unroll
  for (int i = 0; i < S::kKeyGroupsPerWarp; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r4 = 0; r4 < 4; ++r4) {
        const int group = warp + S::kWarps * i, row = lane_row + 8 * (r4 & 1);
        const int d = 8 * (4 * group + lane_col) + 4 * h + 2 * (r4 >> 1);
        uint32_t terms[3] = {0u, 0u, 0u};
        if (group < S::kKeyGroups && row < wi.n) split_terms<T, 3>(q_row[r4 & 1][d], q_row[r4 & 1][d + 1], terms);
#pragma unroll
        for (int k = 0; k < 3; ++k) q_frag[i][h][k][r4] = terms[k];
      }
}

// cp.async of the 16 rows whose offsets are in offsets[set] (-1: zeros) into stage `stage`: 16-bit rows swizzled into
// `rows`; F8: e4m3 rows as they are into `raw` (the offsets count elements, which are bytes there).
template <typename T, int DL, int DR, bool F8>
__device__ __forceinline__ void mla_mma_copy_rows(T* rows, unsigned char* raw, const int64_t* offsets, int set,
                                                  const T* kv, int stage) {
  using S = MlaMmaShape<DL, DR>;
  constexpr int kThreads = 32 * S::kWarps, DK = S::DK;
  if constexpr (F8) {
    const unsigned char* src = reinterpret_cast<const unsigned char*>(kv);
    for (int i = threadIdx.x; i < 16 * S::kRawChunks; i += kThreads) {
      const int r = i / S::kRawChunks, c = i % S::kRawChunks;
      const int64_t off = offsets[set * 16 + r];
      cp_async16(raw + (stage * 16 + r) * DK + 16 * c, src + (off >= 0 ? off + 16 * c : 0), off >= 0);
    }
  } else {
    for (int i = threadIdx.x; i < 16 * S::kChunks; i += kThreads) {
      const int r = i / S::kChunks, c = i % S::kChunks;
      const int64_t off = offsets[set * 16 + r];
      cp_async16(rows + (stage * 16 + r) * DK + 8 * (c ^ mla_swizzle(r)), kv + (off >= 0 ? off + 8 * c : 0),
                 off >= 0);
    }
  }
}

// F8: raw stage `stage` converted to T into the 16-bit rows, 8 e4m3 bytes c of a row becoming its 16-bit chunk c
// (swizzled as mla_mma_copy_rows places a 16-bit cache's); 8 bytes at a time keeps few registers live beside the
// fragments.
template <typename T, int DL, int DR>
__device__ __forceinline__ void mla_mma_convert_stage(T* rows, const unsigned char* raw, int stage) {
  using S = MlaMmaShape<DL, DR>;
  for (int i = threadIdx.x; i < 16 * S::kChunks; i += 32 * S::kWarps) {
    const int r = i / S::kChunks, c = i % S::kChunks;
    const Pack<unsigned short, 4> x =
        *reinterpret_cast<const Pack<unsigned short, 4>*>(raw + (stage * 16 + r) * S::DK + 8 * c);
    Pairs4 w;
#pragma unroll
    for (int e = 0; e < 4; ++e) w.v[e] = e4m3x2_to<T>(x.v[e]);
    *reinterpret_cast<Pairs4*>(rows + r * S::DK + 8 * (c ^ mla_swizzle(r))) = w;
  }
}

// This warp's partial scores of the step's 16 keys (`tile`: row 8 n + lane_row, chunks 4 group + lane_col) over its
// key chunk groups, the 3 query terms summed, stored in fragment order: partials[warp][n][lane][i].
template <typename T, int DL, int DR>
__device__ __forceinline__ void mla_mma_partial_scores(
    float* partials, const T* tile, const uint32_t (&q_frag)[MlaMmaShape<DL, DR>::kKeyGroupsPerWarp][2][3][4],
    int warp, int lane, int lane_row, int lane_col) {
  using S = MlaMmaShape<DL, DR>;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const T* key = tile + (8 * n + lane_row) * S::DK;
    const int swizzle = mla_swizzle(8 * n + lane_row);
    float term_scores[3][4];  // one accumulator per query term: 3 independent chains of tensor-core products, not one
#pragma unroll
    for (int k = 0; k < 3; ++k)
#pragma unroll
      for (int i = 0; i < 4; ++i) term_scores[k][i] = 0.f;
#pragma unroll
    for (int i = 0; i < S::kKeyGroupsPerWarp; ++i) {
      const int group = warp + S::kWarps * i;
      if (S::kKeyGroups % S::kWarps != 0 && group >= S::kKeyGroups) break;  // warp-uniform
      const Pairs4 w = *reinterpret_cast<const Pairs4*>(key + 8 * ((4 * group + lane_col) ^ swizzle));
      const uint32_t b0[2] = {w.v[0], w.v[1]}, b1[2] = {w.v[2], w.v[3]};
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        mma_16816<T>(term_scores[k], q_frag[i][0][k], b0);
        mma_16816<T>(term_scores[k], q_frag[i][1][k], b1);
      }
    }
    // An infinite key element times the query's three terms gives +-inf per term (or NaN from a zero term), so
    // the sum can be NaN where the score is +-inf: then the first term's (the reference's sign) stands.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float s = term_scores[0][i] + (term_scores[1][i] + term_scores[2][i]);
      partials[((warp * 2 + n) * 32 + lane) * 4 + i] = isnan(s) && !isnan(term_scores[0][i]) ? term_scores[0][i] : s;
    }
  }
}

// The step's scores of this lane's fragment (rows lane_row (+ 8), tokens 8 n + 2 lane_col (+ 1)): the warps'
// partials summed in warp order, times the cache's scale (1 for a 16-bit cache).
template <int NW>
__device__ __forceinline__ void mla_mma_summed_scores(float (&scores)[2][4], const float* partials, int lane,
                                                      float k_scale) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float x = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) x += partials[((w * 2 + n) * 32 + lane) * 4 + i];
      scores[n][i] = x * k_scale;
    }
}

// The online softmax of rows lane_row, lane_row + 8 over step k's tokens begin + 16 k + 8u + 2 lane_col + e (scores
// in log2 units): a token not read (its offset in offsets[set] -1) or at or past the row's length `len` scores -inf.
// Leaves P's A fragments in p_hi, p_lo (2 terms, softmax_step) and rescales acc.
template <typename T>
__device__ __forceinline__ void mla_mma_softmax(const float (&scores)[2][4], const int64_t* offsets, int set,
                                                int begin, int k, const int (&len)[2], int lane_col, float (&m)[2],
                                                float (&l)[2], float (&acc)[8][4], uint32_t (&p_hi)[4],
                                                uint32_t (&p_lo)[4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x[2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        x[u][e] = offsets[set * 16 + 8 * u + 2 * lane_col + e] >= 0 &&
                          begin + 16 * k + 8 * u + 2 * lane_col + e < len[r]
                      ? scores[u][2 * r + e]
                      : -INFINITY;
    softmax_step<T, 2>(x, r, m[r], l[r], acc, p_hi, p_lo);
  }
}

// V's B-fragment words of this warp's latent dims: v_words[u][e] is row 8u + 2 lane_col + e, chunk 8 warp + lane_row
// (dims 64 warp + 8 lane_row ..), 8 elements.
template <typename T, int DK>
__device__ __forceinline__ void mla_mma_load_v(uint32_t (&v_words)[2][2][4], const T* tile, int warp, int lane_row,
                                               int lane_col) {
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * u + 2 * lane_col + e;
      const Pairs4 w = *reinterpret_cast<const Pairs4*>(tile + r * DK + 8 * ((8 * warp + lane_row) ^ mla_swizzle(r)));
#pragma unroll
      for (int i = 0; i < 4; ++i) v_words[u][e][i] = w.v[i];
    }
}

// P.V over this warp's latent dims: n-tile j, column lane_row = dim 64 warp + 8 lane_row + j; both P terms.
template <typename T>
__device__ __forceinline__ void mla_mma_pv(float (&acc)[8][4], const uint32_t (&p_hi)[4], const uint32_t (&p_lo)[4],
                                           const uint32_t (&v_words)[2][2][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t b[2] = {pair_rows(v_words[0][0], v_words[0][1], j), pair_rows(v_words[1][0], v_words[1][1], j)};
    mma_16816<T>(acc[j], p_hi, b);
    mma_16816<T>(acc[j], p_lo, b);
  }
}

// P.V of a ragged step (split_kv.cuh's ragged_from; its first token s): once per query token of the block's rows,
// both P terms times V masked at that token's length, kept in that token's rows only (mma_rows_upto). The operands
// are mla_mma_pv's (v_words: the lane's value words, tokens 8u + 2 lane_col + e). The query tokens are a loop, not
// unrolled: this runs on the last steps of a multi-token item only.
template <typename T>
__device__ __forceinline__ void mla_mma_pv_ragged(float (&acc)[8][4], const uint32_t (&p_hi)[4],
                                                  const uint32_t (&p_lo)[4], const uint32_t (&v_words)[2][2][4],
                                                  const WorkItem& wi, const MlaParams& p, int cap, int s, int lane_row,
                                                  int lane_col) {
  const int last = wi.token(wi.n - 1, p.H), mine0 = wi.token(lane_row, p.H), mine1 = wi.token(lane_row + 8, p.H);
#pragma unroll 1
  for (int q = wi.token(0, p.H); q <= last; ++q) {  // warp-uniform
    const int lim = clamp_len(p.seq_lens[q], cap) - s;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t b[2] = {pair_rows(v_words[0][0], v_words[0][1], j),
                             pair_rows(v_words[1][0], v_words[1][1], j)};
      mma_rows_upto<T, 2>(acc[j], p_hi, p_lo, b, lim, lane_col, mine0 == q, mine1 == q);
    }
  }
}

// The row sums of the 4 lanes of a row; then the normalised partial of rows lane_row (+ 8) below n, this warp's 64
// latent dims, and (warp 0) the rows' natural LSE.
template <int DL>
__device__ __forceinline__ void mla_mma_write_partial(const MlaParams& p, int item, int nrows, int warp, int lane_row,
                                                      int lane_col, const float (&acc)[8][4], const float (&m)[2],
                                                      float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = lane_row + 8 * r;
    if (row >= nrows) continue;
    const int64_t prow = static_cast<int64_t>(item) * 16 + row;
    float* o = p.part_o + prow * DL + 64 * warp;
    float inv, lse;
    finish_row(m[r], l[r], inv, lse);
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // C columns 2 lane_col, + 1 of n-tile j: dims 8 (2 lane_col + e) + j
      o[16 * lane_col + j] = acc[j][2 * r] * inv;
      o[16 * lane_col + 8 + j] = acc[j][2 * r + 1] * inv;
    }
    if (warp == 0 && lane_col == 0) p.part_lse[prow] = lse;
  }
}

// The kernel: the query staged, then per 16-token step the rows copied ahead, the scores (partials summed across the
// warps), the softmax and P.V. A thread of warp `warp`, lane 4 lane_row + lane_col (mma.cuh's g and t), holds rows
// lane_row and lane_row + 8 of every fragment.
template <typename T, int DL, int DR, bool F8>
__device__ __forceinline__ void mla_mma_body(const MlaParams& p) {
  using S = MlaMmaShape<DL, DR>;
  constexpr int NW = S::kWarps, DK = S::DK;
  static_assert(DL % 256 == 0 && DR % 64 == 0, "latent a multiple of 256, rope of 64");
  const int item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int begin = wi.begin, end = wi.end;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, lane_row = lane / 4, lane_col = lane % 4;
  DCP_DYNAMIC_SMEM(float, smem);
  float* partials = smem;                                               // [warps][2][32][4] partial scores
  int64_t* offsets = reinterpret_cast<int64_t*>(partials + NW * 256);  // [3][16]: a row's element offset in kv, or -1
  T* rows = reinterpret_cast<T*>(offsets + 3 * 16);                    // [2][16][DK], swizzled (F8: [16][DK])
  unsigned char* raw = reinterpret_cast<unsigned char*>(rows + (F8 ? 16 : 0) * DK);  // F8: [2][16][DK] e4m3

  uint32_t q_frag[S::kKeyGroupsPerWarp][2][3][4];
  mla_mma_stage_query<T, DL, DR>(q_frag, p, wi, warp, lane_row, lane_col);
  const T* kv = static_cast<const T*>(p.kv);  // (F8: e4m3 bytes)
  // each row's own length: the query tokens of a sequence share the tile (multi-token decode)
  const int cap = p.max_blocks * p.block_size;
  const int len[2] = {row_len(wi, lane_row, p.H, p.seq_lens, cap), row_len(wi, lane_row + 8, p.H, p.seq_lens, cap)};
  float acc[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

  // Step k's rows are in stage k % 2 and their offsets in offsets[k % 3]. The offsets of step k + 2 are read from
  // the block table at the start of step k and stored at its end, so that read's latency overlaps the arithmetic.
  const int steps = end > begin ? (end - begin + 15) / 16 : 0;
  if (threadIdx.x < 16) {
    offsets[threadIdx.x] = mla_token_offset(p, wi, begin + threadIdx.x);
    offsets[16 + threadIdx.x] = mla_token_offset(p, wi, begin + 16 + threadIdx.x);
  }
  __syncthreads();
  if (steps > 0) mla_mma_copy_rows<T, DL, DR, F8>(rows, raw, offsets, 0, kv, 0);
  cp_async_commit();
  // Steps from ragged_from on (multi-token decode: the rows disagree on some of a step's tokens, always the last
  // steps of the item) mask V per query token in P.V (mla_mma_pv_ragged). Two loops over one step (step): the plain
  // steps, then the ragged ones; the hot loop holds the plain P.V only.
  const int rag = ragged_from(wi, 0, p.H, p.seq_lens, cap, end);
  const int plain_steps = rag == kNotRagged ? steps : min(steps, max(0, (rag - begin) / 16));
  // One step: the next step's copy issued, this step's rows in (F8: converted), scores, softmax, P.V (masked per
  // query token when `ragged`).
  auto step = [&](const int k, auto ragged) {
    const int stage = k & 1, offset_set = k % 3;
    const int64_t ahead = threadIdx.x < 16 ? mla_token_offset(p, wi, begin + 16 * (k + 2) + threadIdx.x) : -1;
    if (k + 1 < steps) mla_mma_copy_rows<T, DL, DR, F8>(rows, raw, offsets, (k + 1) % 3, kv, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // this step's rows are in
    if constexpr (F8) {
      mla_mma_convert_stage<T, DL, DR>(rows, raw, stage);
      __syncthreads();  // ... and converted
    }
    const T* tile = rows + (F8 ? 0 : stage) * 16 * DK;
    mla_mma_partial_scores<T, DL, DR>(partials, tile, q_frag, warp, lane, lane_row, lane_col);
    __syncthreads();  // every warp's partial scores are in
    float scores[2][4];  // an FP8 cache's scale read here, not held in a register across the steps
    mla_mma_summed_scores<NW>(scores, partials, lane, F8 ? *p.k_scale : 1.f);
    uint32_t p_hi[4], p_lo[4];
    mla_mma_softmax<T>(scores, offsets, offset_set, begin, k, len, lane_col, m, l, acc, p_hi, p_lo);
    uint32_t v_words[2][2][4];
    mla_mma_load_v<T, DK>(v_words, tile, warp, lane_row, lane_col);
    if constexpr (!decltype(ragged)::value)
      mla_mma_pv<T>(acc, p_hi, p_lo, v_words);
    else
      mla_mma_pv_ragged<T>(acc, p_hi, p_lo, v_words, wi, p, cap, begin + 16 * k, lane_row, lane_col);
    if (threadIdx.x < 16) offsets[(k + 2) % 3 * 16 + threadIdx.x] = ahead;  // last read in step k - 1
    __syncthreads();  // before the next step overwrites the partial scores and, one step on, this stage
  };
  int k = 0;
  for (; k < plain_steps; ++k) step(k, std::false_type());
  for (; k < steps; ++k) step(k, std::true_type());
  mla_mma_write_partial<DL>(p, item, wi.n, warp, lane_row, lane_col, acc, m, l);
}

template <typename T, int DL, int DR>
__global__ void __launch_bounds__(DL / 2) mla_mma_kernel(MlaParams p) {
  mla_mma_body<T, DL, DR, false>(p);
}

// On an fp8 cache the conversion's registers, beside the fragments, spilled under the 16-bit kernel's bound (latent
// 256: 168 registers, 8 bytes spilled, sm_80 and sm_90a); one block per SM lets it take what it needs.
template <typename T, int DL, int DR>
__global__ void __launch_bounds__(DL / 2, 1) mla_mma_kernel_fp8(MlaParams p) {
  mla_mma_body<T, DL, DR, true>(p);
}

template <typename T, int DL, int DR, bool F8>
cudaError_t mla_mma_launch(const MlaParams& p, cudaStream_t stream) {
  const dim3 grid(p.items);  // one block per work item
  auto kernel = F8 ? mla_mma_kernel_fp8<T, DL, DR> : mla_mma_kernel<T, DL, DR>;
  const int smem = mla_mma_smem_bytes<DL / 64, DL + DR, T>();
  DCP_LAUNCH(kernel, grid, dim3(DL / 2), smem, stream, p);
  return cudaGetLastError();
}

constexpr int kMlaMmaRows = 16;  // query rows per block of mla_mma_kernel (the m of its mma.sync products)

// Whether the tensor-core kernel can run (cuda/split_choice.h decides): 16-bit queries (on caches of their type or fp8
// ones), latent 256 or 512, a device with mma.sync.
inline bool mla_on_tensor_cores(int q_elem_size, int latent, bool tensor_cores) {
  return tensor_cores && q_elem_size == 2 && (latent == 256 || latent == 512);
}

template <typename T, bool F8>
cudaError_t mla_mma_dispatch(const MlaParams& p, int latent, int rope, cudaStream_t stream) {
  if (latent == 512)
    return rope == 64 ? mla_mma_launch<T, 512, 64, F8>(p, stream) : mla_mma_launch<T, 512, 0, F8>(p, stream);
  return rope == 64 ? mla_mma_launch<T, 256, 64, F8>(p, stream) : mla_mma_launch<T, 256, 0, F8>(p, stream);
}

// The split pass of mla_decode_partial on the fp32 scaled query, for a query of type T on a cache of T or (fp8)
// float8_e4m3fn: the tensor-core kernel (on_tensor_cores: cuda/split_choice.h chose it), else the SIMT kernel of
// mla_decode.cuh.
template <typename T>
cudaError_t mla_split_pass(const MlaParams& p, int latent, int rope, cudaStream_t stream, bool on_tensor_cores,
                           bool fp8) {
  if constexpr (sizeof(T) == 2) {
    if (on_tensor_cores)
      return fp8 ? mla_mma_dispatch<T, true>(p, latent, rope, stream)
                 : mla_mma_dispatch<T, false>(p, latent, rope, stream);
  }
  return fp8 ? mla_split<fp8_e4m3>(p, latent, rope, stream) : mla_split<T>(p, latent, rope, stream);
}

}  // namespace dcp_ops::kernels
