// SIMT executor: compiles CUDA kernel sources with the host compiler and runs them on the CPU (tests only).
//
// Blocks run one after another; the threads of a block are fibers (ucontext) that run until they meet a barrier:
// __syncthreads() releases when every live thread of the block waits there, warp operations (__shfl*_sync, votes,
// __syncwarp, the tensor-core emulations) when every live lane of the warp does, warpgroup operations (wgmma.*,
// simt/wgmma.h) when all 128 threads of the warpgroup (4 consecutive warps: linear thread id / 128) do. A thread that
// exits while others wait at __syncthreads or at a warpgroup operation (.sync.aligned needs all 128), threads of a
// warpgroup waiting at different warpgroup operations, or a state where nothing can run, is reported as an error.
// It is built to fail where a GPU would:
//   - Schedules. A fiber runs alone until its next barrier or warp operation, and the first runnable fiber in the
//     schedule's order runs next, so the warp released first runs ahead of the others up to the next barrier: a
//     kernel that reads shared memory another thread (or warp) writes without a barrier between them sees the store
//     or not depending on the order. DCP_SIMT_SCHEDULE picks the order: `forward` (thread 0 first, the default),
//     `reverse`, or `random:<seed>` (a fresh permutation at every release, seeded per block); anything else is
//     refused by name. Forward and reverse together see every race of one writer and one reader.
//   - Asynchronous copies land at their wait: cp.async (async_copy16) snapshots its 16 source bytes at issue and
//     writes them to shared memory only when a cp.async.wait_group retires its commit group (in commit order), so a
//     read before the wait sees whatever was there: poison, or an older tile. wgmma.mma_async likewise reads its
//     operands and writes its accumulators only when a wgmma.wait_group retires its group (simt/wgmma.h).
//   - Named barriers and mbarriers (simt/barriers.h): work attached to an mbarrier (bulk and tensor-map copies,
//     simt/tma.h; cp.async arrivals) lands at a wait on it (`forward`), at its issue (`reverse`), or either
//     (`random`), so both a read without a wait and a copy into a buffer still being read show.
//   - Bank conflicts. The warp-wide shared accesses the executor performs (ldmatrix, and the stores routed through
//     st_shared_u32) are counted in g_bank_stats, cp.async's writes (the k-th copy of each lane of a warp taken as
//     one instruction) in g_async_bank_stats: requests, wavefronts, and the fewest wavefronts their sizes allow.
// Dynamic shared memory is filled with 0xff bytes at every block start; static __shared__ arrays are one instance
// for the kernel, so a read before any write sees the previous block's (or launch's) values, never zeros.
#pragma once

#include <cxxabi.h>
#include <dlfcn.h>
#include <immintrin.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

// ---- CUDA language surface ------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // one instance per kernel: blocks run one after another
#define __restrict__
#define __launch_bounds__(...)
#define __grid_constant__

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "simt"; }

