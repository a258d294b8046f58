// Split-KV paged decode: each tile of cache rows is read in place through row pointers (a tile spans blocks), scored
// by a register-blocked GEMM, folded into an online base-2 softmax and multiplied into the output, while the next
// tile's rows are prefetched; the splits are combined at the end. The query tokens of one sequence (multi-token
// decode; up to kUnitTokens of them) take each tile in turn while it is in cache, each with its own running state.
#include "cpu/level.h"
#include "cpu/paged_decode.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "checks.h"
#include "cpu/amx.h"
#include "cpu/avx512.h"
#include "cpu/gemm.h"
#include "cpu/line_vector.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

namespace {

// Most tokens per tile; the AMX kernels' tiles (128 tokens ran no faster there: MLA 16 and 128 heads, GQA, bf16, 32K,
// alternated runs).
constexpr int64_t kTileMax = 64;
// Most query tokens of one sequence that share a tile's reads (multi-token decode): their running states and packed
// queries live in each thread's buffers, at most kUnitStateBytes of output state (so that they stay in L2 beside the
// tile): MLA 16 heads x 512 takes 8 tokens (32 KiB each), 128 heads one (256 KiB). (32K tokens, bf16, 2 threads,
// 4 query tokens: MLA 16 heads 18.5 ms against 19.1 for 4 separate sequences; 128 heads w_uk 195 against 184.)
constexpr int64_t kUnitTokens = 8, kUnitStateBytes = 256 * 1024;
constexpr int64_t kTileBytes = 16 * 1024;  // small-G tiles: this tile and the next (prefetched) one fit in L1
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147180559945309f;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Spreads software prefetches of the next tile's rows (every KV head, K and V) over the arithmetic of the current
// tile: each call from a GEMM hook issues a share of the lines, so their memory latency overlaps the math instead of
// stalling the first loads of the next tile. The share is sized from the number of calls the previous tile made.
// The first line of every run is prefetched at once when the tile is queued, so that the TLB walks of all the next
// tile's pages start a whole tile ahead (alternated runs at 32K tokens, bf16 and fp32, batch 1 to 16: 0-8% faster
// than spreading every line).
// For the AMX kernels (`streams`): rows contiguous in the cache are queued as one run, runs are cut into streams of
// at most kStreamBytes, the lines go out one line of each stream in turn, and the kernels call the hook after
// every A tile's products (pv, for more than 32 heads, after every 64 dims of V), a few lines a call. One thread
// reading random 8 KiB blocks here got 9.6 GB/s one block at a time and 12.5 with 4 to 16 blocks read in turn (a
// microbenchmark). Against the runs one after another, in shares after every 32-wide chunk of K or 64 dims of V,
// with runs of 16 KiB or more left to the hardware's stream prefetcher after their first line (32K tokens,
// alternated, medians): GQA 16q/2kv d128 bf16 batch 1 2.42 -> 2.35 ms, batch 16 35.1 -> 33.9; MLA 16 heads bf16
// batch 1 2.78 -> 2.58, batch 16 39.5 -> 37.6, with w_uk batch 1 3.44 -> 2.87; fp32 batch 1 7.89 -> 6.95, batch 16
// 121 -> 107; MLA 128 heads bf16 batch 4 35.2 -> 34.2. Streams alone or the finer shares alone gained a quarter of
// that (MLA 16 heads bf16 batch 1: 2.85 either way against 2.47 both, one build, switched by environment); streams
// of 2 KiB lost most of it, 4 and 16 KiB ran as 8.
// Issuing them is not free: with the cache resident (every block id one of 4 blocks), GQA 16q/2kv bf16 batch 1 took
// 1.40 ms with the prefetches and 0.67 without when each line went out of a loop that kept every stream's cursor in
// memory (about 8 cycles a line). The streams are therefore sorted longest first and issued by offset: the line at one
// offset of every stream with lines left, then the next offset (resident: GQA 1.56 -> 1.09 ms, MLA 16 heads bf16
// 1.74 -> 1.50).
// Every line goes to L2 only (prefetcht1), for both kinds of kernel: a tile with the next one's rows overflows L1, and
// the tile loads and vector loads read L2 at full speed. Into L1 as well (prefetcht0), and for the streams with four
// nops ahead of each prefetch, ran faster on earlier days of the same kind of host (the fifty-first session's notes in
// bench/RESULTS.md), but not on the fifty-third's: 32K, medians, each call after what precedes it in bench_cpu.py (the
// read and matmul probes and the flushes; the configurations in random order), prefetcht0 with nops -> prefetcht1
// without, batch 1: GQA 16q/2kv bf16 2.49 -> 2.40 ms, fp32 4.41 -> 4.15; MLA 16 heads bf16 2.55 / 2.56, with w_uk
// 2.79 / 2.84, fp32 6.72 / 6.87; batch 16 (alternated): GQA bf16 35.0-36.4 -> 31.0-31.7, fp32 62.6-63.2 -> 56.7-57.8;
// MLA 16 heads bf16 35.3-38.4 -> 35.8-37.8, fp32 97-100 -> 88-95; MLA 128 heads bf16 batch 4 28.7-30.6 -> 27.9-28.9.
// prefetchnta took 5.9-6.6 ms, every second or fourth line (the hardware's prefetcher to fetch the rest) 7-45% slower.
struct TilePrefetcher {
  static constexpr int64_t kStreamBytes = 8 * 1024;
  static void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1 on x86
  struct Run {  // bytes to prefetch: from p on for the FMA kernels (p advances), from p + off for the streams
    const char* p;
    const char* end;
  };
  bool streams = false;  // the AMX kernels' mode (above); else whole runs, one after another
  std::vector<Run> merged;  // the next tile's rows, contiguous ones merged for streams
  std::vector<Run> runs;    // ... as they are issued: merged's runs, or their streams, longest first
  size_t next = 0, live = 0;  // the run to issue from next; streams: those with lines past `off` (a prefix)
  int64_t off = 0;            // streams: the byte offset in every stream of the lines now going out
  int64_t per_call = 4, calls = 0;

