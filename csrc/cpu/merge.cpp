// CPU merge family: merge_partials, correct_partial, pack_exchange, merge_exchange. fp32 accumulation throughout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/level.h"
#include "checks.h"
#include "cpu/convert.h"
#include "ops.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using fVec = at::vec::Vectorized<float>;

// An LSE in natural log as the merges read it (docs/design.md §2): -inf is an empty partial; from other kernels
// (propagate = false) NaN and +inf are empty too; from ours (propagate = true) they stay, and poison the row.
inline float read_lse(float x, float ln_base, bool propagate) {
  const float v = x * ln_base;
  return propagate || !(std::isnan(v) || v == std::numeric_limits<float>::infinity()) ? v : kNegInf;
}

// Merge weights exp(lse_r - L) for N partials; returns L. Every partial empty: L = -inf, weights 0. A NaN LSE: L
// NaN; else a +inf one: L = +inf; then every partial but the empty ones gets weight NaN.
inline float merge_weights(const float* lse, int64_t n, float* w) {
  float mx = kNegInf;
  bool nan = false;
  for (int64_t r = 0; r < n; ++r) {
    nan |= std::isnan(lse[r]);
    mx = std::max(mx, lse[r]);
  }
  if (nan || mx == -kNegInf || mx == kNegInf) {
    for (int64_t r = 0; r < n; ++r) w[r] = lse[r] == kNegInf ? 0.f : std::numeric_limits<float>::quiet_NaN();
    return nan ? std::numeric_limits<float>::quiet_NaN() : mx;
  }
  float sum = 0.f;
  for (int64_t r = 0; r < n; ++r) sum += (w[r] = std::exp(lse[r] - mx));
  for (int64_t r = 0; r < n; ++r) w[r] /= sum;
  return mx + std::log(sum);
}

// dst[0:D] = sum_r w[r] * src_r[0:D] in fp32, src_r = base + r * stride_r.
template <typename scalar_t>
inline void weighted_sum(const scalar_t* base, int64_t stride_r, const float* w, int64_t n, int64_t D,
                         scalar_t* dst, float* acc) {
  std::fill(acc, acc + D, 0.f);
  for (int64_t r = 0; r < n; ++r) {
    if (w[r] == 0.f) continue;  // an empty partial may hold anything (even NaN); it must not leak
    const scalar_t* src = base + r * stride_r;
    for (int64_t d = 0; d < D; ++d) acc[d] += w[r] * cpu::to_f32(src[d]);
  }
  for (int64_t d = 0; d < D; ++d) dst[d] = cpu::from_f32<scalar_t>(acc[d]);
}

}  // namespace

std::tuple<Tensor, Tensor> merge_partials_cpu(const Tensor& outs, const Tensor& lses, double lse_base,
                                              c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "merge_partials");
  validate_merge(outs, lses, lse_base, "merge_partials");
  const int64_t N = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  Tensor out = at::empty({T, H, D}, outs.options());
  Tensor lse = at::empty({T, H}, lses.options());
  const float ln_base = static_cast<float>(std::log(lse_base));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, outs.scalar_type(), "merge_partials_cpu", [&] {
    const scalar_t* o = outs.data_ptr<scalar_t>();
    const float* l = lses.data_ptr<float>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    float* lse_dst = lse.data_ptr<float>();
    at::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> lv(N), w(N), acc(D);
      for (int64_t th = begin; th < end; ++th) {
        const int64_t t = th / H, h = th % H;
        for (int64_t r = 0; r < N; ++r)
          lv[r] = read_lse(l[r * lses.stride(0) + t * lses.stride(1) + h * lses.stride(2)], ln_base, propagate);
        lse_dst[th] = merge_weights(lv.data(), N, w.data());
        weighted_sum(o + t * outs.stride(1) + h * outs.stride(2), outs.stride(0), w.data(), N, D, dst + th * D,
                     acc.data());
      }
    });
  });
  return {out, lse};
}

Tensor correct_partial_cpu(Tensor& out, const Tensor& lses, int64_t rank, double lse_base,
                           c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "correct_partial");
  validate_correct(out, lses, rank, lse_base);
  const int64_t N = lses.size(0), T = out.size(0), H = out.size(1), D = out.size(2);
  Tensor lse = at::empty({T, H}, lses.options());
  const float ln_base = static_cast<float>(std::log(lse_base));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "correct_partial_cpu", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const float* l = lses.data_ptr<float>();
    float* lse_dst = lse.data_ptr<float>();
    at::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> lv(N), w(N);
      for (int64_t th = begin; th < end; ++th) {
        const int64_t t = th / H, h = th % H;
        for (int64_t r = 0; r < N; ++r)
          lv[r] = read_lse(l[r * lses.stride(0) + t * lses.stride(1) + h * lses.stride(2)], ln_base, propagate);
        lse_dst[th] = merge_weights(lv.data(), N, w.data());
        const float factor = w[rank];
        scalar_t* row = o + t * out.stride(0) + h * out.stride(1);
        for (int64_t d = 0; d < D; ++d)  // an empty shard's row is zeroed, never multiplied (0 * NaN)
          row[d] = cpu::from_f32<scalar_t>(factor == 0.f ? 0.f : factor * cpu::to_f32(row[d]));
      }
    });
  });
  return lse;
}

void pack_exchange_cpu(const Tensor& out, const Tensor& lse, Tensor& send) {
  validate_pack_exchange(out, lse, send);
  const int64_t N = send.size(0), T = out.size(0), Hl = send.size(2), D = out.size(2);
  const int64_t row = send.size(3), esize = out.element_size();
  const char* o = static_cast<const char*>(out.data_ptr());
  const float* l = lse.data_ptr<float>();
  char* s = static_cast<char*>(send.data_ptr());
  at::parallel_for(0, N * T * Hl, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / (T * Hl), t = (i / Hl) % T, hl = i % Hl, h = r * Hl + hl;
      char* dst = s + i * row * esize;
      std::memcpy(dst, o + (t * out.stride(0) + h * out.stride(1)) * esize, D * esize);
      const float v = l[t * lse.stride(0) + h * lse.stride(1)];
      std::memset(dst + D * esize, 0, 16);
      std::memcpy(dst + D * esize, &v, sizeof(float));
    }
  });
}

void merge_exchange_cpu(const Tensor& recv, Tensor& out, Tensor& lse, c10::string_view nonfinite_lse) {
  const bool propagate = parse_nonfinite_lse(nonfinite_lse, "merge_exchange");
  validate_merge_exchange(recv, out, lse);
  const int64_t N = recv.size(0), T = recv.size(1), Hl = recv.size(2), row = recv.size(3);
  const int64_t D = out.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, recv.scalar_type(), "merge_exchange_cpu", [&] {
    const scalar_t* in = recv.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    float* lse_dst = lse.data_ptr<float>();
    at::parallel_for(0, T * Hl, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> lv(N), w(N), acc(D);
      for (int64_t th = begin; th < end; ++th) {
        const int64_t t = th / Hl, h = th % Hl;
        for (int64_t r = 0; r < N; ++r) {
          float v;
          std::memcpy(&v, in + ((r * T + t) * Hl + h) * row + D, sizeof(float));
          lv[r] = read_lse(v, 1.f, propagate);
        }
        lse_dst[t * lse.stride(0) + h * lse.stride(1)] = merge_weights(lv.data(), N, w.data());
        weighted_sum(in + th * row, T * Hl * row, w.data(), N, D, o + t * out.stride(0) + h * out.stride(1),
                     acc.data());
      }
    });
  });
}

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
