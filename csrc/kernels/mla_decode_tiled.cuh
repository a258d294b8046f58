// Paged MLA decode attention on tensor cores with the field's numerics (precision "native"; bf16 / fp16 caches,
// latent 256 or 512, rope 0 or 64, sm_80 and later): the absorbed query enters the products as one 16-bit term and
// P is rounded once to the cache's type before P.V; scores, softmax statistics, row sums and the accumulators are
// fp32. The split pass of mla_decode_partial, built like the fastest decode kernels:
//   - a block takes a work item's kMlaRows = 64 query rows, (query token, head) pairs of one sequence in token-major
//     order (split_plan.cuh; the q_row and orow lambdas are the only places that say so): 128 heads read each KV
//     tile twice, and 16 heads x 4 query tokens (multi-token decode) read it once; each row is masked at its own
//     length;
//   - BN-token KV tiles (BN = 64, one page of 64; 32 where shared memory is smaller) are copied by cp.async into two
//     shared stages: tile k + 1 is in flight while tile k is computed; V is the latent part of the same rows;
//   - scores: warp w takes the 16 rows of row group w % 4 and half the tile's tokens (w / 4), over the full
//     DL + DR dims (no split of K, no reduction through shared memory); A (the query) and B (the key rows) come by
//     ldmatrix from shared memory;
//   - the two warps of a row group exchange their row maxima through shared memory and so share m; P (rounded to T)
//     and the rescale factors go to shared memory;
//   - P.V: warp w owns output columns DL / 8 * w, ... for all 64 rows; A (P) by ldmatrix, B (V) by ldmatrix.trans.
// Shared tiles are swizzled by 16-byte chunks: chunk c of row r sits at c ^ (r & 7) (c ^ ((r >> 1) & 3) in a 4-chunk
// P row), so the 8 rows an ldmatrix reads, and the 8 rows a warp's P stores touch, are on distinct banks. Tokens past
// the split, past seq_len, or in blocks outside the cache are never read (zeros) and get P = 0; so do a row's tokens
// past its own length. A row's P = 0 does not keep a NaN or inf in a masked token's V out of P.V (0 x NaN is NaN),
// so where a row group's rows (several query tokens) disagree on a tile's tokens, V is masked per query token
// (mla_tiled_pv_ragged). Writes the normalised fp32 partial and natural LSE of each split, as mla_split_kernel does.
// An FP8 cache (F8; a 16-bit query, T its type): the tiles' e4m3 rows are copied by cp.async into two raw stages (half
// the bytes), and each tile, once in, is converted exactly to T into one 16-bit stage that the products read as
// above (one more barrier a tile); the cache's scale multiplies scale_log2 here and the output in the merge.
#pragma once

#include <algorithm>
#include <cstdlib>

#include "kernels/cp_async.cuh"
#include "kernels/mla_decode.cuh"
#include "kernels/mla_fp8_tile.cuh"
#include "kernels/mma.cuh"

namespace dcp_ops::kernels {

constexpr int kMlaRows = 64, kMlaTiledWarps = 8;

// Q, two KV stages (F8: one, and two raw e4m3 stages of half the bytes: the same size), P; then row maxima / sums
// [2][64], rescales [64], valid flags [2][BN]. The one formula of the kernel's shared memory: its launch and
// mla_tiled_tokens.
constexpr int mla_tiled_smem_bytes(int dk, int bn, int elem_bytes) {
  return (kMlaRows * dk + 2 * bn * dk + kMlaRows * bn) * elem_bytes + (5 * kMlaRows + 2 * bn) * 4;
}

// The swizzle of row r of a tile of CH 16-byte chunks a row: chunk c sits at c ^ swizzle_of<CH>(r). Rows of 8 or more
// chunks (128 bytes or more) XOR with r & 7; 4-chunk (64-byte) rows, two to a 128-byte bank line, with (r >> 1) & 3
// (FlashInfer's 64-byte mode). Either way the 8 consecutive rows an ldmatrix phase reads (or a warp's 32-bit stores
// touch) at one logical chunk fall on 8 distinct groups of 4 banks.
template <int CH>
__device__ __forceinline__ int swizzle_of(int r) {
  static_assert(CH >= 8 || CH == 4, "tile rows of 4 or of 8 and more 16-byte chunks");
  return CH >= 8 ? r & 7 : (r >> 1) & 3;
}

// Element offset of 16-byte chunk c of row r in a swizzled tile of CH chunks a row.
template <int CH>
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * CH * 8 + 8 * (c ^ swizzle_of<CH>(r));
}

