// Split-KV paged decode, the driver: the work is cut into items (a range of one sequence's KV tokens for up to
// kUnitTokens of its query tokens, every KV head), which threads claim longest first; an item walks its tiles of cache
// rows, read in place through row pointers (a tile spans blocks) while the next tile's rows are prefetched, and hands
// each (query token, KV head) to a tile kernel: scores, online base-2 softmax, P.V into that token's running state.
// The splits of each (token, head) are merged exactly at the end. The phases: make_plan (the kernels, the tile size),
// plan_work (units, splits, claiming order); per claimed item run_item: stage_queries, run_item_tiles (per tile and
// query token token_tile, per KV head AmxTile::tile or fma_head_tile), write_partials; then merge_splits.
// The tile kernels, one per ISA family:
//   cpu/tile_amx.h  AMX tiles (amx level): bf16 caches, and fp32 MLA caches of 16 heads;
//   cpu/tile_dp.h   bf16 dot products (avx512bf16, amx): the scores of a bf16 cache and an exact bf16 query;
//   cpu/tile_fma.h  fp32 FMAs (every level): any cache, and P.V after the dot-product scores.
#include "cpu/paged_decode.h"

#include <ATen/Parallel.h>
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
#include <vector>

#include "checks.h"
#include "cpu/convert.h"
#include "cpu/gemm.h"
#include "cpu/level.h"
#include "cpu/line_vector.h"
#include "cpu/online_softmax.h"
#include "cpu/tile_amx.h"
#include "cpu/tile_dp.h"
#include "cpu/tile_fma.h"
#include "cpu/tile_prefetch.h"

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
constexpr float kLn2 = 0.693147180559945309f;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The kernels and the tile size of one call, chosen from its shapes and cache type by make_plan; every item uses them.
template <typename scalar_t>
struct DecodePlan {
  int64_t G;    // query heads per KV head
  bool v_in_k;  // V rows are the first Dv elements of the K rows
#if defined(DCP_OPS_AMX)
  AmxPlan amx;
  bool on_amx, v_rows;  // the AMX kernel (cpu/tile_amx.h); its P.V on V's rows in place
#else
  static constexpr bool on_amx = false, v_rows = false;
#endif
  int64_t Ga;   // heads per KV head in the running state: G, or on AMX whole tiles of 16
  int64_t Hqa;  // heads of a query token's running state: Hkv * Ga
#if defined(DCP_OPS_AVX512_BF16)
  bool dp, dp8;    // scores on the dot-product kernel dpk: gemm_dp (whole vectors of heads), gemm_dp8 (at most 8)
  DpTile dpk;
  int64_t qpairs;  // 32-bit bf16 pairs of one KV head's packed query on dpk
#else
  static constexpr bool dp = false, dp8 = false;
#endif
  FmaTile fma;
  int64_t qpack;        // floats of one KV head's packed query on fma
  int64_t tile_tokens;  // KV tokens per tile (an item's last tile may have fewer)
  int64_t k_entry_bytes, v_entry_bytes;  // bytes of a token's entry (every KV head) in each cache
  const scalar_t* k_cache;
  const scalar_t* v_cache;
};