  void queue(const char* p, int64_t bytes) {
    if (streams && !merged.empty() && merged.back().end == p)
      merged.back().end += bytes;
    else
      merged.push_back({p, p + bytes});
  }
  // Queues the rows (kbytes from each K row, vbytes from each V row; vrows null when V rows are the K rows) and sizes
  // the share of lines per call from the number of calls the previous tile made.
  void start(const char* const* krows, const char* const* vrows, int64_t n, int64_t kbytes, int64_t vbytes) {
    merged.clear();
    runs.clear();
    if (streams) {  // K rows, then V rows, so that a block's rows are contiguous in the queue
      for (int64_t i = 0; i < n; ++i) queue(krows[i], kbytes);
      for (int64_t i = 0; vrows && i < n; ++i) queue(vrows[i], vbytes);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        queue(krows[i], kbytes);
        if (vrows) queue(vrows[i], vbytes);
      }
    }
    int64_t lines = 0;
    for (const Run& run : merged) {
      prefetch_l2(run.p);
      const int64_t bytes = run.end - run.p, cut = streams ? kStreamBytes : bytes;
      lines += ceil_div(bytes, 64);
      for (int64_t o = 0; o < bytes; o += cut)  // the first line is out already
        if (std::max<int64_t>(o, 64) < std::min(bytes, o + cut))
          runs.push_back({run.p + std::max<int64_t>(o, 64), run.p + std::min(bytes, o + cut)});
    }
    if (streams)  // longest first, so that the streams with lines left at any offset are a prefix
      std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.end - a.p > b.end - b.p; });
    live = runs.size();
    off = 0;
    if (calls > 0) per_call = std::max<int64_t>(1, ceil_div(lines, calls));
    next = 0;
    calls = 0;
  }
  void issue(int64_t budget) {
    if (streams) {  // the line at `off` of each stream with lines left in turn, then the next offset
      while (budget > 0 && live > 0) {
        const size_t end = std::min<size_t>(live, next + budget);
        for (size_t i = next; i < end; ++i) prefetch_l2(runs[i].p + off);
        budget -= end - next;
        next = end;
        if (next < live) return;
        next = 0;
        off += 64;
        while (live > 0 && runs[live - 1].p + off >= runs[live - 1].end) --live;
      }
      return;
    }
    for (; budget > 0 && next < runs.size(); ++next) {
      Run& run = runs[next];
      for (; budget > 0 && run.p < run.end; --budget, run.p += 64) prefetch_l2(run.p);
      if (run.p < run.end) return;
    }
  }
  void operator()() {
    ++calls;
    issue(per_call);
  }
  void finish() { issue(std::numeric_limits<int64_t>::max()); }
};

// 2^x for x <= 0 (a score minus the running max), -inf and x < -126 giving 0, NaN giving NaN: x = n + f with n the
// nearest integer, |f| <= 1/2, a degree-6 polynomial for 2^f (relative error ~1e-7, as Cephes' exp2f) and n added to
// the exponent.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
inline __m256 exp2_nonpos(__m256 v) {
  const __m256 tiny = _mm256_cmp_ps(v, _mm256_set1_ps(-126.f), _CMP_LT_OQ);  // true for -inf, false for NaN
  const __m256 c = _mm256_max_ps(_mm256_set1_ps(-126.f), v);                 // NaN stays NaN (second operand)
  const __m256 n = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(c, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

inline fVec exp2_nonpos(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  return exp2_nonpos(static_cast<__m256>(x));
#elif defined(CPU_CAPABILITY_AVX512)
  const __m512 v = x;
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_LT_OQ);
  const __m512 c = _mm512_maskz_max_ps(kAll16, _mm512_set1_ps(-126.f), v);
  const __m512 n = _mm512_maskz_roundscale_ps(kAll16, c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(c, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i biased = _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll16, n), _mm512_set1_epi32(127));
  const __m512i e = _mm512_maskz_slli_epi32(kAll16, biased, 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(e));
#else
  return x.exp2();
#endif
}

// x[0 .. n) *= mult: scores of the unscaled bf16 query brought to base-2 softmax units.
void scale_scores(float* x, int64_t n, float mult) {
  const fVec mv(mult);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) (fVec::loadu(x + i) * mv).store(x + i);
  if (i < n) (fVec::loadu(x + i, n - i) * mv).store(x + i, n - i);
}

// One KV head's query as gemm_dp / gemm_dp8 take it: pair i of head g, (q_g[2i], q_g[2i + 1]) in bf16 (0 past an odd
// K), at qp[i * qheads + g] for the G heads. q's rows are a bf16 query times q_mult in fp32, so times inv = 1 / q_mult
// they round back to it. Each row is scaled into row32 and rounded by round_to_bf16 (as c10::BFloat16 rounds, 16
// elements at a time; NaN stays NaN) into row16, then copied a pair at a time: converted one element at a time, the
// query took 0.2 ms of a 0.43 ms call for MLA's 128 heads at 64 tokens. row32 and row16 hold K rounded up to even.
void pack_query_pairs(int64_t G, int64_t K, const float* q, int64_t q_sh, float inv, int64_t qheads, float* row32,
                      c10::BFloat16* row16, uint32_t* qp) {
  const int64_t pairs = (K + 1) / 2;
  const fVec iv(inv);
  for (int64_t g = 0; g < G; ++g) {
    const float* src = q + g * q_sh;
    int64_t d = 0;
    for (; d + kVL <= K; d += kVL) (fVec::loadu(src + d) * iv).store(row32 + d);
    for (; d < K; ++d) row32[d] = src[d] * inv;
    if (K % 2) row32[K] = 0.f;
    round_to_bf16(row32, row16, 2 * pairs);
    for (int64_t i = 0; i < pairs; ++i) std::memcpy(qp + i * qheads + g, row16 + 2 * i, 4);
  }
}

