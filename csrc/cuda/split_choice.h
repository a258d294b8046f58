// The one place that decides a decode op's split pass: which kernel, its query rows per block, the token granule of
// its splits, its KV tile, the staged query's type and its shared memory. The launchers (cuda/gqa_decode.cu,
// cuda/mla_decode.cu) size the split plan and launch by it, and the SIMT tests read it (split_choice op) to know the
// path a device takes; the executor's last_kernel() then shows that path ran.
#pragma once

#include <cstdint>

#include "cuda/device.h"
#include "kernels/gqa_decode_mma.cuh"
#include "kernels/mla_decode_mma.cuh"
#include "kernels/mla_decode_tiled.cuh"
#include "kernels/mla_decode_wgmma.cuh"

namespace dcp_ops {

enum class SplitKernel {
  kSimt,          // one thread a query element: mla_decode.cuh / gqa_decode.cuh (any device, any type)
  kGqaMma,        // gqa_decode_mma.cuh: mma.sync, both precisions
  kMlaSplitTerm,  // mla_decode_mma.cuh: mma.sync on split 16-bit terms of the fp32 query (precision "fp32")
  kMlaTiled,      // mla_decode_tiled.cuh: mma.sync on the 16-bit query, 64 rows a block (precision "native")
  kMlaWgmma,      // mla_decode_wgmma.cuh: the tiled kernel's Hopper twin on wgmma (sm_90a; precision "native")
};

// The wgmma MLA pass is taken on sm_90 only where DCP_OPS_MLA_WGMMA=1 (under the executor too, with
// DCP_SIMT_ARCH=90): it has run on the SIMT executor's wgmma emulation but not yet on a Hopper GPU, so it is not the
// default there until bench/gpu/run.sh has checked and timed it.
inline bool mla_wgmma_enabled() {
  const char* v = std::getenv("DCP_OPS_MLA_WGMMA");
  return v != nullptr && v[0] == '1' && v[1] == 0;
}

constexpr int kSplitGranule = 64;  // tokens a split is a multiple of, unless the kernel's KV tile says otherwise

struct SplitPass {
  SplitKernel kernel;
  const char* name;  // the kernel template's name, as the executor's last_kernel() reports it
  int rows;          // query rows (query token, head) per block: the split plan's R
  int granule;       // tokens a split (but the last of a sequence) is a multiple of: the plan's granule
  int tokens;        // the KV tile of the tiled kernels (their BN), 0 for the others
  bool q16;          // MLA: the staged query is 16-bit (rounded, unscaled), else fp32 (scaled by scale * log2 e)
  int smem;          // the block's dynamic shared memory where the device decides the tile (kMlaTiled, kMlaWgmma),
                     // else 0
};

// mla_decode_partial's split pass for a query of q_elem_bytes (4, or 2 for bf16 / fp16; an fp8 cache takes the same
// pass as a cache of the query's type) with latent + rope dims, precision native or fp32, on `dev`:
//   - native, 16-bit, sm_90 with DCP_OPS_MLA_WGMMA=1, shared memory for a tile of 64 or 32 tokens: the wgmma kernel;
//   - native, 16-bit, a device with mma.sync whose shared memory holds a tile of 64 or 32 tokens: the tiled kernel;
//   - else 16-bit, latent 256 / 512, mma.sync: the split-term kernel (its results are within the native bound too);
//   - else the SIMT kernel.
inline SplitPass mla_split_choice(int latent, int rope, int q_elem_bytes, bool native, const Device& dev) {
  if (native && dev.has_wgmma() && mla_wgmma_enabled()) {
    const int bn = kernels::mla_wgmma_tokens(latent, rope, q_elem_bytes, dev.smem_optin);
    if (bn > 0)
      return {SplitKernel::kMlaWgmma, "mla_wgmma_kernel", kernels::kMlaRows, bn, bn, true,
              kernels::mla_wgmma_smem_bytes(latent + rope, bn, q_elem_bytes, false)};
  }
  if (native && dev.has_mma_sync()) {
    const int bn = kernels::mla_tiled_tokens(latent, rope, q_elem_bytes, dev.smem_optin);
    if (bn > 0)
      return {SplitKernel::kMlaTiled, "mla_tiled_kernel", kernels::kMlaRows, bn, bn, true,
              kernels::mla_tiled_smem_bytes(latent + rope, bn, q_elem_bytes)};
  }
  if (kernels::mla_on_tensor_cores(q_elem_bytes, latent, dev.has_mma_sync()))
    return {SplitKernel::kMlaSplitTerm, "mla_mma_kernel", kernels::kMlaMmaRows, kSplitGranule, 0, false, 0};
  return {SplitKernel::kSimt, "mla_split_kernel", kernels::kMlaHeads, kSplitGranule, 0, false, 0};
}

// gqa_decode_partial's split pass for a query of q_elem_bytes with head dim D and `rows` query rows of a sequence per
// KV head (G heads x its query tokens): mma.sync for 16-bit queries with D 64 / 128, else the SIMT kernel.
inline SplitPass gqa_split_choice(int D, int q_elem_bytes, int64_t rows, const Device& dev) {
  const bool mma = kernels::gqa_on_tensor_cores(q_elem_bytes, D, dev.has_mma_sync());
  return {mma ? SplitKernel::kGqaMma : SplitKernel::kSimt, mma ? "gqa_mma_kernel" : "gqa_split_kernel",
          kernels::gqa_rows(rows, mma), kSplitGranule, 0, false, 0};
}

}  // namespace dcp_ops
