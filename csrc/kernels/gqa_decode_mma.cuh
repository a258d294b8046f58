// Paged GQA decode attention on tensor cores (bf16 / fp16 caches, head dims 64 and 128, sm_80 and later): the split
// pass of gqa_decode.cuh with the scores and P.V of each 16-token step as mma.sync m16n8k16 products. The rows are the
// work item's (query token, head) pairs of one KV head (GT = p.R = 8 of the 16 rows, or 16), so the query tokens of a
// sequence share each K/V read; the softmax is updated once per step, not once per token. Same parameters, outputs and
// merge as the SIMT kernel.
//
// Registers, for lane = 4 * g + t of a warp, in a step of tokens s .. s + 15 (a chunk: 8 consecutive head dims):
//   scores (Q K^T, k = head dims): a lane loads chunks key_chunk(t, i), i < D / 32, of token s + 8 n + g's key (n = 0,
//     1): t + 4i, or on an FP8 cache 2t + 8 (i / 2) + i % 2, which makes chunks i, i + 1 (i even) one 16-byte load.
//     Chunk i's words 0-1 / 2-3 (as T pairs) are the B fragment of k-tiles 2i / 2i + 1. The k order inside a tile is
//     thus a permutation of the head dims; the query fragments are loaded in the same order, so the dot products are
//     exact (the two orders group the dims into k-tiles differently, so their fp32 sums may differ in rounding).
//   P.V (k = tokens): the score fragments are already P's A fragment (rows = heads, k = tokens 2t, 2t+1, 2t+8, 2t+9),
//     and those are the tokens whose values the lane loads: chunks value_chunk(g, h), h < D / 64, of each: g + 8h, or
//     on an FP8 cache with D = 128 2g + h (one 16-byte load). Column g of n-tile (h, j) is head dim
//     8 value_chunk(g, h) + j; byte permutes pair two tokens' elements per register. On an FP8 cache with D = 64
//     (chunk g: 8 bytes) lane g loads 16 bytes, chunks g & ~1 and g | 1, of token 8u + 2t + (g & 1) only, and lanes
//     g, g ^ 1 swap halves by shuffles (gqa_load_values_paired).
//   precision "fp32" (PT = 2) splits P into hi + lo 16-bit parts (two products), so P.V is as accurate as with fp32
//   probabilities; "native" (PT = 1) rounds P to T once, as every kernel of the field does.
// Tokens past the split, past seq_len, or in blocks outside the cache are never read (zeros) and get P = 0; so do a
// row's tokens past its own length, and where the rows (several query tokens) disagree on a step's tokens, V is
// masked per query token (gqa_pv_ragged), since P = 0 does not keep a NaN or inf in V out (0 x NaN is NaN).
// An FP8 cache (F8; T the query's 16-bit type): chunks are 8 e4m3 bytes, all read by 16-byte loads and kept as
// loaded; a product converts its chunks exactly to T in registers (chunk_pairs: the same fragments). Its K scale
// multiplies scale_log2 here, its V scale the output in the merge.
#pragma once

#include "kernels/gqa_decode.cuh"
#include "kernels/mma.cuh"

