// Split-KV paged decode: tiles of kTile tokens are staged to fp32 (K transposed), scored with the register-blocked
// GEMM, folded into an online base-2 softmax, and the splits combined at the end.
#include "cpu/paged_decode.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/gemm.h"

namespace dcp_ops::cpu {

namespace {

constexpr int64_t kTile = 64;  // tokens per staged tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147180559945309f;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename scalar_t>
inline float to_float(scalar_t x) { return static_cast<float>(x); }

// Stages tokens [j, j + n) of one KV head: kt[Dk x kTile] (transposed) and vs[n x Dv], fp32.
template <typename scalar_t>
void stage_tile(const PagedDecodeParams& p, int64_t t, int64_t kvh, int64_t j, int64_t n, float* kt, float* vs) {
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const int32_t* row = p.block_table + t * p.bt_stride;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = j + i;
    const int64_t block = row[pos / p.block_size];
    const int64_t off = pos % p.block_size;
    const scalar_t* kr = k + block * p.k_sb + off * p.k_st + kvh * p.k_sh;
    const scalar_t* vr = v + block * p.v_sb + off * p.v_st + kvh * p.v_sh;
    for (int64_t d = 0; d < p.Dk; ++d) kt[d * kTile + i] = to_float(kr[d]);
    float* vo = vs + i * p.Dv;
    for (int64_t d = 0; d < p.Dv; ++d) vo[d] = to_float(vr[d]);
  }
}

// Online softmax over one tile of base-2 scores s[G x kTile] (n valid columns): s becomes probabilities,
// o rows are rescaled to the new running max.
void softmax_update(float* s, int64_t G, int64_t n, float* m, float* l, float* o, int64_t Dv) {
  constexpr int64_t VL = fVec::size();
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * kTile;
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
    const float m_new = std::max(m[g], mx);
    const float alpha = std::exp2(m[g] - m_new);  // 0 on the first tile (m = -inf)
    fVec sum_v(0.f);
    const fVec mv(m_new);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
      const fVec e = (fVec::loadu(row + i) - mv).exp2();
      e.store(row + i);
      sum_v = sum_v + e;
    }
    float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum_v);
    for (; i < n; ++i) {
      row[i] = std::exp2(row[i] - m_new);
      sum += row[i];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = m_new;
    if (alpha != 1.f) {
      float* orow = o + g * Dv;
      const fVec av(alpha);
      int64_t d = 0;
      for (; d + VL <= Dv; d += VL) (fVec::loadu(orow + d) * av).store(orow + d);
      for (; d < Dv; ++d) orow[d] *= alpha;
    }
  }
}

template <typename scalar_t>
void paged_decode_impl(const PagedDecodeParams& p) {
  const int64_t G = p.Hq / p.Hkv;
  const int64_t pairs = p.T * p.Hkv;
  int64_t max_len = 0;
  for (int64_t t = 0; t < p.T; ++t) max_len = std::max<int64_t>(max_len, p.seq_lens[t]);
  const int64_t threads = at::get_num_threads();
  // Enough splits to give every thread work when the batch is small, never splits of less than a tile.
  const int64_t nsplit = std::max<int64_t>(1, std::min(ceil_div(4 * threads, std::max<int64_t>(pairs, 1)),
                                                       ceil_div(max_len, kTile)));
  const int64_t items = pairs * nsplit;
  std::vector<float> part_o(items * G * p.Dv), part_m(items * G), part_l(items * G);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(p.Dk * kTile), vs(kTile * p.Dv), s(G * kTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / nsplit, split = item % nsplit;
      const int64_t t = pair / p.Hkv, kvh = pair % p.Hkv;
      const int64_t len = p.seq_lens[t];
      const int64_t chunk = ceil_div(ceil_div(len, nsplit), kTile) * kTile;
      const int64_t j0 = split * chunk, j1 = std::min(len, j0 + chunk);
      float* o = part_o.data() + item * G * p.Dv;
      float* m = part_m.data() + item * G;
      float* l = part_l.data() + item * G;
      std::fill(o, o + G * p.Dv, 0.f);
      std::fill(m, m + G, kNegInf);
      std::fill(l, l + G, 0.f);
      const float* qg = p.q + t * p.q_st + kvh * G * p.q_sh;
      for (int64_t j = j0; j < j1; j += kTile) {
        const int64_t n = std::min(kTile, j1 - j);
        stage_tile<scalar_t>(p, t, kvh, j, n, kt.data(), vs.data());
        std::fill(s.begin(), s.end(), 0.f);
        gemm_acc(G, n, p.Dk, qg, p.q_sh, kt.data(), kTile, s.data(), kTile);
        softmax_update(s.data(), G, n, m, l, o, p.Dv);
        gemm_acc(G, p.Dv, n, s.data(), kTile, vs.data(), p.Dv, o, p.Dv);
      }
    }
  });

  // Combine the splits of each (token, head): exact online-softmax merge in base 2.
  at::parallel_for(0, pairs * G, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(nsplit);
    for (int64_t ph = begin; ph < end; ++ph) {
      const int64_t pair = ph / G, g = ph % G;
      const int64_t t = pair / p.Hkv, h = (pair % p.Hkv) * G + g;
      float mx = kNegInf;
      for (int64_t sp = 0; sp < nsplit; ++sp) mx = std::max(mx, part_m[(pair * nsplit + sp) * G + g]);
      float* dst = p.out + (t * p.Hq + h) * p.Dv;
      if (mx == kNegInf) {
        std::fill(dst, dst + p.Dv, 0.f);
        p.lse[t * p.Hq + h] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        const int64_t idx = (pair * nsplit + sp) * G + g;
        w[sp] = part_m[idx] == kNegInf ? 0.f : std::exp2(part_m[idx] - mx);
        total += w[sp] * part_l[idx];
      }
      const float inv = 1.f / total;
      std::fill(dst, dst + p.Dv, 0.f);
      for (int64_t sp = 0; sp < nsplit; ++sp) {
        if (w[sp] == 0.f) continue;
        const float* src = part_o.data() + ((pair * nsplit + sp) * G + g) * p.Dv;
        const float ws = w[sp] * inv;
        for (int64_t d = 0; d < p.Dv; ++d) dst[d] += ws * src[d];
      }
      p.lse[t * p.Hq + h] = (mx + std::log2(total)) * kLn2;
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
