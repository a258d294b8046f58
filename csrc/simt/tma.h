// Tensor-map bulk copies (TMA, sm_90) under the SIMT executor (included by simt.h after barriers.h): a tensor map as
// cuTensorMapEncodeTiled describes it (encode_tiled: its parameter rules, for the modes emulated), and
// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes, which copies one box of it into
// shared memory and completes the box's bytes on an mbarrier, landing as the mbarrier's other work does
// (simt/barriers.h). kernels/tma.cuh is the device wrapper; the CUDA driver API's cuTensorMapEncodeTiled and the PTX
// ISA's cp.async.bulk.tensor and "Tensor Access Modes" are the reference.
//
// Emulated: rank 1 to 5, element strides 1, no interleave, no L2 promotion semantics, out-of-bound elements filled
// with zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), the swizzles none / 32B / 64B / 128B (16-byte chunks). The box lands
// in shared memory with dimension 0 innermost, rows of boxDim[0] x element bytes; swizzled, that row is the swizzle
// span (a box row narrower than the span is refused here: the padding rules are not emulated) and 16-byte chunk c of
// a 128-byte line L of the shared address space is stored at chunk c ^ (L % (span / 16)): the same address-based
// pattern as wgmma's descriptors (simt/wgmma.h). The destination is 128-byte aligned. Coordinates are signed: a box
// reaching outside the tensor on any side gets zeros there, and completes its whole size in transaction bytes.
#pragma once

namespace dcp_ops::simt {

constexpr int kTmaMaxRank = 5;

struct TensorMap {
  const unsigned char* base = nullptr;
  int rank = 0, elem_bytes = 0, swizzle = 0;  // swizzle: 0 none, else the span in bytes (32, 64, 128)
  uint64_t dims[kTmaMaxRank] = {};
  uint64_t strides[kTmaMaxRank] = {};  // bytes; strides[0] is the element size, strides[i] the given globalStrides[i-1]
  uint32_t box[kTmaMaxRank] = {};
  int box_bytes() const {
    int n = elem_bytes;
    for (int i = 0; i < rank; ++i) n *= static_cast<int>(box[i]);
    return n;
  }
};

// cuTensorMapEncodeTiled's rules for the emulated modes (throws on a breach). global_strides: rank - 1 byte strides
// of dimensions 1 .. rank - 1. swizzle: 0, 32, 64 or 128.
inline TensorMap encode_tiled(int elem_bytes, int rank, const void* base, const uint64_t* dims,
                              const uint64_t* global_strides, const uint32_t* box, int swizzle) {
  auto fail = [](const std::string& why) { throw std::runtime_error("simt: tensor map: " + why); };
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8) fail("element size 1, 2, 4 or 8");
  if (rank < 1 || rank > kTmaMaxRank) fail("rank 1 to 5");
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) fail("the global address must be 16-byte aligned");
  TensorMap m;
  m.base = static_cast<const unsigned char*>(base);
  m.rank = rank;
  m.elem_bytes = elem_bytes;
  m.swizzle = swizzle;
  m.strides[0] = elem_bytes;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32)) fail("dimension " + std::to_string(i) + " must be 1 to 2^32");
    if (box[i] == 0 || box[i] > 256) fail("box dimension " + std::to_string(i) + " must be 1 to 256");
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    if (i > 0) {
      if (global_strides[i - 1] % 16 != 0 || global_strides[i - 1] >= (uint64_t{1} << 40))
        fail("stride " + std::to_string(i - 1) + " must be a multiple of 16 below 2^40");
      m.strides[i] = global_strides[i - 1];
    }
  }
  const int row = static_cast<int>(box[0]) * elem_bytes;
  if (row % 16 != 0) fail("the box's inner dimension must be a multiple of 16 bytes, got " + std::to_string(row));
  if (swizzle != 0 && swizzle != 32 && swizzle != 64 && swizzle != 128) fail("swizzle none, 32, 64 or 128 bytes");
  if (swizzle != 0 && row > swizzle)
    fail("the box's inner dimension (" + std::to_string(row) + " bytes) exceeds the swizzle span");
  if (swizzle != 0 && row < swizzle)
    fail("a box row narrower than the swizzle span is not emulated (" + std::to_string(row) + " bytes)");
  return m;
}

// The box at coords (signed, dimension 0 first) of m into shared dst, completing its bytes on bar.
inline void tma_load(void* dst, const TensorMap& m, const int* coords, void* bar) {
  const uintptr_t smem = reinterpret_cast<uintptr_t>(g_dynamic_smem.data()), d = reinterpret_cast<uintptr_t>(dst);
  const int bytes = m.box_bytes();
  if (m.rank == 0) throw std::runtime_error("simt: cp.async.bulk.tensor: the tensor map was never encoded");
  if (d < smem || d + bytes > smem + g_dynamic_smem.size() || (d - smem) % 128 != 0)
    throw std::runtime_error("simt: cp.async.bulk.tensor: the destination must be 128-byte aligned in dynamic "
                             "shared memory, with room for the box (" + std::to_string(bytes) + " bytes)");
  Mbarrier& mb = mbarrier_at(bar, "cp.async.bulk.tensor");
  MbarrierWork w;
  w.dst = static_cast<unsigned char*>(dst);
  w.bytes.assign(bytes, 0);
  for (int o = 0; o < bytes; o += m.elem_bytes) {  // o: the element's offset in the unswizzled box
    int64_t src = 0;
    bool in = true;
    int rest = o / m.elem_bytes;
    for (int i = 0; i < m.rank; ++i) {
      const int64_t c = static_cast<int64_t>(coords[i]) + rest % static_cast<int>(m.box[i]);
      rest /= static_cast<int>(m.box[i]);
      in &= c >= 0 && c < static_cast<int64_t>(m.dims[i]);
      src += c * static_cast<int64_t>(m.strides[i]);
    }
    uintptr_t at = (d - smem) + o;  // its shared address, then swizzled: chunk ^= the 128-byte line's low bits
    if (m.swizzle != 0) at ^= ((at / 128) % (m.swizzle / 16)) << 4;
    if (in) std::memcpy(w.bytes.data() + (at - (d - smem)), m.base + src, m.elem_bytes);
  }
  w.tx = bytes;
  mbarrier_attach(mb, std::move(w));
}

}  // namespace dcp_ops::simt
