// Paged MLA decode attention on tensor cores with the field's numerics (precision "native"; bf16 / fp16 caches,
// latent 256 or 512, rope 0 or 64, sm_80 and later): the absorbed query enters the products as one 16-bit term and
// P is rounded once to the cache's type before P.V; scores, softmax statistics, row sums and the accumulators are
// fp32. The split pass of mla_decode_partial, built like the fastest decode kernels:
//   - a block takes a work item's kMlaRows = 64 query rows, (query token, head) pairs of one sequence in token-major
//     order (split_plan.cuh; qrow() and orow() are the only places that say so): 128 heads read each KV tile twice,
//     and 16 heads x 4 query tokens (multi-token decode) read it once; each row is masked at its own length;
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

// P.V of a ragged tile (split_kv.cuh's ragged_from; its first token s): each row group takes each k-step once per
// query token of its rows, V masked at that token's length and the result kept in that token's rows only
// (mma_rows_upto). The operands are the plain path's: P's A fragments at pa (mla_tiled_kernel's pa0), V's B fragments
// by ldmatrix.trans at va (va0 and the stage's offset). It runs on the last tiles of a multi-token item only: the
// k-steps and query tokens are loops, not unrolled, and the kernel's code stays small.
template <typename T, int DL, int DK, int BN, int NV>
__device__ __forceinline__ void mla_tiled_pv_ragged(float (&acc)[4][NV][4], SmemAddr pa, SmemAddr va, int pch,
                                                    int vch, int sw, const WorkItem& wi, const MlaParams& p, int cap,
                                                    int s, int g, int t) {
  constexpr int PCH = BN / 8;
#pragma unroll 1
  for (int ks = 0; ks < BN / 16; ++ks) {
#pragma unroll
    for (int rg = 0; rg < 4; ++rg) {
      if (16 * rg >= wi.n) continue;
      uint32_t a[4];
      ldmatrix_x4<false>(a, pa + (rg * 16 * BN + 8 * ((2 * ks + pch) ^ swizzle_of<PCH>(sw))) *
                                     static_cast<int>(sizeof(T)));
      const int last = wi.token(min(16 * rg + 15, wi.n - 1), p.H);
      const int mine0 = wi.token(16 * rg + g, p.H), mine1 = wi.token(16 * rg + g + 8, p.H);
#pragma unroll 1
      for (int q = wi.token(16 * rg, p.H); q <= last; ++q) {  // warp-uniform
        const int lim = clamp_len(p.seq_lens[q], cap) - (s + 16 * ks);
#pragma unroll
        for (int np = 0; np < NV / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4<true>(b, va + (16 * ks * DK + 8 * ((vch + 2 * np) ^ sw)) * static_cast<int>(sizeof(T)));
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_rows_upto<T, 1>(acc[rg][2 * np], a, a, b0, lim, t, mine0 == q, mine1 == q);
          mma_rows_upto<T, 1>(acc[rg][2 * np + 1], a, a, b1, lim, t, mine0 == q, mine1 == q);
        }
      }
    }
  }
}