// c = 0 for each of N fragments of 4 accumulators.
template <int N>
__device__ __forceinline__ void zero_fragments(float (&c)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) c[n][i] = 0.f;
}

// The tiles of a work item (`tiles` of BN tokens from wi.begin) before its first ragged one: the least ragged_from
// (split_kv.cuh) of its 4 row groups; all of them where no row group's rows disagree on a token of the split.
template <int BN>
__device__ __forceinline__ int mla_tiled_plain_tiles(const WorkItem& wi, const MlaParams& p, int cap, int tiles) {
  int ragged_start = kNotRagged;
#pragma unroll
  for (int rg = 0; rg < 4; ++rg)
    ragged_start = min(ragged_start, ragged_from(wi, 16 * rg, p.H, p.seq_lens, cap, wi.end));
  return ragged_start == kNotRagged ? tiles : min(tiles, max(0, (ragged_start - wi.begin) / BN));
}

// The kernel's shapes: a KV (and Q) row of DK elements as 16-byte chunks (16-bit: 8 elements; e4m3: 16); the 16-bit
// KV stages; a warp's score n-tiles (8 tokens each, half the tile) and P.V n-tiles (8 columns each, DL / 8 columns);
// the threads copying one KV row of a tile. (A P row is BN / 8 chunks.)
template <int DL, int DR, int BN, bool F8>
struct MlaTiledShape {
  static constexpr int DK = DL + DR, kChunks = DK / 8, kRawChunks = DK / 16;
  static constexpr int kStages16 = F8 ? 1 : 2;
  static constexpr int kScoreTiles = BN / 16, kOutTiles = DL / 64;
  static constexpr int kThreads = 32 * kMlaTiledWarps, kThreadsPerRow = kThreads / BN;
  static_assert(DL % 256 == 0 && DR % 64 == 0 && (BN == 32 || BN == 64), "latent 256 / 512, rope 0 / 64");
  static_assert(kChunks % 8 == 0 && kChunks % kThreadsPerRow == 0 && kScoreTiles % 2 == 0 && kOutTiles % 2 == 0,
                "tile shapes");
};

// cp.async of the block's query rows (p.q16) into the swizzled Q tile; rows past n are zeros.
template <typename T, int DK>
__device__ __forceinline__ void mla_tiled_stage_query(T* sQ, const MlaParams& p, const WorkItem& wi) {
  constexpr int kChunks = DK / 8;
  const T* q16 = static_cast<const T*>(p.q16);
  // a block's row r: its query row
  auto q_row = [&](int r) { return static_cast<int64_t>(wi.token(r, p.H)) * p.H + wi.head(r, p.H); };
  for (int i = threadIdx.x; i < kMlaRows * kChunks; i += 32 * kMlaTiledWarps) {
    const int r = i / kChunks, c = i % kChunks;
    cp_async16(sQ + swizzled<kChunks>(r, c), q16 + (r < wi.n ? q_row(r) * DK + 8 * c : 0), r < wi.n);
  }
}