// Chooses the kernels (AMX tiles, bf16 dot products or fp32 FMAs) and the tile size for the call's shapes and cache.
template <typename scalar_t>
DecodePlan<scalar_t> make_plan(const PagedDecodeParams& p) {
  DecodePlan<scalar_t> plan{};
  const int64_t G = plan.G = p.Hq / p.Hkv;
  // V rows are the first Dv elements of the K rows (MLA's latent; or one tensor passed as both caches).
  const bool v_in_k = plan.v_in_k =
      p.v == p.k && p.v_sb == p.k_sb && p.v_st == p.k_st && p.v_sh == p.k_sh && p.Dv <= p.Dk;
#if defined(DCP_OPS_AMX)
  plan.amx = AmxPlan::make<scalar_t>(p, G, v_in_k);
  plan.on_amx = plan.amx.on;
  plan.v_rows = plan.amx.v_rows;
  plan.Ga = plan.amx.Ga;
#else
  plan.Ga = G;
#endif
  const bool on_amx = plan.on_amx;
  plan.Hqa = p.Hkv * plan.Ga;
  // Scores by bf16 dot products (cpu/tile_dp.h): a bf16 cache and an exact bf16 query in avx512bf16 / amx builds, not
  // on AMX; gemm_dp for whole vectors of heads (MLA), gemm_dp8 for at most 8 (GQA).
  const bool exact_bf16 = kDpBf16 && std::is_same_v<scalar_t, c10::BFloat16> && p.q_exact_bf16 && !on_amx;
  const bool dp = exact_bf16 && G % kVL == 0, dp8 = exact_bf16 && G <= 8;
  // The FMA kernel (cpu/tile_fma.h). gemm_nt for G < 16 in every build: tuned in AVX2 builds, and in AVX-512 builds
  // MLA's 16 heads ran 7-17% faster with the heads along the vector than by gemm_nt (fp32, alternated calls).
  const bool nt = G < 16;
  const bool convert = !std::is_same_v<scalar_t, float> && !nt && !on_amx;
  // V's rows are converted too, except where the scores are dot products on K's rows in place (dp) and there are at
  // most 16 heads: P.V then reads V's bf16 rows in place as well, converting them in registers once per block of 6
  // heads (Zen 4, MLA 16 heads, alternated: 4K tokens, batch 1, warm 0.917 -> 0.850 ms; 32K batch 1, cold 5.65 ->
  // 5.45 ms; 32 and 64 heads the same; 128 heads 4-5% slower; GQA 32q/2kv d128, V its own rows, 4K batch 1, warm:
  // 0.501-0.541 -> 0.476-0.500 ms). Outputs bitwise the same either way.
  plan.fma = FmaTile{G, p.Dk, p.Dv, nt, convert && !dp, convert && !(dp && G <= 16), v_in_k};
  plan.qpack = plan.fma.qpack();
#if defined(DCP_OPS_AVX512_BF16)
  plan.dp = dp;
  plan.dp8 = dp8;
  plan.dpk = DpTile{G, p.Dk, dp8, p.q_mult};
  plan.qpairs = plan.dpk.qpairs();
#endif
  const int64_t token_bytes =
      (p.Hkv * p.Dk + (v_in_k ? 0 : p.Hkv * p.Dv)) * static_cast<int64_t>(sizeof(scalar_t));
  // Tiles of a multiple of the rows gemm_nt takes at a time: at 32K tokens, bf16 16q/2kv d128 ran 7-10% faster in
  // tiles of 15 tokens than of 16, whose last token went through a half-idle pair of rows.
  const int64_t row_block = dp8 ? kDp8Rows : gemm_nt_row_block(G);
  plan.tile_tokens =
      on_amx ? kTileMax
      : nt   ? std::clamp<int64_t>((kTileBytes / token_bytes + row_block / 2) / row_block * row_block, row_block,
                                   kTileMax / row_block * row_block)
             : kTileMax;
  plan.k_entry_bytes = ((p.Hkv - 1) * p.k_sh + p.Dk) * static_cast<int64_t>(sizeof(scalar_t));
  plan.v_entry_bytes = ((p.Hkv - 1) * p.v_sh + p.Dv) * static_cast<int64_t>(sizeof(scalar_t));
  plan.k_cache = static_cast<const scalar_t*>(p.k);
  plan.v_cache = static_cast<const scalar_t*>(p.v);
  return plan;
}

// A unit of work: up to kUnitTokens query tokens of one sequence (multi-token decode: cu_seqlens_q), which share
// each KV tile read: the tile's rows are read from memory once and then, for every query token of the unit, scored,
// folded into that token's own running state and multiplied into its output, each token masked at its own length.
struct Unit {
  int64_t b, t0, t1, len;  // block-table row, query tokens [t0, t1), the longest of their lengths
};

// The call's work: its units, each cut into nsplit items (one range of the unit's KV tokens, every KV head).
struct WorkPlan {
  std::vector<Unit> units;
  std::vector<int64_t> order;  // the units, longest first: the order in which the threads claim their items
  int64_t unit_tokens = 1;     // the most query tokens of any unit
  int64_t nsplit = 1;          // items per unit
  int64_t items = 0;           // units x nsplit
};

