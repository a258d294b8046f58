// CPU entry points of the partial decode attention ops: query staging (scale, fused w_uk), the paged kernel,
// and the optional w_uv up-projection of the normalised latent output.
#include <ATen/ATen.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <memory>
#include <vector>

#include "cpu/level.h"
#include "cpu/gemm.h"
#include "cpu/paged_decode.h"
#include "ops.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

namespace {
constexpr double kLog2e = 1.4426950408889634;

// Writes x [T, H, n] (any float dtype and strides) times mult into the fp32 rows dst[(t * H + h) * ld + col ..]: the
// kernel's query operand is staged here, not by ATen ops, each of which costs microseconds (a few of them cost as
// much as a decode step over a short context).
void stage_rows(const Tensor& x, double mult, float* dst, int64_t ld, int64_t col) {
  const int64_t T = x.size(0), H = x.size(1), n = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "stage_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float m = static_cast<float>(mult);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* src = xp + t * s0 + h * s1;
        float* out = dst + (t * H + h) * ld + col;
        if (s2 == 1) {  // the usual case, vectorised
          for (int64_t i = 0; i < n; ++i) out[i] = cpu::to_f32(src[i]) * m;
        } else {
          for (int64_t i = 0; i < n; ++i) out[i] = cpu::to_f32(src[i * s2]) * m;
        }
      }
  });
}

// The value of an FP8 cache's scale (a 1-element fp32 CPU tensor, checked by the validators), 1 without one.
double scale_value(const std::optional<Tensor>& scale) {
  return scale.has_value() ? static_cast<double>(*scale->data_ptr<float>()) : 1.0;
}

cpu::PagedDecodeParams base_params(const float* q32, const DecodeDims& d, const Tensor& block_table,
                                   const Tensor& seq_lens, const std::optional<Tensor>& cu_seqlens_q, Tensor& out,
                                   Tensor& lse) {
  cpu::PagedDecodeParams p{};
  p.q = q32;
  p.q_st = d.Hq * d.Dk;
  p.q_sh = d.Dk;
  p.T = d.T;
  p.Hq = d.Hq;
  p.Hkv = d.Hkv;
  p.Dk = d.Dk;
  p.Dv = d.Dv;
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.block_size = d.block_size;
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  p.B = cu_seqlens_q.has_value() ? block_table.size(0) : d.T;
  p.out = out.data_ptr();
  p.out_dtype = out.scalar_type();
  p.lse = lse.data_ptr<float>();
  p.out_mult = 1.f;
  return p;
}
// Per-head projection y[t, h, :] += x[t, h, :] @ w[h] for fp32 rows x (row (t, h) at x + t * xs0 + h * xs1) and w
// [H, K, N] in its own dtype, into fp32 rows y (at y + t * ys0 + h * ys1), for the MLA w_uk absorption and w_uv
// up-projection: w is read once, converted in registers, never copied to fp32.
void per_head_matmul(const float* x, int64_t xs0, int64_t xs1, int64_t T, const Tensor& w, float* y, int64_t ys0,
                     int64_t ys1) {
  const int64_t H = w.size(0), K = w.size(1), N = w.size(2);
  const Tensor wc = w.stride(2) == 1 ? w : w.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "per_head_matmul", [&] {
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h)
        cpu::gemm_acc(T, N, K, cpu::Strided<float>{x + h * xs1, xs0, 1},
                      cpu::Strided<scalar_t>{wp + h * wc.stride(0), wc.stride(1), 1}, y + h * ys1, ys0);
    });
  });
}
}  // namespace

std::tuple<Tensor, Tensor> gqa_decode_partial_cpu(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                  c10::string_view precision,
                                                  const std::optional<Tensor>& cu_seqlens_q,
                                                  const std::optional<Tensor>& k_scale,
                                                  const std::optional<Tensor>& v_scale) {
  parse_precision(precision, "gqa_decode_partial");  // exact under both: it passes the native bound too
  const DecodeDims d =
      validate_gqa(q, k_cache, v_cache, block_table, seq_lens, scale, cu_seqlens_q, k_scale, v_scale);
  cpu::check_paged_indices(block_table, seq_lens, cu_seqlens_q, d.num_blocks, d.block_size, "gqa_decode_partial");
  // An FP8 cache's K scale folds into the softmax scale, its V scale into the output (docs/design.md §6).
  const double q_mult = scale * scale_value(k_scale) * kLog2e;
  std::vector<float> q32(d.T * d.Hq * d.Dk);
  stage_rows(q, q_mult, q32.data(), d.Dk, 0);
  Tensor out = at::empty({d.T, d.Hq, d.Dv}, q.options());
  Tensor lse = at::empty({d.T, d.Hq}, q.options().dtype(at::kFloat));
  if (d.T == 0 || d.Hq == 0) return {out, lse};  // nothing to compute (docs/design.md §2: zero-size dims never crash)
  cpu::PagedDecodeParams p = base_params(q32.data(), d, block_table, seq_lens, cu_seqlens_q, out, lse);
  p.q_mult = static_cast<float>(q_mult);
  p.q_exact_bf16 = q.scalar_type() == at::kBFloat16;
  p.out_mult = static_cast<float>(scale_value(v_scale));
  p.k = k_cache.data_ptr();
  p.k_sb = k_cache.stride(0);
  p.k_st = k_cache.stride(1);
  p.k_sh = k_cache.stride(2);
  p.v = v_cache.data_ptr();
  p.v_sb = v_cache.stride(0);
  p.v_st = v_cache.stride(1);
  p.v_sh = v_cache.stride(2);
  cpu::paged_decode(p, k_cache.scalar_type());
  return {out, lse};
}