// Whether x[0 .. n) are all finite: x - x is 0 for a finite x and NaN for an inf or a NaN, and a NaN survives the sum.
bool all_finite(const float* x, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) {
    const fVec v = fVec::loadu(x + i);
    acc = acc + (v - v);
  }
  float total = 0.f;
  for (; i < n; ++i) total += x[i] - x[i];
  alignas(64) float lanes[kVL];
  acc.store(lanes);
  for (float f : lanes) total += f;
  return total == 0.f;
}

// st[i * Ga + g] = K_i . q_g in fp32 FMAs for i < n (0 for the padded heads g >= G): the AMX scores of a tile whose K
// holds an inf or NaN in a valid slot, for a query split into three bf16 terms, whose zero or opposite-signed terms
// would make q x inf a NaN where the reference has +-inf.
template <typename Rows>
void exact_scores(int64_t n, int64_t G, int64_t Ga, int64_t Dk, const Rows& rows, const float* q, int64_t q_sh,
                  float* st) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < Ga; ++g) {
      float s = 0.f;
      if (g < G)
        for (int64_t d = 0; d < Dk; ++d) s = std::fma(q[g * q_sh + d], to_f32(rows(i)[d]), s);
      st[i * Ga + g] = s;
    }
}

// The first Dv elements of rows g < G of o (rows `stride` floats apart) times alpha[g]: the running outputs brought to
// a new running max.
void rescale_rows(float* o, int64_t G, int64_t Dv, int64_t stride, const float* alpha) {
  for (int64_t g = 0; g < G; ++g) {
    if (alpha[g] == 1.f) continue;
    float* orow = o + g * stride;
    const fVec av(alpha[g]);
    int64_t d = 0;
    for (; d + kVL <= Dv; d += kVL) (fVec::loadu(orow + d) * av).store(orow + d);
    for (; d < Dv; ++d) orow[d] *= alpha[g];
  }
}

// Online softmax over one tile of transposed base-2 scores st[n x G] times mult (1, or q_mult for the scores of an
// unscaled bf16 query, as scale_scores would have scaled them first): st becomes probabilities, m and l are updated,
// and alpha[g] is what head g's running output must be multiplied by (rescale_rows). Vectorised across the G heads;
// the running max in four partial maxima, since one chain of them (max, compare, or: 5 cycles a row) took 40% of the
// function's time (AMX GQA bf16, cache resident). hook() runs every 16 rows of the max and every 8 of the
// exponentials: the AMX kernels' prefetches of the next tile, which would otherwise pause here (32K, medians, each
// call after what precedes it in bench_cpu.py: GQA 16q/2kv bf16 batch 1 2.33-2.35 -> 2.10-2.11 ms, batch 16 33.3 ->
// 30.8; MLA 16 heads bf16 batch 1 the same, batch 16 41.3 -> 39.2, with w_uk 44.7 / 45.4).
template <typename Hook = NoHook>
void softmax_update(float* st, int64_t G, int64_t n, float* m, float* l, float* alpha, float mult = 1.f,
                    Hook&& hook = NoHook{}) {
  constexpr int64_t VL = fVec::size();
  const fVec mv(mult);
  for (int64_t g0 = 0; g0 < G; g0 += VL) {
    const int64_t w = std::min(VL, G - g0);
    auto row = [&](int64_t i) { return fVec::loadu(st + i * G + g0, w) * mv; };
    const fVec m_old = fVec::loadu(m + g0, w);
    fVec mx[4] = {m_old, m_old, m_old, m_old};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (int r = 0; r < 4; ++r) mx[r] = vmax(mx[r], row(i + r));
      if (i % 16 == 12) hook();
    }
    for (; i < n; ++i) mx[0] = vmax(mx[0], row(i));
    const fVec top = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
    const fVec base = fVec::blendv(top, fVec(0.f), top == fVec(kNegInf));  // only -inf so far: every e is 0
    const fVec a = exp2_nonpos(m_old - base);  // 0 on the first tile (m = -inf)
    fVec sum(0.f);
    for (i = 0; i < n; ++i) {
      const fVec e = exp2_nonpos(row(i) - base);
      e.store(st + i * G + g0, w);
      sum = sum + e;
      if (i % 8 == 7) hook();
    }
    (fVec::loadu(l + g0, w) * a + sum).store(l + g0, w);
    top.store(m + g0, w);
    a.store(alpha + g0, w);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// softmax_update for G <= 8 heads in AVX-512 builds: one 256-bit vector per token row of st rather than a half-empty
// 512-bit one.
void softmax_update8(float* st, int64_t G, int64_t n, float* m, float* l, float* alpha) {
  const __mmask8 mk = static_cast<__mmask8>((1u << G) - 1);
  auto load = [&](const float* p) { return G == 8 ? _mm256_loadu_ps(p) : _mm256_maskz_loadu_ps(mk, p); };
  auto store = [&](float* p, __m256 x) { G == 8 ? _mm256_storeu_ps(p, x) : _mm256_mask_storeu_ps(p, mk, x); };
  const __m256 m_old = load(m);
  __m256 mx = m_old;
  for (int64_t i = 0; i < n; ++i) {  // a NaN score propagates, as vmax does
    const __m256 x = load(st + i * G);
    mx = _mm256_or_ps(_mm256_max_ps(mx, x), _mm256_cmp_ps(mx, x, _CMP_UNORD_Q));
  }
  const __m256 base =  // only -inf so far: every e is 0
      _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ));
  const __m256 a = exp2_nonpos(_mm256_sub_ps(m_old, base));  // 0 on the first tile (m = -inf)
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 e = exp2_nonpos(_mm256_sub_ps(load(st + i * G), base));
    store(st + i * G, e);
    sum = _mm256_add_ps(sum, e);
  }
  store(l, _mm256_fmadd_ps(load(l), a, sum));
  store(m, mx);
  store(alpha, a);
}
#endif

