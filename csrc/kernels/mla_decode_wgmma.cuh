// Paged MLA decode attention on Hopper's warpgroup MMA (wgmma, sm_90a): the twin of mla_decode_tiled.cuh (precision
// "native"; bf16 / fp16 caches or float8_e4m3fn with a 16-bit query; latent 256 or 512, rope 0 or 64), with the same
// parameters, work items, numerics and outputs: the absorbed query enters the products as one 16-bit term, P is
// rounded once to T before P.V, scores, softmax statistics, row sums and accumulators are fp32; it writes the
// normalised fp32 partial and the natural LSE of each split. The split pass, built like FlashMLA's sm90 decode:
//   - a block (256 threads: two warpgroups) takes a work item's kMlaRows = 64 query rows (the tiled kernel's rows:
//     (query token, head) pairs in token-major order, each masked at its own length);
//   - BN-token KV tiles (BN = 64; 32 where shared memory is smaller) are copied by cp.async into two shared stages:
//     tile k + 1 is in flight while tile k is computed; V is the latent part of the same rows. 8 threads copy a
//     row, so that a thread's copies are one base plus immediates; each thread follows one token's cache offset
//     from tile to tile (TokenCursor: no division) and the warp's lanes pass the rows' offsets by shuffle;
//   - scores: warpgroup h computes S_h = Q K_h^T for all 64 rows over its half of the tile's tokens (m64n(BN/2)k16,
//     A = Q and B = the key rows from shared memory by descriptor, DK / 16 k-steps, fp32 accumulators);
//   - softmax: the two warpgroups exchange their row maxima through shared memory and so share m (a thread holds
//     rows 16 w + g and 16 w + g + 8 of warp w in both products, so it rescales its own output rows);
//   - P.V: warpgroup h owns output columns [DL / 2 h, DL / 2 (h + 1)) of all 64 rows (m64n(DL/2)k16, DL / 4
//     accumulators a thread); the k-steps of its own token half take A (P) from its score registers, those of the
//     other half from shared memory, where each warpgroup writes its half of P; B (V) by an MN-major descriptor on
//     the same stage. The own half's k-steps are issued before the barrier that makes the other half's P visible.
// Shared tiles are in wgmma's 128-byte swizzled canonical layout: a tile of R rows x DK 16-bit elements is DK / 64
// column blocks of [R][128 bytes], 16-byte chunk u of row r at byte r * 128 + 16 * (u ^ (r % 8)) of its block,
// every block at a multiple of 1024 bytes. As B of S (K-major) a k-step's descriptor starts at its block + 32 bytes
// per 16 dims, SBO 1024; as B of P.V (MN-major) at the block of its first dim + 1024 bytes per 8 tokens, LBO the
// next 64 dims (R * 128 bytes), SBO 1024. P is [64][BN] 16-bit: one 128-byte block (BN 64), or 64-byte rows in the
// 64-byte swizzle (BN 32: chunk u of row r at r * 64 + 16 * (u ^ ((r / 2) % 4)), SBO 512).
// Masking as the tiled kernel: tokens not read (past the split, past seq_len, in blocks outside the cache; zeros),
// and a row's tokens past its own length, get P = 0: a token not read by its score set to -inf (sBias, a select, as
// 0 x an infinite query element is NaN); a row's length is compared on ragged tiles only (on the others every row
// below n attends every token read). A P of 0 does not keep a NaN or inf in a masked token's V out of P.V (0 x NaN is
// NaN), so on ragged tiles (split_kv.cuh's ragged_from over the block's rows: multi-token decode,
// rows disagreeing on the tile's tokens) the non-finite V elements of the tokens some row masks are first added by
// hand, P[r][j] V[j][d], to the rows that attend them, then zeroed in shared memory before the P.V (ragged_fixup).
// An FP8 cache (F8): raw e4m3 rows come by cp.async into two raw stages, and each tile, once in, is converted exactly
// to T into one 16-bit stage in the layout above (one more barrier a tile); the cache's scale multiplies scale_log2.
// Shared memory written by the threads' own stores (P, converted tiles, cleaned V) and by cp.async is made visible to
// the wgmmas by fence_proxy_async before the barrier that precedes them.
// The hot loop's instructions (bench/gpu/sass_budget.py) are kept down by the above, by warp-uniform descriptors
// (uniform_desc: one uniform add a k-step), P's exponentials by MUFU.EX2 alone (exp2_ftz) with the scale and the max
// in one FFMA, and P rounded two at a time (pack2_rn).
#pragma once