// This thread's part of the copy of a tile row into stage `stage` (cp.async; zeros where off < 0, the token not
// read), and the row's valid flag: chunks copy_part, copy_part + kThreadsPerRow, ... of row copy_row, from the cache
// row at element offset off (F8: bytes). With 4 threads a row, the 8 lanes of a copy's phase write 4 chunks of two
// rows: the odd row takes its chunk pairs in the other order (step i ^ 1), so that the two rows fill the two halves
// of 128 bytes of banks (16-bit rows are 128-byte multiples, swizzled with r & 7, which the two rows share but in
// bit 0; raw e4m3 rows where they are 128-byte multiples) instead of one half twice.
template <typename T, int DL, int DR, int BN, bool F8>
__device__ __forceinline__ void mla_tiled_copy_row(T* sKV, unsigned char* sRaw, int* sValid, int stage, int64_t off,
                                                   const void* kv, int copy_row, int copy_part) {
  using S = MlaTiledShape<DL, DR, BN, F8>;
  constexpr int DK = S::DK, kPerRow = S::kThreadsPerRow;
  constexpr bool kPairSteps = kPerRow == 4;
  if constexpr (F8) {  // (off counts elements, which are bytes here)
    unsigned char* dst = sRaw + (stage * BN + copy_row) * DK;
    const unsigned char* src = static_cast<const unsigned char*>(kv);
    constexpr int kSteps = (S::kRawChunks + kPerRow - 1) / kPerRow;
    constexpr bool kSwap = kPairSteps && DK % 128 == 0 && kSteps % 2 == 0 && S::kRawChunks % kPerRow == 0;
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int c = copy_part + kPerRow * (kSwap ? i ^ (copy_row & 1) : i);
      if (S::kRawChunks % kPerRow == 0 || c < S::kRawChunks)
        cp_async16(dst + 16 * c, src + (off >= 0 ? off + 16 * c : 0), off >= 0);
    }
  } else {
    T* dst = sKV + stage * BN * DK;
    const T* src = static_cast<const T*>(kv);
    static_assert(!kPairSteps || S::kChunks / kPerRow % 2 == 0, "pairs of copy steps");
#pragma unroll
    for (int i = 0; i < S::kChunks / kPerRow; ++i) {
      const int c = copy_part + kPerRow * (kPairSteps ? i ^ (copy_row & 1) : i);
      cp_async16(dst + swizzled<S::kChunks>(copy_row, c), src + (off >= 0 ? off + 8 * c : 0), off >= 0);
    }
  }
  if (copy_part == 0) sValid[stage * BN + copy_row] = off >= 0;
}

// F8: raw stage `stage` (a tile in) converted to T into the 16-bit stage (convert_e4m3_rows), swizzled as
// mla_tiled_copy_row places a 16-bit cache's rows.
template <typename T, int DL, int DR, int BN>
__device__ __forceinline__ void mla_tiled_convert(T* sKV, const unsigned char* sRaw, int stage, int tid) {
  using S = MlaTiledShape<DL, DR, BN, true>;
  convert_e4m3_rows<T, BN, S::DK, S::kThreads>(sKV, sRaw, stage, tid,
                                               [](int r, int c) { return swizzled<S::kChunks>(r, c); });
}

// The ldmatrix row addresses of the score products (lane: row ld_row of matrix ld_matrix): Q's rows 16 row_group ..
// (A) and the stage's key rows BN / 2 token_half .. (B, stage 0). Chunk c of a row is at (c & ~7 | (c & 7) ^ ld_row)
// (swizzled), so 4 bases, chunks 2 v + (a bit of ld_matrix), cover c & 7 = 2 (ks % 4) + bit of every k-step ks.
template <int DK, int BN, typename T>
__device__ __forceinline__ void mla_tiled_score_bases(SmemAddr (&q_addr)[4], SmemAddr (&k_addr)[4], const T* sQ,
                                                      const T* sKV, int row_group, int token_half, int ld_matrix,
                                                      int ld_row) {
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const int cq = 2 * v + ld_matrix / 2, ck = 2 * v + ld_matrix % 2;
    q_addr[v] = smem_addr(sQ + swizzled<DK / 8>(16 * row_group + 8 * (ld_matrix % 2) + ld_row, cq));
    k_addr[v] = smem_addr(sKV + swizzled<DK / 8>(BN / 2 * token_half + 8 * (ld_matrix / 2) + ld_row, ck));
  }
}