template <typename scalar_t>
void paged_decode_impl(const PagedDecodeParams& p) {
  const int64_t G = p.Hq / p.Hkv;
  // Small G (GQA): scores by gemm_nt, tiles sized to stay in L1. Large G (MLA): scores by gemm_acc with the heads
  // along the vector, whose Q^T tile is reused over up to kTileMax rows. G < 16 in every build: tuned in AVX2 builds,
  // and in AVX-512 builds MLA's 16 heads ran 7-17% faster with the heads along the vector than by gemm_nt (fp32,
  // alternated calls).
  const bool nt = G < 16;
  // A bf16 cache and an exact bf16 query in AVX512_BF16 builds: scores by bf16 dot products of the unscaled query,
  // scaled after in fp32; by gemm_dp for whole vectors of heads (MLA), by gemm_dp8 for at most 8 (GQA; P.V as with nt).
  const bool exact_bf16 = kDpBf16 && std::is_same_v<scalar_t, c10::BFloat16> && p.q_exact_bf16;
  // V rows are the first Dv elements of the K rows (MLA's latent; or one tensor passed as both caches).
  const bool v_in_k = p.v == p.k && p.v_sb == p.k_sb && p.v_st == p.k_st && p.v_sh == p.k_sh && p.Dv <= p.Dk;
  // A bf16 cache in AMX builds, K and V rows of multiples of 32 (amx::fits): both GEMMs on AMX tiles (amx.h), an fp32
  // query as three bf16 terms and the probabilities as two. Ga: heads per KV head as the running state lays them out;
  // the AMX kernels take whole tiles of 16, the heads past G (zero queries) computed and dropped.
#if defined(DCP_OPS_AMX)
  // An fp32 cache with 16 heads per KV head and V in K's rows (MLA 16 heads) too: each tile's rows are split into
  // three bf16 terms (amx::split_rows, exact), scored against the query's three, and P's three terms multiplied by
  // V's (the same split rows): six tile products for each, fp32 accuracy. (32K tokens, batch 16, alternated: MLA 16
  // heads 127-135 -> 118-124 ms, with w_uk 133-141 -> 124-127 ms; GQA 32q/2kv d128 84 -> 123 ms, which splits V's rows
  // too and keeps the FMA kernels.) Where Linux refuses the tile state, an fp32 cache keeps the FMA kernels (as exact,
  // and what it ran on before), while a bf16 one raises below.
  const bool amx32 = std::is_same_v<scalar_t, float> && G == 16 && v_in_k && amx::fits(p.Dk, p.Dv) &&
                     amx_tile_permitted();
  const bool amx = (std::is_same_v<scalar_t, c10::BFloat16> && amx::fits(p.Dk, p.Dv)) || amx32;
  TORCH_CHECK(!amx || amx_tile_permitted(), "paged_decode: Linux refused this process the AMX tile state "
              "(arch_prctl ARCH_REQ_XCOMP_PERM); set DCP_OPS_CPU_CAPABILITY=avx512bf16");
  const int qterms = p.q_exact_bf16 && !amx32 ? 1 : 3;  // (score_block3 takes K in three terms against three)
  const int64_t Ga = amx ? amx::padded_heads(G) : G;
  const bool v_rows = amx && Ga <= amx::kRowsVMaxHeads;  // P.V by pv_rows: O's columns even / odd apart per 32
  // ... or, for at most 8 heads of a bf16 cache, by pv_stacked: both halves of P's dwords in one A tile, half the
  // products and P's tiles (32K tokens, GQA 16q/2kv d128, alternated: batch 1 3.0 -> 2.8 ms, batch 16 45.6 -> 40.3).
  const bool stack_fits = amx && !amx32 && G <= amx::kStackedMaxHeads;
#else
  constexpr bool amx = false, amx32 = false, v_rows = false;
  constexpr bool stack_fits = false;
  const int64_t Ga = G;
#endif
  const int64_t Hqa = p.Hkv * Ga;
  const bool dp = !amx && exact_bf16 && G % kVL == 0, dp8 = !amx && exact_bf16 && G <= 8;
  // Large G with a bf16 / fp16 cache: the score GEMM reads each K element once per column strip of heads and P.V each
  // V element once per block of 6 heads (22 times for 128 heads), converting it every time; instead each KV head's
  // tile rows are converted to fp32 once, into a buffer that stays in L2 (MLA 128 heads, 32K, bf16: 119 -> 93 ms;
  // 16 heads 13.6 -> 11.5; outputs bitwise the same).
  const bool convert = !std::is_same_v<scalar_t, float> && !nt && !amx;
  // ... V's rows too, except where the scores are bf16 dot products on K's rows in place (dp) and there are at most
  // 16 heads: P.V then reads V's bf16 rows in place as well, converting them in registers once per block of 6 heads
  // (Zen 4, MLA 16 heads, alternated: 4K tokens, batch 1, warm 0.917 -> 0.850 ms; 32K batch 1, cold 5.65 -> 5.45 ms;
  // 32 and 64 heads the same; 128 heads 4-5% slower; GQA 32q/2kv d128, V its own rows, 4K batch 1, warm: 0.501-0.541
  // -> 0.476-0.500 ms). Outputs bitwise the same either way.
  const bool convert_v = convert && !(dp && G <= 16);
  const int64_t token_bytes =
      (p.Hkv * p.Dk + (v_in_k ? 0 : p.Hkv * p.Dv)) * static_cast<int64_t>(sizeof(scalar_t));
  // Tiles of a multiple of the rows gemm_nt takes at a time: at 32K tokens, bf16 16q/2kv d128 ran 7-10% faster in
  // tiles of 15 tokens than of 16, whose last token went through a half-idle pair of rows.
  const int64_t rb = dp8 ? kDp8Rows : gemm_nt_row_block(G);
  const int64_t kTile = amx ? kTileMax
                       : nt ? std::clamp<int64_t>((kTileBytes / token_bytes + rb / 2) / rb * rb, rb, kTileMax / rb * rb)
                            : kTileMax;
  // Units of work: up to unit_max query tokens of one sequence (multi-token decode: cu_seqlens_q), which share
  // each KV tile read: the tile's rows are read from memory once and then, for every query token of the unit, scored,
  // folded into that token's own running state and multiplied into its output, each token masked at its own length.
  struct Unit {
    int64_t b, t0, t1, len;  // block-table row, query tokens [t0, t1), the longest of their lengths
  };
  std::vector<Unit> units;
  int64_t max_len = 0, unit_tokens = 1;
  const int64_t unit_max =
      std::clamp<int64_t>(kUnitStateBytes / std::max<int64_t>(1, p.Hq * p.Dv * 4), 1, kUnitTokens);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t t_begin = p.cu_seqlens_q ? p.cu_seqlens_q[b] : b;
    const int64_t t_end = p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] : b + 1;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += unit_max) {
      Unit u{b, t0, std::min(t_end, t0 + unit_max), 0};
      for (int64_t t = u.t0; t < u.t1; ++t) u.len = std::max<int64_t>(u.len, p.seq_lens[t]);
      max_len = std::max(max_len, u.len);
      unit_tokens = std::max(unit_tokens, u.t1 - u.t0);
      units.push_back(u);
    }
  }
  const int64_t nunits = static_cast<int64_t>(units.size());
  const int64_t threads = at::get_num_threads();
  // Enough splits to give every thread work when the batch is small, never splits of less than a tile.
  const int64_t nsplit = std::max<int64_t>(1, std::min(ceil_div(4 * threads, std::max<int64_t>(nunits, 1)),
                                                       ceil_div(max_len, kTile)));
  const int64_t items = nunits * nsplit;  // one item = one token range of one unit, all KV heads
  // Threads claim items one at a time, longest sequences first, so that a thread slowed down for a while (another
  // tenant on a shared host) or a mix of long and short sequences does not leave the other threads idle at the end:
  // batch 3 at 32K tokens, 2 threads (9 items) ran 16-20% faster than with a static split of the items.
  std::vector<int64_t> order(nunits);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return units[a].len > units[b].len; });
  std::atomic<int64_t> next_item{0};
  // Every item writes its whole slice of these, so they are not zeroed first (part_o is 2 MiB for 8 splits of 128 MLA
  // heads).
  std::unique_ptr<float[]> part_o(new float[p.T * nsplit * p.Hq * p.Dv]), part_m(new float[p.T * nsplit * p.Hq]),
      part_l(new float[p.T * nsplit * p.Hq]);
  const int64_t qpack = std::max(packed_nt_size(G, p.Dk), p.Dk * G);
  // bf16 pairs (32 bits each) of one KV head's query, for gemm_dp (G heads) or gemm_dp8 (8 heads, 0 past G)
  const int64_t qheads = dp8 ? 8 : G, qpairs = (p.Dk + 1) / 2 * qheads;
  // Bytes of a token's entry (every KV head) in each cache.
  const int64_t kbytes = ((p.Hkv - 1) * p.k_sh + p.Dk) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t vbytes = ((p.Hkv - 1) * p.v_sh + p.Dv) * static_cast<int64_t>(sizeof(scalar_t));
  const auto* kc = static_cast<const scalar_t*>(p.k);
  const auto* vc = static_cast<const scalar_t*>(p.v);