namespace dcp_ops::simt {

struct Builtins {
  dim3 threadIdx, blockIdx, blockDim, gridDim;
};
inline thread_local Builtins g;  // the running fiber's built-ins
inline thread_local std::vector<unsigned char> g_dynamic_smem;

constexpr int kWarp = 32;

constexpr int kWarpgroup = 128;  // 4 consecutive warps: the unit of wgmma

enum class State { Runnable, WaitBlock, WaitWarp, WaitGroup, WaitBarrier, Done };  // WaitBarrier: simt/barriers.h

// One 16-byte cp.async in flight: its destination and the source bytes read at issue.
struct AsyncCopy {
  unsigned char* dst;
  unsigned char bytes[16];
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  dim3 tid;
  int linear = 0;
  State state = State::Runnable;
  const char* group_op = nullptr;                   // the warpgroup operation it waits at (WaitGroup), for errors
  std::vector<AsyncCopy> open_group;                // issued since the last commit
  std::vector<std::vector<AsyncCopy>> committed;    // commit groups not yet retired, oldest first
};

// The fiber order at every release (DCP_SIMT_SCHEDULE), read at each launch.
struct Schedule {
  enum Kind { Forward, Reverse, Random } kind = Forward;
  uint64_t seed = 0;
};
inline Schedule schedule_from_env() {
  Schedule s;
  const char* v = std::getenv("DCP_SIMT_SCHEDULE");
  if (v == nullptr || *v == 0 || std::strcmp(v, "forward") == 0) return s;
  if (std::strcmp(v, "reverse") == 0) {
    s.kind = Schedule::Reverse;
    return s;
  }
  char* end = nullptr;
  if (std::strncmp(v, "random:", 7) == 0 && v[7] != 0) {
    s.seed = std::strtoull(v + 7, &end, 10);
    if (*end == 0) {
      s.kind = Schedule::Random;
      return s;
    }
  }
  throw std::invalid_argument(std::string("simt: DCP_SIMT_SCHEDULE must be forward, reverse or random:<seed>, got '") +
                              v + "'");
}
inline thread_local Schedule g_schedule;

// Shared-memory bank statistics of the warp-wide accesses the executor performs: `requests` warp-wide accesses,
// `wavefronts` the shared-memory cycles they take (32 banks of 4 bytes), `ideal` the fewest their sizes allow. A
// kernel is conflict-free when wavefronts == ideal.
struct BankStats {
  int64_t requests = 0, wavefronts = 0, ideal = 0;
};
inline BankStats g_bank_stats;        // ldmatrix and the stores routed through st_shared_u32
inline BankStats g_async_bank_stats;  // cp.async's shared-memory writes

template <typename Addr>
void count_banks(BankStats& stats, int accesses, int per_phase, int bytes, Addr&& addr);

struct Block {
  ucontext_t sched;
  std::vector<Fiber> fibers;
  int current = -1;
  std::exception_ptr error;
  std::vector<uint64_t> warp_slots;  // one 64-bit slot per thread for shuffles and votes
  const std::function<void()>* body = nullptr;
  std::vector<int> order;  // the order the run loop visits the fibers in (the schedule)
  size_t cursor = 0;       // the run loop's position in `order` (released)
  std::mt19937_64 rng;
  // cp.async destinations by warp and issue index: the k-th copy of each lane of a warp is one warp instruction
  std::vector<std::vector<std::vector<uintptr_t>>> warp_copies;
  std::vector<int> copies_issued;  // per thread
  std::shared_ptr<void> wgmma;     // the warpgroups' wgmma state (simt/wgmma.h), made at the block's first use
  std::shared_ptr<void> barriers;  // named barriers and mbarriers (simt/barriers.h), made at the first use
};
inline thread_local Block* g_block = nullptr;

inline void yield_as(State s) {
  Block& b = *g_block;
  Fiber& f = b.fibers[b.current];
  f.state = s;
  swapcontext(&f.ctx, &b.sched);
}

inline void fiber_entry() {
  Block& b = *g_block;
  try {
    (*b.body)();
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  Fiber& f = b.fibers[b.current];
  f.open_group.clear();  // copies still in flight when a thread exits never land (its block's shared memory is gone)
  f.committed.clear();
  f.state = State::Done;
  swapcontext(&b.fibers[b.current].ctx, &b.sched);
}

// One fiber per thread of the block, each on its own stack, entering the kernel body (fiber_entry) when first run.
inline void start_fibers(Block& b, const dim3& block) {
  constexpr size_t kStack = 256 * 1024;
  const int n = static_cast<int>(block.x * block.y * block.z);
  b.fibers.resize(n);
  b.warp_slots.assign(n, 0);
  b.warp_copies.resize((n + kWarp - 1) / kWarp);
  b.copies_issued.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    f.stack.reset(new char[kStack]);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
}

// The order the run loop visits the fibers in, by the schedule: thread order, reversed, or shuffled (seeded per block,
// and again at every release).
inline void order_fibers(Block& b, const dim3& block_idx, const dim3& grid) {
  b.order.resize(b.fibers.size());
  std::iota(b.order.begin(), b.order.end(), 0);
  if (g_schedule.kind == Schedule::Reverse) std::reverse(b.order.begin(), b.order.end());
  b.rng.seed(g_schedule.seed * 0x9E3779B97F4A7C15ull + (block_idx.z * grid.y + block_idx.y) * grid.x + block_idx.x);
  if (g_schedule.kind == Schedule::Random) std::shuffle(b.order.begin(), b.order.end(), b.rng);
}

// Every fiber at an order position before b.cursor waits or is done: only a release makes a fiber runnable again,
// and a release sends the cursor back to the start, so the first runnable fiber in the order always runs next
// (the warp released first runs ahead of the others until its next barrier).
inline void released(Block& b) {
  if (g_schedule.kind == Schedule::Random) std::shuffle(b.order.begin(), b.order.end(), b.rng);
  b.cursor = 0;
}

// Releases warp w when every live lane of it waits at a warp operation.
inline void try_release_warp(Block& b, int w) {
  const int n = static_cast<int>(b.fibers.size());
  bool all = true, any = false;
  for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
    if (b.fibers[i].state == State::Done) continue;
    any = true;
    all &= b.fibers[i].state == State::WaitWarp;
  }
  if (!any || !all) return;
  for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i)
    if (b.fibers[i].state != State::Done) b.fibers[i].state = State::Runnable;
  released(b);
}