// Cuts the call into units (as many query tokens as kUnitStateBytes of running output allows, at most kUnitTokens)
// and each unit into splits.
WorkPlan plan_work(const PagedDecodeParams& p, int64_t tile_tokens, int64_t threads) {
  WorkPlan work;
  int64_t max_len = 0;
  const int64_t unit_max =
      std::clamp<int64_t>(kUnitStateBytes / std::max<int64_t>(1, p.Hq * p.Dv * 4), 1, kUnitTokens);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t t_begin = p.cu_seqlens_q ? p.cu_seqlens_q[b] : b;
    const int64_t t_end = p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] : b + 1;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += unit_max) {
      Unit u{b, t0, std::min(t_end, t0 + unit_max), 0};
      for (int64_t t = u.t0; t < u.t1; ++t) u.len = std::max<int64_t>(u.len, p.seq_lens[t]);
      max_len = std::max(max_len, u.len);
      work.unit_tokens = std::max(work.unit_tokens, u.t1 - u.t0);
      work.units.push_back(u);
    }
  }
  const int64_t nunits = static_cast<int64_t>(work.units.size());
  // Enough splits to give every thread work when the batch is small, never splits of less than a tile.
  work.nsplit = std::max<int64_t>(1, std::min(ceil_div(4 * threads, std::max<int64_t>(nunits, 1)),
                                              ceil_div(max_len, tile_tokens)));
  work.items = nunits * work.nsplit;
  // Threads claim items one at a time, longest sequences first, so that a thread slowed down for a while (another
  // tenant on a shared host) or a mix of long and short sequences does not leave the other threads idle at the end:
  // batch 3 at 32K tokens, 2 threads (9 items) ran 16-20% faster than with a static split of the items.
  work.order.resize(nunits);
  std::iota(work.order.begin(), work.order.end(), 0);
  std::stable_sort(work.order.begin(), work.order.end(),
                   [&](int64_t a, int64_t b) { return work.units[a].len > work.units[b].len; });
  return work;
}

// Each item's final running state, for the merge, at (query token, split) and head (each KV head's first G): o not
// yet normalised, m and l base 2. Every item writes its whole slice of these, so they are not zeroed first (o is
// 2 MiB for 8 splits of 128 MLA heads).
struct SplitPartials {
  std::unique_ptr<float[]> o, m, l;
  SplitPartials(const PagedDecodeParams& p, int64_t nsplit)
      : o(new float[p.T * nsplit * p.Hq * p.Dv]),
        m(new float[p.T * nsplit * p.Hq]),
        l(new float[p.T * nsplit * p.Hq]) {}
};

// One thread's buffers, kept over the items it claims. Running state lives here (items of other threads share cache
// lines in the partials); st, acc_o and the AMX buffers start on cache lines, as AMX tiles load and store them
// (line_vector.h).
template <typename scalar_t>
struct ThreadState {
  LineVector<float> st;                    // one KV head's tile of scores, then probabilities, [tokens x heads]
  LineVector<float> acc_o;                 // running outputs [unit_tokens x Hqa x Dv]
  std::vector<float> alpha, acc_m, acc_l;  // one KV head's rescale factors; running max, sum [unit_tokens x Hqa]
  // Row pointers (token entries) of this tile and of the next one, which is being prefetched.
  std::vector<const scalar_t*> krows, vrows, next_krows, next_vrows;
  TilePrefetcher pf;
  // The FMA kernel's packed queries (every token of the unit and KV head) and fp32 copies of one KV head's tile
  // rows, when it converts them (147 KiB for MLA: left uninitialised, as every row used is written first).
  std::vector<float> qt;
  std::unique_ptr<float[]> kf, vf;
#if defined(DCP_OPS_AVX512_BF16)
  // The dot-product kernel's queries in bf16 pairs, with a row of the query in fp32 and bf16 on the way; gemm_dp8's
  // heads past G are zeroed here and never written.
  std::unique_ptr<uint32_t[]> qp;
  std::vector<float> qrow32;
  std::vector<c10::BFloat16> qrow16;
#endif
#if defined(DCP_OPS_AMX)
  AmxTile<scalar_t> amx_tile;
#endif
  int64_t q_unit = -1;  // the unit whose queries the kernels hold