#if defined(DCP_OPS_AMX)
  // Elements of one KV head's Q^T packed for the score tiles (16 columns per KV head whatever G: 16x the query's
  // size with one head per KV head, so it is packed per thread for the token at hand, not for the whole batch).
  const int64_t qb_size = qterms * amx::q_size(Ga, p.Dk);
#endif

  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    // Running state lives in this thread's buffers (items of other threads share cache lines in part_*); st, acc_o and
    // the AMX buffers start on cache lines, as AMX tiles load and store them (line_vector.h).
    LineVector<float> st(kTileMax * Ga), acc_o(unit_tokens * Hqa * p.Dv);
    std::vector<float> qt(unit_tokens * p.Hkv * qpack), alpha(Ga), acc_m(unit_tokens * Hqa), acc_l(unit_tokens * Hqa);
    // Row pointers (token entries) of this tile and of the next one, which is being prefetched.
    std::vector<const scalar_t*> krows(kTileMax), vrows(kTileMax), next_krows(kTileMax), next_vrows(kTileMax);
    TilePrefetcher pf;
    pf.streams = amx;
    // ... every KV head's, with a row of the query in fp32 and bf16 on the way (pack_query_pairs); gemm_dp8's heads
    // past G are zeroed here and never written
    std::unique_ptr<uint32_t[]> qp(dp8  ? new uint32_t[unit_tokens * p.Hkv * qpairs]()
                                   : dp ? new uint32_t[unit_tokens * p.Hkv * qpairs]
                                        : nullptr);
    std::vector<float> qrow32(dp || dp8 ? (p.Dk + 1) / 2 * 2 : 0);
    std::vector<c10::BFloat16> qrow16(qrow32.size());
    // fp32 copies of one KV head's tile rows, when `convert` / `convert_v` (147 KiB for MLA: left uninitialised, as
    // every row used is written first)
    std::unique_ptr<float[]> kf((convert && !dp) || (convert_v && v_in_k) ? new float[kTileMax * p.Dk] : nullptr),
        vf(convert_v && !v_in_k ? new float[kTileMax * p.Dv] : nullptr);
#if defined(DCP_OPS_AMX)
    // AMX: the tile configuration for this thread; copies of unevenly strided K rows (bf16) or the three terms of
    // every K row (fp32); V for P.V (pack_v's pairs, or copies of unevenly strided V rows for pv_rows / pv_stacked);
    // P's terms (pack_p's, or pack_p_halves' or pack_p_stacked's dwords)
    std::optional<amx::TileScope> tiles;
    if (amx) tiles.emplace();
    const int kterms = amx32 ? 3 : 1;  // bf16 terms of each cache element in the tiles
    LineVector<amx::bf16> kbuf(amx ? kterms * kTileMax * p.Dk : 0), vbuf(amx ? p.Dv / 16 * amx::v_tile(kTileMax) : 0);
    LineVector<amx::bf16> qb(amx ? unit_tokens * p.Hkv * qb_size : 0);  // unit q_unit's Q^T, every token and KV head
    LineVector<uint32_t> pbuf(amx ? std::max({Ga * kTileMax, amx::p_halves_size(Ga, kTileMax, kterms == 3 ? 3 : 2),
                                              amx::p_stacked_size(kTileMax, 2)})
                                  : 0);