// Releases warpgroup w when all 128 of its threads wait at the same warpgroup operation. Once no thread of it can
// still arrive (each waits there or has exited), an exited thread, a block too small to hold the group, or two
// operations is an error: the operations are .sync.aligned over the whole warpgroup.
inline void try_release_group(Block& b, int w) {
  const int n = static_cast<int>(b.fibers.size());
  const int lo = w * kWarpgroup, hi = std::min(n, lo + kWarpgroup);
  int waiting = 0, done = 0;
  for (int i = lo; i < hi; ++i) {
    waiting += b.fibers[i].state == State::WaitGroup;
    done += b.fibers[i].state == State::Done;
  }
  if (waiting == 0 || waiting + done < hi - lo) return;
  const char* op = nullptr;
  for (int i = lo; i < hi && !b.error; ++i) {
    const Fiber& f = b.fibers[i];
    if (f.state != State::WaitGroup) continue;
    if (op != nullptr && std::strcmp(op, f.group_op) != 0)
      b.error = std::make_exception_ptr(std::runtime_error(
          std::string("simt: warpgroup divergence: threads of warpgroup ") + std::to_string(w) + " wait at " + op +
          " and at " + f.group_op));
    op = f.group_op;
  }
  if (!b.error && (done > 0 || hi - lo < kWarpgroup))
    b.error = std::make_exception_ptr(std::runtime_error(
        std::string("simt: warpgroup divergence: ") + op + " needs all 128 threads of warpgroup " + std::to_string(w) +
        ", but " + std::to_string(kWarpgroup - waiting) + " of them " +
        (done > 0 ? "exited" : "are outside the block (" + std::to_string(n) + " threads)")));
  if (b.error) return;
  for (int i = lo; i < hi; ++i) b.fibers[i].state = State::Runnable;
  released(b);
}

inline bool land_for_waiters(Block& b);  // simt/barriers.h

// No fiber can run: the block is finished (true), or asynchronous work that threads wait on lands (simt/barriers.h),
// or every live thread waits at __syncthreads() and all are released, or it is an error (a barrier some thread exited
// before, or a deadlock), recorded in b.error.
inline bool release_block(Block& b) {
  const int n = static_cast<int>(b.fibers.size());
  int done = 0, at_block = 0, at_warp = 0, at_group = 0, at_barrier = 0;
  for (int i = 0; i < n; ++i) {
    done += b.fibers[i].state == State::Done;
    at_block += b.fibers[i].state == State::WaitBlock;
    at_warp += b.fibers[i].state == State::WaitWarp;
    at_group += b.fibers[i].state == State::WaitGroup;
    at_barrier += b.fibers[i].state == State::WaitBarrier;
  }
  if (done == n) return true;
  if (at_barrier > 0 && land_for_waiters(b)) return false;
  if (at_block > 0 && at_block + done == n && done == 0) {
    for (auto& f : b.fibers) f.state = State::Runnable;
    released(b);
    return false;
  }
  b.error = std::make_exception_ptr(std::runtime_error(
      at_block > 0 && at_block + done == n
          ? "simt: __syncthreads() divergence: " + std::to_string(done) + " thread(s) of the block exited while " +
                std::to_string(at_block) + " wait at the barrier"
          : "simt: deadlock: no thread can run (threads wait at barriers that can never release: " +
                std::to_string(at_block) + " at __syncthreads, " + std::to_string(at_warp) + " at warp operations, " +
                std::to_string(at_group) + " at warpgroup operations, " + std::to_string(at_barrier) +
                " at named barriers or mbarriers)"));
  return false;
}

