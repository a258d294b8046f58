// Software prefetch of the next KV tile's rows, spread over the current tile's arithmetic (the decode kernels' hook).
#pragma once

#include "cpu/level.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// Spreads software prefetches of the next tile's rows (every KV head, K and V) over the arithmetic of the current
// tile: each call from a GEMM hook issues a share of the lines, so their memory latency overlaps the math instead of
// stalling the first loads of the next tile. The share is sized from the number of calls the previous tile made.
// The first line of every run is prefetched at once when the tile is queued, so that the TLB walks of all the next
// tile's pages start a whole tile ahead (alternated runs at 32K tokens, bf16 and fp32, batch 1 to 16: 0-8% faster
// than spreading every line).
// For the AMX kernels (`streams`): rows contiguous in the cache are queued as one run, runs are cut into streams of
// at most kStreamBytes, the lines go out one line of each stream in turn, and the kernels call the hook after
// every A tile's products (pv, for more than 32 heads, after every 64 dims of V), a few lines a call. One thread
// reading random 8 KiB blocks here got 9.6 GB/s one block at a time and 12.5 with 4 to 16 blocks read in turn (a
// microbenchmark). Against the runs one after another, in shares after every 32-wide chunk of K or 64 dims of V,
// with runs of 16 KiB or more left to the hardware's stream prefetcher after their first line (32K tokens,
// alternated, medians): GQA 16q/2kv d128 bf16 batch 1 2.42 -> 2.35 ms, batch 16 35.1 -> 33.9; MLA 16 heads bf16
// batch 1 2.78 -> 2.58, batch 16 39.5 -> 37.6, with w_uk batch 1 3.44 -> 2.87; fp32 batch 1 7.89 -> 6.95, batch 16
// 121 -> 107; MLA 128 heads bf16 batch 4 35.2 -> 34.2. Streams alone or the finer shares alone gained a quarter of
// that (MLA 16 heads bf16 batch 1: 2.85 either way against 2.47 both, one build, switched by environment); streams
// of 2 KiB lost most of it, 4 and 16 KiB ran as 8.
// Issuing them is not free: with the cache resident (every block id one of 4 blocks), GQA 16q/2kv bf16 batch 1 took
// 1.40 ms with the prefetches and 0.67 without when each line went out of a loop that kept every stream's cursor in
// memory (about 8 cycles a line). The streams are therefore sorted longest first and issued by offset: the line at one
// offset of every stream with lines left, then the next offset (resident: GQA 1.56 -> 1.09 ms, MLA 16 heads bf16
// 1.74 -> 1.50).
// Every line goes to L2 only (prefetcht1), for both kinds of kernel: a tile with the next one's rows overflows L1, and
// the tile loads and vector loads read L2 at full speed. Into L1 as well (prefetcht0), and for the streams with four
// nops ahead of each prefetch, ran faster on other days of the same kind of host, but
// not in these runs: 32K, medians, each call after what precedes it in bench_cpu.py (the
// read and matmul probes and the flushes; the configurations in random order), prefetcht0 with nops -> prefetcht1
// without, batch 1: GQA 16q/2kv bf16 2.49 -> 2.40 ms, fp32 4.41 -> 4.15; MLA 16 heads bf16 2.55 / 2.56, with w_uk
// 2.79 / 2.84, fp32 6.72 / 6.87; batch 16 (alternated): GQA bf16 35.0-36.4 -> 31.0-31.7, fp32 62.6-63.2 -> 56.7-57.8;
// MLA 16 heads bf16 35.3-38.4 -> 35.8-37.8, fp32 97-100 -> 88-95; MLA 128 heads bf16 batch 4 28.7-30.6 -> 27.9-28.9.
// prefetchnta took 5.9-6.6 ms, every second or fourth line (the hardware's prefetcher to fetch the rest) 7-45% slower.
struct TilePrefetcher {
  static constexpr int64_t kStreamBytes = 8 * 1024;
  static void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1 on x86
  struct Run {  // bytes to prefetch: from p on for the FMA kernels (p advances), from p + off for the streams
    const char* p;
    const char* end;
  };
  bool streams = false;  // the AMX kernels' mode (above); else whole runs, one after another
  std::vector<Run> merged;  // the next tile's rows, contiguous ones merged for streams
  std::vector<Run> runs;    // ... as they are issued: merged's runs, or their streams, longest first
  size_t next = 0, live = 0;  // the run to issue from next; streams: those with lines past `off` (a prefix)
  int64_t off = 0;            // streams: the byte offset in every stream of the lines now going out
  int64_t per_call = 4, calls = 0;

  void queue(const char* p, int64_t bytes) {
    if (streams && !merged.empty() && merged.back().end == p)
      merged.back().end += bytes;
    else
      merged.push_back({p, p + bytes});
  }
  // Queues the rows (kbytes from each K row, vbytes from each V row; vrows null when V rows are the K rows) and sizes
  // the share of lines per call from the number of calls the previous tile made.
  void start(const char* const* krows, const char* const* vrows, int64_t n, int64_t kbytes, int64_t vbytes) {
    merged.clear();
    runs.clear();
    if (streams) {  // K rows, then V rows, so that a block's rows are contiguous in the queue
      for (int64_t i = 0; i < n; ++i) queue(krows[i], kbytes);
      for (int64_t i = 0; vrows && i < n; ++i) queue(vrows[i], vbytes);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        queue(krows[i], kbytes);
        if (vrows) queue(vrows[i], vbytes);
      }
    }
    int64_t lines = 0;
    for (const Run& run : merged) {
      prefetch_l2(run.p);
      const int64_t bytes = run.end - run.p, cut = streams ? kStreamBytes : bytes;
      lines += (bytes + 63) / 64;
      for (int64_t o = 0; o < bytes; o += cut)  // the first line is out already
        if (std::max<int64_t>(o, 64) < std::min(bytes, o + cut))
          runs.push_back({run.p + std::max<int64_t>(o, 64), run.p + std::min(bytes, o + cut)});
    }
    if (streams)  // longest first, so that the streams with lines left at any offset are a prefix
      std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.end - a.p > b.end - b.p; });
    live = runs.size();
    off = 0;
    if (calls > 0) per_call = std::max<int64_t>(1, (lines + calls - 1) / calls);
    next = 0;
    calls = 0;
  }
  void issue(int64_t budget) {
    if (streams) {  // the line at `off` of each stream with lines left in turn, then the next offset
      while (budget > 0 && live > 0) {
        const size_t end = std::min<size_t>(live, next + budget);
        for (size_t i = next; i < end; ++i) prefetch_l2(runs[i].p + off);
        budget -= end - next;
        next = end;
        if (next < live) return;
        next = 0;
        off += 64;
        while (live > 0 && runs[live - 1].p + off >= runs[live - 1].end) --live;
      }
      return;
    }
    for (; budget > 0 && next < runs.size(); ++next) {
      Run& run = runs[next];
      for (; budget > 0 && run.p < run.end; --budget, run.p += 64) prefetch_l2(run.p);
      if (run.p < run.end) return;
    }
  }
  void operator()() {
    ++calls;
    issue(per_call);
  }
  void finish() { issue(std::numeric_limits<int64_t>::max()); }
};

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