#include <type_traits>

#include "kernels/cp_async.cuh"
#include "kernels/mla_decode.cuh"
#include "kernels/mla_decode_tiled.cuh"
#include "kernels/mla_fp8_tile.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

namespace dcp_ops::kernels {

constexpr int kMlaWgmmaThreads = 256;  // two warpgroups

// Q, the KV stages (F8: one 16-bit stage, and two raw e4m3 stages of BN x DK bytes: the same size), P; then row
// maxima and sums [2][64], the tokens' score biases [2][BN], the ragged tile's non-finite-V token flags [BN]. The
// 16-bit regions come first, so that each of their column blocks starts at a multiple of 1024 bytes. One formula for
// the launcher (constexpr) and for mla_wgmma_tokens (runtime).
constexpr int mla_wgmma_smem_bytes(int dk, int bn, int elem_bytes, bool f8) {
  return (kMlaRows * dk + (f8 ? 1 : 2) * bn * dk + kMlaRows * bn) * elem_bytes + (f8 ? 2 * bn * dk : 0) +
         (4 * kMlaRows + 3 * bn) * 4;
}
template <int DK, int BN, typename T, bool F8>
constexpr int mla_wgmma_smem_bytes() {
  return mla_wgmma_smem_bytes(DK, BN, static_cast<int>(sizeof(T)), F8);
}

// Element offset of 16-byte chunk c (dims 8c .. 8c + 7) of row r in a tile of R rows of 16-bit elements stored as
// 64-dim column blocks of [R][128 bytes], 128-byte swizzled (the layout in the header comment).
template <int R>
__device__ __forceinline__ int block_swizzled(int r, int c) {
  return (c / 8) * R * 64 + r * 64 + 8 * ((c % 8) ^ (r % 8));
}

// A descriptor moved on by `bytes` (a multiple of 16): the start address field is the low 14 bits, in 16-byte units;
// shared addresses stay below 256 KiB, so it does not carry out of its field.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, int bytes) {
  return desc + static_cast<uint64_t>(bytes >> 4);
}

// A descriptor the compiler knows to be warp-uniform: lane 0's (every thread computes the same one). Descriptors
// built from it with compile-time offsets stay in uniform registers, so a k-step costs one uniform 64-bit add
// instead of vector adds and two R2UR moves (CUTLASS makes the warpgroup index uniform the same way).
__device__ __forceinline__ uint64_t uniform_desc(uint64_t desc) {
  return __shfl_sync(0xffffffffu, desc, 0);
}

// 2^x by MUFU.EX2 alone (ex2.approx.ftz): exp2f adds a fix-up for results below 2^-126 (three instructions more),
// values that no P keeps (they are summed next to the row's largest, 1).
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__) && !defined(DCP_SIMT)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// lo, hi rounded to T and packed as pack2 does, in one conversion (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename T>
__device__ __forceinline__ uint32_t pack2_rn(float lo, float hi) {
#ifdef DCP_SIMT
  return pack2(from_f32<T>(lo), from_f32<T>(hi));
#else
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
#endif
}

// cp_async16 with the zero fill as cp.async's ignore-src predicate (rather than a source size of 0), which the
// compiler sets once for all the copies of a row.
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
#if defined(DCP_SIMT) || !defined(__CUDA_ARCH__)
  cp_async16(dst, src, valid);
#else
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %2, 0;\ncp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(d),
               "l"(src), "r"(static_cast<unsigned>(valid)));
#endif
}

// Whether a 16-bit float's bits are inf or NaN (all exponent bits set).
template <typename T>
__device__ __forceinline__ bool nonfinite_bits(unsigned bits) {
  constexpr unsigned kExp = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  return (bits & kExp) == kExp;
}