// Runs one block of `block` threads to completion: the first runnable fiber in the order runs until it waits or
// exits, then the warp or warpgroup it waits with is released if complete; when none can run, the block barrier.
inline void run_block(const dim3& block_idx, const dim3& grid, const dim3& block, const std::function<void()>& body) {
  std::fill(g_dynamic_smem.begin(), g_dynamic_smem.end(), 0xff);  // poisoned: a read before a write shows
  Block b;
  b.body = &body;
  g_block = &b;
  start_fibers(b, block);
  order_fibers(b, block_idx, grid);
  g.blockIdx = block_idx;
  g.blockDim = block;
  g.gridDim = grid;
  while (!b.error) {
    while (b.cursor < b.order.size() && b.fibers[b.order[b.cursor]].state != State::Runnable) ++b.cursor;
    if (b.cursor == b.order.size()) {
      if (release_block(b)) break;
      continue;
    }
    const int i = b.order[b.cursor];
    b.current = i;
    g.threadIdx = b.fibers[i].tid;
    swapcontext(&b.sched, &b.fibers[i].ctx);
    const State s = b.fibers[i].state;
    if (s != State::WaitBlock) try_release_warp(b, i / kWarp);
    if (s == State::WaitGroup || s == State::Done) try_release_group(b, i / kWarpgroup);
  }
  for (const auto& warp : b.warp_copies)  // each cp.async warp instruction: 4 phases of 8 lanes x 16 bytes
    for (const auto& inst : warp)
      count_banks(g_async_bank_stats, static_cast<int>(inst.size()), 8, 16,
                  [&](int l) { return reinterpret_cast<const void*>(inst[l]); });
  g_block = nullptr;
  if (b.error) std::rethrow_exception(b.error);
}

// The names of the kernels launched, in order, each without namespaces, return type and parameters
// ("mla_tiled_kernel<...>"), from its symbol: what the tests' kernel_log() and last_kernel() report, so a test can
// assert which path ran.
inline std::vector<std::string> g_kernel_log;
inline std::string kernel_name(const void* fn) {
  Dl_info info{};
  if (dladdr(fn, &info) == 0 || info.dli_sname == nullptr || info.dli_saddr != fn) return "?";  // not exported
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> full(abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status),
                                              std::free);
  std::string name = status == 0 && full ? full.get() : info.dli_sname;
  int depth = 0;  // cut the parameter list (the last parenthesis at template depth 0), then the return type and scopes
  size_t open = std::string::npos;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0) open = i;
  }
  if (open != std::string::npos) name.resize(open);
  size_t start = 0;
  depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (depth == 0 && (name[i] == ' ' || (name[i] == ':' && i + 1 < name.size() && name[i + 1] == ':')))
      start = name[i] == ' ' ? i + 1 : i + 2;
  }
  return name.substr(start);
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  g_kernel_log.push_back(kernel_name(reinterpret_cast<const void*>(kernel)));
  g_schedule = schedule_from_env();
  g_dynamic_smem.assign(smem_bytes, 0xff);
  const std::function<void()> body = [&]() { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block(dim3(x, y, z), grid, block, body);
}

inline int lane() { return g_block->current % kWarp; }

template <typename T>
T exchange(T v, int src_lane) {  // every live lane publishes v, then reads src_lane's
  static_assert(sizeof(T) <= 8, "simt shuffles move at most 64 bits");
  Block& b = *g_block;
  const int me = b.current, base = me - me % kWarp;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b.warp_slots[me] = bits;
  yield_as(State::WaitWarp);
  const int src = base + src_lane;
  T out = v;
  if (src >= 0 && src < static_cast<int>(b.fibers.size())) std::memcpy(&out, &b.warp_slots[src], sizeof(T));
  yield_as(State::WaitWarp);  // nobody overwrites a slot before every lane has read
  return out;
}

// Every live lane publishes a pointer to its own data; then fn(at) runs, where at(l) is lane l's pointer. No lane
// leaves before every lane has run fn, so the data behind the pointers stays valid (warp-wide register exchange,
// as a tensor-core instruction does).
template <typename F>
void warp_view(const void* mine, F&& fn) {
  Block& b = *g_block;
  const int me = b.current, base = me - me % kWarp;
  b.warp_slots[me] = reinterpret_cast<uintptr_t>(mine);
  yield_as(State::WaitWarp);
  fn([&](int l) { return reinterpret_cast<const void*>(static_cast<uintptr_t>(b.warp_slots[base + l])); });
  yield_as(State::WaitWarp);
}

// Waits at warpgroup operation `op` (its name, for the error reports) until all 128 threads of the warpgroup do.
inline void yield_to_group(const char* op) {
  Block& b = *g_block;
  b.fibers[b.current].group_op = op;
  yield_as(State::WaitGroup);
}