  ThreadState(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, int64_t unit_tokens)
      : st(kTileMax * plan.Ga),
        acc_o(unit_tokens * plan.Hqa * p.Dv),
        alpha(plan.Ga),
        acc_m(unit_tokens * plan.Hqa),
        acc_l(unit_tokens * plan.Hqa),
        krows(kTileMax),
        vrows(kTileMax),
        next_krows(kTileMax),
        next_vrows(kTileMax),
        qt(unit_tokens * p.Hkv * plan.qpack),
        kf(plan.fma.convert_k || (plan.fma.convert_v && plan.v_in_k) ? new float[kTileMax * p.Dk] : nullptr),
        vf(plan.fma.convert_v && !plan.v_in_k ? new float[kTileMax * p.Dv] : nullptr)
#if defined(DCP_OPS_AVX512_BF16)
        ,
        qp(plan.dp8  ? new uint32_t[unit_tokens * p.Hkv * plan.qpairs]()
           : plan.dp ? new uint32_t[unit_tokens * p.Hkv * plan.qpairs]
                     : nullptr),
        qrow32(plan.dp || plan.dp8 ? (p.Dk + 1) / 2 * 2 : 0),
        qrow16(qrow32.size())
#endif
#if defined(DCP_OPS_AMX)
        ,
        amx_tile(plan.amx, p, unit_tokens, kTileMax)
#endif
  {
    pf.streams = plan.on_amx;
  }
};

// The queries of the unit's tokens in the kernels' layouts, packed once per unit and thread: a thread's next item is
// often of the same unit (packed per item, the query took 8% of MLA 16 heads' time at 4K tokens, batch 1, on the FMA
// kernels).
template <typename scalar_t>
inline void stage_queries(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, ThreadState<scalar_t>& ts,
                          const Unit& unit) {
  const int64_t nq = unit.t1 - unit.t0;  // query tokens of the unit; token qi is t0 + qi
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float* qtok = p.q + (unit.t0 + qi) * p.q_st;
#if defined(DCP_OPS_AMX)
    if (plan.on_amx) {
      ts.amx_tile.pack_query(qi, qtok);
      if (!plan.amx.split) continue;  // (an fp32 item may be recomputed on the FMA kernel: run_item)
    }
#endif
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      const float* qh = qtok + kvh * plan.G * p.q_sh;
#if defined(DCP_OPS_AVX512_BF16)
      if (plan.dp || plan.dp8) {
        plan.dpk.pack_query(qh, p.q_sh, ts.qrow32.data(), ts.qrow16.data(),
                            ts.qp.get() + (qi * p.Hkv + kvh) * plan.qpairs);
        continue;
      }
#endif
      plan.fma.pack_query(qh, p.q_sh, ts.qt.data() + (qi * p.Hkv + kvh) * plan.qpack);
    }
  }
}

// Row pointers kr, vr of a sequence's tokens j .. j + n - 1 (bt_row: its block-table row; block and offset stepped,
// not divided, per token).
template <typename scalar_t>
DCP_INLINE void fill_rows(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, const int32_t* bt_row,
                          int64_t j, int64_t n, const scalar_t** kr, const scalar_t** vr) {
  const scalar_t* const k_cache = plan.k_cache;
  const scalar_t* const v_cache = plan.v_cache;
  int64_t blk = j / p.block_size, off = j % p.block_size;
  for (int64_t i = 0; i < n; ++i) {
    kr[i] = k_cache + bt_row[blk] * p.k_sb + off * p.k_st;
    vr[i] = v_cache + bt_row[blk] * p.v_sb + off * p.v_st;
    if (++off == p.block_size) off = 0, ++blk;
  }
}