// One block's state and steps. A thread of warpgroup wg, warp w of it, lane 4 g + t, holds rows 16 w + g (+ 8) of
// both products: score columns (tokens of its half) 8 j + 2 t (+ 1), output columns DL / 2 wg + 8 j + 2 t (+ 1).
template <typename T, int DL, int DR, int BN, bool F8>
struct MlaWgmmaBlock {
  static constexpr int DK = DL + DR, CH = DK / 8, CH8 = DK / 16;  // chunks of a 16-bit row, of an e4m3 row
  static constexpr int KST = F8 ? 1 : 2;                            // 16-bit KV stages
  static constexpr int SN = BN / 2, SACC = SN / 2;                  // score tokens (N) a warpgroup, accumulators
  static constexpr int ON = DL / 2, OACC = ON / 2;                  // output columns (N) a warpgroup, accumulators
  static constexpr int HS = SN / 16;                                // P.V k-steps of a token half
  static constexpr int PCH = BN / 8;                                // 16-byte chunks of a P row
  static constexpr int kCopyRows = kMlaWgmmaThreads / 8;            // KV rows a copy pass (8 threads a row)
  static constexpr int kPasses = BN / kCopyRows;                    // copy passes a tile
  static constexpr int kStageBytes = BN * DK * 2, kKvBlockBytes = BN * 128, kQBlockBytes = kMlaRows * 128;
  static_assert(DL % 256 == 0 && DR % 64 == 0 && (BN == 32 || BN == 64), "latent 256 / 512, rope 0 / 64");
  static_assert(sizeof(T) == 2 && CH % 8 == 0, "16-bit T; tile shapes");

  const MlaParams& p;
  const WorkItem wi;
  const int item, tid, wg, g, t, row0;  // row0: this thread's first row (16 w + g); the second is row0 + 8
  const int crow, csub;                 // the tile row this thread copies in the first pass (+ 32 a pass), its chunk
  const int ctok;                       // the tile token whose cache offset this thread follows (load_tile)
  int step_slot, step_in;               // BN tokens in block-table slots and tokens: BN / block_size, BN % block_size
  T *sQ, *sKV, *sP;
  unsigned char* sRaw;
  float *sMax, *sSum;
  float* sBias;
  int* sBad;
  int len[2];  // this thread's rows' lengths, relative to the split's first token (0 for rows past n)

