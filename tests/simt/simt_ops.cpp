// Test-only extension: the CUDA launchers and kernels (csrc/cuda/*.cu) compiled by the host compiler with
// DCP_SIMT and run by the SIMT executor on CPU tensors, as torch.ops.dcp_ops_simt.*, plus the executor's own
// self-test kernels.
#include <torch/library.h>

#include "cuda/launch.h"
#include "cuda/gqa_decode.cu"
#include "cuda/merge.cu"
#include "cuda/mla_decode.cu"
#include "cuda/split_choice.cu"
#include "cuda/split_plan.cu"
#include "cuda/write_kv.cu"
#include "schemas.h"
#include "selftest_kernels.cuh"

using at::Tensor;

static std::tuple<Tensor, Tensor> warp_reduce(const Tensor& x) {
  const int n = x.numel(), warps = (n + 31) / 32;
  Tensor sums = at::full({warps}, NAN, x.options());
  Tensor ballots = at::zeros({warps}, x.options().dtype(at::kInt));
  DCP_LAUNCH(simt_selftest::warp_reduce, dim3((n + 63) / 64), dim3(64), 0, nullptr, x.data_ptr<float>(),
             sums.data_ptr<float>(), reinterpret_cast<unsigned*>(ballots.data_ptr<int>()), n);
  return {sums, ballots};
}

static Tensor transpose32(const Tensor& x) {  // [tiles, 32, 32]
  Tensor out = at::full_like(x, NAN);
  DCP_LAUNCH(simt_selftest::transpose32, dim3(x.size(0)), dim3(32, 8), 0, nullptr, x.data_ptr<float>(),
             out.data_ptr<float>(), static_cast<int>(x.size(0)));
  return out;
}

static Tensor histogram(const Tensor& x, int64_t bins) {
  Tensor out = at::zeros({bins}, x.options());
  DCP_LAUNCH(simt_selftest::histogram, dim3(3), dim3(64), bins * sizeof(int), nullptr, x.data_ptr<int>(),
             static_cast<int>(x.numel()), static_cast<int>(bins), out.data_ptr<int>());
  return out;
}

static Tensor block_sum(const Tensor& x, bool sync, int64_t reader) {
  Tensor out = at::full({1}, NAN, x.options());
  DCP_LAUNCH(simt_selftest::block_sum, dim3(1), dim3(x.numel()), 0, nullptr, x.data_ptr<float>(),
             out.data_ptr<float>(), sync, static_cast<unsigned>(reader));
  return out;
}

static Tensor async_copy(const Tensor& x) {  // x: [threads * 8]
  const int64_t n = x.numel() / 8;
  Tensor seen = at::full({3, n, 8}, NAN, x.options());
  DCP_LAUNCH(simt_selftest::async_copy, dim3(1), dim3(n), n * 8 * sizeof(float), nullptr, x.data_ptr<float>(),
             seen.data_ptr<float>());
  return seen;
}

static Tensor strided_store(int64_t stride) {
  Tensor out = at::full({32}, NAN);
  DCP_LAUNCH(simt_selftest::strided_store, dim3(1), dim3(32), 32 * stride * 4, nullptr, static_cast<int>(stride),
             out.data_ptr<float>());
  return out;
}

// The executor's bank statistics since the last reset: [requests, wavefronts, ideal wavefronts] of ldmatrix and
// st_shared_u32 (bank_stats), of cp.async (async_bank_stats).
static std::vector<int64_t> read_stats(dcp_ops::simt::BankStats& s, bool reset) {
  const std::vector<int64_t> out{s.requests, s.wavefronts, s.ideal};
  if (reset) s = dcp_ops::simt::BankStats{};
  return out;
}
static std::vector<int64_t> bank_stats(bool reset) { return read_stats(dcp_ops::simt::g_bank_stats, reset); }
static std::vector<int64_t> async_bank_stats(bool reset) {
  return read_stats(dcp_ops::simt::g_async_bank_stats, reset);
}

// simt_selftest::mbarrier_ring over x ([tiles, chunk] floats) with `consumers` consumer threads.
static Tensor mbarrier_ring(const Tensor& x, int64_t stages, int64_t consumers, int64_t misuse) {
  const int tiles = static_cast<int>(x.size(0)), chunk = static_cast<int>(x.size(1));
  Tensor out = at::full_like(x, NAN);
  const size_t smem = simt_selftest::ring_head(static_cast<int>(stages)) + stages * chunk * sizeof(float);
  DCP_LAUNCH(simt_selftest::mbarrier_ring, dim3(1), dim3(32 + consumers), smem, nullptr, x.data_ptr<float>(),
             out.data_ptr<float>(), tiles, static_cast<int>(stages), chunk, static_cast<int>(misuse));
  return out;
}