// One KV head kvh's n tile rows (ts.krows, ts.vrows) for the unit's query token qi on the dot-product and FMA kernels:
// scores into ts.st, the online softmax update of the token's running max m and sum l (G heads), its running output
// o (G rows of Dv) rescaled to the new max, and P.V added into o.
template <typename scalar_t>
DCP_INLINE void fma_head_tile(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, ThreadState<scalar_t>& ts,
                              int64_t n, int64_t kvh, int64_t qi, float* m, float* l, float* o) {
  const int64_t G = plan.G;
  const RowPtrs<scalar_t> k{ts.krows.data(), kvh * p.k_sh};
  const RowPtrs<scalar_t> v{ts.vrows.data(), kvh * p.v_sh};
  float* st = ts.st.data();
  const bool dp_scores = std::is_same_v<scalar_t, c10::BFloat16> && (plan.dp || plan.dp8);  // else the FMA kernel's
#if defined(DCP_OPS_AVX512_BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    if (dp_scores) plan.dpk.scores(n, k, ts.qp.get() + (qi * p.Hkv + kvh) * plan.qpairs, st, ts.pf);
#endif
  if (!dp_scores) plan.fma.scores(n, k, ts.qt.data() + (qi * p.Hkv + kvh) * plan.qpack, st, ts.kf.get(), ts.pf);
#if defined(CPU_CAPABILITY_AVX512)
  if (G <= 8)
    softmax_update8(st, G, n, m, l, ts.alpha.data());
  else
#endif
    softmax_update(st, G, n, m, l, ts.alpha.data());
  rescale_rows(o, G, p.Dv, p.Dv, ts.alpha.data());
  plan.fma.pv(n, st, k, v, o, ts.kf.get(), ts.vf.get(), ts.pf);
}

// The unit's query token qi against the tile of n_tile rows from KV token j, masked at the token's own length: every
// KV head's scores, online softmax and P.V into the token's running state, on the AMX kernel (use_amx; P.V on V's
// rows in place: rows_v) or on the dot-product and FMA kernels.
template <typename scalar_t>
DCP_INLINE void token_tile(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, ThreadState<scalar_t>& ts,
                           const Unit& unit, int64_t qi, int64_t j, int64_t n_tile, [[maybe_unused]] bool use_amx,
                           [[maybe_unused]] bool rows_v) {
  const int64_t t = unit.t0 + qi, n = std::clamp<int64_t>(p.seq_lens[t] - j, 0, n_tile);  // its own length
  if (n == 0) return;
  const int64_t G = plan.G;
  float* o = ts.acc_o.data() + qi * plan.Hqa * p.Dv;
  float* m = ts.acc_m.data() + qi * plan.Hqa;
  float* l = ts.acc_l.data() + qi * plan.Hqa;
  for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
#if defined(DCP_OPS_AMX)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, float>) {  // AMX's types
      if (use_amx) {
        const int64_t Ga = plan.Ga;
        ts.amx_tile.tile(n, ts.krows.data(), ts.vrows.data(), kvh, qi, t, rows_v, ts.st.data(), m + kvh * Ga,
                         l + kvh * Ga, ts.alpha.data(), o + kvh * Ga * p.Dv, ts.pf);
        continue;
      }
    }
#endif
    fma_head_tile(p, plan, ts, n, kvh, qi, m + kvh * G, l + kvh * G, o + kvh * G * p.Dv);
  }
}