// The scores of this warp's 16 rows over its half of the stage's tokens (k_addr: its key rows, stage_bytes on),
// DK / 16 k-steps. A by ldmatrix at q_addr[ks % 4], B at k_addr[ks % 4], each + the bytes of k-step ks's group of 8
// chunks (the 4 bases cover the swizzled chunk pairs of a group).
template <typename T, int DK, int NT>
__device__ __forceinline__ void mla_tiled_scores(float (&scores)[NT][4], const SmemAddr (&q_addr)[4],
                                                 const SmemAddr (&k_addr)[4], int stage_bytes) {
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    const int group_bytes = ks / 4 * 128;  // bytes of the 8-chunk group of k-step ks
    uint32_t a[4];
    ldmatrix_x4<false>(a, q_addr[ks % 4] + group_bytes);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4<false>(b, k_addr[ks % 4] + stage_bytes + np * 16 * DK * static_cast<int>(sizeof(T)) + group_bytes);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_16816<T>(scores[2 * np], a, b0);
      mma_16816<T>(scores[2 * np + 1], a, b1);
    }
  }
}

// The scores of this lane's rows masked (-inf: the token not read, valid[] 0, or at or past the row's length: tokens
// 8 n + (i & 1) from this lane's first, not below limit[r]) and scaled by scale_log2; the rows' maxima over the
// warp's token half into sMaxHalf[row] (rows first_row, first_row + 8; lane_col 0 of the quad stores).
template <int NT>
__device__ __forceinline__ void mla_tiled_mask_and_max(float (&scores)[NT][4], const int* valid, const int (&limit)[2],
                                                       float scale_log2, float* sMaxHalf, int first_row,
                                                       int lane_col) {
  float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      scores[n][i] = valid[8 * n + 2 * lane_col + (i & 1)] && 8 * n + (i & 1) < limit[i / 2] ? scores[n][i] * scale_log2
                                                                                             : -INFINITY;
      row_max[i / 2] = fmaxf(row_max[i / 2], scores[n][i]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
    row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
    if (lane_col == 0) sMaxHalf[first_row + 8 * r] = row_max[r];
  }
}

// The online softmax update of this lane's rows first_row, first_row + 8 with both halves' maxima in sMax: the new
// max m, the rescale alpha of the old (into sAlpha, from lane_col 0 of token half 0), the row sums l over this lane's
// tokens, and P rounded to T into sP (row chunk NT token_half + n, swizzled). The token half is derived here from the
// thread index tid: taken as an argument, the sAlpha condition was hoisted out of the tile loop and the fp8
// instantiations at latent 512, BN 64 spilled (4 to 36 bytes, sm_80 and sm_90a).
template <typename T, int BN, int NT>
__device__ __forceinline__ void mla_tiled_probabilities(const float (&scores)[NT][4], float (&m)[2], float (&l)[2],
                                                        T* sP, const float* sMax, float* sAlpha, int first_row,
                                                        int tid, int lane_col) {
  const int token_half = tid / 32 / 4;  // the warp's
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 8 * r;
    const float m_new = fmaxf(m[r], fmaxf(sMax[row], sMax[kMlaRows + row]));
    const float mu = m_new == -INFINITY ? 0.f : m_new;  // no token yet: every P is 0, nothing to rescale
    const float alpha = exp2f(m[r] - mu);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float p0 = exp2f(scores[n][2 * r] - mu), p1 = exp2f(scores[n][2 * r + 1] - mu);
      sum += p0 + p1;
      st_shared_u32(sP + swizzled<BN / 8>(row, NT * token_half + n) + 2 * lane_col,
                    pack2(from_f32<T>(p0), from_f32<T>(p1)));
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
    if (token_half == 0 && lane_col == 0) sAlpha[row] = alpha;
  }
}

// The output accumulators of the row groups below nrows rescaled by their rows' alpha (sAlpha).
template <int NV>
__device__ __forceinline__ void mla_tiled_rescale(float (&acc)[4][NV][4], const float* sAlpha, int nrows,
                                                  int lane_row) {
#pragma unroll
  for (int rg = 0; rg < 4; ++rg) {
    if (16 * rg >= nrows) continue;
    const float a0 = sAlpha[16 * rg + lane_row], a1 = sAlpha[16 * rg + lane_row + 8];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      acc[rg][n][0] *= a0;
      acc[rg][n][1] *= a0;
      acc[rg][n][2] *= a1;
      acc[rg][n][3] *= a1;
    }
  }
}