  __device__ __forceinline__ MlaWgmmaBlock(const MlaParams& params, const WorkItem& w, unsigned char* smem)
      : p(params), wi(w), item(blockIdx.x), tid(threadIdx.x), wg(threadIdx.x / 128), g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4), row0(threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4), crow(threadIdx.x / 8),
        csub(threadIdx.x % 8),
        ctok(threadIdx.x / 32 * 4 + threadIdx.x % 4 + (kPasses == 2 ? kCopyRows * (threadIdx.x / 4 % 2) : 0)) {
    sQ = reinterpret_cast<T*>(smem);  // [DK / 64][64][64]
    sKV = sQ + kMlaRows * DK;         // [KST][DK / 64][BN][64]
    sP = sKV + KST * BN * DK;         // [64][BN]
    sRaw = reinterpret_cast<unsigned char*>(sP + kMlaRows * BN);  // F8: [2][BN][DK] e4m3, unswizzled
    sMax = reinterpret_cast<float*>(sRaw + (F8 ? 2 * BN * DK : 0));  // [2][64]: the halves' row maxima; then m
    sSum = sMax + 2 * kMlaRows;                                      // [2][64]: the halves' row sums, at the end
    sBias = sSum + 2 * kMlaRows;                     // [2][BN]: a stage's token's score bias: 0 if read, else -inf
    sBad = reinterpret_cast<int*>(sBias + 2 * BN);  // [BN]: a ragged tile's tokens with non-finite V
    const int cap = capacity();
    len[0] = row_len(wi, row0, p.H, p.seq_lens, cap) - wi.begin;
    len[1] = row_len(wi, row0 + 8, p.H, p.seq_lens, cap) - wi.begin;
    step_slot = BN / p.block_size;
    step_in = BN % p.block_size;
  }

  __device__ __forceinline__ int capacity() const { return p.max_blocks * p.block_size; }
  __device__ __forceinline__ int tiles() const { return wi.end > wi.begin ? (wi.end - wi.begin + BN - 1) / BN : 0; }
  // a block's row r: its query row and its partial's row
  __device__ __forceinline__ int64_t qrow(int r) const {
    return static_cast<int64_t>(wi.token(r, p.H)) * p.H + wi.head(r, p.H);
  }
  __device__ __forceinline__ int64_t orow(int r) const { return static_cast<int64_t>(item) * kMlaRows + r; }

  // A token followed from tile to tile without a division (block_size is a runtime value): the token j, its
  // block-table slot j / block_size and its place j % block_size.
  struct TokenCursor {
    int j, slot, in;
  };
  __device__ __forceinline__ TokenCursor cursor(int j) const { return {j, j / p.block_size, j % p.block_size}; }
  __device__ __forceinline__ void advance(TokenCursor& c) const {  // on by BN tokens
    c.j += BN;
    c.slot += step_slot;
    c.in += step_in;
    if (c.in >= p.block_size) {
      c.in -= p.block_size;
      ++c.slot;
    }
  }
  // The cursor's element offset in the cache, or -1 when its token is not read.
  __device__ __forceinline__ int64_t offset(const TokenCursor& c) const {
    if (c.j >= wi.end) return -1;
    const int64_t block = p.block_table[wi.b * p.bt_st + c.slot];
    return block >= 0 && block < p.num_blocks ? block * p.kv_sb + static_cast<int64_t>(c.in) * p.kv_st : -1;
  }

  // The query rows (rows past n are zeros), by cp.async into the swizzled Q tile: 8 consecutive threads take the 8
  // chunks of one 128-byte row segment, on distinct banks.
  __device__ __forceinline__ void load_query() const {
    const T* q16 = static_cast<const T*>(p.q16);
    for (int i = tid; i < kMlaRows * CH; i += kMlaWgmmaThreads) {
      const int r = i / CH, c = i % CH;
      cp_async16(sQ + block_swizzled<kMlaRows>(r, c), q16 + (r < wi.n ? qrow(r) * DK + 8 * c : 0), r < wi.n);
    }
  }

  // This thread's part of the copy of a tile into `stage`. off: the cache offset of token ctok (offset()). Rows
  // crow + 32 i are copied by 8 threads each, thread csub taking chunks csub + 8 c: in shared memory they are a
  // column block apart (16-bit; F8: 128 bytes), in the cache 128 bytes apart, so every cp.async of the tile is a
  // per-thread base plus an immediate; and the 8 threads of a row fill the 128 bytes of banks once. The row's offset
  // comes from lane (row % 4) + 4 pass of the warp (ctok), which also writes the token's score bias.
  __device__ __forceinline__ void load_tile(int stage, int64_t off) const {
    const bool ok = off >= 0;
    if (tid % 32 < 4 * kPasses) sBias[stage * BN + ctok] = ok ? 0.f : -INFINITY;
    const auto* row = reinterpret_cast<const unsigned char*>(static_cast<const T*>(p.kv)) + (ok ? off : 0) *
                      (F8 ? 1 : static_cast<int64_t>(sizeof(T)));  // the row of token ctok (F8: off counts bytes)
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int lane = tid % 32 / 8 + 4 * pass;
      const auto at = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), lane);
      copy_row(stage, crow + kCopyRows * pass, reinterpret_cast<const unsigned char*>(at),
               __shfl_sync(0xffffffffu, static_cast<int>(ok), lane));
    }
  }
  __device__ __forceinline__ void copy_row(int stage, int r, const unsigned char* row, bool ok) const {
    const unsigned char* src = row + 16 * csub;
    if constexpr (F8) {
      unsigned char* dst = sRaw + (stage * BN + r) * DK + 16 * csub;
#pragma unroll
      for (int c = 0; c < (CH8 + 7) / 8; ++c)
        if (CH8 % 8 == 0 || csub + 8 * c < CH8) cp_async16_or_zero(dst + 128 * c, src + 128 * c, ok);
    } else {
      T* dst = sKV + stage * BN * DK + block_swizzled<BN>(r, csub);
#pragma unroll
      for (int c = 0; c < CH / 8; ++c) cp_async16_or_zero(dst + c * BN * 64, src + 128 * c, ok);
    }
  }

  // F8: raw stage `stage` (a tile in) converted exactly to T into the 16-bit stage (convert_e4m3_rows), in its
  // column blocks.
  __device__ __forceinline__ void convert(int stage) const {
    convert_e4m3_rows<T, BN, DK, kMlaWgmmaThreads>(sKV, sRaw, stage, tid,
                                                   [](int r, int c) { return block_swizzled<BN>(r, c); });
  }

  // S = Q K^T over this warpgroup's token half of the stage at byte offset kv_bytes from sKV: DK / 16 k-steps,
  // A = Q (K-major, 128-byte swizzle), B = the key rows (K-major), done at the wait.
  __device__ __forceinline__ void scores(int kv_bytes, float (&s)[SACC]) const {
    const uint64_t qd = make_smem_desc(sQ, kSwizzle128B, 16, 1024);
    const uint64_t kd =
        uniform_desc(desc_plus(make_smem_desc(sKV, kSwizzle128B, 16, 1024), kv_bytes + SN * wg * 128));
    wgmma_fence(s);
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks)
      wgmma_m64nNk16<SN, T, false>(s, desc_plus(qd, ks / 4 * kQBlockBytes + 32 * (ks % 4)),
                                   desc_plus(kd, ks / 4 * kKvBlockBytes + 32 * (ks % 4)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>(s);
  }

  // The online softmax of tile k (stage `stage`) on this thread's scores s: masks (not read: the bias -inf; on a
  // RAGGED tile also past the row's own length; a plain tile's rows below n attend all its tokens, and the rows past
  // n are not written out), exchanges the halves' row maxima through sMax (one barrier), and leaves in s the
  // unrounded P, in pa the A fragments of its half's k-steps (P rounded to T), in sP its half of P, in alpha the
  // rescale of its rows. m and l: its rows' max (log2 units) and sum of its half's P. The maxima are taken on the
  // unscaled scores and scaled after (scale_log2 > 0: the softmax scale, which the op checks, times an FP8 cache's
  // scale, which must be positive), so that scaling a score and taking the max off it is one FFMA.
  template <bool RAGGED>
  __device__ __forceinline__ void softmax(int k, int stage, float scale_log2, float (&s)[SACC], float (&m)[2],
                                          float (&l)[2], uint32_t (&pa)[HS][4], float (&alpha)[2]) const {
    const int tok0 = SN * wg + 2 * t;                     // this thread's tokens: tok0 + 8 j + e
    const float* bias = sBias + stage * BN + tok0;        // their biases: bias[8 j + e]
    const int lim[2] = {len[0] - k * BN, len[1] - k * BN};  // (RAGGED) a row attends the tile's tokens below it
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < SN / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // a select, not an add: a token not read is zeros, and 0 x an infinite query element is NaN
        s[4 * j + i] = bias[8 * j + (i & 1)] == 0.f ? s[4 * j + i] : -INFINITY;
        if (RAGGED && tok0 + 8 * j + (i & 1) >= lim[i / 2]) s[4 * j + i] = -INFINITY;
        mx[i / 2] = fmaxf(mx[i / 2], s[4 * j + i]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      if (t == 0) sMax[wg * kMlaRows + row0 + 8 * r] = mx[r];
    }
    __syncthreads();  // both halves' maxima are in
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      const float m_new = fmaxf(m[r], fmaxf(sMax[row], sMax[kMlaRows + row]) * scale_log2);
      const float mu = m_new == -INFINITY ? 0.f : m_new;  // no token yet: every P is 0, nothing to rescale
      alpha[r] = exp2_ftz(m[r] - mu);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < SN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[4 * j + 2 * r + e] = exp2_ftz(fmaf(s[4 * j + 2 * r + e], scale_log2, -mu));
          sum += s[4 * j + 2 * r + e];
        }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = m_new;
    }
    // P rounded to T: register j / 2 of the k-step's A fragment (a[0], a[1]: tokens 2t, 2t + 1 of rows g, g + 8;
    // a[2], a[3]: tokens 2t + 8, 2t + 9), and its place in sP (row, token SN wg + 8 j + 2 t): chunk SN / 8 wg + j,
    // at p0 ^ 8 j (j < SN / 8, a power of 2 that divides SN / 8 wg; row0 + 8 has row0's swizzle, 8 rows on)
    const int p0 = swizzled<PCH>(row0, SN / 8 * wg) + 2 * t;