namespace dcp_ops::kernels {

constexpr int kGqaMmaWarps = 4;

// The cache row of token j of sequence `seq` (block id, or -1 when j is not read), from the step's first block.
struct StepBlocks {
  int first_block, first_off;
  __device__ __forceinline__ int64_t block_of(const GqaParams& p, int seq, int j, int j1, int d, int64_t& off) const {
    int b = first_block, o = first_off + d;
    while (o >= p.block_size) {  // at most once for block sizes of 16 and more
      o -= p.block_size;
      ++b;
    }
    off = o;
    if (j >= j1) return -1;
    const int64_t block = p.block_table[seq * p.bt_st + b];
    return block >= 0 && block < p.num_blocks ? block : -1;
  }
};

// 32-bit words of one 8-element chunk in registers as loaded: 4 (16-bit cache), 2 (FP8, unconverted).
template <bool F8>
constexpr int kChunkWords = F8 ? 2 : 4;

// The key chunk (8 head dims) whose words 0-1 / 2-3 (as T pairs) are lane t's B fragment of k-tiles 2i / 2i + 1:
// t + 4i, or on an FP8 cache 2t + 8 (i / 2) + i % 2, which puts chunks i, i + 1 (i even) in 16 adjacent bytes.
template <bool F8>
__device__ __forceinline__ int key_chunk(int t, int i) {
  return F8 ? 2 * t + 8 * (i / 2) + i % 2 : t + 4 * i;
}

// The value chunk (8 head dims) of n-tiles (h, 0..7) at column g: g + 8h, or on an FP8 cache with D = 128 2g + h,
// which puts a lane's two chunks in 16 adjacent bytes.
template <int VH, bool F8>
__device__ __forceinline__ int value_chunk(int g, int h) {
  return F8 && VH == 2 ? 2 * g + h : g + 8 * h;
}

// 16 bytes at element offset `at` of `base` (elements of type C) into w[k .. k + 3] where `read`, else zeros (nothing
// is read; zero e4m3 bytes convert to zeros).
template <typename C, int N>
__device__ __forceinline__ void load16_or_zeros(uint32_t (&w)[N], int k, bool read, const void* base, int64_t at) {
  if (read) {
    const Pairs4 x = *reinterpret_cast<const Pairs4*>(static_cast<const C*>(base) + at);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[k + i] = x.v[i];
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[k + i] = 0u;
  }
}

// Chunk c of a lane's cache words w (kChunkWords each) as 4 registers of T pairs: the words of a 16-bit cache, or
// (F8) its 8 e4m3 bytes converted exactly (e4m3x2_to, the low byte first).
template <typename T, bool F8, int N>
__device__ __forceinline__ void chunk_pairs(const uint32_t (&w)[N], int c, uint32_t (&out)[4]) {
  if constexpr (F8) {
    unsigned short x[4];
#ifdef DCP_SIMT
    for (int i = 0; i < 4; ++i) x[i] = static_cast<unsigned short>(w[2 * c + i / 2] >> (16 * (i % 2)));
#else
    asm("mov.b32 {%0, %1}, %2;" : "=h"(x[0]), "=h"(x[1]) : "r"(w[2 * c]));  // the halves, no shift
    asm("mov.b32 {%0, %1}, %2;" : "=h"(x[2]), "=h"(x[3]) : "r"(w[2 * c + 1]));
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = e4m3x2_to<T>(x[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = w[4 * c + i];
  }
}

// Query fragments of rows g, g + 8 (the item's rows: query token, head; 0 past wi.n, and rows 8-15 with GT = 8):
// qa[2i + h] is k-tile 2i + h's A fragment, whose k 2t, 2t+1 | 2t+8, 2t+9 are head dims 8c + 4h + 0, 1 | + 2, 3 of
// key chunk c = key_chunk(t, i): the k order of gqa_scores' B fragments.
template <typename T, int KC, bool ROWS16, bool F8>
__device__ __forceinline__ void gqa_load_query(uint32_t (&qa)[2 * KC][4], const GqaParams& p, const WorkItem& wi, int G,
                                               int g, int t) {
  const T* q = static_cast<const T*>(p.q);
  const T* qrow[2] = {q + wi.token(g, G) * p.q_st + wi.head(g, G) * p.q_sh,
                      q + wi.token(g + 8, G) * p.q_st + wi.head(g + 8, G) * p.q_sh};
  auto word = [&](int row, int dim) {
    const T* qr = qrow[row >= 8];
    return row < wi.n ? pack2(qr[dim], qr[dim + 1]) : 0u;
  };
#pragma unroll
  for (int i = 0; i < KC; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int d = 8 * key_chunk<F8>(t, i) + 4 * h;
      qa[2 * i + h][0] = word(g, d);
      qa[2 * i + h][1] = ROWS16 ? word(g + 8, d) : 0u;
      qa[2 * i + h][2] = word(g, d + 2);
      qa[2 * i + h][3] = ROWS16 ? word(g + 8, d + 2) : 0u;
    }
}

// Keys of the step from token s: kw[n] = chunks key_chunk(t, 0 .. KC - 1) of token s + 8 n + g (cache words, zeros
// where that token is not read), in 16-byte loads: one a chunk, or (F8) one for chunks i, i + 1.
template <typename T, int KC, bool F8>
__device__ __forceinline__ void gqa_load_keys(uint32_t (&kw)[2][KC * kChunkWords<F8>], const GqaParams& p,
                                              const StepBlocks& sb, int seq, int s, int j1, int64_t kh, int g, int t) {
  using C = std::conditional_t<F8, unsigned char, T>;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    int64_t off;
    const int64_t block = sb.block_of(p, seq, s + 8 * n + g, j1, 8 * n + g, off);
#pragma unroll
    for (int i = 0; i < KC; i += F8 ? 2 : 1) {
      const int64_t at = kh + block * p.k_sb + off * p.k_st + 8 * key_chunk<F8>(t, i);
      load16_or_zeros<C>(kw[n], kChunkWords<F8> * i, block >= 0, p.k, at);
    }
  }
}

// Values of the step from token s: vw[u][e] = chunks value_chunk(g, 0 .. VH - 1) of token s + 8 u + 2 t + e (cache
// words, zeros where that token is not read: valid[u][e] false), in 16-byte loads: one a chunk, or (F8, D = 128) one
// for both.
template <typename T, int VH, bool F8>
__device__ __forceinline__ void gqa_load_values(uint32_t (&vw)[2][2][VH * kChunkWords<F8>], bool (&valid)[2][2],
                                                const GqaParams& p, const StepBlocks& sb, int seq, int s, int j1,
                                                int64_t vh, int g, int t) {
  static_assert(!F8 || VH == 2, "FP8 with D = 64 takes gqa_load_values_paired");
  using C = std::conditional_t<F8, unsigned char, T>;
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      int64_t off;
      const int d = 8 * u + 2 * t + e;
      const int64_t block = sb.block_of(p, seq, s + d, j1, d, off);
      valid[u][e] = block >= 0;
#pragma unroll
      for (int h = 0; h < VH; h += F8 ? 2 : 1) {
        const int64_t at = vh + block * p.v_sb + off * p.v_st + 8 * value_chunk<VH, F8>(g, h);
        load16_or_zeros<C>(vw[u][e], kChunkWords<F8> * h, block >= 0, p.v, at);
      }
    }
}

// gqa_load_values for D = 64 on an FP8 cache (the same vw, 2 words a token, and valid), where a lane's chunk of a
// token is half a 16-byte load: lanes g and g ^ 1 (lane ^ 4) each load chunks g & ~1, g | 1 of one token, s + 8 u + 2 t
// + (g & 1), and swap halves by two shuffles per u; one more shuffle brings the other token's valid. Every lane
// shuffles (the step is warp-uniform).
template <typename T>
__device__ __forceinline__ void gqa_load_values_paired(uint32_t (&vw)[2][2][2], bool (&valid)[2][2], const GqaParams& p,
                                                       const StepBlocks& sb, int seq, int s, int j1, int64_t vh, int g,
                                                       int t) {
  const bool odd = g & 1;  // this lane loads token e = odd, whose chunk g is w[2 odd], w[2 odd + 1]
  unsigned mine = 0u;      // bit u: this lane's token of u is read
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    int64_t off;
    const int d = 8 * u + 2 * t + odd;
    const int64_t block = sb.block_of(p, seq, s + d, j1, d, off);
    mine |= (block >= 0 ? 1u : 0u) << u;
    uint32_t w[4];
    load16_or_zeros<unsigned char>(w, 0, block >= 0, p.v, vh + block * p.v_sb + off * p.v_st + 8 * (g & ~1));
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // out: the partner's chunk of this token; in: this lane's chunk of the other token
      const uint32_t in = __shfl_xor_sync(0xffffffffu, odd ? w[k] : w[k + 2], 4);
      vw[u][0][k] = odd ? in : w[k];
      vw[u][1][k] = odd ? w[k + 2] : in;
    }
  }
  const unsigned theirs = __shfl_xor_sync(0xffffffffu, mine, 4);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const bool m = mine >> u & 1u, o = theirs >> u & 1u;
    valid[u][0] = odd ? o : m;
    valid[u][1] = odd ? m : o;
  }
}