static Tensor cp_async_arrive(const Tensor& x, int64_t reader, bool wait) {  // x: [threads * 8]
  const int64_t n = x.numel() / 8;
  Tensor out = at::full_like(x, NAN);
  DCP_LAUNCH(simt_selftest::cp_async_arrive, dim3(1), dim3(n), 16 + n * 8 * sizeof(float), nullptr,
             x.data_ptr<float>(), out.data_ptr<float>(), static_cast<unsigned>(reader), wait);
  return out;
}

static Tensor named_handoff(const Tensor& x, int64_t id, int64_t count, int64_t sync_count, bool sync) {  // x: [64]
  Tensor out = at::full({64}, NAN);
  DCP_LAUNCH(simt_selftest::named_handoff, dim3(1), dim3(64), 0, nullptr, x.data_ptr<float>(), out.data_ptr<float>(),
             static_cast<int>(id), static_cast<int>(count), static_cast<int>(sync_count), sync);
  return out;
}

// simt_selftest::tma_box: the tensor map of `src`'s bytes (dims, byte strides of dimensions 1 .., box: elements,
// dimension 0 first; elem_bytes each) with `swizzle` (0, 32, 64, 128), its box at `coords` to shared byte `dst`; the
// whole shared memory (smem_bytes) after the wait.
static Tensor tma_box(const Tensor& src, int64_t elem_bytes, std::vector<int64_t> dims, std::vector<int64_t> strides,
                      std::vector<int64_t> box, int64_t swizzle, std::vector<int64_t> coords, int64_t dst,
                      int64_t smem_bytes, bool wait) {
  TORCH_CHECK(src.dtype() == at::kByte && src.is_contiguous(), "tma_box: src is contiguous uint8");
  const int rank = static_cast<int>(dims.size());
  TORCH_CHECK(rank >= 1 && rank <= 5 && box.size() == dims.size() && coords.size() == dims.size() &&
              strides.size() + 1 == dims.size(), "tma_box: rank 1 to 5: dims, box, coords of it, strides one fewer");
  std::vector<uint64_t> d(dims.begin(), dims.end()), st(strides.begin(), strides.end());
  std::vector<uint32_t> b(box.begin(), box.end());
  const auto map = dcp_ops::simt::encode_tiled(static_cast<int>(elem_bytes), rank, src.data_ptr(), d.data(),
                                               st.data(), b.data(), static_cast<int>(swizzle));
  simt_selftest::TmaCoords c{};
  for (int i = 0; i < rank; ++i) c.v[i] = static_cast<int>(coords[i]);
  Tensor out = at::zeros({smem_bytes}, src.options());
  auto run = [&](auto kernel) {
    DCP_LAUNCH(kernel, dim3(1), dim3(64), smem_bytes, nullptr, map, c, static_cast<int>(dst), map.box_bytes(),
               out.data_ptr<uint8_t>(), static_cast<int>(smem_bytes), wait);
  };
  if (rank == 1) run(simt_selftest::tma_box<1>);
  else if (rank == 2) run(simt_selftest::tma_box<2>);
  else if (rank == 3) run(simt_selftest::tma_box<3>);
  else if (rank == 4) run(simt_selftest::tma_box<4>);
  else run(simt_selftest::tma_box<5>);
  return out;
}

static Tensor divergent_barrier() {
  Tensor out = at::zeros({32});
  DCP_LAUNCH(simt_selftest::divergent_barrier, dim3(1), dim3(32), 0, nullptr, out.data_ptr<float>());
  return out;
}

// One warpgroup's wgmmas on a shared-memory image (simt_selftest::wgmma_steps, which says what the arguments mean):
// image uint8 [bytes], descs int64 [S, 2] (A, B), steps int32 [S, 3], waits int32 [W], a_regs int32 [S, 128, 4] or
// None (A from descriptors), c float32 [2, 128, N / 2]; dtype 0 bf16, 1 fp16. Returns out [W, 2, 128, N / 2],
// NaN where the kernel wrote nothing.
struct WgmmaArgs {
  const Tensor &image, &descs, &steps, &waits;
  const uint32_t* a_regs;
  bool trans_a, trans_b;
  const Tensor &c, &out;
  int misuse;
};
template <int N, typename T>
static void launch_wgmma(const WgmmaArgs& a) {
  constexpr auto kernel = simt_selftest::wgmma_steps<N, T>;
  DCP_LAUNCH(kernel, dim3(1), dim3(128), a.image.numel(), nullptr, a.image.data_ptr<uint8_t>(),
             static_cast<int>(a.image.numel()), a.descs.data_ptr<int64_t>(), a.steps.data_ptr<int>(),
             static_cast<int>(a.steps.size(0)), a.waits.data_ptr<int>(), static_cast<int>(a.waits.numel()), a.a_regs,
             a.trans_a, a.trans_b, a.c.data_ptr<float>(), a.out.data_ptr<float>(), a.misuse);
}
template <typename T, int... Ns>
static bool launch_wgmma_n(int64_t n, std::integer_sequence<int, Ns...>, const WgmmaArgs& a) {
  return ((n == Ns && (launch_wgmma<Ns, T>(a), true)) || ...);
}

