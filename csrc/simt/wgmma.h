// Hopper's warpgroup MMA under the SIMT executor (included by simt.h): wgmma.mma_async.sync.aligned.m64nNk16.f32
// .{bf16,f16}.{bf16,f16} (N = 8, 16, ..., 256; fp32 accumulators; imm-scale-a = imm-scale-b = 1 only), A from a
// shared-memory matrix descriptor or from registers, B from a descriptor, and wgmma.fence / commit_group / wait_group.
// kernels/wgmma.cuh is the device wrapper; the PTX ISA's section 9.7.15 (wgmma) is the reference.
//
// Asynchronous, per warpgroup. An issued wgmma records its descriptors and, per thread, where its accumulator (and A
// fragment) registers are, takes C (scale-d != 0) as the registers hold it at the issue, or as the result of an
// earlier wgmma of the same shape on the same registers still in flight (the ISA orders those), and fills the
// registers with a signalling-NaN poison. It reads shared memory and the A registers, and writes D, only when a
// wgmma.wait_group retires its commit group (oldest first, like cp.async). So a kernel that rewrites an operand
// between the issue and the wait computes with the new bytes, a read of the accumulators before the wait sees NaN, and
// an accumulator written meanwhile (its poison changed) retires as NaN: the GPU's result is undefined there.
// A wgmma needs a wgmma.fence since the thread's last wgmma.wait_group (or the kernel start), else it is refused:
// stricter than the ISA, which asks for the fence before the first wgmma and between register accesses and a wgmma,
// but the wait is where kernels go on to read and rescale the accumulators.
// Descriptors, shapes, types, transposes and scale-d must be the same in all 128 threads (refused otherwise).
// Shared addresses are byte offsets into dynamic shared memory (g_dynamic_smem): a descriptor addresses nothing else.
#pragma once

namespace dcp_ops::simt {

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 the start address, 16-29 the
// leading dimension byte offset (LBO), 32-45 the stride dimension byte offset (SBO), each as (x & 0x3FFFF) >> 4;
// 49-51 the matrix base offset; 62-63 the swizzle mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte. The other bits
// are reserved (zero).
struct MatrixDesc {
  uint32_t start, lbo, sbo;  // bytes
  int base_offset, swizzle;
};
inline MatrixDesc decode_matrix_desc(uint64_t d) {
  return {static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
          static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4, static_cast<int>((d >> 49) & 7), static_cast<int>(d >> 62)};
}
constexpr uint64_t kMatrixDescReserved = 0x3FF1'C000'C000'C000ull;  // bits 14-15, 30-31, 46-48, 52-61
inline int swizzle_bytes(int mode) { return mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0; }

// The descriptor of the matrix at p (in dynamic shared memory): what make_smem_desc (kernels/wgmma.cuh) builds on the
// GPU from the shared-window address, here from the offset into dynamic shared memory. Refuses what the GPU could not
// address or the fields cannot hold.
inline uint64_t wgmma_desc(const void* p, int swizzle, uint32_t lbo, uint32_t sbo) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(g_dynamic_smem.data()), q = reinterpret_cast<uintptr_t>(p);
  if (q < base || q >= base + g_dynamic_smem.size())
    throw std::runtime_error("simt: wgmma descriptor: the matrix is outside dynamic shared memory (the executor's "
                             "wgmma reads only that)");
  const uintptr_t off = q - base;
  if (off % 16 != 0 || lbo % 16 != 0 || sbo % 16 != 0)
    throw std::runtime_error("simt: wgmma descriptor: the start address (offset " + std::to_string(off) +
                             "), LBO (" + std::to_string(lbo) + ") and SBO (" + std::to_string(sbo) +
                             ") must be 16-byte aligned");
  if (off >= (1u << 18) || lbo >= (1u << 18) || sbo >= (1u << 18))
    throw std::runtime_error("simt: wgmma descriptor: start, LBO or SBO beyond the 14-bit fields (256 KiB)");
  if (swizzle < 0 || swizzle > 3) throw std::runtime_error("simt: wgmma descriptor: swizzle mode must be 0 to 3");
  return off >> 4 | static_cast<uint64_t>(lbo >> 4) << 16 | static_cast<uint64_t>(sbo >> 4) << 32 |
         static_cast<uint64_t>(swizzle) << 62;
}

