// The fp8 (float8_e4m3fn) cache's staged tile converted to the query's 16-bit type, for the MLA kernels that copy a
// tile's raw e4m3 rows into shared memory by cp.async and read 16-bit ones (mla_decode_tiled.cuh,
// mla_decode_wgmma.cuh): one loop, each kernel giving its 16-bit layout.
#pragma once

#include "kernels/mma.cuh"

namespace dcp_ops::kernels {

// Raw stage `stage` of raw_stages (stages of ROWS rows of DK e4m3 bytes, unswizzled) converted exactly to T
// (e4m3x2_to) into a 16-bit tile: 16-byte chunk c of row r (dims 16c .. 16c + 15) becomes the tile's 16-bit chunks
// 2c and 2c + 1 of row r, at element offsets chunk_at(r, 2c) and chunk_at(r, 2c + 1) from dst (the caller's swizzled
// layout). THREADS threads share the ROWS x DK / 16 chunks: thread tid takes chunks tid, tid + THREADS, ...
template <typename T, int ROWS, int DK, int THREADS, typename ChunkAt>
__device__ __forceinline__ void convert_e4m3_rows(T* dst, const unsigned char* raw_stages, int stage, int tid,
                                                  ChunkAt chunk_at) {
  const unsigned char* raw = raw_stages + stage * ROWS * DK;
  constexpr int kRawChunks = DK / 16, kTotal = ROWS * kRawChunks;
#pragma unroll
  for (int u = 0; u < (kTotal + THREADS - 1) / THREADS; ++u) {
    const int i = tid + THREADS * u, r = i / kRawChunks, c = i % kRawChunks;
    if (kTotal % THREADS != 0 && i >= kTotal) break;
    const Pack<unsigned short, 8> x = *reinterpret_cast<const Pack<unsigned short, 8>*>(raw + r * DK + 16 * c);
    Pairs4 lo, hi;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo.v[e] = e4m3x2_to<T>(x.v[e]);
      hi.v[e] = e4m3x2_to<T>(x.v[4 + e]);
    }
    *reinterpret_cast<Pairs4*>(dst + chunk_at(r, 2 * c)) = lo;
    *reinterpret_cast<Pairs4*>(dst + chunk_at(r, 2 * c + 1)) = hi;
  }
}

}  // namespace dcp_ops::kernels