// Scores Q K^T of the step: sc[u] = rows (g, g + 8) x tokens (8u + 2t, + 1), the C fragment of n-tile u; chunk i of
// token 8u + g's key (as T pairs) is the B fragment of k-tiles 2i (words 0-1), 2i + 1 (words 2-3).
template <typename T, int KC, bool F8>
__device__ __forceinline__ void gqa_scores(float (&sc)[2][4], const uint32_t (&qa)[2 * KC][4],
                                           const uint32_t (&kw)[2][KC * kChunkWords<F8>]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[u][i] = 0.f;
#pragma unroll
    for (int i = 0; i < KC; ++i) {
      uint32_t k[4];
      chunk_pairs<T, F8>(kw[u], i, k);
      const uint32_t b0[2] = {k[0], k[1]}, b1[2] = {k[2], k[3]};
      mma_16816<T>(sc[u], qa[2 * i], b0);
      mma_16816<T>(sc[u], qa[2 * i + 1], b1);
    }
  }
}

// The online softmax, once per step from token s: row g + 8 r's scores are sc[u][2r + e] (token s + 8u + 2t + e),
// masked (-inf) where the token is not read or is past the row's length len[r]; softmax_step rescales acc and writes
// P's A fragment (ph, and with PT = 2 pl). With GT = 8, rows 8-15 of P are 0.
template <typename T, int PT, bool ROWS16, int NACC>
__device__ __forceinline__ void gqa_softmax(uint32_t (&ph)[4], uint32_t (&pl)[4], float (&m)[2], float (&l)[2],
                                            float (&acc)[NACC][4], const float (&sc)[2][4], const bool (&valid)[2][2],
                                            const int (&len)[2], int s, int t, float scale_log2) {
#pragma unroll
  for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
    float x[2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        x[u][e] = valid[u][e] && s + 8 * u + 2 * t + e < len[r] ? sc[u][2 * r + e] * scale_log2 : -INFINITY;
    softmax_step<T, PT>(x, r, m[r], l[r], acc, ph, pl);
  }
  if (!ROWS16) ph[1] = pl[1] = ph[3] = pl[3] = 0u;
}

