// Owner-only KV append (torch-free): token t's entry of `bytes` bytes goes to flat slot slots[t] of the cache.
// Slot -1 (another rank's token) is skipped, and so is any slot outside the cache: a GPU kernel cannot raise,
// and it must never write outside the tensor (the CPU op rejects such slots).
#pragma once

#include "kernels/common.cuh"

namespace dcp_ops::kernels {

struct WriteKvParams {
  unsigned char* cache;
  int64_t sb, st;  // byte strides of cache dims 0 (block) and 1 (offset)
  const unsigned char* src;
  int64_t src_st;  // byte stride of new's dim 0
  const void* slots;
  bool slots64;
  int64_t num_slots, block_size, bytes, T;
};

// One block per token; threads copy 16-byte chunks when aligned, else bytes.
template <int CHUNK>
__global__ void write_kv_kernel(WriteKvParams p) {
  const int64_t t = blockIdx.x;
  if (t >= p.T) return;
  const int64_t slot = p.slots64 ? static_cast<const int64_t*>(p.slots)[t] : static_cast<const int32_t*>(p.slots)[t];
  if (slot < 0 || slot >= p.num_slots) return;
  unsigned char* dst = p.cache + (slot / p.block_size) * p.sb + (slot % p.block_size) * p.st;
  const unsigned char* src = p.src + t * p.src_st;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * CHUNK; i < p.bytes; i += static_cast<int64_t>(blockDim.x) * CHUNK)
    *reinterpret_cast<Pack<unsigned char, CHUNK>*>(dst + i) = *reinterpret_cast<const Pack<unsigned char, CHUNK>*>(src + i);
}

inline cudaError_t write_kv(const WriteKvParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.bytes == 0) return cudaSuccess;
  const bool aligned = p.bytes % 16 == 0 && p.sb % 16 == 0 && p.st % 16 == 0 && p.src_st % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.cache) % 16 == 0 && reinterpret_cast<uintptr_t>(p.src) % 16 == 0;
  auto kernel = aligned ? write_kv_kernel<16> : write_kv_kernel<1>;
  DCP_LAUNCH(kernel, dim3(static_cast<unsigned>(p.T)), dim3(64), 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dcp_ops::kernels