// Byte address of the 16-bit element (mn, k < 16) of a descriptor's matrix, mn being A's row m or B's column n, by
// the canonical layouts (PTX ISA "Shared Memory Matrix Layout" and its strides table; CUTLASS make_gmma_desc). A core
// matrix is 8 rows of 16 bytes; W is the swizzle width in bytes. K-major (imm-trans 0), a 16-byte row holds 8 k of
// one mn:
//   none:  (mn % 8) * 16 + (k % 8) * 2 + (mn / 8) * SBO + (k / 8) * LBO
//   W:     (mn % 8) * W + k * 2 + (mn / 8) * SBO               (LBO unused: the 16 k of a k16 step fit a W-byte row)
// MN-major (imm-trans 1), a 16-byte row holds 8 mn of one k:
//   none:  (k % 8) * 16 + (mn % 8) * 2 + (mn / 8) * SBO + (k / 8) * LBO
//   W:     (k % 8) * W + (mn % (W / 2)) * 2 + (mn / (W / 2)) * LBO + (k / 8) * SBO
// added to the start address; then, swizzled, the 16-byte chunk (address bits 4 ..) is XORed with the 128-byte line
// above it (bits 7 ..), W / 16 values of each: the granules of every W-byte row permuted by its line, a pattern
// repeating every 8 W bytes (CUTLASS Swizzle<3|2|1, 4, 3> on byte addresses). The XOR takes the whole address, so a
// start inside a pattern (a later k16 step of a swizzled row) reads what the pattern put there. On the GPU the
// addresses are the shared window's: align dynamic shared memory to 1024 bytes for the two to agree.
inline uint32_t element_addr(const MatrixDesc& m, bool mn_major, int mn, int k) {
  const uint32_t w = swizzle_bytes(m.swizzle);
  uint32_t off;
  if (w == 0)
    off = mn_major ? (k % 8) * 16 + (mn % 8) * 2 + (mn / 8) * m.sbo + (k / 8) * m.lbo
                   : (mn % 8) * 16 + (k % 8) * 2 + (mn / 8) * m.sbo + (k / 8) * m.lbo;
  else
    off = mn_major ? (k % 8) * w + (mn % (w / 2)) * 2 + (mn / (w / 2)) * m.lbo + (k / 8) * m.sbo
                   : (mn % 8) * w + k * 2 + (mn / 8) * m.sbo;
  const uint32_t a = m.start + off;
  return w == 0 ? a : a ^ ((a >> 7) & (w / 16 - 1)) << 4;
}