// The B fragments of P.V, n-tile by n-tile: product(n, b) for n-tile n = (h, j), column g = head dim
// 8 value_chunk(g, h) + j, k = tokens 2t, 2t+1 | 2t+8, 2t+9, paired from the value chunks of the lane's 4 tokens (as T
// pairs, chunk_pairs) by byte permutes.
template <typename T, bool F8, int VH, int N, typename Product>
__device__ __forceinline__ void for_each_value_tile(const uint32_t (&vw)[2][2][N], Product&& product) {
#pragma unroll
  for (int h = 0; h < VH; ++h) {
    uint32_t v[2][2][4];  // v[u][e]: token 8u + 2t + e's chunk
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e) chunk_pairs<T, F8>(vw[u][e], h, v[u][e]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t b[2] = {pair_rows(v[0][0], v[0][1], j), pair_rows(v[1][0], v[1][1], j)};
      product(8 * h + j, b);
    }
  }
}

// P.V of a plain step (every row attends every token read), over for_each_value_tile's n-tiles.
template <typename T, int PT, int VH, bool F8>
__device__ __forceinline__ void gqa_pv(float (&acc)[8 * VH][4], const uint32_t (&ph)[4], const uint32_t (&pl)[4],
                                       const uint32_t (&vw)[2][2][VH * kChunkWords<F8>]) {
  for_each_value_tile<T, F8, VH>(vw, [&](int n, const uint32_t (&b)[2]) {
    mma_16816<T>(acc[n], ph, b);
    if constexpr (PT == 2) mma_16816<T>(acc[n], pl, b);
  });
}

// P.V of a ragged step (split_kv.cuh's ragged_from; its first token s): once per query token of the tile's rows, P
// (PT terms) times V masked at that token's length, kept in that token's rows only (mma_rows_upto). The operands are
// gqa_pv's. The query tokens are a loop, not unrolled: this runs on the last steps of a multi-token item only.
template <typename T, int PT, int VH, bool F8>
__device__ __forceinline__ void gqa_pv_ragged(float (&acc)[8 * VH][4], const uint32_t (&ph)[4], const uint32_t (&pl)[4],
                                              const uint32_t (&vw)[2][2][VH * kChunkWords<F8>], const WorkItem& wi,
                                              int G, const int32_t* seq_lens, int cap, int s, int g, int t) {
  const int last = wi.token(wi.n - 1, G), mine0 = wi.token(g, G), mine1 = wi.token(g + 8, G);
#pragma unroll 1
  for (int q = wi.token(0, G); q <= last; ++q) {  // warp-uniform
    const int lim = clamp_len(seq_lens[q], cap) - s;
    for_each_value_tile<T, F8, VH>(vw, [&](int n, const uint32_t (&b)[2]) {
      mma_rows_upto<T, PT>(acc[n], ph, pl, b, lim, t, mine0 == q, mine1 == q);
    });
  }
}

