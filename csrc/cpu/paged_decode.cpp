// Split-KV paged decode: each tile of cache rows is scored in place as S^T = K Q^T with the register-blocked GEMM
// (heads along the vector), folded into an online base-2 softmax, and the splits combined at the end.
#include "cpu/paged_decode.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/gemm.h"

namespace dcp_ops::cpu {

namespace {

constexpr int64_t kTile = 64;  // most tokens per tile (a tile never crosses a cache block)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147180559945309f;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Prefetches (into L2) every KV head's rows of tokens [j, j + n), so the next tile's loads overlap this tile's math.
template <typename scalar_t>
void prefetch_tile(const PagedDecodeParams& p, int64_t t, int64_t j, int64_t n) {
  const int32_t* row = p.block_table + t * p.bt_stride;
  constexpr int64_t es = sizeof(scalar_t);
  auto rows = [&](const void* base, int64_t sb, int64_t st, int64_t sh, int64_t D) {
    const char* c = static_cast<const char*>(base);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = j + i;
      const char* r = c + (row[pos / p.block_size] * sb + (pos % p.block_size) * st) * es;
      for (int64_t h = 0; h < p.Hkv; ++h)
        for (int64_t b = 0; b < D * es; b += 64) __builtin_prefetch(r + h * sh * es + b, 0, 2);
    }
  };
  rows(p.k, p.k_sb, p.k_st, p.k_sh, p.Dk);
  if (p.v != p.k) rows(p.v, p.v_sb, p.v_st, p.v_sh, p.Dv);  // MLA: values are the key rows' prefix
}

// Online softmax over one tile of transposed base-2 scores st[n x G]: st becomes probabilities, and the rows of o
// [G x Dv] are rescaled to the new running max. Vectorised across the G heads.
void softmax_update(float* st, int64_t G, int64_t n, float* m, float* l, float* o, int64_t Dv, float* alpha) {
  constexpr int64_t VL = fVec::size();
  for (int64_t g0 = 0; g0 < G; g0 += VL) {
    const int64_t w = std::min(VL, G - g0);
    fVec mx = fVec::loadu(m + g0, w);
    for (int64_t i = 0; i < n; ++i) mx = at::vec::maximum(mx, fVec::loadu(st + i * G + g0, w));
    const fVec m_old = fVec::loadu(m + g0, w);
    const fVec a = (m_old - mx).exp2();  // 0 on the first tile (m = -inf)
    fVec sum(0.f);
    for (int64_t i = 0; i < n; ++i) {
      const fVec e = (fVec::loadu(st + i * G + g0, w) - mx).exp2();
      e.store(st + i * G + g0, w);
      sum = sum + e;
    }
    (fVec::loadu(l + g0, w) * a + sum).store(l + g0, w);
    mx.store(m + g0, w);
    a.store(alpha + g0, w);
  }
  for (int64_t g = 0; g < G; ++g) {
    if (alpha[g] == 1.f) continue;
    float* orow = o + g * Dv;
    const fVec av(alpha[g]);
    int64_t d = 0;
    for (; d + VL <= Dv; d += VL) (fVec::loadu(orow + d) * av).store(orow + d);
    for (; d < Dv; ++d) orow[d] *= alpha[g];
  }
}

template <typename scalar_t>
void paged_decode_impl(const PagedDecodeParams& p) {
  const int64_t G = p.Hq / p.Hkv;
  int64_t max_len = 0;
  for (int64_t t = 0; t < p.T; ++t) max_len = std::max<int64_t>(max_len, p.seq_lens[t]);
  const int64_t threads = at::get_num_threads();
  // Enough splits to give every thread work when the batch is small, never splits of less than a tile.
  const int64_t nsplit = std::max<int64_t>(1, std::min(ceil_div(4 * threads, std::max<int64_t>(p.T, 1)),
                                                       ceil_div(max_len, kTile)));
  const int64_t items = p.T * nsplit;  // one item = one token range of one sequence, all KV heads
  std::vector<float> part_o(items * p.Hq * p.Dv), part_m(items * p.Hq), part_l(items * p.Hq);
  // Token entries dense over heads (K and V alike, separate tensors): a tile is one contiguous run per cache.
  const int64_t entry = p.Hkv * p.Dk;
  const bool stage = p.v != p.k && p.Dk == p.Dv && p.k_sh == p.Dk && p.v_sh == p.Dv && p.k_st == entry &&
                     p.v_st == entry;
  const auto* kc = static_cast<const scalar_t*>(p.k);
  const auto* vc = static_cast<const scalar_t*>(p.v);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // Running state lives in this thread's buffers (items of other threads share cache lines in part_*).
    std::vector<float> st(kTile * G), qt(p.Hkv * p.Dk * G), alpha(G), acc_o(p.Hq * p.Dv), acc_m(p.Hq), acc_l(p.Hq);
    std::vector<scalar_t> kbuf(stage ? kTile * entry : 0), vbuf(stage ? kTile * entry : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / nsplit, split = item % nsplit;
      const int64_t len = p.seq_lens[t];
      const int64_t chunk = ceil_div(ceil_div(len, nsplit), kTile) * kTile;
      const int64_t j0 = split * chunk, j1 = std::min(len, j0 + chunk);
      float* o = acc_o.data();
      float* m = acc_m.data();
      float* l = acc_l.data();
      std::fill(o, o + p.Hq * p.Dv, 0.f);
      std::fill(m, m + p.Hq, kNegInf);
      std::fill(l, l + p.Hq, 0.f);
      if (j0 < j1) {
      for (int64_t h = 0; h < p.Hq; ++h)  // Q^T per KV head [Dk x G]: S^T = K Q^T puts the heads along the vector
        for (int64_t d = 0; d < p.Dk; ++d) qt[((h / G) * p.Dk + d) * G + h % G] = p.q[t * p.q_st + h * p.q_sh + d];
      const int32_t* row = p.block_table + t * p.bt_stride;
      // Tiles never cross a block, so a tile's rows sit at one stride in the cache and are read in place; all KV
      // heads of a tile are done together so every cache line fetched is used at once.
      for (int64_t j = j0; j < j1;) {
        // In place, a tile never crosses a block (its rows then sit at one stride in the cache). GQA stages instead:
        // each block's run of token entries (all heads) is copied with one sequential memcpy per cache, which
        // streams at the memory's rate where the GEMMs' row-strided reads of the cache do not, and the tile may
        // then span blocks.
        const int64_t off = j % p.block_size;
        const int64_t n = stage ? std::min(kTile, j1 - j) : std::min({kTile, j1 - j, p.block_size - off});
        const int64_t block = row[j / p.block_size];
        const scalar_t* kbase = kc + block * p.k_sb + off * p.k_st;
        const scalar_t* vbase = vc + block * p.v_sb + off * p.v_st;
        int64_t kst = p.k_st, vst = p.v_st;
        if (stage) {
          for (int64_t i = 0; i < n;) {
            const int64_t pos = j + i, o2 = pos % p.block_size, run = std::min(n - i, p.block_size - o2);
            const int64_t b2 = row[pos / p.block_size];
            std::memcpy(kbuf.data() + i * entry, kc + b2 * p.k_sb + o2 * p.k_st, run * entry * sizeof(scalar_t));
            std::memcpy(vbuf.data() + i * entry, vc + b2 * p.v_sb + o2 * p.v_st, run * entry * sizeof(scalar_t));
            i += run;
          }
          kbase = kbuf.data();
          vbase = vbuf.data();
          kst = vst = entry;
          // Touch the head of each of the next tile's runs so the hardware streamer is already running on them.
          const int64_t jn = j + n, nn = std::min(kTile, j1 - jn);
          for (int64_t i = 0; i < nn;) {
            const int64_t pos = jn + i, o2 = pos % p.block_size, run = std::min(nn - i, p.block_size - o2);
            const int64_t b2 = row[pos / p.block_size];
            const char* kr = reinterpret_cast<const char*>(kc + b2 * p.k_sb + o2 * p.k_st);
            const char* vr = reinterpret_cast<const char*>(vc + b2 * p.v_sb + o2 * p.v_st);
            for (int64_t b = 0; b < std::min<int64_t>(run * entry * sizeof(scalar_t), 1024); b += 64) {
              __builtin_prefetch(kr + b, 0, 3);
              __builtin_prefetch(vr + b, 0, 3);
            }
            i += run;
          }
        } else if (j + n < j1) {
          prefetch_tile<scalar_t>(p, t, j + n, std::min({kTile, j1 - j - n, p.block_size}));
        }
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
          const scalar_t* k = kbase + kvh * p.k_sh;
          const scalar_t* v = vbase + kvh * p.v_sh;
          float* oh = o + kvh * G * p.Dv;
          std::fill(st.begin(), st.begin() + n * G, 0.f);
          gemm_acc(n, G, p.Dk, k, kst, 1, qt.data() + kvh * p.Dk * G, G, st.data(), G);
          softmax_update(st.data(), G, n, m + kvh * G, l + kvh * G, oh, p.Dv, alpha.data());
          gemm_acc(G, p.Dv, n, st.data(), 1, G, v, vst, oh, p.Dv);  // P = st^T read in place
        }
        j += n;
      }
      }
      std::copy(o, o + p.Hq * p.Dv, part_o.begin() + item * p.Hq * p.Dv);
      std::copy(m, m + p.Hq, part_m.begin() + item * p.Hq);
      std::copy(l, l + p.Hq, part_l.begin() + item * p.Hq);
    }
  });

  // Combine the splits of each (token, head): exact online-softmax merge in base 2.
  at::parallel_for(0, p.T * p.Hq, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(nsplit);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / p.Hq, h = th % p.Hq;
      auto idx = [&](int64_t sp) { return (t * nsplit + sp) * p.Hq + h; };
      float mx = kNegInf;
      for (int64_t sp = 0; sp < nsplit; ++sp) mx = std::max(mx, part_m[idx(sp)]);
      float* dst = p.out + th * p.Dv;
      if (mx == kNegInf) {
        std::fill(dst, dst + p.Dv, 0.f);
        p.lse[th] = kNegInf;
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
        const float* src = part_o.data() + idx(sp) * p.Dv;
        const float ws = w[sp] * inv;
        for (int64_t d = 0; d < p.Dv; ++d) dst[d] += ws * src[d];
      }
      p.lse[th] = (mx + std::log2(total)) * kLn2;
    }
  });
}

}  // namespace

void check_paged_indices(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t num_blocks,
                         int64_t block_size, const char* op) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0), max_blocks = block_table.size(1);
  for (int64_t t = 0; t < seq_lens.size(0); ++t) {
    const int64_t len = lens[t];
    DCP_CHECK(len >= 0 && len <= max_blocks * block_size, op, "seq_lens[", t, "] = ", len,
              " must be in [0, max_blocks * block_size = ", max_blocks * block_size, "]");
    for (int64_t b = 0; b < ceil_div(len, block_size); ++b) {
      const int64_t id = bt[t * bt_stride + b];
      DCP_CHECK(id >= 0 && id < num_blocks, op, "block_table[", t, ", ", b, "] = ", id,
                " is outside the cache's [0, num_blocks = ", num_blocks, ")");
    }
  }
}

void paged_decode(const PagedDecodeParams& p, at::ScalarType cache_dtype) {
  switch (cache_dtype) {
    case at::kFloat: paged_decode_impl<float>(p); break;
    case at::kBFloat16: paged_decode_impl<c10::BFloat16>(p); break;
    case at::kHalf: paged_decode_impl<c10::Half>(p); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", cache_dtype);
  }
}

}  // namespace dcp_ops::cpu