#pragma unroll
    for (int j = 0; j < SN / 8; ++j) {
      const uint32_t lo = pack2_rn<T>(s[4 * j], s[4 * j + 1]);
      const uint32_t hi = pack2_rn<T>(s[4 * j + 2], s[4 * j + 3]);
      pa[j / 2][2 * (j % 2)] = lo;
      pa[j / 2][2 * (j % 2) + 1] = hi;
      st_shared_u32(sP + (p0 ^ 8 * j), lo);
      st_shared_u32(sP + (p0 ^ 8 * j) + 8 * PCH * 8, hi);
    }
  }

  // The output accumulators' rows rescaled (before the P.V's wgmma_fence).
  __device__ __forceinline__ void rescale(float (&o)[OACC], const float (&alpha)[2]) const {
#pragma unroll
    for (int j = 0; j < ON / 8; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  }

  // V's descriptor for the P.V k-steps of token half `half` (tokens SN half ..) of the stage at kv_bytes: MN-major,
  // 128-byte swizzle, from this warpgroup's first output column; LBO the next 64 columns (a column block), SBO the
  // next 8 tokens. Its k-step s is desc_plus(v_desc(..), 2048 s) (16 tokens on).
  __device__ __forceinline__ uint64_t v_desc(int kv_bytes, int half) const {
    return uniform_desc(desc_plus(make_smem_desc(sKV, kSwizzle128B, kKvBlockBytes, 1024),
                                  kv_bytes + ON * wg / 64 * kKvBlockBytes + HS * half * 2048));
  }

  // The P.V k-steps of this warpgroup's own token half, A from registers (issued; the caller fences and commits).
  __device__ __forceinline__ void pv_own(float (&o)[OACC], const uint32_t (&pa)[HS][4], int kv_bytes) const {
    const uint64_t vd = v_desc(kv_bytes, wg);
#pragma unroll
    for (int s = 0; s < HS; ++s) wgmma_m64nNk16<ON, T, true>(o, pa[s], desc_plus(vd, 2048 * s), 1);
  }

  // The P.V k-steps of the other token half, A = P from sP (K-major: 128-byte swizzle for BN 64, 64-byte for BN 32).
  __device__ __forceinline__ void pv_other(float (&o)[OACC], int kv_bytes) const {
    const uint64_t pd = uniform_desc(desc_plus(
        BN == 64 ? make_smem_desc(sP, kSwizzle128B, 16, 1024) : make_smem_desc(sP, kSwizzle64B, 16, 512),
        32 * HS * (1 - wg)));
    const uint64_t vd = v_desc(kv_bytes, 1 - wg);
#pragma unroll
    for (int s = 0; s < HS; ++s) wgmma_m64nNk16<ON, T, true>(o, desc_plus(pd, 32 * s), desc_plus(vd, 2048 * s), 1);
  }

  // A ragged tile, step 1: sBad[j] = 1 for the tokens j >= from of the stage at kv whose latent row holds an inf or
  // NaN (sBad cleared before, a barrier between).
  __device__ __forceinline__ void flag_nonfinite_v(const T* kv, int from) const {
    for (int i = from * (DL / 8) + tid; i < BN * (DL / 8); i += kMlaWgmmaThreads) {
      const int tok = i / (DL / 8), c = i % (DL / 8);
      const auto x = *reinterpret_cast<const Pack<unsigned short, 8>*>(kv + block_swizzled<BN>(tok, c));
      bool bad = false;
#pragma unroll
      for (int e = 0; e < 8; ++e) bad |= nonfinite_bits<T>(x.v[e]);
      if (bad) sBad[tok] = 1;
    }
  }

  // Step 2: for each flagged token j that this thread's row attends (j below the row's length), P[row][j] V[j][d]
  // (P as rounded, from sP) added to the row's accumulator at each of this thread's columns d where V[j][d] is not
  // finite: what the P.V would add there if no row masked j. Block-uniform loop over the flagged tokens (rare).
  __device__ __forceinline__ void ragged_fixup(float (&o)[OACC], int k, const T* kv, int from) const {
#pragma unroll 1
    for (int tok = from; tok < BN; ++tok) {
      if (!sBad[tok]) continue;
      const bool att0 = tok < len[0] - k * BN, att1 = tok < len[1] - k * BN;
      const float p0 = to_f32(sP[swizzled<PCH>(row0, tok / 8) + tok % 8]);
      const float p1 = to_f32(sP[swizzled<PCH>(row0 + 8, tok / 8) + tok % 8]);
#pragma unroll
      for (int j = 0; j < ON / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = ON * wg + 8 * j + 2 * t + e;
          const float v = to_f32(kv[block_swizzled<BN>(tok, col / 8) + col % 8]);
          if (isfinite(v)) continue;
          if (att0) o[4 * j + e] += p0 * v;
          if (att1) o[4 * j + 2 + e] += p1 * v;
        }
    }
  }

  // Step 3 (after every thread's fix-up): the flagged tokens' non-finite latent elements zeroed in the stage.
  __device__ __forceinline__ void clean_v(T* kv, int from) const {
    for (int i = from * (DL / 8) + tid; i < BN * (DL / 8); i += kMlaWgmmaThreads) {
      const int tok = i / (DL / 8), c = i % (DL / 8);
      if (!sBad[tok]) continue;
      Pack<unsigned short, 8>& x = *reinterpret_cast<Pack<unsigned short, 8>*>(kv + block_swizzled<BN>(tok, c));
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (nonfinite_bits<T>(x.v[e])) x.v[e] = 0;
    }
  }

  // The P.V of a ragged tile (sP holds both halves, the barrier after it passed): the fix-up of the non-finite V
  // elements of tokens from `from` on (the first token some row of the block masks, relative to the tile), their
  // cleaning, then the ordinary product. Finite V is unchanged, so each row gets its masked sum, and a non-finite
  // value reaches exactly the rows that attend its token.
  __device__ __forceinline__ void pv_ragged(float (&o)[OACC], uint32_t (&pa)[HS][4], int k, int kv_bytes,
                                            int from) const {
    T* kv = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sKV) + kv_bytes);
    flag_nonfinite_v(kv, from);
    __syncthreads();  // the flags are in
    ragged_fixup(o, k, kv, from);
    __syncthreads();  // every thread has read the non-finite values
    clean_v(kv, from);
    fence_proxy_async();
    __syncthreads();  // the cleaned tile is in, for the wgmmas