std::tuple<Tensor, Tensor> mla_decode_partial_cpu(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                  const std::optional<Tensor>& w_uk,
                                                  const std::optional<Tensor>& w_uv, c10::string_view precision,
                                                  const std::optional<Tensor>& cu_seqlens_q,
                                                  const std::optional<Tensor>& kv_scale) {
  parse_precision(precision, "mla_decode_partial");  // exact under both: it passes the native bound too
  const DecodeDims d =
      validate_mla(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk, w_uv, cu_seqlens_q, kv_scale);
  cpu::check_paged_indices(block_table, seq_lens, cu_seqlens_q, d.num_blocks, d.block_size, "mla_decode_partial");
  // Query rows [latent | rope] in fp32, times scale * log2(e) (and an FP8 cache's scale, which also multiplies the
  // output: docs/design.md §6); the latent part absorbed through w_uk if given (in
  // place, fp32 accumulation; staged here rather than by ATen ops, which after a decode step's cache traffic took
  // 20-60 us each).
  const int64_t latent = d.Dk - q_pe.size(2);
  const double q_mult = scale * scale_value(kv_scale) * kLog2e;
  std::vector<float> q32(d.T * d.Hq * d.Dk);  // zeros
  if (w_uk.has_value()) {
    const int64_t nope = q_nope.size(2);
    std::vector<float> qn32(d.T * d.Hq * nope);
    stage_rows(q_nope, 1.0, qn32.data(), nope, 0);
    per_head_matmul(qn32.data(), d.Hq * nope, nope, d.T, *w_uk, q32.data(), d.Hq * d.Dk, d.Dk);
    const float m = static_cast<float>(q_mult);
    for (int64_t r = 0; r < d.T * d.Hq; ++r)
      for (int64_t i = 0; i < latent; ++i) q32[r * d.Dk + i] *= m;
  } else {
    stage_rows(q_nope, q_mult, q32.data(), d.Dk, 0);
  }
  stage_rows(q_pe, q_mult, q32.data(), d.Dk, latent);
  const int64_t dv_out = w_uv.has_value() ? w_uv->size(2) : d.Dv;
  Tensor out = at::empty({d.T, d.Hq, dv_out}, q_nope.options());
  Tensor lse = at::empty({d.T, d.Hq}, q_nope.options().dtype(at::kFloat));
  if (d.T == 0 || d.Hq == 0) return {out, lse};
  cpu::PagedDecodeParams p = base_params(q32.data(), d, block_table, seq_lens, cu_seqlens_q, out, lse);
  // The kernel writes out in q's type; with w_uv, the latent output [T, Hq, latent] in fp32 into lat instead (every
  // element written, so not zeroed first), for the up-projection below.
  std::unique_ptr<float[]> lat;
  if (w_uv.has_value()) {
    lat.reset(new float[d.T * d.Hq * d.Dv]);
    p.out = lat.get();
    p.out_dtype = at::kFloat;
  }
  p.q_mult = static_cast<float>(q_mult);
  p.out_mult = static_cast<float>(scale_value(kv_scale));
  p.q_exact_bf16 = !w_uk.has_value() && q_nope.scalar_type() == at::kBFloat16 && q_pe.scalar_type() == at::kBFloat16;
  p.k = p.v = kv_cache.data_ptr();
  p.k_sb = p.v_sb = kv_cache.stride(0);
  p.k_st = p.v_st = kv_cache.stride(1);
  p.k_sh = p.v_sh = 0;
  cpu::paged_decode(p, kv_cache.scalar_type());
  if (w_uv.has_value()) {  // value up-projection, fp32 accumulation, rounded once to q's type
    std::vector<float> y(d.T * d.Hq * dv_out);  // zeros
    per_head_matmul(lat.get(), d.Hq * d.Dv, d.Dv, d.T, *w_uv, y.data(), d.Hq * dv_out, dv_out);
    cpu::store_row(out.data_ptr(), out.scalar_type(), 0, y.data(), static_cast<int64_t>(y.size()));
  }
  return {out, lse};
}

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