template <typename T, int DL, int DR, int BN, bool F8>
__global__ void __launch_bounds__(32 * kMlaTiledWarps, 1) mla_tiled_kernel(MlaParams p) {
  constexpr int DK = DL + DR, CH = DK / 8, PCH = BN / 8;  // chunks of a KV (and Q) row, of a P row
  constexpr int KST = F8 ? 1 : 2, CH8 = DK / 16;          // 16-bit KV stages; 16-byte chunks of an e4m3 row
  constexpr int NT = BN / 16;                             // score n-tiles of 8 tokens per warp (half the tile)
  constexpr int NV = DL / 64;                             // P.V n-tiles of 8 columns per warp (DL / 8 columns)
  constexpr int TPR = 32 * kMlaTiledWarps / BN;           // copying threads per KV row
  static_assert(DL % 256 == 0 && DR % 64 == 0 && (BN == 32 || BN == 64), "latent 256 / 512, rope 0 / 64");
  static_assert(CH % 8 == 0 && CH % TPR == 0 && NT % 2 == 0 && NV % 2 == 0, "tile shapes");
  const int item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int seq = wi.b, j0 = wi.begin, j1 = wi.end, nrows = wi.n;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  // a block's row r: its query row and its partial's row
  auto qrow = [&](int r) { return static_cast<int64_t>(wi.token(r, p.H)) * p.H + wi.head(r, p.H); };
  auto orow = [&](int r) { return static_cast<int64_t>(item) * kMlaRows + r; };

  DCP_DYNAMIC_SMEM(float, smem);
  T* sQ = reinterpret_cast<T*>(smem);   // [64][DK]
  T* sKV = sQ + kMlaRows * DK;          // [KST][BN][DK]
  T* sP = sKV + KST * BN * DK;          // [64][BN]
  unsigned char* sRaw = reinterpret_cast<unsigned char*>(sP + kMlaRows * BN);  // F8: [2][BN][DK] e4m3, unswizzled
  float* sMax = reinterpret_cast<float*>(sRaw + (F8 ? 2 * BN * DK : 0));  // [2][64]: the halves' row maxima; then m
  float* sSum = sMax + 2 * kMlaRows;    // [2][64]: the halves' row sums, at the end
  float* sAlpha = sSum + 2 * kMlaRows;  // [64]: this tile's rescale of each row
  int* sValid = reinterpret_cast<int*>(sAlpha + kMlaRows);  // [2][BN]: whether a stage's token was read

  const int tiles = j1 > j0 ? (j1 - j0 + BN - 1) / BN : 0;
  const T* kv = static_cast<const T*>(p.kv);  // (a 16-bit cache's)
  const float scale_log2 = p.k_scale != nullptr ? p.scale_log2 * *p.k_scale : p.scale_log2;
  const T* q16 = static_cast<const T*>(p.q16);
  auto row_of = [&](int j) -> int64_t {  // token j's element offset in kv, or -1 when it is not read
    if (j >= j1) return -1;
    const int64_t block = p.block_table[seq * p.bt_st + j / p.block_size];
    return block >= 0 && block < p.num_blocks ? block * p.kv_sb + static_cast<int64_t>(j % p.block_size) * p.kv_st
                                              : -1;
  };
  // Thread tid copies chunks csub, csub + TPR, ... of tile row crow. With 4 threads a row, the 8 lanes of a copy's
  // phase write 4 chunks of two rows: the odd row takes its chunk pairs in the other order (step i ^ 1), so that the
  // two rows fill the two halves of 128 bytes of banks (16-bit rows are 128-byte multiples, swizzled with r & 7,
  // which the two rows share but in bit 0; raw e4m3 rows where they are 128-byte multiples) instead of one half twice.
  const int crow = tid / TPR, csub = tid % TPR;
  constexpr bool kPairSteps = TPR == 4;
  auto issue = [&](int stage, int64_t off) {
    if constexpr (F8) {  // (off counts elements, which are bytes here)
      unsigned char* dst = sRaw + (stage * BN + crow) * DK;
      const unsigned char* src = static_cast<const unsigned char*>(p.kv);
      constexpr int kSteps = (CH8 + TPR - 1) / TPR;
      constexpr bool kSwap = kPairSteps && DK % 128 == 0 && kSteps % 2 == 0 && CH8 % TPR == 0;
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        const int c = csub + TPR * (kSwap ? i ^ (crow & 1) : i);
        if (CH8 % TPR == 0 || c < CH8) cp_async16(dst + 16 * c, src + (off >= 0 ? off + 16 * c : 0), off >= 0);
      }
    } else {
      T* dst = sKV + stage * BN * DK;
      static_assert(!kPairSteps || CH / TPR % 2 == 0, "pairs of copy steps");
#pragma unroll
      for (int i = 0; i < CH / TPR; ++i) {
        const int c = csub + TPR * (kPairSteps ? i ^ (crow & 1) : i);
        cp_async16(dst + swizzled<CH>(crow, c), kv + (off >= 0 ? off + 8 * c : 0), off >= 0);
      }
    }
    if (csub == 0) sValid[stage * BN + crow] = off >= 0;
  };
  // F8: raw stage `stage` (a tile in) converted to T into the 16-bit stage, each 16-byte e4m3 chunk c of a row
  // becoming its 16-bit chunks 2c and 2c + 1 (swizzled as issue() places them for a 16-bit cache)
  auto convert = [&](int stage) {
    const unsigned char* raw = sRaw + stage * BN * DK;
    constexpr int kThreads = 32 * kMlaTiledWarps;
#pragma unroll
    for (int u = 0; u < (BN * CH8 + kThreads - 1) / kThreads; ++u) {
      const int i = tid + kThreads * u, r = i / CH8, c = i % CH8;
      if (BN * CH8 % kThreads != 0 && i >= BN * CH8) break;
      const Pack<unsigned short, 8> x = *reinterpret_cast<const Pack<unsigned short, 8>*>(raw + r * DK + 16 * c);
      Pairs4 lo, hi;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        lo.v[e] = e4m3x2_to<T>(x.v[e]);
        hi.v[e] = e4m3x2_to<T>(x.v[4 + e]);
      }
      *reinterpret_cast<Pairs4*>(sKV + swizzled<CH>(r, 2 * c)) = lo;
      *reinterpret_cast<Pairs4*>(sKV + swizzled<CH>(r, 2 * c + 1)) = hi;
    }
  };

  for (int i = tid; i < kMlaRows * CH; i += 32 * kMlaTiledWarps) {  // the query rows; rows past nrows are zeros
    const int r = i / CH, c = i % CH;
    cp_async16(sQ + swizzled<CH>(r, c), q16 + (r < nrows ? qrow(r) * DK + 8 * c : 0), r < nrows);
  }
  if (tiles > 0) issue(0, row_of(j0 + crow));
  cp_async_commit();
  int64_t next = row_of(j0 + BN + crow);  // the offset of this thread's row of the tile after the current one

  // ldmatrix row addresses: lane gives row lane % 8 of matrix lane / 8; every row's swizzle is then lane % 8
  const int mi = lane / 8, sw = lane % 8;
  const int sg = warp % 4, half = warp / 4;  // score phase: row group, token half
  // chunk c of this lane's row is at byte (c & ~7 | (c & 7) ^ sw) * 16: 4 bases cover c & 7 = 2 (ks % 4) + bit
  SmemAddr qa[4], ka[4];
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const int cq = 2 * v + mi / 2, ck = 2 * v + mi % 2;
    qa[v] = smem_addr(sQ + (16 * sg + 8 * (mi % 2) + sw) * DK + 8 * (cq ^ sw));
    ka[v] = smem_addr(sKV + (BN / 2 * half + 8 * (mi / 2) + sw) * DK + 8 * (ck ^ sw));
  }
  // P.V: P rows of row group rg at pa + rg * 16 * BN elements; V rows at va + the chunk pair's offset
  const int pch = mi / 2, vch = DL / 64 * warp + mi / 2;
  const SmemAddr pa0 = smem_addr(sP + (8 * (mi % 2) + sw) * BN);
  const SmemAddr va0 = smem_addr(sKV + (8 * (mi % 2) + sw) * DK);

  float acc[4][NV][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int rg = 0; rg < 4; ++rg)
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rg][n][i] = 0.f;
  const bool score_rows = 16 * sg < nrows;  // warp-uniform: row groups past nrows skip their products
  // Each row's own length (the query tokens of a sequence share the tile in multi-token decode): this lane's rows
  // 16 sg + g (+ 8) take tokens whose offset from the lane's first score token of tile k is below lim[r] - k BN.
  const int cap = p.max_blocks * p.block_size, tok0 = j0 + BN / 2 * half + 2 * t;
  const int lim[2] = {row_len(wi, 16 * sg + g, p.H, p.seq_lens, cap) - tok0,
                      row_len(wi, 16 * sg + g + 8, p.H, p.seq_lens, cap) - tok0};

  // Tiles from ragged_from on (multi-token decode: a row group's rows disagree on some of a tile's tokens, always the
  // last tiles of the item) mask V per query token in P.V (mla_tiled_pv_ragged). The loop runs in two phases, unrolled
  // (two loops over one step, tile_step): the plain tiles, then the ragged ones; the hot loop holds the plain P.V only.
  int rag = kNotRagged;