inline float wgmma_half(uint32_t bits, bool bf16) {  // a 16-bit element, exactly
  if (!bf16) return _cvtsh_ss(static_cast<unsigned short>(bits));
  const uint32_t u = bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

constexpr uint32_t kWgmmaPoison = 0x7fa5a5a5u;  // a signalling NaN: arithmetic on it gives other bits

// What a thread passes to wgmma.mma_async.
struct WgmmaIssue {
  uint64_t desc_a, desc_b;  // desc_a unused with A in registers
  int n, scale_d;
  bool bf16, a_in_regs, trans_a, trans_b;
  float* d;                 // the thread's n / 2 accumulators
  const uint32_t* a;        // its 4 A fragment registers (A in registers)
};

// One thread's side of a wgmma in flight.
struct WgmmaPart {
  float* d = nullptr;
  const uint32_t* a = nullptr;
  std::vector<float> c;   // C: the accumulators at the issue, or the result of the wgmma it follows
  bool follows = false;   // issued while an earlier wgmma of the shape on the same accumulators was in flight
};
struct WgmmaOp {
  WgmmaIssue in;          // thread 0's operands (the same in every thread)
  WgmmaPart part[kWarpgroup];
};
using WgmmaOps = std::vector<std::unique_ptr<WgmmaOp>>;
struct WgmmaGroup {       // one warpgroup's wgmmas in flight
  WgmmaOps open;                     // issued since the last commit
  std::vector<WgmmaOps> committed;   // commit groups not yet retired, oldest first
  bool fenced[kWarpgroup] = {};      // a wgmma.fence since the thread's last wait
};
struct WgmmaBlock {
  std::vector<WgmmaGroup> groups;
};
inline WgmmaGroup& wgmma_group() {
  Block& b = *g_block;
  if (!b.wgmma) {
    auto s = std::make_shared<WgmmaBlock>();
    s->groups.resize((b.fibers.size() + kWarpgroup - 1) / kWarpgroup);
    b.wgmma = s;
  }
  return static_cast<WgmmaBlock*>(b.wgmma.get())->groups[b.current / kWarpgroup];
}

// Refuses a descriptor the emulation cannot follow, or whose matrix (mn_count x 16) leaves dynamic shared memory.
inline void check_matrix_desc(uint64_t d, bool mn_major, int mn_count, const char* which) {
  const std::string what = std::string("simt: wgmma ") + which + " descriptor: ";
  if (d & kMatrixDescReserved) throw std::runtime_error(what + "reserved bits set");
  const MatrixDesc m = decode_matrix_desc(d);
  if (m.base_offset != 0) throw std::runtime_error(what + "nonzero matrix base offset (bits 49-51) not emulated");
  const size_t size = g_dynamic_smem.size();
  for (int mn = 0; mn < mn_count; ++mn)
    for (int k = 0; k < 16; ++k)
      if (element_addr(m, mn_major, mn, k) + 2 > size)
        throw std::runtime_error(what + "element (" + std::to_string(mn) + ", " + std::to_string(k) +
                                 ") at byte " + std::to_string(element_addr(m, mn_major, mn, k)) +
                                 " is outside dynamic shared memory (" + std::to_string(size) + " bytes)");
}

inline void wgmma_fence() {
  Block& b = *g_block;
  WgmmaGroup& grp = wgmma_group();
  yield_to_group("wgmma.fence");
  grp.fenced[b.current % kWarpgroup] = true;
}

inline void wgmma_issue(const WgmmaIssue& in, int scale_a = 1, int scale_b = 1) {
  constexpr const char* kOp = "wgmma.mma_async";
  Block& b = *g_block;
  WgmmaGroup& grp = wgmma_group();
  const int r = b.current % kWarpgroup;
  if (in.n < 8 || in.n > 256 || in.n % 8 != 0)
    throw std::runtime_error("simt: wgmma m64nNk16: N must be a multiple of 8 from 8 to 256, got " +
                             std::to_string(in.n));
  if (scale_a != 1 || scale_b != 1) throw std::runtime_error("simt: wgmma: imm-scale-a/b other than 1 not emulated");
  if (in.a_in_regs && in.trans_a) throw std::runtime_error("simt: wgmma: A from registers is K-major (no imm-trans-a)");
  if (!grp.fenced[r])
    throw std::runtime_error("simt: wgmma.mma_async without a wgmma.fence since the kernel start or the thread's last "
                             "wgmma.wait_group (thread " + std::to_string(b.current) + ")");
  if (r == 0) {  // the op, made before the group's other threads can read it (they wait below for this thread)
    if (!in.a_in_regs) check_matrix_desc(in.desc_a, in.trans_a, 64, "A");
    check_matrix_desc(in.desc_b, in.trans_b, in.n, "B");
    grp.open.push_back(std::make_unique<WgmmaOp>());
    grp.open.back()->in = in;
  }
  warpgroup_view(kOp, &in, [&](auto) {
    WgmmaOp& op = *grp.open.back();
    const WgmmaIssue& o = op.in;
    if (in.n != o.n || in.bf16 != o.bf16 || in.a_in_regs != o.a_in_regs || in.trans_a != o.trans_a ||
        in.trans_b != o.trans_b || (in.scale_d != 0) != (o.scale_d != 0) || in.desc_b != o.desc_b ||
        (!in.a_in_regs && in.desc_a != o.desc_a))
      throw std::runtime_error("simt: wgmma.mma_async: thread " + std::to_string(b.current) +
                               " passes other operands than thread 0 of its warpgroup (descriptors, shape, type, "
                               "transposes and scale-d must be the same)");
    WgmmaPart& p = op.part[r];
    p.d = in.d;
    p.a = in.a;
    auto in_flight = [&](const WgmmaOp& e) { return &e != &op && e.part[r].d == in.d && e.in.n == in.n; };
    for (const auto& g : grp.committed)
      for (const auto& e : g) p.follows |= in_flight(*e);
    for (const auto& e : grp.open) p.follows |= in_flight(*e);
    if (in.scale_d != 0 && !p.follows) p.c.assign(in.d, in.d + in.n / 2);
    for (int i = 0; i < in.n / 2; ++i) std::memcpy(&in.d[i], &kWgmmaPoison, 4);
  });
}

inline void wgmma_commit() {
  Block& b = *g_block;
  WgmmaGroup& grp = wgmma_group();
  yield_to_group("wgmma.commit_group");
  if (b.current % kWarpgroup == 0) {  // the group's other threads touch the queue again only after this thread
    grp.committed.push_back(std::move(grp.open));
    grp.open.clear();
  }
}

// Thread r's part of `op` (the `idx`-th op of commit group `gi`): D = A B (+ C) for its fragment, from shared memory
// and the A registers as they are now. The result goes to the next wgmma in flight on the same accumulators (its C),
// or, the last one, to the registers.
inline void retire_part(WgmmaGroup& grp, size_t gi, size_t idx, int r) {
  const WgmmaOp& op = *grp.committed[gi][idx];
  const WgmmaIssue& in = op.in;
  const WgmmaPart& p = op.part[r];
  const int w = r / kWarp, g = (r % kWarp) / 4, t = r % 4, n = in.n;
  const unsigned char* smem = g_dynamic_smem.data();
  const MatrixDesc da = decode_matrix_desc(in.desc_a), db = decode_matrix_desc(in.desc_b);
  auto at = [&](uint32_t addr) {
    uint16_t v;
    std::memcpy(&v, smem + addr, 2);
    return wgmma_half(v, in.bf16);
  };
  float a[2][16];  // rows 16 w + g and 16 w + g + 8
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k) {
      if (in.a_in_regs) {  // lane 4 g + (k % 8) / 2 of warp w holds it: register h + 2 (k >= 8), half k % 2
        const uint32_t reg = op.part[w * kWarp + 4 * g + (k % 8) / 2].a[h + 2 * (k >= 8)];
        a[h][k] = wgmma_half(k % 2 ? reg >> 16 : reg & 0xffffu, in.bf16);
      } else {
        a[h][k] = at(element_addr(da, in.trans_a, 16 * w + g + 8 * h, k));
      }
    }
  std::vector<float> d(n / 2);
  for (int j = 0; j < n / 8; ++j)
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * t + e;
      float bk[16];
      for (int k = 0; k < 16; ++k) bk[k] = at(element_addr(db, in.trans_b, col, k));
      for (int h = 0; h < 2; ++h) {
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s += a[h][k] * bk[k];
        const int i = 4 * j + 2 * h + e;
        d[i] = in.scale_d != 0 ? s + p.c[i] : s;
      }
    }
  for (int i = 0; i < n / 2; ++i) {  // written while in flight: undefined on the GPU, NaN here
    uint32_t bits;
    std::memcpy(&bits, &p.d[i], 4);
    if (bits != kWgmmaPoison) d[i] = NAN;
  }
  auto next = [&](WgmmaOp& e) {
    WgmmaPart& q = e.part[r];
    if (q.d != p.d || !q.follows || e.in.n != n) return false;
    q.c = d;
    return true;
  };
  for (size_t x = gi; x < grp.committed.size(); ++x)
    for (size_t y = x == gi ? idx + 1 : 0; y < grp.committed[x].size(); ++y)
      if (next(*grp.committed[x][y])) return;
  for (auto& e : grp.open)
    if (next(*e)) return;
  std::copy(d.begin(), d.end(), p.d);
}

// wgmma.wait_group n: every committed group but the newest n retires, oldest first; the thread's fence is used up.
inline void wgmma_wait(int n) {
  Block& b = *g_block;
  WgmmaGroup& grp = wgmma_group();
  const int r = b.current % kWarpgroup;
  int retire = 0;
  warpgroup_view("wgmma.wait_group", &grp, [&](auto) {  // the queue as thread 0 left it at its last commit
    retire = std::max(0, static_cast<int>(grp.committed.size()) - n);
    for (int gi = 0; gi < retire; ++gi)
      for (size_t idx = 0; idx < grp.committed[gi].size(); ++idx) retire_part(grp, gi, idx, r);
  });
  grp.fenced[r] = false;
  if (r == 0 && retire > 0)  // after every thread's retire; the others touch the queue again only after this thread
    grp.committed.erase(grp.committed.begin(), grp.committed.begin() + retire);
}

}  // namespace dcp_ops::simt