static Tensor wgmma(const Tensor& image, const Tensor& descs, const Tensor& steps, const Tensor& waits, int64_t n,
                    int64_t dtype, bool trans_a, bool trans_b, const std::optional<Tensor>& a_regs, const Tensor& c,
                    int64_t misuse) {
  const int64_t S = descs.size(0);
  TORCH_CHECK(image.dtype() == at::kByte && image.is_contiguous(), "wgmma: image is contiguous uint8");
  TORCH_CHECK(descs.dtype() == at::kLong && descs.is_contiguous() && descs.dim() == 2 && descs.size(1) == 2,
              "wgmma: descs is int64 [S, 2]");
  TORCH_CHECK(S >= 1 && S <= simt_selftest::kWgmmaMaxSteps, "wgmma: 1 to 4 steps");
  TORCH_CHECK(steps.dtype() == at::kInt && steps.is_contiguous() && steps.sizes() == at::IntArrayRef({S, 3}),
              "wgmma: steps is int32 [S, 3]");
  TORCH_CHECK(waits.dtype() == at::kInt && waits.is_contiguous() && waits.dim() == 1, "wgmma: waits is int32 [W]");
  TORCH_CHECK(c.dtype() == at::kFloat && c.is_contiguous() && c.sizes() == at::IntArrayRef({2, 128, n / 2}),
              "wgmma: c is float32 [2, 128, N / 2]");
  if (a_regs.has_value())
    TORCH_CHECK(a_regs->dtype() == at::kInt && a_regs->is_contiguous() &&
                    a_regs->sizes() == at::IntArrayRef({S, 128, 4}),
                "wgmma: a_regs is int32 [S, 128, 4]");
  TORCH_CHECK(dtype == 0 || dtype == 1, "wgmma: dtype 0 (bf16) or 1 (fp16)");
  Tensor out = at::full({waits.numel(), 2, 128, n / 2}, NAN);
  const WgmmaArgs a{image, descs, steps, waits,
                    a_regs.has_value() ? reinterpret_cast<const uint32_t*>(a_regs->data_ptr<int>()) : nullptr,
                    trans_a, trans_b, c, out, static_cast<int>(misuse)};
  using Ns = std::integer_sequence<int, 8, 16, 24, 64, 128, 136, 256>;
  const bool ok = dtype == 0 ? launch_wgmma_n<__nv_bfloat16>(n, Ns{}, a) : launch_wgmma_n<__half>(n, Ns{}, a);
  TORCH_CHECK(ok, "wgmma: the self-test is built for N in {8, 16, 24, 64, 128, 136, 256}, got ", n);
  return out;
}

// make_smem_desc (kernels/wgmma.cuh) of byte `offset` of a dynamic shared memory of smem_bytes.
static int64_t wgmma_desc(int64_t smem_bytes, int64_t offset, int64_t swizzle, int64_t lbo, int64_t sbo) {
  Tensor out = at::zeros({1}, at::kLong);
  DCP_LAUNCH(simt_selftest::wgmma_desc, dim3(1), dim3(1), smem_bytes, nullptr, static_cast<int>(offset),
             static_cast<int>(swizzle), static_cast<int>(lbo), static_cast<int>(sbo), out.data_ptr<int64_t>());
  return out.item<int64_t>();
}

// The decode launchers' split plan (kernels/split_plan.cuh), as made under the executor (8 SMs).
static std::tuple<Tensor, Tensor, Tensor> split_plan(const Tensor& seq_lens, const std::optional<Tensor>& cu,
                                                     int64_t capacity, int64_t granule, int64_t G, int64_t Hkv,
                                                     int64_t R) {
  const int64_t T = seq_lens.size(0), B = cu.has_value() ? cu->size(0) - 1 : T;
  const dcp_ops::SplitPlan plan = dcp_ops::plan_splits(seq_lens, cu, T, B, capacity, static_cast<int>(granule), G,
                                                       Hkv, static_cast<int>(R), "split_plan");
  TORCH_CHECK(plan.err == cudaSuccess, "split_plan: launch failed");
  return {plan.work, plan.unit, plan.tok};
}

