// What the launchers know of the device they launch on: its compute capability, SM count and shared memory per
// block, and the stream. On the GPU, cached attribute reads (no synchronisation); under the SIMT executor
// (DCP_SIMT, tests/simt), a device described by environment variables, so that the tests take every path:
//   DCP_SIMT_ARCH        compute capability as 80, 90 or 100 (default 80: the mma.sync paths)
//   DCP_SIMT_SMEM_OPTIN  shared memory a block may opt in to, bytes (default an H100's, kH100SmemOptin)
// and 8 SMs, which the split plans fill.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#ifdef DCP_SIMT
#include "simt/simt.h"
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dcp_ops {

constexpr int kH100SmemOptin = 232448;  // cudaDevAttrMaxSharedMemoryPerBlockOptin of sm_90 (227 KiB)
constexpr int kA100SmemOptin = 166912;  // ... of an A100, sm_80 (163 KiB)

// The shared memory a block may opt in to on each arch's flagship (A100, H100, B200: 227 KiB as on the H100), for a
// device described without one (describe_split_pass).
inline int flagship_smem_optin(int arch) { return arch >= 90 ? kH100SmemOptin : kA100SmemOptin; }

// The device a launch goes to, as the split-pass choices (cuda/split_choice.h) read it.
struct Device {
  int arch;        // compute capability, 10 * major + minor (80, 86, 89, 90, 100, ...)
  int smem_optin;  // the shared memory one block may use, bytes
  int sms;         // streaming multiprocessors
  bool has_mma_sync() const { return arch >= 80; }  // mma.sync m16n8k16 with bf16 / fp16 inputs
  bool has_wgmma() const { return arch == 90; }     // wgmma.mma_async (sm_90a only)
};

#ifdef DCP_SIMT
#define DCP_CUDA_GUARD(t)
inline cudaStream_t current_stream() { return nullptr; }
// Under the executor outputs start as NaN, so an element a kernel never writes fails its test.
inline at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& o) { return at::full(shape, NAN, o); }
inline int simt_env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != 0 || x <= 0)
    throw std::invalid_argument(std::string("simt: ") + name + " must be a positive integer, got '" + v + "'");
  return static_cast<int>(x);
}
inline Device current_device() {
  const int arch = simt_env_int("DCP_SIMT_ARCH", 80);
  if (arch != 80 && arch != 90 && arch != 100)
    throw std::invalid_argument("simt: DCP_SIMT_ARCH must be 80, 90 or 100, got " + std::to_string(arch));
  return {arch, simt_env_int("DCP_SIMT_SMEM_OPTIN", kH100SmemOptin), 8};
}
#else
#define DCP_CUDA_GUARD(t) const c10::cuda::CUDAGuard dcp_cuda_guard_((t).device())
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
inline at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& o) { return at::empty(shape, o); }
// The current device's attributes (ATen/cuda/CUDAContext.h would need the cuSPARSE headers, which a toolkit may
// lack). A test may lower (never raise) the shared memory with DCP_OPS_TEST_SMEM_OPTIN, to run the smaller tiles and
// the fallbacks on a GPU.
inline Device current_device() {
  int device = 0, major = 0, minor = 0, smem = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return {0, 0, 1};
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    major = minor = 0;
  if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) smem = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 1;
  const char* cap = std::getenv("DCP_OPS_TEST_SMEM_OPTIN");
  if (cap != nullptr && std::atoi(cap) > 0) smem = std::min(smem, std::atoi(cap));
  return {10 * major + minor, smem, sms};
}
#endif

}  // namespace dcp_ops