// The item's tiles, KV tokens [j0, j1) of the unit, from empty running states (acc_*, one per query token of the
// unit): each tile's rows are read in place through row pointers (a tile spans blocks) while the next tile's rows
// are prefetched. use_amx, rows_v: as token_tile. (Not forced inline, as AMX builds call it twice; the per-tile
// functions above are forced into it.)
template <typename scalar_t>
inline void run_item_tiles(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, ThreadState<scalar_t>& ts,
                           const Unit& unit, int64_t j0, int64_t j1, bool use_amx, bool rows_v) {
  const int64_t nq = unit.t1 - unit.t0, tile = plan.tile_tokens;
  std::fill(ts.acc_o.data(), ts.acc_o.data() + nq * plan.Hqa * p.Dv, 0.f);
  std::fill(ts.acc_m.begin(), ts.acc_m.begin() + nq * plan.Hqa, kNegInf);
  std::fill(ts.acc_l.begin(), ts.acc_l.begin() + nq * plan.Hqa, 0.f);
  const int32_t* bt_row = p.block_table + unit.b * p.bt_stride;
  if (j0 < j1) fill_rows(p, plan, bt_row, j0, std::min(tile, j1 - j0), ts.next_krows.data(), ts.next_vrows.data());
  for (int64_t j = j0; j < j1; j += tile) {
    const int64_t n_tile = std::min(tile, j1 - j), n_next = std::clamp<int64_t>(j1 - j - n_tile, 0, tile);
    ts.krows.swap(ts.next_krows);  // this tile's rows were filled (and prefetched) as the previous tile's next
    ts.vrows.swap(ts.next_vrows);
    fill_rows(p, plan, bt_row, j + n_tile, n_next, ts.next_krows.data(), ts.next_vrows.data());
    ts.pf.start(reinterpret_cast<const char* const*>(ts.next_krows.data()),
                plan.v_in_k ? nullptr : reinterpret_cast<const char* const*>(ts.next_vrows.data()), n_next,
                plan.k_entry_bytes, plan.v_entry_bytes);
    for (int64_t qi = 0; qi < nq; ++qi)  // the tile's rows, read from memory for the first, from cache after
      token_tile(p, plan, ts, unit, qi, j, n_tile, use_amx, rows_v);
    ts.pf.finish();
  }
}

// The item's running state into the partials at (query token, split): the first G of each KV head's Ga heads, the
// outputs in dim order (P.V on V's rows, rows_v, leaves AMX's interleaved: AmxTile::copy_out).
template <typename scalar_t>
inline void write_partials(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan,
                           const ThreadState<scalar_t>& ts, const Unit& unit, int64_t split, int64_t nsplit,
                           [[maybe_unused]] bool rows_v, SplitPartials& part) {
  const int64_t G = plan.G, Ga = plan.Ga;
  for (int64_t qi = 0; qi < unit.t1 - unit.t0; ++qi) {
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      const int64_t item = (unit.t0 + qi) * nsplit + split;  // the partials' index: (query token, split)
      const float* o = ts.acc_o.data() + qi * plan.Hqa * p.Dv;
      const float* m = ts.acc_m.data() + qi * plan.Hqa;
      const float* l = ts.acc_l.data() + qi * plan.Hqa;
      float* dst = part.o.get() + (item * p.Hq + kvh * G) * p.Dv;
#if defined(DCP_OPS_AMX)
      ts.amx_tile.copy_out(o + kvh * Ga * p.Dv, rows_v, dst);
#else
      std::copy(o + kvh * Ga * p.Dv, o + (kvh * Ga + G) * p.Dv, dst);
#endif
      std::copy(m + kvh * Ga, m + kvh * Ga + G, part.m.get() + item * p.Hq + kvh * G);
      std::copy(l + kvh * Ga, l + kvh * Ga + G, part.l.get() + item * p.Hq + kvh * G);
    }
  }
}

// Item number `claim` of the claiming order: its range of the unit's KV tokens, the unit's queries staged unless this
// thread holds them, its tiles, and its running state written to the partials.
template <typename scalar_t>
inline void run_item(const PagedDecodeParams& p, const DecodePlan<scalar_t>& plan, const WorkPlan& work,
                     ThreadState<scalar_t>& ts, SplitPartials& part, int64_t claim) {
  const int64_t ui = work.order[claim / work.nsplit], split = claim % work.nsplit;
  const Unit& unit = work.units[ui];
  const int64_t chunk = ceil_div(ceil_div(unit.len, work.nsplit), plan.tile_tokens) * plan.tile_tokens;
  const int64_t j0 = split * chunk, j1 = std::min(unit.len, j0 + chunk);
  if (j0 < j1 && ts.q_unit != ui) {
    ts.q_unit = ui;
    stage_queries(p, plan, ts, unit);
  }
  // P.V on V's cache rows puts the zero half of each P dword against a real V element, so a non-finite V element
  // in a valid slot (0 x inf = NaN) would also turn its neighbouring dim's output NaN where the reference gives a
  // number; an fp32 V element's terms (inf - inf) are NaN too. An item with any non-finite output is therefore
  // recomputed with V packed (bf16), whose products keep the dims apart, or on the fp32 FMA kernel; finite caches
  // never take this second pass.
  bool rows_v = plan.v_rows;
  run_item_tiles(p, plan, ts, unit, j0, j1, plan.on_amx, rows_v);
#if defined(DCP_OPS_AMX)
  if (rows_v && !all_finite(ts.acc_o.data(), (unit.t1 - unit.t0) * plan.Hqa * p.Dv)) {
    rows_v = false;
    run_item_tiles(p, plan, ts, unit, j0, j1, plan.on_amx && !plan.amx.split, rows_v);
  }
#endif
  write_partials(p, plan, ts, unit, split, work.nsplit, rows_v, part);
}