// P.V of a tile: acc[rg][n] (rows 16 rg + lane_row (+ 8), columns DL / 8 warp + 8 n + 2 lane_col (+ 1)) += P V. Per
// k-step of 16 tokens: the A fragments of the row groups below nrows, P by ldmatrix from p_addr (row group rg
// 16 rg BN elements on, chunk 2 ks + p_chunk, swizzled as ld_row's row); V's B fragments by ldmatrix.trans from
// v_addr (the stage's; chunk v_chunk + 2 np, swizzled with ld_row).
template <typename T, int DK, int BN, int NV>
__device__ __forceinline__ void mla_tiled_pv(float (&acc)[4][NV][4], SmemAddr p_addr, SmemAddr v_addr, int p_chunk,
                                             int v_chunk, int ld_row, int nrows) {
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    uint32_t a[4][4];
#pragma unroll
    for (int rg = 0; rg < 4; ++rg)
      if (16 * rg < nrows)
        ldmatrix_x4<false>(a[rg], p_addr + (rg * 16 * BN + 8 * ((2 * ks + p_chunk) ^ swizzle_of<BN / 8>(ld_row))) *
                                               static_cast<int>(sizeof(T)));
#pragma unroll
    for (int np = 0; np < NV / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, v_addr + (16 * ks * DK + 8 * ((v_chunk + 2 * np) ^ ld_row)) * static_cast<int>(sizeof(T)));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int rg = 0; rg < 4; ++rg) {
        if (16 * rg >= nrows) continue;
        mma_16816<T>(acc[rg][2 * np], a[rg], b0);
        mma_16816<T>(acc[rg][2 * np + 1], a[rg], b1);
      }
    }
  }
}

// P.V of a ragged tile (split_kv.cuh's ragged_from; its first token s): each row group takes each k-step once per
// query token of its rows, V masked at that token's length and the result kept in that token's rows only
// (mma_rows_upto). The operands are mla_tiled_pv's (v_addr: the stage's). It runs on the last tiles of a multi-token
// item only: the k-steps and query tokens are loops, not unrolled, and the kernel's code stays small.
template <typename T, int DL, int DK, int BN, int NV>
__device__ __forceinline__ void mla_tiled_pv_ragged(float (&acc)[4][NV][4], SmemAddr p_addr, SmemAddr v_addr,
                                                    int p_chunk, int v_chunk, int ld_row, const WorkItem& wi,
                                                    const MlaParams& p, int cap, int s, int lane_row, int lane_col) {
#pragma unroll 1
  for (int ks = 0; ks < BN / 16; ++ks) {
#pragma unroll
    for (int rg = 0; rg < 4; ++rg) {
      if (16 * rg >= wi.n) continue;
      uint32_t a[4];
      ldmatrix_x4<false>(a, p_addr + (rg * 16 * BN + 8 * ((2 * ks + p_chunk) ^ swizzle_of<BN / 8>(ld_row))) *
                                         static_cast<int>(sizeof(T)));
      const int last = wi.token(min(16 * rg + 15, wi.n - 1), p.H);
      const int mine0 = wi.token(16 * rg + lane_row, p.H), mine1 = wi.token(16 * rg + lane_row + 8, p.H);
#pragma unroll 1
      for (int q = wi.token(16 * rg, p.H); q <= last; ++q) {  // warp-uniform
        const int lim = clamp_len(p.seq_lens[q], cap) - (s + 16 * ks);
#pragma unroll
        for (int np = 0; np < NV / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4<true>(b, v_addr + (16 * ks * DK + 8 * ((v_chunk + 2 * np) ^ ld_row)) *
                                            static_cast<int>(sizeof(T)));
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_rows_upto<T, 1>(acc[rg][2 * np], a, a, b0, lim, lane_col, mine0 == q, mine1 == q);
          mma_rows_upto<T, 1>(acc[rg][2 * np + 1], a, a, b1, lim, lane_col, mine0 == q, mine1 == q);
        }
      }
    }
  }
}

// The sum l of each of this lane's rows (first_row, first_row + 8) over its quad, into sSum[token_half][row]; from
// token half 0 also the rows' m into sMax.
__device__ __forceinline__ void mla_tiled_share_row_stats(float (&l)[2], const float (&m)[2], float* sSum, float* sMax,
                                                          int first_row, int token_half, int lane_col) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = first_row + 8 * r;
    if (lane_col == 0) {
      sSum[token_half * kMlaRows + row] = l[r];
      if (token_half == 0) sMax[row] = m[r];
    }
  }
}

