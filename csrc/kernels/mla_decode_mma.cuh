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

// P.V of a ragged step (split_kv.cuh's ragged_from; its first token s): once per query token of the block's rows,
// both P terms times V masked at that token's length, kept in that token's rows only (mma_rows_upto). The operands
// are the plain path's (vw: the lane's value words, tokens 8u + 2t + e). The query tokens are a loop, not unrolled:
// this runs on the last steps of a multi-token item only.
template <typename T>
__device__ __forceinline__ void mla_mma_pv_ragged(float (&acc)[8][4], const uint32_t (&ph)[4], const uint32_t (&pl)[4],
                                                  const uint32_t (&vw)[2][2][4], const WorkItem& wi,
                                                  const MlaParams& p, int cap, int s, int g, int t) {
  const int last = wi.token(wi.n - 1, p.H), mine0 = wi.token(g, p.H), mine1 = wi.token(g + 8, p.H);
#pragma unroll 1
  for (int q = wi.token(0, p.H); q <= last; ++q) {  // warp-uniform
    const int lim = clamp_len(p.seq_lens[q], cap) - s;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t b[2] = {pair_rows(vw[0][0], vw[0][1], j), pair_rows(vw[1][0], vw[1][1], j)};
      mma_rows_upto<T, 2>(acc[j], ph, pl, b, lim, t, mine0 == q, mine1 == q);
    }
  }
}

template <int NW, int DK, typename T>
constexpr int mla_mma_smem_bytes() {  // partial scores, row offsets of 3 steps, two stages of 16 rows (F8: one, and
                                      // two raw e4m3 stages of half the bytes)
  return NW * 2 * 32 * 4 * 4 + 3 * 16 * 8 + 2 * 16 * DK * static_cast<int>(sizeof(T));
}