#pragma unroll
  for (int rg = 0; rg < 4; ++rg) rag = min(rag, ragged_from(wi, 16 * rg, p.H, p.seq_lens, cap, j1));
  const int plain_tiles = rag == kNotRagged ? tiles : min(tiles, max(0, (rag - j0) / BN));
  // One tile: wait for it, issue the next, scores, softmax, P.V (masked per query token when `ragged`).
  auto tile_step = [&](const int k, auto ragged) {
    const int stage = k & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile k is in; every warp is done with tile k - 1 (its stage, P, rescales)
    if (k + 1 < tiles) {
      const int64_t after = row_of(j0 + (k + 2) * BN + crow);
      issue(stage ^ 1, next);
      next = after;
    }
    cp_async_commit();
    if constexpr (F8) {
      convert(stage);
      __syncthreads();  // the converted tile is in
    }
    const int kvo = F8 ? 0 : stage * BN * DK * static_cast<int>(sizeof(T));  // this 16-bit stage's byte offset

    // scores of rows 16 sg + g (+ 8), tokens BN / 2 half + 8 n + 2 t (+ 1)
    float sc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = 0.f;
    if (score_rows) {
#pragma unroll
      for (int ks = 0; ks < DK / 16; ++ks) {
        const int cb = ks / 4 * 128;  // bytes of the 8-chunk group of k-step ks
        uint32_t a[4];
        ldmatrix_x4<false>(a, qa[ks % 4] + cb);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4<false>(b, ka[ks % 4] + kvo + np * 16 * DK * static_cast<int>(sizeof(T)) + cb);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816<T>(sc[2 * np], a, b0);
          mma_16816<T>(sc[2 * np + 1], a, b1);
        }
      }
    }
    const int* valid = sValid + stage * BN + BN / 2 * half;
    const int lk[2] = {lim[0] - k * BN, lim[1] - k * BN};
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sc[n][i] = valid[8 * n + 2 * t + (i & 1)] && 8 * n + (i & 1) < lk[i / 2] ? sc[n][i] * scale_log2 : -INFINITY;
        mx[i / 2] = fmaxf(mx[i / 2], sc[n][i]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      if (t == 0) sMax[half * kMlaRows + 16 * sg + g + 8 * r] = mx[r];
    }
    __syncthreads();  // both halves' maxima are in
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * sg + g + 8 * r;
      const float m_new = fmaxf(m[r], fmaxf(sMax[row], sMax[kMlaRows + row]));
      const float mu = m_new == -INFINITY ? 0.f : m_new;  // no token yet: every P is 0, nothing to rescale
      const float alpha = exp2f(m[r] - mu);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float p0 = exp2f(sc[n][2 * r] - mu), p1 = exp2f(sc[n][2 * r + 1] - mu);
        sum += p0 + p1;
        st_shared_u32(sP + swizzled<PCH>(row, NT * half + n) + 2 * t, pack2(from_f32<T>(p0), from_f32<T>(p1)));
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      if (half == 0 && t == 0) sAlpha[row] = alpha;
    }
    __syncthreads();  // P and the rescales are in

    // P.V: acc[rg][n] is rows 16 rg + g (+ 8), columns DL / 8 warp + 8 n + 2 t (+ 1)
