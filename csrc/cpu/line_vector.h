// std::vector whose storage starts on a cache line (64 bytes).
#pragma once

#include "cpu/level.h"

#include <cstddef>
#include <new>
#include <vector>

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// For buffers that AMX tiles load and store: a tile row that straddles two cache lines loads and stores at about half
// speed (one thread, rows in L1 / L2: GQA's P.V 1.19 -> 0.58 us per 64 tokens with O's rows on whole lines).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const LineAllocator&) const { return true; }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