// The split pass a decode launch takes on the executor's device (DCP_SIMT_ARCH, DCP_SIMT_SMEM_OPTIN):
// cuda/split_choice.h.
static std::tuple<std::string, int64_t, int64_t, int64_t, int64_t> mla_split_choice(int64_t latent, int64_t rope,
                                                                                    int64_t elem_bytes, bool native) {
  const dcp_ops::SplitPass s = dcp_ops::mla_split_choice(static_cast<int>(latent), static_cast<int>(rope),
                                                         static_cast<int>(elem_bytes), native,
                                                         dcp_ops::current_device());
  return {s.name, s.rows, s.granule, s.tokens, s.smem};
}
static std::tuple<std::string, int64_t, int64_t> gqa_split_choice(int64_t D, int64_t elem_bytes, int64_t rows) {
  const dcp_ops::SplitPass s = dcp_ops::gqa_split_choice(static_cast<int>(D), static_cast<int>(elem_bytes), rows,
                                                         dcp_ops::current_device());
  return {s.name, s.rows, s.granule};
}

// The kernels the executor launched since the last reset, in order ("mla_tiled_kernel<__nv_bfloat16, 512, 64, 64,
// false>", ...), and the last of them.
static std::vector<std::string> kernel_log(bool reset) {
  std::vector<std::string> out = dcp_ops::simt::g_kernel_log;
  if (reset) dcp_ops::simt::g_kernel_log.clear();
  return out;
}
static std::string last_kernel() {
  return dcp_ops::simt::g_kernel_log.empty() ? "" : dcp_ops::simt::g_kernel_log.back();
}

TORCH_LIBRARY(dcp_ops_simt, m) {
  using namespace dcp_ops::schema;  // the public ops' schemas, so a test calls each CUDA kernel as the op is called
  m.def(kGqaDecodePartial, &dcp_ops::gqa_decode_partial_cuda);
  m.def(kMlaDecodePartial, &dcp_ops::mla_decode_partial_cuda);
  m.def(kMergePartials, &dcp_ops::merge_partials_cuda);
  m.def(kCorrectPartial, &dcp_ops::correct_partial_cuda);
  m.def(kPackExchange, &dcp_ops::pack_exchange_cuda);
  m.def(kMergeExchange, &dcp_ops::merge_exchange_cuda);
  m.def(kWriteKv, &dcp_ops::write_kv_cuda);
  m.def("split_plan(Tensor seq_lens, Tensor? cu, int capacity, int granule, int G, int Hkv, int R) -> "
        "(Tensor, Tensor, Tensor)", &split_plan);
  m.def("mla_split_choice(int latent, int rope, int elem_bytes, bool native) -> (str, int, int, int, int)",
        &mla_split_choice);
  m.def("gqa_split_choice(int D, int elem_bytes, int rows) -> (str, int, int)", &gqa_split_choice);
  m.def("kernel_log(bool reset=True) -> str[]", &kernel_log);
  m.def("last_kernel() -> str", &last_kernel);
  m.def("warp_reduce(Tensor x) -> (Tensor, Tensor)", &warp_reduce);
  m.def("transpose32(Tensor x) -> Tensor", &transpose32);
  m.def("histogram(Tensor x, int bins) -> Tensor", &histogram);
  m.def("block_sum(Tensor x, bool sync, int reader=0) -> Tensor", &block_sum);
  m.def("async_copy(Tensor x) -> Tensor", &async_copy);
  m.def("strided_store(int stride) -> Tensor", &strided_store);
  m.def("bank_stats(bool reset=True) -> int[]", &bank_stats);
  m.def("async_bank_stats(bool reset=True) -> int[]", &async_bank_stats);
  m.def("divergent_barrier() -> Tensor", &divergent_barrier);
  m.def("mbarrier_ring(Tensor x, int stages, int consumers, int misuse=0) -> Tensor", &mbarrier_ring);
  m.def("cp_async_arrive(Tensor x, int reader, bool wait) -> Tensor", &cp_async_arrive);
  m.def("tma_box(Tensor src, int elem_bytes, int[] dims, int[] strides, int[] box, int swizzle, int[] coords, int dst, "
        "int smem_bytes, bool wait=True) -> Tensor", &tma_box);
  m.def("named_handoff(Tensor x, int id, int count, int sync_count, bool sync) -> Tensor", &named_handoff);
  m.def("wgmma(Tensor image, Tensor descs, Tensor steps, Tensor waits, int n, int dtype, bool trans_a, bool trans_b, "
        "Tensor? a_regs, Tensor c, int misuse=0) -> Tensor", &wgmma);
  m.def("wgmma_desc(int smem_bytes, int offset, int swizzle, int lbo, int sbo) -> int", &wgmma_desc);
}
