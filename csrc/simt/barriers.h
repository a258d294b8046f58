// Named barriers, mbarriers and bulk copies under the SIMT executor (included by simt.h): bar.sync / bar.arrive with
// a barrier id and a thread count; mbarrier.init, .arrive, .arrive.expect_tx, .try_wait.parity; cp.async.mbarrier
// .arrive(.noinc); cp.async.bulk global -> shared with mbarrier::complete_tx. kernels/barriers.cuh is the device
// wrapper; the PTX ISA's sections on bar / barrier, mbarrier and cp.async.bulk are the reference.
//
// Named barrier id (1 .. 15; 0 is __syncthreads'): an instance completes when `count` threads (a multiple of 32, at
// most the block) have arrived, by bar.sync (which waits for the completion) or bar.arrive (which does not); then the
// next instance begins. Every arrival at one instance must name the same count (refused otherwise). The executor
// counts threads, the GPU warps: all 32 lanes of a warp arrive together.
//
// An mbarrier is an 8-byte object in shared memory whose state the executor keeps by its address (the bytes are not
// used): the expected arrival count (init), the pending arrivals and the transaction count of the current phase, and
// the phase number. The phase completes when its pending arrivals and its transaction count are both zero; then the
// next phase begins with the expected count. try_wait.parity P is true once the phase of parity P before the current
// one has completed, i.e. when the current phase's parity is not P. An mbarrier used before its init, an init with
// asynchronous work still attached, an arrival beyond the pending count, a count outside 1 .. 2^20 - 1 are refused.
//
// Asynchronous work attached to an mbarrier lands (writes shared memory, then arrives or completes its transaction
// bytes) at a time the schedule picks, as the GPU's may land any time from its issue to its completion:
//   - `forward` (the default): as late as possible: when a thread tries a wait on that barrier, or, for work attached
//     after a thread went to sleep on it, when no thread can run; so a thread that reads the destination without
//     waiting sees what was there before (poison, an older tile);
//   - `reverse`: at the issue, so a copy issued into a buffer that other threads still read (a missing wait on the
//     "empty" barrier of a ring) overwrites it under their reads;
//   - `random:<seed>`: one or the other per operation.
// Its source bytes are read at the issue. Work still in flight when the block ends never lands.
// cp.async.mbarrier.arrive attaches the thread's cp.async copies not yet landed (all its commit groups, open or not):
// they land with the barrier, and the thread's later cp.async.wait_group does not wait for them.
#pragma once

#include <map>