#pragma unroll
    for (int s = 0; s < HS; ++s) wgmma_fence_operand(pa[s]);
    wgmma_fence(o);
    pv_own(o, pa, kv_bytes);
    pv_other(o, kv_bytes);
    wgmma_commit();
    wgmma_wait<0>(o);
  }

  // The halves' row sums (the same m in both); then each warpgroup writes its columns of rows below n, normalised,
  // and threads 0 .. n - 1 the rows' natural LSE.
  __device__ __forceinline__ void epilogue(const float (&o)[OACC], const float (&m)[2], float (&l)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
      if (t == 0) {
        sSum[wg * kMlaRows + row0 + 8 * r] = l[r];
        if (wg == 0) sMax[row0 + 8 * r] = m[r];
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (row >= wi.n) continue;
      float inv, lse;
      finish_row(sMax[row], sSum[row] + sSum[kMlaRows + row], inv, lse);
      float* out = p.part_o + orow(row) * DL + ON * wg + 2 * t;
#pragma unroll
      for (int j = 0; j < ON / 8; ++j)
        *reinterpret_cast<Pack<float, 2>*>(out + 8 * j) =
            Pack<float, 2>{{o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv}};
    }
    if (tid < wi.n) {
      float inv, lse;
      finish_row(sMax[tid], sSum[tid] + sSum[kMlaRows + tid], inv, lse);
      p.part_lse[orow(tid)] = lse;
    }
  }
};

