// Split-KV paged decode, the driver: the work is cut into items (a range of one sequence's KV tokens for up to
// kUnitTokens of its query tokens, every KV head), which threads claim longest first; an item walks its tiles of cache
// rows, read in place through row pointers (a tile spans blocks) while the next tile's rows are prefetched, and hands
// each (query token, KV head) to a tile kernel: scores, online base-2 softmax, P.V into that token's running state.
// The splits of each (token, head) are merged exactly at the end. The tile kernels, one per ISA family:
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

template <typename scalar_t>
void paged_decode_impl(const PagedDecodeParams& p) {
  const int64_t G = p.Hq / p.Hkv;
  // V rows are the first Dv elements of the K rows (MLA's latent; or one tensor passed as both caches).
  const bool v_in_k = p.v == p.k && p.v_sb == p.k_sb && p.v_st == p.k_st && p.v_sh == p.k_sh && p.Dv <= p.Dk;
#if defined(DCP_OPS_AMX)
  const AmxPlan amx = AmxPlan::make<scalar_t>(p, G, v_in_k);
  const bool on_amx = amx.on, v_rows = amx.v_rows;
  const int64_t Ga = amx.Ga;
#else
  constexpr bool on_amx = false, v_rows = false;
  const int64_t Ga = G;
#endif
  const int64_t Hqa = p.Hkv * Ga;
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
  const FmaTile fma{G, p.Dk, p.Dv, nt, convert && !dp, convert && !(dp && G <= 16), v_in_k};
#if defined(DCP_OPS_AVX512_BF16)
  const DpTile dpk{G, p.Dk, dp8, p.q_mult};
#endif
  const int64_t token_bytes =
      (p.Hkv * p.Dk + (v_in_k ? 0 : p.Hkv * p.Dv)) * static_cast<int64_t>(sizeof(scalar_t));
  // Tiles of a multiple of the rows gemm_nt takes at a time: at 32K tokens, bf16 16q/2kv d128 ran 7-10% faster in
  // tiles of 15 tokens than of 16, whose last token went through a half-idle pair of rows.
  const int64_t rb = dp8 ? kDp8Rows : gemm_nt_row_block(G);
  const int64_t kTile = on_amx ? kTileMax
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
  const int64_t qpack = fma.qpack();
#if defined(DCP_OPS_AVX512_BF16)
  const int64_t qpairs = dpk.qpairs();
#endif
  // Bytes of a token's entry (every KV head) in each cache.
  const int64_t kbytes = ((p.Hkv - 1) * p.k_sh + p.Dk) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t vbytes = ((p.Hkv - 1) * p.v_sh + p.Dv) * static_cast<int64_t>(sizeof(scalar_t));
  const auto* kc = static_cast<const scalar_t*>(p.k);
  const auto* vc = static_cast<const scalar_t*>(p.v);

  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    // Running state lives in this thread's buffers (items of other threads share cache lines in part_*); st, acc_o and
    // the AMX buffers start on cache lines, as AMX tiles load and store them (line_vector.h).
    LineVector<float> st(kTileMax * Ga), acc_o(unit_tokens * Hqa * p.Dv);
    std::vector<float> alpha(Ga), acc_m(unit_tokens * Hqa), acc_l(unit_tokens * Hqa);
    // Row pointers (token entries) of this tile and of the next one, which is being prefetched.
    std::vector<const scalar_t*> krows(kTileMax), vrows(kTileMax), next_krows(kTileMax), next_vrows(kTileMax);
    TilePrefetcher pf;
    pf.streams = on_amx;
    // The FMA kernel's packed queries (every token of the unit and KV head) and fp32 copies of one KV head's tile
    // rows, when it converts them (147 KiB for MLA: left uninitialised, as every row used is written first).
    std::vector<float> qt(unit_tokens * p.Hkv * qpack);
    std::unique_ptr<float[]> kf(fma.convert_k || (fma.convert_v && v_in_k) ? new float[kTileMax * p.Dk] : nullptr),
        vf(fma.convert_v && !v_in_k ? new float[kTileMax * p.Dv] : nullptr);
#if defined(DCP_OPS_AVX512_BF16)
    // The dot-product kernel's queries in bf16 pairs, with a row of the query in fp32 and bf16 on the way; gemm_dp8's
    // heads past G are zeroed here and never written.
    std::unique_ptr<uint32_t[]> qp(dp8  ? new uint32_t[unit_tokens * p.Hkv * qpairs]()
                                   : dp ? new uint32_t[unit_tokens * p.Hkv * qpairs]
                                        : nullptr);
    std::vector<float> qrow32(dp || dp8 ? (p.Dk + 1) / 2 * 2 : 0);
    std::vector<c10::BFloat16> qrow16(qrow32.size());
#endif
#if defined(DCP_OPS_AMX)
    AmxTile<scalar_t> amx_tile(amx, p, unit_tokens, kTileMax);
#endif
    int64_t q_unit = -1;  // the unit whose queries the kernels hold
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
        if (on_amx) {
          amx_tile.pack_query(qi, qtok);
          if (!amx.split) continue;  // (an fp32 item may be recomputed on the FMA kernel, below)
        }
#endif
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
          const float* qh = qtok + kvh * G * p.q_sh;
#if defined(DCP_OPS_AVX512_BF16)
          if (dp || dp8) {
            dpk.pack_query(qh, p.q_sh, qrow32.data(), qrow16.data(), qp.get() + (qi * p.Hkv + kvh) * qpairs);
            continue;
          }
#endif
          fma.pack_query(qh, p.q_sh, qt.data() + (qi * p.Hkv + kvh) * qpack);
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
      // The item's tiles, on the AMX kernel (use_amx; P.V on V's rows in place: rows_v) or on the dot-product and FMA
      // kernels; every query token of the unit (qi) has its own running state in acc_*.
      auto run = [&]([[maybe_unused]] bool use_amx, [[maybe_unused]] bool rows_v) {
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
#if defined(DCP_OPS_AMX)
              if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, float>) {  // AMX's
                if (use_amx) {
                  amx_tile.tile(n, krows.data(), vrows.data(), kvh, qi, t, rows_v, st.data(), m + kvh * Ga,
                                l + kvh * Ga, alpha.data(), o + kvh * Ga * p.Dv, pf);
                  continue;
                }
              }
#endif
              const RowPtrs<scalar_t> k{krows.data(), kvh * p.k_sh};
              const RowPtrs<scalar_t> v{vrows.data(), kvh * p.v_sh};
              float* oh = o + kvh * G * p.Dv;
#if defined(DCP_OPS_AVX512_BF16)
              if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
                if (dp || dp8) dpk.scores(n, k, qp.get() + (qi * p.Hkv + kvh) * qpairs, st.data(), pf);
              if (!dp && !dp8)
#endif
                fma.scores(n, k, qt.data() + (qi * p.Hkv + kvh) * qpack, st.data(), kf.get(), pf);
#if defined(CPU_CAPABILITY_AVX512)
              if (G <= 8)
                softmax_update8(st.data(), G, n, m + kvh * G, l + kvh * G, alpha.data());
              else
#endif
                softmax_update(st.data(), G, n, m + kvh * G, l + kvh * G, alpha.data());
              rescale_rows(oh, G, p.Dv, p.Dv, alpha.data());
              fma.pv(n, st.data(), k, v, oh, kf.get(), vf.get(), pf);
            }
          }
          pf.finish();
        }
      };
      // P.V on V's cache rows puts the zero half of each P dword against a real V element, so a non-finite V element
      // in a valid slot (0 x inf = NaN) would also turn its neighbouring dim's output NaN where the reference gives a
      // number; an fp32 V element's terms (inf - inf) are NaN too. An item with any non-finite output is therefore
      // recomputed with V packed (bf16), whose products keep the dims apart, or on the fp32 FMA kernel; finite caches
      // never take this second pass.
      bool rows_v = v_rows;
      run(on_amx, rows_v);
#if defined(DCP_OPS_AMX)
      if (rows_v && !all_finite(acc_o.data(), nq * Hqa * p.Dv)) run(on_amx && !amx.split, rows_v = false);
#endif
      for (int64_t qi = 0; qi < nq; ++qi) {
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {  // the first G of each KV head's Ga heads
          const int64_t item = (unit.t0 + qi) * nsplit + split;  // the partials' index: (query token, split)
          const float* o = acc_o.data() + qi * Hqa * p.Dv;
          const float* m = acc_m.data() + qi * Hqa;
          const float* l = acc_l.data() + qi * Hqa;
          float* dst = part_o.get() + (item * p.Hq + kvh * G) * p.Dv;
#if defined(DCP_OPS_AMX)
          amx_tile.copy_out(o + kvh * Ga * p.Dv, rows_v, dst);
#else
          std::copy(o + kvh * Ga * p.Dv, o + (kvh * Ga + G) * p.Dv, dst);
#endif
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