// warp_view over the warpgroup: every thread of it publishes a pointer to its own data, then fn(at) runs, where at(r)
// is the pointer of the group's thread r (0 .. 127); no thread leaves before every thread has run fn.
template <typename F>
void warpgroup_view(const char* op, const void* mine, F&& fn) {
  Block& b = *g_block;
  const int me = b.current, base = me - me % kWarpgroup;
  b.warp_slots[me] = reinterpret_cast<uintptr_t>(mine);
  yield_to_group(op);
  fn([&](int r) { return reinterpret_cast<const void*>(static_cast<uintptr_t>(b.warp_slots[base + r])); });
  yield_to_group(op);
}

// cp.async: 16 bytes from src (or zeros when !valid) to shared dst, landing when a wait retires the commit group.
inline void async_copy16(void* dst, const void* src, bool valid) {
  AsyncCopy c{static_cast<unsigned char*>(dst), {}};
  if (valid) std::memcpy(c.bytes, src, 16);
  Block& b = *g_block;
  b.fibers[b.current].open_group.push_back(c);
  auto& warp = b.warp_copies[b.current / kWarp];
  const int k = b.copies_issued[b.current]++;
  if (static_cast<int>(warp.size()) <= k) warp.resize(k + 1);
  warp[k].push_back(reinterpret_cast<uintptr_t>(dst));
}
inline void async_commit() {
  Fiber& f = g_block->fibers[g_block->current];
  f.committed.push_back(std::move(f.open_group));
  f.open_group.clear();
}
// cp.async.wait_group n: every committed group but the newest n lands, oldest first (uncommitted copies stay).
inline void async_wait(int n) {
  Fiber& f = g_block->fibers[g_block->current];
  const int retire = static_cast<int>(f.committed.size()) - n;
  for (int i = 0; i < retire; ++i)
    for (const AsyncCopy& c : f.committed[i]) std::memcpy(c.dst, c.bytes, 16);
  if (retire > 0) f.committed.erase(f.committed.begin(), f.committed.begin() + retire);
}

// Bank statistics of one warp-wide shared access in phases: `addr(i)` is the address of access i (`bytes` wide,
// naturally aligned), accesses [k * per_phase, (k + 1) * per_phase) form phase k. A phase takes as many wavefronts
// as the most distinct words (4 bytes, or a wider access's own bytes) any one bank is asked for; equal addresses
// are one word (broadcast, or one store).
template <typename Addr>
void count_banks(BankStats& stats, int accesses, int per_phase, int bytes, Addr&& addr) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(g_dynamic_smem.data());
  for (int p0 = 0; p0 < accesses; p0 += per_phase) {
    std::vector<uintptr_t> words[32];
    for (int i = p0; i < std::min(accesses, p0 + per_phase); ++i) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(addr(i)) - base;
      for (int w = 0; w < std::max(1, bytes / 4); ++w) {
        const uintptr_t word = a / 4 + w;
        auto& v = words[word % 32];
        if (std::find(v.begin(), v.end(), word) == v.end()) v.push_back(word);
      }
    }
    size_t most = 0;
    for (auto& v : words) most = std::max(most, v.size());
    stats.wavefronts += static_cast<int64_t>(most);
  }
  stats.requests += 1;
  stats.ideal += std::max(1, accesses * bytes / 128);
}
template <typename Addr>
void count_banks(int accesses, int per_phase, int bytes, Addr&& addr) {
  count_banks(g_bank_stats, accesses, per_phase, bytes, addr);
}

inline unsigned ballot(bool p) {
  Block& b = *g_block;
  const int me = b.current, base = me - me % kWarp;
  b.warp_slots[me] = p;
  yield_as(State::WaitWarp);
  unsigned bits = 0;
  for (int i = 0; i < kWarp && base + i < static_cast<int>(b.fibers.size()); ++i)
    if (b.fibers[base + i].state != State::Done && b.warp_slots[base + i]) bits |= 1u << i;
  yield_as(State::WaitWarp);
  return bits;
}

}  // namespace dcp_ops::simt

#include "simt/wgmma.h"
#include "simt/barriers.h"
#include "simt/tma.h"

#define threadIdx (::dcp_ops::simt::g.threadIdx)
#define blockIdx (::dcp_ops::simt::g.blockIdx)
#define blockDim (::dcp_ops::simt::g.blockDim)
#define gridDim (::dcp_ops::simt::g.gridDim)
#define warpSize 32
#define DCP_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::dcp_ops::simt::g_dynamic_smem.data())

