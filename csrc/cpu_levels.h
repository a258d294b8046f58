// The ISA levels of the CPU kernels (cpu/level.h) and the choice of one at import: the best level compiled into the
// library that this CPU and OS can run, or the one DCP_OPS_CPU_CAPABILITY names.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "ops.h"

namespace dcp_ops::cpu {

// One level's CPU ops (cpu/level_ops.cpp), with the signatures ops.h declares for the CPU kernels; ops.cpp registers
// the chosen level's (Forward).
struct Ops {
  decltype(&gqa_decode_partial_cpu) gqa_decode_partial;
  decltype(&mla_decode_partial_cpu) mla_decode_partial;
  decltype(&merge_partials_cpu) merge_partials;
  decltype(&correct_partial_cpu) correct_partial;
  decltype(&pack_exchange_cpu) pack_exchange;
  decltype(&merge_exchange_cpu) merge_exchange;
  decltype(&write_kv_cpu) write_kv;
};

// The chosen level's name ("default", "avx2", "avx512", "avx512bf16" or "amx"), chosen on the first call (the
// Python module calls it at import); nullptr when no level can run, and level_error() then says why.
const char* active_level();
const std::string& level_error();
// The levels compiled into this library, lowest first, comma-separated.
std::string built_levels();
// The chosen level's ops; fails with level_error() when there is none.
const Ops& active_ops();
// Whether Linux grants this process the AMX tile state (asked once; the amx level's kernels need it).
bool amx_tile_permitted();

// The registered CPU kernel of one op (ops.cpp): Forward<&Ops::x>::call has op x's signature and calls the chosen
// level's x.
template <auto Member, typename Fn = std::remove_reference_t<decltype(std::declval<Ops&>().*Member)>>
struct Forward;
template <auto Member, typename R, typename... Args>
struct Forward<Member, R (*)(Args...)> {
  static R call(Args... args) { return (active_ops().*Member)(args...); }
};

}  // namespace dcp_ops::cpu