namespace dcp_ops::simt {

constexpr int kNamedBarriers = 16;

struct NamedBarrier {
  int count = 0, arrived = 0;  // the current instance: its thread count (0: no arrival yet), arrivals so far
  std::vector<int> waiting;    // the fibers waiting at bar.sync
};

// Asynchronous work attached to an mbarrier: cp.async copies whose landing arrives once (arrive: -1 pending), or a
// bulk copy whose landing completes `tx` transaction bytes.
struct MbarrierWork {
  std::vector<AsyncCopy> copies;
  unsigned char* dst = nullptr;
  std::vector<unsigned char> bytes;  // a bulk copy's source bytes, read at the issue
  int arrivals = 0;
  int64_t tx = 0;
};

struct Mbarrier {
  int expected = 0, pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;
  std::vector<MbarrierWork> in_flight;
  std::vector<int> waiting;  // fibers waiting for a phase of it to complete
};

struct BarrierBlock {
  NamedBarrier named[kNamedBarriers];
  std::map<uintptr_t, Mbarrier> mbarriers;
};
inline BarrierBlock& barrier_block() {
  Block& b = *g_block;
  if (!b.barriers) b.barriers = std::make_shared<BarrierBlock>();
  return *static_cast<BarrierBlock*>(b.barriers.get());
}

inline void release_fibers(std::vector<int>& waiting) {
  Block& b = *g_block;
  for (int i : waiting) b.fibers[i].state = State::Runnable;
  if (!waiting.empty()) released(b);
  waiting.clear();
}

// bar.sync (wait) or bar.arrive (not) at named barrier `id` for `count` threads.
inline void named_barrier(int id, int count, bool wait) {
  Block& b = *g_block;
  const int n = static_cast<int>(b.fibers.size());
  const std::string what = std::string("simt: ") + (wait ? "bar.sync " : "bar.arrive ") + std::to_string(id) + ", " +
                           std::to_string(count) + ": ";
  if (id < 1 || id >= kNamedBarriers) throw std::runtime_error(what + "the barrier id must be 1 to 15");
  if (count <= 0 || count % kWarp != 0 || count > n)
    throw std::runtime_error(what + "the thread count must be a multiple of 32, at most the block's " +
                             std::to_string(n));
  NamedBarrier& nb = barrier_block().named[id];
  if (nb.count != 0 && nb.count != count)
    throw std::runtime_error(what + "threads arrive at one instance with different counts (" +
                             std::to_string(nb.count) + " and " + std::to_string(count) + ")");
  nb.count = count;
  ++nb.arrived;
  if (nb.arrived == count) {
    nb.count = nb.arrived = 0;
    release_fibers(nb.waiting);
    return;
  }
  if (!wait) return;
  nb.waiting.push_back(b.current);
  yield_as(State::WaitBarrier);
}

inline Mbarrier& mbarrier_at(const void* bar, const char* op) {
  auto& all = barrier_block().mbarriers;
  const auto it = all.find(reinterpret_cast<uintptr_t>(bar));
  if (it == all.end()) throw std::runtime_error(std::string("simt: ") + op + " on an mbarrier never initialised");
  return it->second;
}

// The phase completes once nothing is pending; its waiters are released.
inline void mbarrier_check(Mbarrier& m) {
  if (m.pending != 0 || m.tx != 0) return;
  ++m.phase;
  m.pending = m.expected;
  release_fibers(m.waiting);
}

inline void mbarrier_arrivals(Mbarrier& m, int count, const char* op) {
  if (count > m.pending)
    throw std::runtime_error(std::string("simt: ") + op + ": " + std::to_string(count) + " arrival(s) with " +
                             std::to_string(m.pending) + " pending in the phase");
  m.pending -= count;
  mbarrier_check(m);
}

inline void mbarrier_land(Mbarrier& m, MbarrierWork& w) {
  for (const AsyncCopy& c : w.copies) std::memcpy(c.dst, c.bytes, 16);
  if (!w.bytes.empty()) std::memcpy(w.dst, w.bytes.data(), w.bytes.size());
  m.tx -= w.tx;
  if (w.arrivals > 0) {
    mbarrier_arrivals(m, w.arrivals, "an asynchronous arrival");
  } else {
    mbarrier_check(m);
  }
}

// Lands every operation attached to m (a wait on it).
inline void mbarrier_land_all(Mbarrier& m) {
  std::vector<MbarrierWork> work;
  work.swap(m.in_flight);
  for (MbarrierWork& w : work) mbarrier_land(m, w);
}

// No thread can run: the work attached to the mbarriers that threads wait on lands (whether any did).
inline bool land_for_waiters(Block& b) {
  if (!b.barriers) return false;
  bool any = false;
  for (auto& [addr, m] : static_cast<BarrierBlock*>(b.barriers.get())->mbarriers)
    if (!m.waiting.empty() && !m.in_flight.empty()) {
      mbarrier_land_all(m);
      any = true;
    }
  return any;
}

// Attaches w to m, or lands it now, as the schedule says.
inline void mbarrier_attach(Mbarrier& m, MbarrierWork w) {
  Block& b = *g_block;
  const bool now = g_schedule.kind == Schedule::Reverse || (g_schedule.kind == Schedule::Random && (b.rng() & 1));
  if (now) {
    mbarrier_land(m, w);
  } else {
    m.in_flight.push_back(std::move(w));
  }
}

inline void mbarrier_init(void* bar, int count) {
  if (count < 1 || count >= (1 << 20))
    throw std::runtime_error("simt: mbarrier.init: the count must be 1 to 2^20 - 1, got " + std::to_string(count));
  Mbarrier& m = barrier_block().mbarriers[reinterpret_cast<uintptr_t>(bar)];
  if (!m.in_flight.empty()) throw std::runtime_error("simt: mbarrier.init on an mbarrier with work in flight");
  if (!m.waiting.empty()) throw std::runtime_error("simt: mbarrier.init on an mbarrier that threads wait on");
  m = Mbarrier{};
  m.expected = m.pending = count;
}

// mbarrier.arrive.expect_tx (tx > 0) or mbarrier.arrive (tx 0): the transaction count raised by tx, then one arrival.
inline void mbarrier_arrive(void* bar, int64_t tx) {
  Mbarrier& m = mbarrier_at(bar, "mbarrier.arrive");
  m.tx += tx;
  mbarrier_arrivals(m, 1, "mbarrier.arrive");
}

inline bool mbarrier_try_wait(void* bar, int parity) {
  Mbarrier& m = mbarrier_at(bar, "mbarrier.try_wait");
  if (static_cast<int>(m.phase & 1) != (parity & 1)) return true;
  mbarrier_land_all(m);
  return static_cast<int>(m.phase & 1) != (parity & 1);
}

// try_wait.parity in a loop: the thread sleeps until a phase of the barrier completes, then tries again.
inline void mbarrier_wait(void* bar, int parity) {
  while (!mbarrier_try_wait(bar, parity)) {
    mbarrier_at(bar, "mbarrier.try_wait").waiting.push_back(g_block->current);
    yield_as(State::WaitBarrier);
  }
}

// cp.async.mbarrier.arrive (noinc false: the pending count is raised by one first) or .noinc: the thread's copies in
// flight land with the barrier, then arrive.
inline void cp_async_mbarrier_arrive(void* bar, bool noinc) {
  Mbarrier& m = mbarrier_at(bar, "cp.async.mbarrier.arrive");
  Fiber& f = g_block->fibers[g_block->current];
  MbarrierWork w;
  for (auto& group : f.committed) w.copies.insert(w.copies.end(), group.begin(), group.end());
  w.copies.insert(w.copies.end(), f.open_group.begin(), f.open_group.end());
  f.committed.clear();
  f.open_group.clear();
  w.arrivals = 1;
  if (!noinc) ++m.pending;
  mbarrier_attach(m, std::move(w));
}

// cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes: `bytes` (a multiple of 16, both addresses 16-byte
// aligned) from global src to shared dst, completing `bytes` transaction bytes of the barrier when it lands.
inline void bulk_copy(void* dst, const void* src, int bytes, void* bar) {
  if (bytes <= 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: cp.async.bulk: the size (" + std::to_string(bytes) +
                             ") must be a positive multiple of 16 and both addresses 16-byte aligned");
  Mbarrier& m = mbarrier_at(bar, "cp.async.bulk");
  MbarrierWork w;
  w.dst = static_cast<unsigned char*>(dst);
  w.bytes.assign(static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
  w.tx = bytes;
  mbarrier_attach(m, std::move(w));
}

}  // namespace dcp_ops::simt