#endif
    int64_t q_unit = -1;  // the unit whose queries qt, qp (or qb) hold
    for (int64_t claim; (claim = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t ui = order[claim / nsplit], split = claim % nsplit;
      const Unit& unit = units[ui];
      const int64_t nq = unit.t1 - unit.t0;  // query tokens of the unit; token i is t0 + i
      const int64_t chunk = ceil_div(ceil_div(unit.len, nsplit), kTile) * kTile;
      const int64_t j0 = split * chunk, j1 = std::min(unit.len, j0 + chunk);
      // The queries in the kernels' layouts, packed once per unit and thread: a thread's next item is often of the
      // same unit (packed per item, the query took 8% of MLA 16 heads' time at 4K tokens, batch 1, on the FMA kernels).
      const bool new_q = j0 < j1 && q_unit != ui;
      if (new_q) q_unit = ui;
      for (int64_t qi = 0; new_q && qi < nq; ++qi) {
        const float* qtok = p.q + (unit.t0 + qi) * p.q_st;
#if defined(DCP_OPS_AMX)
        if (amx)
          for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
            amx::pack_q(G, Ga, p.Dk, qtok + kvh * G * p.q_sh, p.q_sh, p.q_exact_bf16 ? 1.f / p.q_mult : 1.f, qterms,
                        qb.data() + (qi * p.Hkv + kvh) * qb_size);
#endif
        if (amx && !amx32) continue;  // (an fp32 item may be recomputed without AMX, below)
        if (dp || dp8) {  // Q^T per KV head in pairs of rows: the bf16 query itself
          for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
            pack_query_pairs(G, p.Dk, qtok + kvh * G * p.q_sh, p.q_sh, 1.f / p.q_mult, qheads, qrow32.data(),
                             qrow16.data(), qp.get() + (qi * p.Hkv + kvh) * qpairs);
        } else if (nt) {  // Q per KV head packed for gemm_nt
          for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
            pack_nt(G, p.Dk, qtok + kvh * G * p.q_sh, p.q_sh, qt.data() + (qi * p.Hkv + kvh) * qpack);
        } else {  // Q^T per KV head [Dk x G]: S^T = K Q^T puts the heads along the vector
          float* qti = qt.data() + qi * p.Hkv * qpack;
          for (int64_t h = 0; h < p.Hq; ++h)
            for (int64_t d = 0; d < p.Dk; ++d) qti[((h / G) * p.Dk + d) * G + h % G] = qtok[h * p.q_sh + d];
        }
      }
      const int32_t* row = p.block_table + unit.b * p.bt_stride;
      // Row pointers of tokens j .. j + n - 1 (block and offset stepped, not divided, per token).
      auto fill_rows = [&](int64_t j, int64_t n, const scalar_t** kr, const scalar_t** vr) {
        int64_t b = j / p.block_size, off = j % p.block_size;
        for (int64_t i = 0; i < n; ++i) {
          kr[i] = kc + row[b] * p.k_sb + off * p.k_st;
          vr[i] = vc + row[b] * p.v_sb + off * p.v_st;
          if (++off == p.block_size) off = 0, ++b;
        }
      };
      // The item's tiles: on AMX (use_amx) with P.V on V's rows in place (pv_rows) or on V packed (pack_v, pv), or
      // on the fp32 FMA kernels; every query token of the unit (i) has its own running state in acc_*.
      auto run = [&](bool use_amx, bool rows_v) {
        [[maybe_unused]] const bool stacked = rows_v && stack_fits;  // read in AMX builds only
        std::fill(acc_o.data(), acc_o.data() + nq * Hqa * p.Dv, 0.f);
        std::fill(acc_m.begin(), acc_m.begin() + nq * Hqa, kNegInf);
        std::fill(acc_l.begin(), acc_l.begin() + nq * Hqa, 0.f);
        if (j0 < j1) fill_rows(j0, std::min(kTile, j1 - j0), next_krows.data(), next_vrows.data());
        for (int64_t j = j0; j < j1; j += kTile) {
          const int64_t n_tile = std::min(kTile, j1 - j), n_next = std::clamp<int64_t>(j1 - j - n_tile, 0, kTile);
          krows.swap(next_krows);  // this tile's rows were filled (and prefetched) as the previous tile's next
          vrows.swap(next_vrows);
          fill_rows(j + n_tile, n_next, next_krows.data(), next_vrows.data());
          pf.start(reinterpret_cast<const char* const*>(next_krows.data()),
                   v_in_k ? nullptr : reinterpret_cast<const char* const*>(next_vrows.data()), n_next, kbytes,
                   vbytes);
          for (int64_t qi = 0; qi < nq; ++qi) {  // the tile's rows, read from memory for the first, from cache after
            const int64_t t = unit.t0 + qi, n = std::clamp<int64_t>(p.seq_lens[t] - j, 0, n_tile);  // its own length
            if (n == 0) continue;
            float* o = acc_o.data() + qi * Hqa * p.Dv;
            float* m = acc_m.data() + qi * Hqa;
            float* l = acc_l.data() + qi * Hqa;
            for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
              const RowPtrs<scalar_t> k{krows.data(), kvh * p.k_sh};
              const RowPtrs<scalar_t> v{vrows.data(), kvh * p.v_sh};
              float* oh = o + kvh * G * p.Dv;
              const Strided<float> pt{st.data(), 1, G};  // P = st^T, read in place
#if defined(DCP_OPS_AMX)
              if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, float>) {  // AMX's
                if (use_amx) {
                  auto krow = [&](int64_t i) { return krows[i] + kvh * p.k_sh; };
                  auto vrow = [&](int64_t i) { return vrows[i] + kvh * p.v_sh; };
                  float* oa = o + kvh * Ga * p.Dv;
                  amx::TileRows kt[3];  // K's tiles: the cache rows (bf16), or their three bf16 terms (fp32)
                  if constexpr (std::is_same_v<scalar_t, float>)
                    amx::split_rows(krow, n, p.Dk, kbuf.data(), kt);
                  else
                    kt[0] = amx::tile_rows(krow, n, p.Dk, p.k_st, kbuf.data());
                  amx::scores(n, Ga, p.Dk, kt, kterms, qb.data() + (qi * p.Hkv + kvh) * qb_size, qterms, st.data(), pf);
                  if (qterms > 1 && !all_finite(st.data(), n * Ga))
                    exact_scores(n, G, Ga, p.Dk, krow, p.q + t * p.q_st + kvh * G * p.q_sh, p.q_sh, st.data());
                  softmax_update(st.data(), Ga, n, m + kvh * Ga, l + kvh * Ga, alpha.data(),
                                 p.q_exact_bf16 ? p.q_mult : 1.f, pf);
                  if (stacked) {  // rows h and 8 + h of O are head h's even and odd dims
                    rescale_rows(oa, G, p.Dv / 2, p.Dv, alpha.data());
                    rescale_rows(oa + amx::kStackedMaxHeads * p.Dv, G, p.Dv / 2, p.Dv, alpha.data());
                  } else {
                    rescale_rows(oa, Ga, p.Dv, p.Dv, alpha.data());
                  }
                  if constexpr (std::is_same_v<scalar_t, float>) {
                    // P's three terms against V's: the first Dv elements of K's split rows (amx32 takes v_in_k)
                    amx::pack_p_halves(st.data(), n, Ga, 3, pbuf.data());
                    amx::pv_rows<3, 3>(Ga, p.Dv, n, pbuf.data(), kt, oa, pf);
                  } else if (rows_v) {  // P's two terms against V's rows: K's (their first Dv elements) or their own
                    const amx::TileRows vt = v_in_k ? kt[0] : amx::tile_rows(vrow, n, p.Dv, p.v_st, vbuf.data());
                    if (stacked) {
                      amx::pack_p_stacked(st.data(), n, Ga, 2, pbuf.data());
                      amx::pv_stacked<2>(p.Dv, n, pbuf.data(), vt, oa, pf);
                    } else {
                      amx::pack_p_halves(st.data(), n, Ga, 2, pbuf.data());
                      amx::pv_rows<2, 1>(Ga, p.Dv, n, pbuf.data(), &vt, oa, pf);
                    }
                  } else {
                    const int64_t np = amx::padded(n);
                    auto* hi = reinterpret_cast<amx::bf16*>(pbuf.data());
                    amx::pack_p(st.data(), n, Ga, np, hi, hi + Ga * np);
                    amx::pack_v(vrow, n, np, p.Dv, vbuf.data());
                    amx::pv(Ga, p.Dv, np, hi, hi + Ga * np, vbuf.data(), oa, pf);
                  }
                  continue;
                }
              }
#endif
              if (dp8) {
#if defined(DCP_OPS_AVX512_BF16)
                if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
                  gemm_dp8(n, p.Dk, k, reinterpret_cast<const c10::BFloat16*>(qp.get() + (qi * p.Hkv + kvh) * qpairs),
                           st.data(), G, G,
                           pf);
#endif
                scale_scores(st.data(), n * G, p.q_mult);
              } else if (nt) {
                gemm_nt(n, G, p.Dk, k, qt.data() + (qi * p.Hkv + kvh) * qpack, st.data(), G, pf);
              } else {
                std::fill(st.begin(), st.begin() + n * G, 0.f);
                const Strided<float> qh{qt.data() + qi * p.Hkv * qpack + kvh * p.Dk * G, G, 1};
                if (dp) {
#if defined(DCP_OPS_AVX512_BF16)
                  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
                    gemm_dp(n, G, p.Dk, k,
                            reinterpret_cast<const c10::BFloat16*>(qp.get() + (qi * p.Hkv + kvh) * qpairs), G,
                            st.data(),
                            G, pf);
#endif
                  scale_scores(st.data(), n * G, p.q_mult);
                  if (convert_v && v_in_k)  // P.V reads the fp32 copy of V, K's first Dv elements (a separate V: below)
                    for (int64_t i = 0; i < n; ++i) convert_row(k.row(i), p.Dv, kf.get() + i * p.Dk);
                } else if (convert) {
                  for (int64_t i = 0; i < n; ++i) convert_row(k.row(i), p.Dk, kf.get() + i * p.Dk);
                  gemm_acc(n, G, p.Dk, Strided<float>{kf.get(), p.Dk, 1}, qh, st.data(), G, pf);
                } else {
                  gemm_acc(n, G, p.Dk, k, qh, st.data(), G, pf);
                }
              }
#if defined(CPU_CAPABILITY_AVX512)
              if (G <= 8)
                softmax_update8(st.data(), G, n, m + kvh * G, l + kvh * G, alpha.data());
              else
#endif
                softmax_update(st.data(), G, n, m + kvh * G, l + kvh * G, alpha.data());
              rescale_rows(oh, G, p.Dv, p.Dv, alpha.data());
              if (convert_v && v_in_k) {
                gemm_acc(G, p.Dv, n, pt, Strided<float>{kf.get(), p.Dk, 1}, oh, p.Dv, pf);
              } else if (convert_v) {
                for (int64_t i = 0; i < n; ++i) convert_row(v.row(i), p.Dv, vf.get() + i * p.Dv);
                gemm_acc(G, p.Dv, n, pt, Strided<float>{vf.get(), p.Dv, 1}, oh, p.Dv, pf);
              } else {
                gemm_acc(G, p.Dv, n, pt, v, oh, p.Dv, pf);
              }
            }
          }
          pf.finish();
        }
      };
      // P.V on V's cache rows puts the zero half of each P dword against a real V element, so a non-finite V element
      // in a valid slot (0 x inf = NaN) would also turn its neighbouring dim's output NaN where the reference gives a
      // number; an fp32 V element's terms (inf - inf) are NaN too. An item with any non-finite output is therefore
      // recomputed with V packed (bf16), whose products keep the dims apart, or on the fp32 FMA kernels; finite caches
      // never take this second pass.
      bool rows_v = v_rows;
      run(amx, rows_v);
      if (rows_v && !all_finite(acc_o.data(), nq * Hqa * p.Dv)) run(amx && !amx32, rows_v = false);
      for (int64_t qi = 0; qi < nq; ++qi) {
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {  // the first G of each KV head's Ga heads
          const int64_t item = (unit.t0 + qi) * nsplit + split;  // the partials' index: (query token, split)
          const float* o = acc_o.data() + qi * Hqa * p.Dv;
          const float* m = acc_m.data() + qi * Hqa;
          const float* l = acc_l.data() + qi * Hqa;
          float* dst = part_o.get() + (item * p.Hq + kvh * G) * p.Dv;
#if defined(DCP_OPS_AMX)
          if (rows_v) {  // odd dims 16 columns on (pv_rows) or 8 rows down (pv_stacked)
            const int64_t odd = stack_fits ? amx::kStackedMaxHeads * p.Dv : 16, step = stack_fits ? 16 : 32;
            for (int64_t g = 0; g < G; ++g) {
              const float* even = o + (kvh * Ga + g) * p.Dv;
              amx::interleave_row(even, even + odd, step, p.Dv, dst + g * p.Dv);
            }
          } else
#endif
            std::copy(o + kvh * Ga * p.Dv, o + (kvh * Ga + G) * p.Dv, dst);
          std::copy(m + kvh * Ga, m + kvh * Ga + G, part_m.get() + item * p.Hq + kvh * G);
          std::copy(l + kvh * Ga, l + kvh * Ga + G, part_l.get() + item * p.Hq + kvh * G);
        }
      }
    }
  });

  // Combine the splits of each (token, head): exact online-softmax merge in base 2, stored in the output's type.
  at::parallel_for(0, p.T * p.Hq, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(nsplit), row(p.Dv);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / p.Hq, h = th % p.Hq;
      auto idx = [&](int64_t sp) { return (t * nsplit + sp) * p.Hq + h; };
      // A NaN score made its split's m NaN (vmax keeps NaN), a +inf one its m +inf: the row is NaN, or
      // NaN with LSE +inf, as in the float64 reference; only -inf scores or none: an empty row (docs/design.md §2).
      float mx = kNegInf;
      bool nan = false;
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        nan |= std::isnan(part_m[idx(sp)]);
        mx = std::max(mx, part_m[idx(sp)]);
      }
      float* dst = row.data();
      if (nan || mx == kNegInf || mx == -kNegInf) {
        std::fill(dst, dst + p.Dv, mx == kNegInf && !nan ? 0.f : std::numeric_limits<float>::quiet_NaN());
        store_row(p.out, p.out_dtype, th * p.Dv, dst, p.Dv);
        p.lse[th] = nan ? std::numeric_limits<float>::quiet_NaN() : mx;
        continue;
      }
      float total = 0.f;
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        w[sp] = part_m[idx(sp)] == kNegInf ? 0.f : std::exp2(part_m[idx(sp)] - mx);
        total += w[sp] * part_l[idx(sp)];
      }
      const float inv = 1.f / total;
      std::fill(dst, dst + p.Dv, 0.f);
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        if (w[sp] == 0.f) continue;
        const float* src = part_o.get() + idx(sp) * p.Dv;
        const float ws = w[sp] * inv * p.out_mult;
        for (int64_t d = 0; d < p.Dv; ++d) dst[d] += ws * src[d];
      }
      store_row(p.out, p.out_dtype, th * p.Dv, dst, p.Dv);
      p.lse[th] = (mx + std::log2(total)) * kLn2;
    }
  });
}

}  // namespace