// Combines the splits of each (token, head): exact online-softmax merge in base 2, stored in the output's type.
void merge_splits(const PagedDecodeParams& p, int64_t nsplit, const SplitPartials& part) {
  at::parallel_for(0, p.T * p.Hq, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weight(nsplit), out_row(p.Dv);
    for (int64_t th = begin; th < end; ++th) {  // (token, head) index
      const int64_t t = th / p.Hq, h = th % p.Hq;
      auto idx = [&](int64_t sp) { return (t * nsplit + sp) * p.Hq + h; };
      // A NaN score made its split's m NaN (vmax keeps NaN), a +inf one its m +inf: the row is NaN, or
      // NaN with LSE +inf, as in the float64 reference; only -inf scores or none: an empty row (docs/design.md §2).
      float m_max = kNegInf;
      bool nan = false;
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        nan |= std::isnan(part.m[idx(sp)]);
        m_max = std::max(m_max, part.m[idx(sp)]);
      }
      float* dst = out_row.data();
      if (nan || m_max == kNegInf || m_max == -kNegInf) {
        std::fill(dst, dst + p.Dv, m_max == kNegInf && !nan ? 0.f : std::numeric_limits<float>::quiet_NaN());
        store_row(p.out, p.out_dtype, th * p.Dv, dst, p.Dv);
        p.lse[th] = nan ? std::numeric_limits<float>::quiet_NaN() : m_max;
        continue;
      }
      float total = 0.f;  // the splits' sums l, brought to the common max m_max
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        weight[sp] = part.m[idx(sp)] == kNegInf ? 0.f : std::exp2(part.m[idx(sp)] - m_max);
        total += weight[sp] * part.l[idx(sp)];
      }
      const float inv_total = 1.f / total;
      std::fill(dst, dst + p.Dv, 0.f);
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        if (weight[sp] == 0.f) continue;
        const float* src = part.o.get() + idx(sp) * p.Dv;
        const float scale = weight[sp] * inv_total * p.out_mult;
        for (int64_t d = 0; d < p.Dv; ++d) dst[d] += scale * src[d];
      }
      store_row(p.out, p.out_dtype, th * p.Dv, dst, p.Dv);
      p.lse[th] = (m_max + std::log2(total)) * kLn2;
    }
  });
}

// The driver: the plan, then every item on the threads (each claims the next item until none is left), then the
// merge of each (token, head)'s splits.
template <typename scalar_t>
void paged_decode_impl(const PagedDecodeParams& p) {
  const DecodePlan<scalar_t> plan = make_plan<scalar_t>(p);
  const int64_t threads = at::get_num_threads();
  const WorkPlan work = plan_work(p, plan.tile_tokens, threads);
  SplitPartials part(p, work.nsplit);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min(threads, work.items), 1, [&](int64_t, int64_t) {
    ThreadState<scalar_t> ts(p, plan, work.unit_tokens);
    for (int64_t claim; (claim = next_item.fetch_add(1, std::memory_order_relaxed)) < work.items;)
      run_item(p, plan, work, ts, part, claim);
  });
  merge_splits(p, work.nsplit, part);
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