// The end of a warp's steps: the row sums of the 4 lanes of a row group, then the warp's state (m, l, and the
// unnormalised accumulator rows) into slot `warp`. C column 2t + e of n-tile (h, j) is head dim
// 8 value_chunk(2t + e, h) + j.
template <int D, int GT, bool F8>
__device__ __forceinline__ void gqa_store_state(const SlotState& st, int warp, int g, int t, const float (&m)[2],
                                                float (&l)[2], const float (&acc)[D / 8][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < (GT == 16 ? 2 : 1); ++r) {
    const int row = g + 8 * r;
    if (t == 0) {
      st.m[warp * GT + row] = m[r];
      st.l[warp * GT + row] = l[r];
    }
    float* o = st.o + (warp * GT + row) * D;
#pragma unroll
    for (int h = 0; h < D / 64; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[8 * value_chunk<D / 64, F8>(2 * t, h) + j] = acc[8 * h + j][2 * r];
        o[8 * value_chunk<D / 64, F8>(2 * t + 1, h) + j] = acc[8 * h + j][2 * r + 1];
      }
  }
}

template <typename T, int D, int GT, int PT, bool F8>
__global__ void __launch_bounds__(32 * kGqaMmaWarps, 1) gqa_mma_kernel(GqaParams p) {
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static_assert(GT == 8 || GT == 16, "8 or 16 query heads per tile");
  constexpr int KC = D / 32;     // key chunks per lane and token (two k-tiles each)
  constexpr int VH = D / 64;     // value chunks per lane and token
  constexpr bool ROWS16 = GT == 16;
  const int G = p.Hq / p.Hkv, item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int seq = wi.b, j0 = wi.begin, j1 = wi.end, kvh = wi.kvh;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  DCP_DYNAMIC_SMEM(float, smem);
  const SlotState st(smem, kGqaMmaWarps, GT);

  uint32_t qa[2 * KC][4];
  gqa_load_query<T, KC, ROWS16, F8>(qa, p, wi, G, g, t);
  float acc[8 * VH][4], m[2], l[2];
#pragma unroll
  for (int n = 0; n < 8 * VH; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
  // each row's own length: the query tokens of a sequence share the tile (multi-token decode)
  const int cap = p.max_blocks * p.block_size;
  const int len[2] = {row_len(wi, g, G, p.seq_lens, cap), row_len(wi, g + 8, G, p.seq_lens, cap)};

  const float scale_log2 = p.k_scale != nullptr ? p.scale_log2 * *p.k_scale : p.scale_log2;
  const int64_t kh = kvh * p.k_sh, vh = kvh * p.v_sh;  // element offsets of this KV head
  // One step, tokens s .. s + 15: keys, values, scores, softmax, P.V (masked per query token when `ragged`).
  auto step = [&](const int s, auto ragged) {
    const StepBlocks sb{s / p.block_size, s % p.block_size};
    uint32_t kw[2][KC * kChunkWords<F8>];
    gqa_load_keys<T, KC, F8>(kw, p, sb, seq, s, j1, kh, g, t);
    uint32_t vw[2][2][VH * kChunkWords<F8>];
    bool valid[2][2];
    if constexpr (F8 && VH == 1)
      gqa_load_values_paired<T>(vw, valid, p, sb, seq, s, j1, vh, g, t);
    else
      gqa_load_values<T, VH, F8>(vw, valid, p, sb, seq, s, j1, vh, g, t);
    float sc[2][4];
    gqa_scores<T, KC, F8>(sc, qa, kw);
    uint32_t ph[4], pl[4] = {0u, 0u, 0u, 0u};
    gqa_softmax<T, PT, ROWS16>(ph, pl, m, l, acc, sc, valid, len, s, t, scale_log2);
    if constexpr (!decltype(ragged)::value)
      gqa_pv<T, PT, VH, F8>(acc, ph, pl, vw);
    else
      gqa_pv_ragged<T, PT, VH, F8>(acc, ph, pl, vw, wi, G, p.seq_lens, cap, s, g, t);
  };
  // Steps from ragged_from on (multi-token decode: the rows disagree on some of a step's tokens, always the last
  // steps of the item) mask V per query token in P.V (gqa_pv_ragged). Two loops over one step: the plain steps, then
  // the ragged ones; the hot loop holds the plain P.V only.
  const int rag = ragged_from(wi, 0, G, p.seq_lens, cap, j1);
  int s = j0 + 16 * warp;
  for (const int end = min(j1, rag - 15); s < end; s += 16 * kGqaMmaWarps) step(s, std::false_type());  // warp-uniform
  for (; s < j1; s += 16 * kGqaMmaWarps) step(s, std::true_type());

  gqa_store_state<D, GT, F8>(st, warp, g, t, m, l, acc);
  __syncthreads();
  const int64_t row = static_cast<int64_t>(item) * GT;
  combine_slots(st, kGqaMmaWarps, GT, wi.n, D, p.part_o + row * D, p.part_lse + row);
}

template <typename T, int D, int GT, int PT, bool F8>
cudaError_t gqa_mma_launch(const GqaParams& p, cudaStream_t stream) {
  const dim3 grid(p.items);
  auto kernel = gqa_mma_kernel<T, D, GT, PT, F8>;
  DCP_LAUNCH(kernel, grid, dim3(32 * kGqaMmaWarps), slot_smem_bytes(kGqaMmaWarps, GT, D), stream, p);
  return cudaGetLastError();
}

// The tensor-core kernel for p.R rows and head dim p.D; P in 1 term (native) or 2 (fp32).
template <typename T, int PT, bool F8>
cudaError_t gqa_mma_dispatch(const GqaParams& p, cudaStream_t stream) {
  const bool wide = p.R == 16;
  if (p.D == 64)
    return wide ? gqa_mma_launch<T, 64, 16, PT, F8>(p, stream) : gqa_mma_launch<T, 64, 8, PT, F8>(p, stream);
  return wide ? gqa_mma_launch<T, 128, 16, PT, F8>(p, stream) : gqa_mma_launch<T, 128, 8, PT, F8>(p, stream);
}

// Whether the tensor-core kernel can run (cuda/split_choice.h decides): 16-bit queries (on caches of their type or fp8
// ones), head dims 64 and 128, a device with mma.sync.
inline bool gqa_on_tensor_cores(int q_elem_size, int D, bool tensor_cores) {
  return tensor_cores && q_elem_size == 2 && (D == 64 || D == 128);
}

// The query rows per block (GqaParams::R) of the kernel gqa_split_pass runs, for `rows` query rows of a sequence per
// KV head: 8 or 16 on tensor cores, a power of two up to 8 in the SIMT kernel.
inline int gqa_rows(int64_t rows, bool on_tensor_cores) {
  if (on_tensor_cores) return rows > 8 ? 16 : 8;
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
}

// The split pass of gqa_decode_partial for a query of type T on a cache of T or (fp8) float8_e4m3fn: the tensor-core
// kernel (on_tensor_cores: cuda/split_choice.h chose it), else the SIMT kernel of gqa_decode.cuh.
template <typename T>
cudaError_t gqa_split_pass(const GqaParams& p, cudaStream_t stream, bool on_tensor_cores, bool native, bool fp8) {
  if constexpr (sizeof(T) == 2) {
    if (on_tensor_cores) {
      if (fp8) return native ? gqa_mma_dispatch<T, 1, true>(p, stream) : gqa_mma_dispatch<T, 2, true>(p, stream);
      return native ? gqa_mma_dispatch<T, 1, false>(p, stream) : gqa_mma_dispatch<T, 2, false>(p, stream);
    }
  }
  return fp8 ? gqa_split<T, fp8_e4m3>(p, stream) : gqa_split<T>(p, stream);
}

}  // namespace dcp_ops::kernels