// Declared (and described) in paged_decode.h.
void store_row(void* out, at::ScalarType dtype, int64_t offset, const float* src, int64_t n) {
  switch (dtype) {
    case at::kFloat: std::copy(src, src + n, static_cast<float*>(out) + offset); break;
    case at::kBFloat16: std::copy(src, src + n, static_cast<c10::BFloat16*>(out) + offset); break;
    case at::kHalf: std::transform(src, src + n, static_cast<c10::Half*>(out) + offset, from_f32<c10::Half>); break;
    default: TORCH_CHECK(false, "store_row: unsupported output dtype ", dtype);
  }
}

void check_paged_indices(const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_blocks, int64_t block_size,
                         const char* op) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  const int64_t bt_stride = block_table.stride(0), max_blocks = block_table.size(1);
  const int64_t rows = cu ? block_table.size(0) : seq_lens.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t longest = 0;  // of the row's query tokens
    for (int64_t t = cu ? cu[r] : r; t < (cu ? cu[r + 1] : r + 1); ++t) {
      const int64_t len = lens[t];
      DCP_CHECK(len >= 0 && len <= max_blocks * block_size, op, "seq_lens[", t, "] = ", len,
                " must be in [0, max_blocks * block_size = ", max_blocks * block_size, "]");
      longest = std::max(longest, len);
    }
    for (int64_t b = 0; b < ceil_div(longest, block_size); ++b) {
      const int64_t id = bt[r * bt_stride + b];
      DCP_CHECK(id >= 0 && id < num_blocks, op, "block_table[", r, ", ", b, "] = ", id,
                " is outside the cache's [0, num_blocks = ", num_blocks, ")");
    }
  }
}

void paged_decode(const PagedDecodeParams& p, at::ScalarType cache_dtype) {
  switch (cache_dtype) {
    case at::kFloat: paged_decode_impl<float>(p); break;
    case at::kBFloat16: paged_decode_impl<c10::BFloat16>(p); break;
    case at::kHalf: paged_decode_impl<c10::Half>(p); break;
    case at::kFloat8_e4m3fn: paged_decode_impl<c10::Float8_e4m3fn>(p); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", cache_dtype);
  }
}

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
