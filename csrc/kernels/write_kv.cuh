// Owner-only KV append (torch-free): token t's entry goes to flat slot slots[t] of the cache, copied (n bytes), or
// quantized into a float8_e4m3fn cache (n elements).
// Slot -1 (another rank's token) is skipped, and so is any slot outside the cache: a GPU kernel cannot raise,
// and it must never write outside the tensor (the CPU op rejects such slots).
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

struct WriteKvParams {
  unsigned char* cache;
  int64_t sb, st;  // byte strides of cache dims 0 (block) and 1 (offset)
  const void* src;
  int64_t src_st;  // stride of new's dim 0: in bytes for the copy, in elements for fp8
  const float* scale;  // fp8 only
  const void* slots;
  bool slots64;
  int64_t num_slots, block_size, n, T;  // n: bytes of an entry for the copy, elements for fp8
};

// Token t's entry, or null when its slot is -1 (or outside the cache).
__device__ __forceinline__ unsigned char* slot_entry(const WriteKvParams& p, int64_t t) {
  const int64_t slot = p.slots64 ? static_cast<const int64_t*>(p.slots)[t] : static_cast<const int32_t*>(p.slots)[t];
  if (slot < 0 || slot >= p.num_slots) return nullptr;
  return p.cache + (slot / p.block_size) * p.sb + (slot % p.block_size) * p.st;
}

// One block per token; threads copy 16-byte chunks when aligned, else bytes.
template <int CHUNK>
__global__ void write_kv_kernel(WriteKvParams p) {
  const int64_t t = blockIdx.x;
  unsigned char* dst = t < p.T ? slot_entry(p, t) : nullptr;
  if (dst == nullptr) return;
  const unsigned char* src = static_cast<const unsigned char*>(p.src) + t * p.src_st;
  using Chunk = Pack<unsigned char, CHUNK>;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * CHUNK; i < p.n; i += static_cast<int64_t>(blockDim.x) * CHUNK)
    *reinterpret_cast<Chunk*>(dst + i) = *reinterpret_cast<const Chunk*>(src + i);
}

// Into a float8_e4m3fn cache: element i of token t's entry is new[t][i] / scale, saturated to +-448 and rounded to
// nearest even (NaN stays NaN), one thread per element. T the type of new (fp32, bf16 or fp16).
template <typename T>
__global__ void write_kv_fp8_kernel(WriteKvParams p) {
  const int64_t t = blockIdx.x;
  unsigned char* dst = t < p.T ? slot_entry(p, t) : nullptr;
  if (dst == nullptr) return;
  const T* src = static_cast<const T*>(p.src) + t * p.src_st;
  const float s = *p.scale;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x)
    dst[i] = __nv_cvt_float_to_fp8(to_f32(src[i]) / s, __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
cudaError_t write_kv_fp8(const WriteKvParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.n == 0) return cudaSuccess;
  DCP_LAUNCH(write_kv_fp8_kernel<T>, dim3(static_cast<unsigned>(p.T)), dim3(128), 0, stream, p);
  return cudaGetLastError();
}

inline cudaError_t write_kv(const WriteKvParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.n == 0) return cudaSuccess;
  const bool aligned = p.n % 16 == 0 && p.sb % 16 == 0 && p.st % 16 == 0 && p.src_st % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.cache) % 16 == 0 && reinterpret_cast<uintptr_t>(p.src) % 16 == 0;
  auto kernel = aligned ? write_kv_kernel<16> : write_kv_kernel<1>;
  DCP_LAUNCH(kernel, dim3(static_cast<unsigned>(p.T)), dim3(64), 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