template <typename T, int DL, int DR, int BN, bool F8>
__global__ void __launch_bounds__(kMlaWgmmaThreads, 1) mla_wgmma_kernel(MlaParams p) {
#if defined(__CUDA_ARCH__) && !DCP_WGMMA_PTX
  __trap();  // sm_90a only (cuda/split_choice.h chooses it there only); no code for the other architectures
#else
  using Block = MlaWgmmaBlock<T, DL, DR, BN, F8>;
  const WorkItem wi = work_item(p.work, blockIdx.x);
  if (wi.b < 0) return;
#ifdef DCP_SIMT
  DCP_DYNAMIC_SMEM(unsigned char, smem);
#else
  extern __shared__ __align__(1024) unsigned char mla_wgmma_smem[];  // swizzled operands: 1024-byte aligned
  unsigned char* smem = mla_wgmma_smem;
#endif
  const Block blk(p, wi, smem);
  const int tiles = blk.tiles(), j0 = wi.begin;
  const float scale_log2 = p.k_scale != nullptr ? p.scale_log2 * *p.k_scale : p.scale_log2;

  blk.load_query();
  typename Block::TokenCursor cur = blk.cursor(j0 + blk.ctok);  // token ctok of tile 0, then of each next tile
  if (tiles > 0) blk.load_tile(0, blk.offset(cur));
  cp_async_commit();
  blk.advance(cur);
  int64_t next = blk.offset(cur);  // the offset of token ctok of the tile after the current one
  blk.advance(cur);

  float o[Block::OACC], s[Block::SACC], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t pa[Block::HS][4];
#pragma unroll
  for (int i = 0; i < Block::OACC; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < Block::SACC; ++i) s[i] = 0.f;

  // Tiles from ragged_from on (the least row length below the split's end: multi-token decode, always the last tiles
  // of the item) take the fix-up of non-finite V (pv_ragged). Two loops over one step (tile_step): the plain tiles,
  // then the ragged ones; the hot loop holds the plain P.V only.
  int rag = kNotRagged;
#pragma unroll
  for (int rg = 0; rg < 4; ++rg) rag = min(rag, ragged_from(wi, 16 * rg, p.H, p.seq_lens, blk.capacity(), wi.end));
  const int plain_tiles = rag == kNotRagged ? tiles : min(tiles, max(0, (rag - j0) / BN));
  auto tile_step = [&](const int k, auto ragged) {
    const int stage = k & 1;
    cp_async_wait<0>();
    fence_proxy_async();  // the copies (and, first, the query) visible to the wgmmas
    __syncthreads();      // tile k is in; both warpgroups are done with tile k - 1 (its stage, P, maxima)
    if (k + 1 < tiles) {
      const int64_t after = blk.offset(cur);  // tile k + 2's
      blk.advance(cur);
      blk.load_tile(stage ^ 1, next);
      next = after;
    }
    cp_async_commit();
    if constexpr (F8) {
      blk.convert(stage);
      fence_proxy_async();
      __syncthreads();  // the converted tile is in
    }
    const int kv_bytes = F8 ? 0 : stage * Block::kStageBytes;  // this 16-bit stage's byte offset from sKV
    blk.scores(kv_bytes, s);
    float alpha[2];
    blk.template softmax<decltype(ragged)::value>(k, stage, scale_log2, s, m, l, pa, alpha);
    fence_proxy_async();  // this thread's P in sP, for the other warpgroup's wgmmas
    blk.rescale(o, alpha);
    if constexpr (!decltype(ragged)::value) {
#pragma unroll
      for (int i = 0; i < Block::HS; ++i) wgmma_fence_operand(pa[i]);
      wgmma_fence(o);
      blk.pv_own(o, pa, kv_bytes);
      __syncthreads();  // the other half's P is in
      blk.pv_other(o, kv_bytes);
      wgmma_commit();
      wgmma_wait<0>(o);
    } else {
      if (blk.tid < BN) blk.sBad[blk.tid] = 0;
      __syncthreads();  // the whole tile's P is in; the flags are clear
      blk.pv_ragged(o, pa, k, kv_bytes, max(0, rag - (j0 + k * BN)));
    }
  };
  int k = 0;
  for (; k < plain_tiles; ++k) tile_step(k, std::false_type());
  for (; k < tiles; ++k) tile_step(k, std::true_type());
  blk.epilogue(o, m, l);
#endif
}