#pragma unroll
    for (int rg = 0; rg < 4; ++rg) {
      if (16 * rg >= nrows) continue;
      const float a0 = sAlpha[16 * rg + g], a1 = sAlpha[16 * rg + g + 8];
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        acc[rg][n][0] *= a0;
        acc[rg][n][1] *= a0;
        acc[rg][n][2] *= a1;
        acc[rg][n][3] *= a1;
      }
    }
    if constexpr (!decltype(ragged)::value) {
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t a[4][4];
#pragma unroll
        for (int rg = 0; rg < 4; ++rg)
          if (16 * rg < nrows)
            ldmatrix_x4<false>(a[rg], pa0 + (rg * 16 * BN + 8 * ((2 * ks + pch) ^ swizzle_of<PCH>(sw))) *
                                                static_cast<int>(sizeof(T)));
#pragma unroll
        for (int np = 0; np < NV / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4<true>(b, va0 + kvo + (16 * ks * DK + 8 * ((vch + 2 * np) ^ sw)) * static_cast<int>(sizeof(T)));
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
          for (int rg = 0; rg < 4; ++rg) {
            if (16 * rg >= nrows) continue;
            mma_16816<T>(acc[rg][2 * np], a[rg], b0);
            mma_16816<T>(acc[rg][2 * np + 1], a[rg], b1);
          }
        }
      }
    } else {
      mla_tiled_pv_ragged<T, DL, DK, BN, NV>(acc, pa0, va0 + kvo, pch, vch, sw, wi, p, cap, j0 + k * BN, g, t);
    }
  };
  int k = 0;
  for (; k < plain_tiles; ++k) tile_step(k, std::false_type());
  for (; k < tiles; ++k) tile_step(k, std::true_type());

  // the halves' row sums (same m in both); then each warp writes its columns of every row
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = 16 * sg + g + 8 * r;
    if (t == 0) {
      sSum[half * kMlaRows + row] = l[r];
      if (half == 0) sMax[row] = m[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int rg = 0; rg < 4; ++rg)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * rg + g + 8 * r;
      if (row >= nrows) continue;
      float inv, lse;
      finish_row(sMax[row], sSum[row] + sSum[kMlaRows + row], inv, lse);
      float* o = p.part_o + orow(row) * DL + DL / 8 * warp + 2 * t;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        o[8 * n] = acc[rg][n][2 * r] * inv;
        o[8 * n + 1] = acc[rg][n][2 * r + 1] * inv;
      }
    }
  if (tid < nrows) {
    float inv, lse;
    finish_row(sMax[tid], sSum[tid] + sSum[kMlaRows + tid], inv, lse);
    p.part_lse[orow(tid)] = lse;
  }
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