inline void __syncthreads() { ::dcp_ops::simt::yield_as(::dcp_ops::simt::State::WaitBlock); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::dcp_ops::simt::yield_as(::dcp_ops::simt::State::WaitWarp); }
template <typename T> T __shfl_sync(unsigned, T v, int src) { return ::dcp_ops::simt::exchange(v, src % 32); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int m) {
  return ::dcp_ops::simt::exchange(v, ::dcp_ops::simt::lane() ^ m);
}
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned d) {
  const int src = ::dcp_ops::simt::lane() + static_cast<int>(d);
  const T got = ::dcp_ops::simt::exchange(v, src < 32 ? src : ::dcp_ops::simt::lane());
  return got;
}
template <typename T> T __shfl_up_sync(unsigned, T v, unsigned d) {
  const int src = ::dcp_ops::simt::lane() - static_cast<int>(d);
  return ::dcp_ops::simt::exchange(v, src >= 0 ? src : ::dcp_ops::simt::lane());
}
inline unsigned __ballot_sync(unsigned, int p) { return ::dcp_ops::simt::ballot(p != 0); }
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned, int p) {
  const unsigned live_mask = ::dcp_ops::simt::ballot(true);
  return ::dcp_ops::simt::ballot(p != 0) == live_mask;
}
// One OS thread runs every fiber and a fiber only yields at barriers: read-modify-write is atomic.
template <typename T> T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <typename T> T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
// Bytes of (y:x) picked by the selector's nibbles (the plain mode: selector bit 3 of a nibble must be clear).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = static_cast<uint64_t>(y) << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// exp2f, log2f, fmaxf come from <cmath>.
inline int min(int a, int b) { return a < b ? a : b; }  // CUDA's integer min/max
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
using std::fmaxf;
using std::isnan;
using std::isfinite;

// 16-bit float types with the cuda_bf16.h / cuda_fp16.h conversions the kernels use (round to nearest even).
struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __half2float(__half x) { return _cvtsh_ss(x.bits); }
inline __half __float2half(float f) { return {static_cast<uint16_t>(_cvtss_sh(f, 0))}; }  // 0: nearest even

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __half __ushort_as_half(unsigned short bits) { return {bits}; }

// cuda_fp8.h's float -> e4m3 conversion with __NV_SATFINITE (the only mode the kernels use): round to nearest even,
// magnitudes from 448 up (inf included) saturate to 448, NaN becomes 0x7F.
using __nv_fp8_storage_t = unsigned char;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t, __nv_fp8_interpretation_t) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const unsigned char sign = static_cast<unsigned char>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return 0x7f;                     // NaN
  if (u >= 0x43e00000u) return sign | 0x7e;             // >= 448: the largest finite value
  if (u < 0x3c800000u) {                                // below 2^-6: subnormal, m x 2^-9 with m in [0, 8]
    float f;
    std::memcpy(&f, &u, 4);
    return sign | static_cast<unsigned char>(std::nearbyint(f * 512.f));  // the current mode: nearest even
  }
  u += 0x7ffffu + ((u >> 20) & 1u);                     // round the 20 dropped mantissa bits to nearest even
  return sign | static_cast<unsigned char>((u >> 20) - (120u << 3));  // exponent rebiased 127 -> 7
}

// cuda_fp8.h's e4m3 pair -> fp16 pair conversion (E4M3 only): exact, as every e4m3 value is an fp16 one; the NaN
// magnitude 0x7F gives an fp16 NaN. Decoded from the bits (m x 2^-9 below the normal range, else the fields).
using __nv_fp8x2_storage_t = unsigned short;
struct __half2_raw {
  unsigned short x, y;
};
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t two, __nv_fp8_interpretation_t) {
  auto one = [](unsigned b) -> unsigned short {
    const unsigned mag = b & 0x7Fu;
    float v = NAN;
    if (mag < 8u) {
      v = static_cast<float>(mag) / 512.f;
    } else if (mag != 0x7Fu) {
      const uint32_t u = (mag << 20) + (120u << 23);
      std::memcpy(&v, &u, 4);
    }
    return static_cast<unsigned short>(_cvtss_sh(b & 0x80u ? -v : v, 0));
  };
  return {one(two & 0xFFu), one(two >> 8)};
}