// The normalised partial of every row below nrows (row sums from both halves in sSum, m in sMax), this warp's
// columns DL / 8 warp + 8 n + 2 lane_col (+ 1); threads 0 .. nrows - 1 the rows' natural LSE.
template <int DL, int NV>
__device__ __forceinline__ void mla_tiled_write_partial(const MlaParams& p, int item, int nrows,
                                                        const float (&acc)[4][NV][4], const float* sMax,
                                                        const float* sSum, int warp, int lane_row, int lane_col) {
  // a block's row r: its partial's row
  auto orow = [&](int r) { return static_cast<int64_t>(item) * kMlaRows + r; };
#pragma unroll
  for (int rg = 0; rg < 4; ++rg)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * rg + lane_row + 8 * r;
      if (row >= nrows) continue;
      float inv, lse;
      finish_row(sMax[row], sSum[row] + sSum[kMlaRows + row], inv, lse);
      float* o = p.part_o + orow(row) * DL + DL / 8 * warp + 2 * lane_col;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        o[8 * n] = acc[rg][n][2 * r] * inv;
        o[8 * n + 1] = acc[rg][n][2 * r + 1] * inv;
      }
    }
  const int tid = threadIdx.x;
  if (tid < nrows) {
    float inv, lse;
    finish_row(sMax[tid], sSum[tid] + sSum[kMlaRows + tid], inv, lse);
    p.part_lse[orow(tid)] = lse;
  }
}