template <typename T, int DL, int DR, int BN, bool F8>
cudaError_t mla_wgmma_launch(const MlaParams& p, cudaStream_t stream) {
  auto kernel = mla_wgmma_kernel<T, DL, DR, BN, F8>;
  constexpr int smem = mla_wgmma_smem_bytes<DL + DR, BN, T, F8>();
#ifndef DCP_SIMT
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
#endif
  DCP_LAUNCH(kernel, dim3(p.items), dim3(kMlaWgmmaThreads), smem, stream, p);  // one block per work item
  return cudaGetLastError();
}

template <typename T, int BN, bool F8>
cudaError_t mla_wgmma_dispatch(const MlaParams& p, int latent, int rope, cudaStream_t stream) {
  if (latent == 512)
    return rope == 64 ? mla_wgmma_launch<T, 512, 64, BN, F8>(p, stream)
                      : mla_wgmma_launch<T, 512, 0, BN, F8>(p, stream);
  return rope == 64 ? mla_wgmma_launch<T, 256, 64, BN, F8>(p, stream)
                    : mla_wgmma_launch<T, 256, 0, BN, F8>(p, stream);
}

// The token tile the wgmma kernel takes with this much shared memory (64, else 32; elem_bytes: the query's, 2), or 0
// when it does not run. An FP8 cache's stages take the same bytes.
inline int mla_wgmma_tokens(int latent, int rope, int elem_bytes, int smem_optin) {
  if (elem_bytes != 2 || (latent != 256 && latent != 512) || (rope != 0 && rope != 64)) return 0;
  for (const int bn : {64, 32})
    if (mla_wgmma_smem_bytes(latent + rope, bn, 2, false) <= smem_optin) return bn;
  return 0;
}

// The wgmma split pass (precision "native", p.q16 set; sm_90a only: elsewhere the wgmmas trap): BN = bn from
// mla_wgmma_tokens. T: the query's 16-bit type, and the cache's, or the cache is float8_e4m3fn (F8).
template <typename T, bool F8 = false>
cudaError_t mla_wgmma_pass(const MlaParams& p, int latent, int rope, int bn, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) return cudaErrorInvalidValue;  // 16-bit queries only (mla_wgmma_tokens says 0)
  else
    return bn == 64 ? mla_wgmma_dispatch<T, 64, F8>(p, latent, rope, stream)
                    : mla_wgmma_dispatch<T, 32, F8>(p, latent, rope, stream);
}

}  // namespace dcp_ops::kernels
