// Merge family (torch-free; raw pointers and element strides): merge of N normalised partials by their LSE,
// vLLM's in-place correction, and the a2a exchange's pack.
//   out[t,h,:] = sum_r exp(lse_r - L) * outs[r,t,h,:],  L = logsumexp_r lse_r
// Non-finite LSE (docs/design.md §2): -inf is an empty partial (weight 0). With propagate = false (LSE from other
// kernels, vLLM's convention) NaN and +inf count as -inf too. With propagate = true (our own partials, which mark empty
// ones with -inf) a NaN LSE makes the row's L and output NaN, and a +inf one (a +inf score) makes L +inf and the output
// NaN.
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

// An LSE in natural log as the merges read it.
__device__ __forceinline__ float read_lse(float x, float ln_base, bool propagate) {
  const float v = x * ln_base;
  return propagate || !(isnan(v) || v == INFINITY) ? v : -INFINITY;
}

// LSE of rank r for row (t, h): fp32 at a strided address, or bit-stored in an a2a row's pad (any alignment).
struct StridedLse {
  const float* p;
  int64_t sn, st, sh;
  __device__ float operator()(int r, int64_t t, int64_t h) const { return p[r * sn + t * st + h * sh]; }
};
struct PackedLse {
  const unsigned char* p;  // first pad byte of rank 0, row (0, 0)
  int64_t sn, st, sh;      // byte strides
  __device__ float operator()(int r, int64_t t, int64_t h) const {
    const unsigned char* b = p + r * sn + t * st + h * sh;
    const uint32_t u = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

// Max and sum of exp over a row's N LSEs (read_lse): max = -inf when every partial is empty, NaN when one is NaN,
// +inf when one is +inf and none is NaN (propagate only); sum only for a finite max.
// The partials r0 .. r0 + N - 1 are read.
template <typename Lse>
__device__ __forceinline__ void lse_stats(const Lse& lse, int r0, int N, int64_t t, int64_t h, float ln_base,
                                          bool propagate, float& mx, float& sum) {
  mx = -INFINITY;
  bool nan = false;
  for (int r = r0; r < r0 + N; ++r) {
    const float v = read_lse(lse(r, t, h), ln_base, propagate);
    nan |= isnan(v);
    mx = fmaxf(mx, v);
  }
  if (nan) mx = NAN;
  sum = 0.f;
  if (isfinite(mx))
    for (int r = r0; r < r0 + N; ++r) sum += __expf(read_lse(lse(r, t, h), ln_base, propagate) - mx);
}

// The merged row's LSE from lse_stats: -inf (empty), NaN and +inf pass through.
__device__ __forceinline__ float merged_lse(float mx, float sum) { return isfinite(mx) ? mx + __logf(sum) : mx; }

// The weight exp(v - L) of a partial whose LSE reads v, inv = 1 / sum: 0 for an empty partial, NaN for every other
// one when the row's max is NaN or +inf.
__device__ __forceinline__ float merge_weight(float v, float mx, float inv) {
  return v == -INFINITY ? 0.f : isfinite(mx) ? __expf(v - mx) * inv : NAN;
}

// The partials of a split plan (split_plan.cuh): partial rows [items, R], so_n (and the LSE's sn) an item's stride
// and so_h (sh) a row's. Query token t's head h reads partial row rho % R of items r0 .. r0 + N - 1 of its unit; none
// (N = 0): an empty row, out 0 and LSE -inf.
struct PlanRows {
  const int32_t* tok = nullptr;   // [T][3]: unit base (-1: none), first row, row tiles per KV head
  const int32_t* unit = nullptr;  // [units][2]: first item, item count
  int G = 1, R = 1;               // query heads per KV head, rows per item
  __device__ __forceinline__ void locate(int64_t t, int64_t h, int& r0, int& N, int64_t& row) const {
    const int32_t* tk = tok + 3 * t;
    r0 = N = 0;
    row = 0;
    if (tk[0] < 0) return;
    const int rho = tk[1] + static_cast<int>(h % G), u = tk[0] + static_cast<int>(h / G) * tk[2] + rho / R;
    r0 = unit[2 * u];
    N = unit[2 * u + 1];
    row = rho % R;
  }
};

template <typename Lse>
struct MergeArgs {
  const void* outs;
  int64_t so_n, so_t, so_h;  // element strides of outs [N, T, H, D]; last dim contiguous
  Lse lses;
  void* out;                 // [T, H, D], element strides below; last dim contiguous
  int64_t out_st, out_sh;
  float* lse;                // [T, H] natural log
  int64_t lse_st, lse_sh;
  int N, T, H, D;
  float ln_base;
  bool propagate;            // nonfinite_lse="propagate" (see the top of this file)
  PlanRows plan = {};        // a split plan's partials, or none (plan.tok null)
  const float* out_scale = nullptr;  // an FP8 cache's V scale (1 element, on the device): the output times it, in fp32
};
using MergeParams = MergeArgs<StridedLse>;

// blockDim.x threads cover one row's D / VEC packs; blockDim.y rows per block.
template <typename TIn, typename TOut, int VEC, typename Lse>
__global__ void merge_kernel(MergeArgs<Lse> p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= static_cast<int64_t>(p.T) * p.H) return;
  const int64_t t = row / p.H, h = row % p.H;
  int r0 = 0, N = p.N;
  int64_t pt = t, ph = h;  // the partials' (t, h)
  if (p.plan.tok != nullptr) {
    p.plan.locate(t, h, r0, N, ph);
    pt = 0;
  }
  float mx, sum;
  lse_stats(p.lses, r0, N, pt, ph, p.ln_base, p.propagate, mx, sum);
  if (threadIdx.x == 0) p.lse[t * p.lse_st + h * p.lse_sh] = merged_lse(mx, sum);
  const float inv = isfinite(mx) ? 1.f / sum : 0.f;
  const float vs = p.out_scale != nullptr ? *p.out_scale : 1.f;
  const TIn* src = static_cast<const TIn*>(p.outs) + pt * p.so_t + ph * p.so_h;
  TOut* dst = static_cast<TOut*>(p.out) + t * p.out_st + h * p.out_sh;
  for (int d = threadIdx.x * VEC; d < p.D; d += blockDim.x * VEC) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    for (int r = r0; r < r0 + N; ++r) {
      const float w = merge_weight(read_lse(p.lses(r, pt, ph), p.ln_base, p.propagate), mx, inv);
      if (w == 0.f) continue;  // an empty partial may hold NaN; it must not leak
      const Pack<TIn, VEC> x = *reinterpret_cast<const Pack<TIn, VEC>*>(src + r * p.so_n + d);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += w * to_f32(x.v[i]);
    }
    Pack<TOut, VEC> y;
#pragma unroll
    for (int i = 0; i < VEC; ++i) y.v[i] = from_f32<TOut>(acc[i] * vs);
    *reinterpret_cast<Pack<TOut, VEC>*>(dst + d) = y;
  }
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Row layout for one row per (blockDim.y) and D / VEC threads per row (blockDim.x, at most 32).
inline void row_grid(int64_t rows, int D, int vec, dim3& grid, dim3& block) {
  int tx = 1;
  while (tx < 32 && tx * vec < D) tx *= 2;
  const int ty = 128 / tx;
  block = dim3(tx, ty);
  grid = dim3(static_cast<unsigned>((rows + ty - 1) / ty));
}

// Launches with 16-byte packs when every row start is 16-byte aligned, else one element per thread.
template <typename TIn, typename TOut, typename Lse>
cudaError_t merge(const MergeArgs<Lse>& p, cudaStream_t stream) {
  constexpr int kVec = 16 / (sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
  const bool aligned = p.D % kVec == 0 && p.so_n % kVec == 0 && p.so_t % kVec == 0 && p.so_h % kVec == 0 &&
                       p.out_st % kVec == 0 && p.out_sh % kVec == 0 && aligned16(p.outs) && aligned16(p.out);
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  if (rows == 0) return cudaSuccess;
  dim3 grid, block;
  row_grid(rows, p.D, aligned ? kVec : 1, grid, block);
  auto kernel = aligned ? merge_kernel<TIn, TOut, kVec, Lse> : merge_kernel<TIn, TOut, 1, Lse>;
  DCP_LAUNCH(kernel, grid, block, 0, stream, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t merge_partials(const MergeParams& p, cudaStream_t stream) {
  return merge<T, T>(p, stream);
}

// correct_partial: out[t,h,:] *= exp(lse_rank - L) in place, L written to total; empty rows become 0.
struct CorrectParams {
  void* out;
  int64_t st, sh;
  StridedLse lses;
  float* total;  // [T, H] contiguous
  int rank, N, T, H, D;
  float ln_base;
  bool propagate;
};

template <typename T, int VEC>
__global__ void correct_kernel(CorrectParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= static_cast<int64_t>(p.T) * p.H) return;
  const int64_t t = row / p.H, h = row % p.H;
  float mx, sum;
  lse_stats(p.lses, 0, p.N, t, h, p.ln_base, p.propagate, mx, sum);
  if (threadIdx.x == 0) p.total[row] = merged_lse(mx, sum);
  const float w = merge_weight(read_lse(p.lses(p.rank, t, h), p.ln_base, p.propagate), mx, 1.f / sum);
  T* dst = static_cast<T*>(p.out) + t * p.st + h * p.sh;
  for (int d = threadIdx.x * VEC; d < p.D; d += blockDim.x * VEC) {
    Pack<T, VEC> x = *reinterpret_cast<Pack<T, VEC>*>(dst + d);
#pragma unroll
    for (int i = 0; i < VEC; ++i) x.v[i] = from_f32<T>(w == 0.f ? 0.f : w * to_f32(x.v[i]));
    *reinterpret_cast<Pack<T, VEC>*>(dst + d) = x;
  }
}

template <typename T>
cudaError_t correct_partial(const CorrectParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = p.D % kVec == 0 && p.st % kVec == 0 && p.sh % kVec == 0 && aligned16(p.out);
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  if (rows == 0) return cudaSuccess;
  dim3 grid, block;
  row_grid(rows, p.D, aligned ? kVec : 1, grid, block);
  auto kernel = aligned ? correct_kernel<T, kVec> : correct_kernel<T, 1>;
  DCP_LAUNCH(kernel, grid, block, 0, stream, p);
  return cudaGetLastError();
}

// pack_exchange: send[r, t, i, :D] = out[t, r*Hl + i, :], then 16 pad bytes: the fp32 LSE, then zeros.
struct PackParams {
  const void* out;
  int64_t st, sh;
  const float* lse;
  int64_t lse_st, lse_sh;
  void* send;  // [N, T, Hl, D + pad] contiguous
  int N, T, Hl, D, pad;
};

template <typename T, int VEC>
__global__ void pack_kernel(PackParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;  // (r, t, i)
  if (row >= static_cast<int64_t>(p.N) * p.T * p.Hl) return;
  const int64_t i = row % p.Hl, t = (row / p.Hl) % p.T, r = row / (static_cast<int64_t>(p.Hl) * p.T);
  const int64_t h = r * p.Hl + i;
  const T* src = static_cast<const T*>(p.out) + t * p.st + h * p.sh;
  T* dst = static_cast<T*>(p.send) + row * (p.D + p.pad);
  for (int d = threadIdx.x * VEC; d < p.D; d += blockDim.x * VEC)
    *reinterpret_cast<Pack<T, VEC>*>(dst + d) = *reinterpret_cast<const Pack<T, VEC>*>(src + d);
  if (threadIdx.x == 0) {
    const float v = p.lse[t * p.lse_st + h * p.lse_sh];
    uint32_t u;
    memcpy(&u, &v, 4);
    unsigned char* b = reinterpret_cast<unsigned char*>(dst + p.D);
    for (int k = 0; k < 16; ++k) b[k] = k < 4 ? static_cast<unsigned char>(u >> (8 * k)) : 0;
  }
}

template <typename T>
cudaError_t pack_exchange(const PackParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = p.D % kVec == 0 && p.st % kVec == 0 && p.sh % kVec == 0 && aligned16(p.out) &&
                       aligned16(p.send);  // rows of D + 16 bytes stay 16-byte aligned when D is a pack multiple
  const int64_t rows = static_cast<int64_t>(p.N) * p.T * p.Hl;
  if (rows == 0) return cudaSuccess;
  dim3 grid, block;
  row_grid(rows, p.D, aligned ? kVec : 1, grid, block);
  auto kernel = aligned ? pack_kernel<T, kVec> : pack_kernel<T, 1>;
  DCP_LAUNCH(kernel, grid, block, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