// The kernel: the query rows and the first tile staged, then per tile its copy ahead, the scores, the softmax (both
// token halves' maxima exchanged) and P.V; at the end both halves' row sums. A thread of warp `warp`, lane
// 4 lane_row + lane_col (mma.cuh's g and t), computes scores of rows 16 row_group + lane_row (+ 8) over token half
// token_half, and P.V of output columns DL / 8 warp + 8 n + 2 lane_col (+ 1) of all 64 rows.
template <typename T, int DL, int DR, int BN, bool F8>
__global__ void __launch_bounds__(32 * kMlaTiledWarps, 1) mla_tiled_kernel(MlaParams p) {
  using S = MlaTiledShape<DL, DR, BN, F8>;
  constexpr int DK = S::DK, NT = S::kScoreTiles, NV = S::kOutTiles;
  const int item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int begin = wi.begin, end = wi.end, nrows = wi.n;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, lane_row = lane / 4, lane_col = lane % 4;

  DCP_DYNAMIC_SMEM(float, smem);
  T* sQ = reinterpret_cast<T*>(smem);   // [64][DK]
  T* sKV = sQ + kMlaRows * DK;          // [kStages16][BN][DK]
  T* sP = sKV + S::kStages16 * BN * DK;  // [64][BN]
  unsigned char* sRaw = reinterpret_cast<unsigned char*>(sP + kMlaRows * BN);  // F8: [2][BN][DK] e4m3, unswizzled
  float* sMax = reinterpret_cast<float*>(sRaw + (F8 ? 2 * BN * DK : 0));  // [2][64]: the halves' row maxima; then m
  float* sSum = sMax + 2 * kMlaRows;    // [2][64]: the halves' row sums, at the end
  float* sAlpha = sSum + 2 * kMlaRows;  // [64]: this tile's rescale of each row
  int* sValid = reinterpret_cast<int*>(sAlpha + kMlaRows);  // [2][BN]: whether a stage's token was read

  const int tiles = end > begin ? (end - begin + BN - 1) / BN : 0;
  const float scale_log2 = p.k_scale != nullptr ? p.scale_log2 * *p.k_scale : p.scale_log2;
  auto token_offset = [&](int j) -> int64_t {  // token j's element offset in kv, or -1 when it is not read
    if (j >= end) return -1;
    const int64_t block = p.block_table[wi.b * p.bt_st + j / p.block_size];
    return block >= 0 && block < p.num_blocks ? block * p.kv_sb + static_cast<int64_t>(j % p.block_size) * p.kv_st
                                              : -1;
  };
  // this thread copies chunks copy_part + kThreadsPerRow i of tile row copy_row (mla_tiled_copy_row)
  const int copy_row = tid / S::kThreadsPerRow, copy_part = tid % S::kThreadsPerRow;
  mla_tiled_stage_query<T, DK>(sQ, p, wi);
  if (tiles > 0)
    mla_tiled_copy_row<T, DL, DR, BN, F8>(sKV, sRaw, sValid, 0, token_offset(begin + copy_row), p.kv, copy_row,
                                          copy_part);
  cp_async_commit();
  int64_t next_offset = token_offset(begin + BN + copy_row);  // this thread's row of the tile after the current one

  // ldmatrix row addresses: lane gives row ld_row of matrix ld_matrix; every row's swizzle is then ld_row
  const int ld_matrix = lane / 8, ld_row = lane % 8;
  const int row_group = warp % 4, token_half = warp / 4;  // scores: rows 16 row_group .., tokens BN / 2 token_half ..
  SmemAddr q_addr[4], k_addr[4];
  mla_tiled_score_bases<DK, BN>(q_addr, k_addr, sQ, sKV, row_group, token_half, ld_matrix, ld_row);
  // P.V: P rows of row group rg at p_addr + rg * 16 * BN elements; V rows at v_addr + the chunk pair's offset
  const int p_chunk = ld_matrix / 2, v_chunk = DL / 64 * warp + ld_matrix / 2;
  const SmemAddr p_addr = smem_addr(sP + (8 * (ld_matrix % 2) + ld_row) * BN);
  const SmemAddr v_addr = smem_addr(sKV + (8 * (ld_matrix % 2) + ld_row) * DK);

  float acc[4][NV][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int rg = 0; rg < 4; ++rg) zero_fragments(acc[rg]);
  const bool score_rows = 16 * row_group < nrows;  // warp-uniform: row groups past nrows skip their products
  // Each row's own length (the query tokens of a sequence share the tile in multi-token decode): this lane's rows
  // 16 row_group + lane_row (+ 8) take tokens whose offset from the lane's first score token of tile k (first_token
  // + k BN) is below row_limit[r] - k BN.
  const int cap = p.max_blocks * p.block_size, first_token = begin + BN / 2 * token_half + 2 * lane_col;
  const int row_limit[2] = {row_len(wi, 16 * row_group + lane_row, p.H, p.seq_lens, cap) - first_token,
                            row_len(wi, 16 * row_group + lane_row + 8, p.H, p.seq_lens, cap) - first_token};

  // Tiles from ragged_from on (multi-token decode: a row group's rows disagree on some of a tile's tokens, always the
  // last tiles of the item) mask V per query token in P.V (mla_tiled_pv_ragged). Two loops over one step
  // (tile_step): the plain tiles, then the ragged ones; the hot loop holds the plain P.V only.
  const int plain_tiles = mla_tiled_plain_tiles<BN>(wi, p, cap, tiles);
  // One tile: wait for it, issue the next, scores, softmax, P.V (masked per query token when `ragged`).
  auto tile_step = [&](const int k, auto ragged) {
    const int stage = k & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile k is in; every warp is done with tile k - 1 (its stage, P, rescales)
    if (k + 1 < tiles) {
      const int64_t after_next = token_offset(begin + (k + 2) * BN + copy_row);
      mla_tiled_copy_row<T, DL, DR, BN, F8>(sKV, sRaw, sValid, stage ^ 1, next_offset, p.kv, copy_row, copy_part);
      next_offset = after_next;
    }
    cp_async_commit();
    if constexpr (F8) {
      mla_tiled_convert<T, DL, DR, BN>(sKV, sRaw, stage, tid);
      __syncthreads();  // the converted tile is in
    }
    const int stage_bytes = F8 ? 0 : stage * BN * DK * static_cast<int>(sizeof(T));  // this 16-bit stage's offset

    // scores of rows 16 row_group + lane_row (+ 8), tokens BN / 2 token_half + 8 n + 2 lane_col (+ 1)
    float scores[NT][4];
    zero_fragments(scores);
    if (score_rows) mla_tiled_scores<T, DK, NT>(scores, q_addr, k_addr, stage_bytes);
    const int limit[2] = {row_limit[0] - k * BN, row_limit[1] - k * BN};
    mla_tiled_mask_and_max<NT>(scores, sValid + stage * BN + BN / 2 * token_half, limit, scale_log2,
                               sMax + token_half * kMlaRows, 16 * row_group + lane_row, lane_col);
    __syncthreads();  // both halves' maxima are in
    mla_tiled_probabilities<T, BN, NT>(scores, m, l, sP, sMax, sAlpha, 16 * row_group + lane_row, tid, lane_col);
    __syncthreads();  // P and the rescales are in
    mla_tiled_rescale<NV>(acc, sAlpha, nrows, lane_row);
    if constexpr (!decltype(ragged)::value)
      mla_tiled_pv<T, DK, BN, NV>(acc, p_addr, v_addr + stage_bytes, p_chunk, v_chunk, ld_row, nrows);
    else
      mla_tiled_pv_ragged<T, DL, DK, BN, NV>(acc, p_addr, v_addr + stage_bytes, p_chunk, v_chunk, ld_row, wi, p, cap,
                                             begin + k * BN, lane_row, lane_col);
  };
  int k = 0;
  for (; k < plain_tiles; ++k) tile_step(k, std::false_type());
  for (; k < tiles; ++k) tile_step(k, std::true_type());

  // the halves' row sums (same m in both); then each warp writes its columns of every row
  mla_tiled_share_row_stats(l, m, sSum, sMax, 16 * row_group + lane_row, token_half, lane_col);
  __syncthreads();
  mla_tiled_write_partial<DL, NV>(p, item, nrows, acc, sMax, sSum, warp, lane_row, lane_col);
}