template <typename T, int DL, int DR, bool F8>
__device__ __forceinline__ void mla_mma_body(const MlaParams& p) {
  constexpr int NW = DL / 64, DK = DL + DR, CH = DK / 8;  // warps; a row: CH chunks of 8 elements (16 bytes)
  constexpr int CH8 = DK / 16;                            // F8: 16-byte chunks of an e4m3 row
  constexpr int CG = DK / 32, CGW = (CG + NW - 1) / NW;  // key chunk groups of 32 dims; per warp at most
  static_assert(DL % 256 == 0 && DR % 64 == 0, "latent a multiple of 256, rope of 64");
  const int item = blockIdx.x;
  const WorkItem wi = work_item(p.work, item);
  if (wi.b < 0) return;
  const int seq = wi.b, j0 = wi.begin, j1 = wi.end, ng = wi.n;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  DCP_DYNAMIC_SMEM(float, smem);
  float* part = smem;                                            // [warps][2][32][4] partial scores
  int64_t* rowoff = reinterpret_cast<int64_t*>(part + NW * 256);  // [3][16]: a row's element offset in kv, or -1
  T* rows = reinterpret_cast<T*>(rowoff + 3 * 16);               // [2][16][DK], swizzled (F8: [16][DK])
  unsigned char* raw = reinterpret_cast<unsigned char*>(rows + (F8 ? 16 : 0) * DK);  // F8: [2][16][DK] e4m3

  // Query fragments (3 terms) of this warp's chunk groups; register r4 is row g + 8 (r4 & 1), dims + 2 (r4 >> 1).
  uint32_t qa[CGW][2][3][4];
  const float* qr[2] = {p.q + (static_cast<int64_t>(wi.token(g, p.H)) * p.H + wi.head(g, p.H)) * DK,
                        p.q + (static_cast<int64_t>(wi.token(g + 8, p.H)) * p.H + wi.head(g + 8, p.H)) * DK};
#pragma unroll
  for (int i = 0; i < CGW; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r4 = 0; r4 < 4; ++r4) {
        const int cg = warp + NW * i, row = g + 8 * (r4 & 1);
        const int d = 8 * (4 * cg + t) + 4 * h + 2 * (r4 >> 1);
        uint32_t terms[3] = {0u, 0u, 0u};
        if (cg < CG && row < ng) split_terms<T, 3>(qr[r4 & 1][d], qr[r4 & 1][d + 1], terms);
#pragma unroll
        for (int k = 0; k < 3; ++k) qa[i][h][k][r4] = terms[k];
      }

  const T* kv = static_cast<const T*>(p.kv);
  // each row's own length: the query tokens of a sequence share the tile (multi-token decode)
  const int cap = p.max_blocks * p.block_size;
  const int len[2] = {row_len(wi, g, p.H, p.seq_lens, cap), row_len(wi, g + 8, p.H, p.seq_lens, cap)};
  auto row_of = [&](int j) -> int64_t {  // token j's row offset, or -1 when it is not read
    if (j >= j1) return -1;
    const int64_t block = p.block_table[seq * p.bt_st + j / p.block_size];
    return block >= 0 && block < p.num_blocks ? block * p.kv_sb + static_cast<int64_t>(j % p.block_size) * p.kv_st
                                              : -1;
  };
  auto issue = [&](int buf, int stage) {  // cp.async of the rows whose offsets are in rowoff[buf] into `stage`
    if constexpr (F8) {  // (offsets count elements, which are bytes here)
      const unsigned char* src = static_cast<const unsigned char*>(p.kv);
      for (int i = threadIdx.x; i < 16 * CH8; i += 32 * NW) {
        const int r = i / CH8, c = i % CH8;
        const int64_t off = rowoff[buf * 16 + r];
        cp_async16(raw + (stage * 16 + r) * DK + 16 * c, src + (off >= 0 ? off + 16 * c : 0), off >= 0);
      }
    } else {
      for (int i = threadIdx.x; i < 16 * CH; i += 32 * NW) {
        const int r = i / CH, c = i % CH;
        const int64_t off = rowoff[buf * 16 + r];
        cp_async16(rows + (stage * 16 + r) * DK + 8 * (c ^ mla_swizzle(r)), kv + (off >= 0 ? off + 8 * c : 0),
                   off >= 0);
      }
    }
  };
  // F8: raw stage `stage` converted to T into the 16-bit rows, 8 e4m3 bytes c of a row becoming its 16-bit chunk c
  // (swizzled as issue() places a 16-bit cache's); 8 bytes at a time keeps few registers live beside the fragments
  auto convert = [&](int stage) {
    for (int i = threadIdx.x; i < 16 * CH; i += 32 * NW) {
      const int r = i / CH, c = i % CH;
      const Pack<unsigned short, 4> x =
          *reinterpret_cast<const Pack<unsigned short, 4>*>(raw + (stage * 16 + r) * DK + 8 * c);
      Pairs4 w;
#pragma unroll
      for (int e = 0; e < 4; ++e) w.v[e] = e4m3x2_to<T>(x.v[e]);
      *reinterpret_cast<Pairs4*>(rows + r * DK + 8 * (c ^ mla_swizzle(r))) = w;
    }
  };

  float acc[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
  // Step k's rows are in stage k % 2 and their offsets in rowoff[k % 3]. The offsets of step k + 2 are read from
  // the block table at the start of step k and stored at its end, so that read's latency overlaps the arithmetic.
  const int steps = j1 > j0 ? (j1 - j0 + 15) / 16 : 0;
  if (threadIdx.x < 16) {
    rowoff[threadIdx.x] = row_of(j0 + threadIdx.x);
    rowoff[16 + threadIdx.x] = row_of(j0 + 16 + threadIdx.x);
  }
  __syncthreads();
  if (steps > 0) issue(0, 0);
  cp_async_commit();
  // Steps from ragged_from on (multi-token decode: the rows disagree on some of a step's tokens, always the last
  // steps of the item) mask V per query token in P.V (mla_mma_pv_ragged). The loop runs in two phases, unrolled into
  // two loops: the plain steps, then the ragged ones; the hot loop holds the plain P.V only.
  const int rag = ragged_from(wi, 0, p.H, p.seq_lens, cap, j1);
  const int plain_steps = rag == kNotRagged ? steps : min(steps, max(0, (rag - j0) / 16));
  int k = 0;
#pragma unroll
  for (int phase = 0; phase < 2; ++phase) {
    for (const int end = phase == 0 ? plain_steps : steps; k < end; ++k) {
      const int stage = k & 1, buf = k % 3;
      const int64_t ahead = threadIdx.x < 16 ? row_of(j0 + 16 * (k + 2) + threadIdx.x) : -1;
      if (k + 1 < steps) issue((k + 1) % 3, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();  // this step's rows are in
      if constexpr (F8) {
        convert(stage);
        __syncthreads();  // ... and converted
      }
      const T* R = rows + (F8 ? 0 : stage) * 16 * DK;
      float sc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {  // keys: row 8 n + g, chunks 4 cg + t
        const T* row = R + (8 * n + g) * DK;
        const int sw = mla_swizzle(8 * n + g);
        float c3[3][4];  // one accumulator per query term: 3 independent chains of tensor-core products, not one
#pragma unroll
        for (int k = 0; k < 3; ++k)
#pragma unroll
          for (int i = 0; i < 4; ++i) c3[k][i] = 0.f;
#pragma unroll
        for (int i = 0; i < CGW; ++i) {
          const int cg = warp + NW * i;
          if (CG % NW != 0 && cg >= CG) break;  // warp-uniform
          const Pairs4 w = *reinterpret_cast<const Pairs4*>(row + 8 * ((4 * cg + t) ^ sw));
          const uint32_t b0[2] = {w.v[0], w.v[1]}, b1[2] = {w.v[2], w.v[3]};
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            mma_16816<T>(c3[k], qa[i][0][k], b0);
            mma_16816<T>(c3[k], qa[i][1][k], b1);
          }
        }
        // An infinite key element times the query's three terms gives +-inf per term (or NaN from a zero term), so
        // the sum can be NaN where the score is +-inf: then the first term's (the reference's sign) stands.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float s = c3[0][i] + (c3[1][i] + c3[2][i]);
          part[((warp * 2 + n) * 32 + lane) * 4 + i] = isnan(s) && !isnan(c3[0][i]) ? c3[0][i] : s;
        }
      }
      __syncthreads();  // every warp's partial scores are in
      const float ks = F8 ? *p.k_scale : 1.f;  // an FP8 cache's scale, into the summed scores (read here: no register
                                               // held across the step loop)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float x = 0.f;
#pragma unroll
          for (int w = 0; w < NW; ++w) x += part[((w * 2 + n) * 32 + lane) * 4 + i];
          sc[n][i] = x * ks;
        }
      // online softmax of rows g, g + 8 (scores already in log2 units), tokens 8u + 2t + e
      uint32_t ph[4], pl[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float x[2][2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            x[u][e] = rowoff[buf * 16 + 8 * u + 2 * t + e] >= 0 && j0 + 16 * k + 8 * u + 2 * t + e < len[r]
                          ? sc[u][2 * r + e]
                          : -INFINITY;
        softmax_step<T, 2>(x, r, m[r], l[r], acc, ph, pl);
      }
      // P.V over this warp's latent dims: n-tile j, column g = dim 64 warp + 8 g + j; rows 8u + 2t + e
      uint32_t vw[2][2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 8 * u + 2 * t + e;
          const Pairs4 w = *reinterpret_cast<const Pairs4*>(R + r * DK + 8 * ((8 * warp + g) ^ mla_swizzle(r)));
#pragma unroll
          for (int i = 0; i < 4; ++i) vw[u][e][i] = w.v[i];
        }
      if (phase == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t b[2] = {pair_rows(vw[0][0], vw[0][1], j), pair_rows(vw[1][0], vw[1][1], j)};
          mma_16816<T>(acc[j], ph, b);
          mma_16816<T>(acc[j], pl, b);
        }
      } else {
        mla_mma_pv_ragged<T>(acc, ph, pl, vw, wi, p, cap, j0 + 16 * k, g, t);
      }
      if (threadIdx.x < 16) rowoff[(k + 2) % 3 * 16 + threadIdx.x] = ahead;  // last read in step k - 1
      __syncthreads();  // before the next step overwrites the partial scores and, one step on, this stage
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = g + 8 * r;
    if (row >= ng) continue;
    const int64_t prow = static_cast<int64_t>(item) * 16 + row;
    float* o = p.part_o + prow * DL + 64 * warp;
    float inv, lse;
    finish_row(m[r], l[r], inv, lse);
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // C columns 2t, 2t + 1 of n-tile j: dims 8 (2t + e) + j
      o[16 * t + j] = acc[j][2 * r] * inv;
      o[16 * t + 8 + j] = acc[j][2 * r + 1] * inv;
    }
    if (warp == 0 && t == 0) p.part_lse[prow] = lse;
  }
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
