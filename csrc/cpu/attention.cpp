// CPU entry points of the partial decode attention ops: query staging (scale, fused w_uk), the paged kernel,
// and the optional w_uv up-projection of the normalised latent output.
#include <ATen/ATen.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu/gemm.h"
#include "cpu/paged_decode.h"
#include "ops.h"

namespace dcp_ops {

namespace {
constexpr double kLog2e = 1.4426950408889634;

cpu::PagedDecodeParams base_params(const Tensor& q32, const DecodeDims& d, const Tensor& block_table,
                                   const Tensor& seq_lens, Tensor& out32, Tensor& lse) {
  cpu::PagedDecodeParams p{};
  p.q = q32.data_ptr<float>();
  p.q_st = q32.stride(0);
  p.q_sh = q32.stride(1);
  p.T = d.T;
  p.Hq = d.Hq;
  p.Hkv = d.Hkv;
  p.Dk = d.Dk;
  p.Dv = d.Dv;
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.block_size = d.block_size;
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out32.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  return p;
}
// Per-head projection y[t, h, :] = x[t, h, :] @ w[h] for fp32 x [T, H, K] and w [H, K, N] in its own dtype (the MLA
// w_uk absorption and w_uv up-projection): w is read once, converted in registers, never copied to fp32.
Tensor per_head_matmul(const Tensor& x, const Tensor& w) {
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2), N = w.size(2);
  const Tensor wc = w.stride(2) == 1 ? w : w.contiguous();
  Tensor y = at::zeros({T, H, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "per_head_matmul", [&] {
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h)
        cpu::gemm_acc(T, N, K, cpu::Strided<float>{xp + h * x.stride(1), x.stride(0), x.stride(2)},
                      cpu::Strided<scalar_t>{wp + h * wc.stride(0), wc.stride(1), 1}, yp + h * N, H * N);
    });
  });
  return y;
}
}  // namespace

std::tuple<Tensor, Tensor> gqa_decode_partial_cpu(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale) {
  const DecodeDims d = validate_gqa(q, k_cache, v_cache, block_table, seq_lens, scale);
  cpu::check_paged_indices(block_table, seq_lens, d.num_blocks, d.block_size, "gqa_decode_partial");
  const Tensor q32 = (q.to(at::kFloat) * (scale * kLog2e)).contiguous();
  Tensor out32 = at::empty({d.T, d.Hq, d.Dv}, q.options().dtype(at::kFloat));
  Tensor lse = at::empty({d.T, d.Hq}, q.options().dtype(at::kFloat));
  cpu::PagedDecodeParams p = base_params(q32, d, block_table, seq_lens, out32, lse);
  p.k = k_cache.data_ptr();
  p.k_sb = k_cache.stride(0);
  p.k_st = k_cache.stride(1);
  p.k_sh = k_cache.stride(2);
  p.v = v_cache.data_ptr();
  p.v_sb = v_cache.stride(0);
  p.v_st = v_cache.stride(1);
  p.v_sh = v_cache.stride(2);
  cpu::paged_decode(p, q.scalar_type());
  return {out32.to(q.scalar_type()), lse};
}

std::tuple<Tensor, Tensor> mla_decode_partial_cpu(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_cache,
                                                  const Tensor& block_table, const Tensor& seq_lens, double scale,
                                                  const std::optional<Tensor>& w_uk,
                                                  const std::optional<Tensor>& w_uv) {
  const DecodeDims d = validate_mla(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk, w_uv);
  cpu::check_paged_indices(block_table, seq_lens, d.num_blocks, d.block_size, "mla_decode_partial");
  Tensor q_lat = q_nope.to(at::kFloat);
  if (w_uk.has_value()) q_lat = per_head_matmul(q_lat, *w_uk);  // query absorption, fp32 accumulation
  const Tensor q32 = (at::cat({q_lat, q_pe.to(at::kFloat)}, -1) * (scale * kLog2e)).contiguous();
  Tensor out32 = at::empty({d.T, d.Hq, d.Dv}, q_nope.options().dtype(at::kFloat));
  Tensor lse = at::empty({d.T, d.Hq}, q_nope.options().dtype(at::kFloat));
  cpu::PagedDecodeParams p = base_params(q32, d, block_table, seq_lens, out32, lse);
  p.k = p.v = kv_cache.data_ptr();
  p.k_sb = p.v_sb = kv_cache.stride(0);
  p.k_st = p.v_st = kv_cache.stride(1);
  p.k_sh = p.v_sh = 0;
  cpu::paged_decode(p, q_nope.scalar_type());
  if (w_uv.has_value()) out32 = per_head_matmul(out32, *w_uv);  // value up-projection, before any merge
  return {out32.to(q_nope.scalar_type()).contiguous(), lse};
}

}  // namespace dcp_ops