// The token tile the tiled kernel takes with this much shared memory (64, else 32), or 0 when it does not run.
inline int mla_tiled_tokens(int latent, int rope, int elem_bytes, int smem_optin) {
  if (elem_bytes != 2 || (latent != 256 && latent != 512) || (rope != 0 && rope != 64)) return 0;
  for (const int bn : {64, 32})
    if (mla_tiled_smem_bytes(latent + rope, bn, 2) <= smem_optin) return bn;
  return 0;
}

template <typename T, int DL, int DR, int BN, bool F8>
cudaError_t mla_tiled_launch(const MlaParams& p, cudaStream_t stream) {
  const dim3 grid(p.items);  // one block per work item
  auto kernel = mla_tiled_kernel<T, DL, DR, BN, F8>;
  constexpr int smem = mla_tiled_smem_bytes(DL + DR, BN, sizeof(T));
#ifndef DCP_SIMT
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
#endif
  DCP_LAUNCH(kernel, grid, dim3(32 * kMlaTiledWarps), smem, stream, p);
  return cudaGetLastError();
}

template <typename T, int BN, bool F8>
cudaError_t mla_tiled_dispatch(const MlaParams& p, int latent, int rope, cudaStream_t stream) {
  if (latent == 512)
    return rope == 64 ? mla_tiled_launch<T, 512, 64, BN, F8>(p, stream)
                      : mla_tiled_launch<T, 512, 0, BN, F8>(p, stream);
  return rope == 64 ? mla_tiled_launch<T, 256, 64, BN, F8>(p, stream)
                    : mla_tiled_launch<T, 256, 0, BN, F8>(p, stream);
}

// The tiled split pass (precision "native", p.q16 set): BN = bn from mla_tiled_tokens. T: the query's 16-bit type,
// and the cache's, or the cache is float8_e4m3fn (F8).
template <typename T, bool F8 = false>
cudaError_t mla_tiled_pass(const MlaParams& p, int latent, int rope, int bn, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) return cudaErrorInvalidValue;  // 16-bit queries only (mla_tiled_tokens says 0)
  else
    return bn == 64 ? mla_tiled_dispatch<T, 64, F8>(p, latent, rope, stream)
                    : mla_tiled_dispatch<T, 32, F8>(p, latent, rope, stream);
}

}  // namespace dcp_ops::kernels
