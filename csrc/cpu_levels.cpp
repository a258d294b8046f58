// The choice of the CPU kernels' ISA level (cpu_levels.h), and the registered CPU kernels, which call that level's.
#include "cpu_levels.h"

#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace dcp_ops::cpu {

// Each level's table (cpu/level_ops.cpp), null where the build left the level out (DCP_OPS_CPU_ISA).
inline namespace isa_default { extern const Ops kOps __attribute__((weak)); }
inline namespace isa_avx2 { extern const Ops kOps __attribute__((weak)); }
inline namespace isa_avx512 { extern const Ops kOps __attribute__((weak)); }
inline namespace isa_avx512bf16 { extern const Ops kOps __attribute__((weak)); }
inline namespace isa_amx { extern const Ops kOps __attribute__((weak)); }

bool amx_tile_permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

namespace {

struct Level {
  const char* name;
  const Ops* ops;
  // What this CPU (or OS) lacks of the level's instructions, or nullptr. GCC's checks include the OS's: AVX and
  // AVX-512 count only where the OS saves their registers (XCR0).
  const char* (*missing)();
};

const char* missing_avx2() {
  if (!__builtin_cpu_supports("avx2")) return "AVX2";
  if (!__builtin_cpu_supports("fma")) return "FMA";
  return __builtin_cpu_supports("f16c") ? nullptr : "F16C";
}
const char* missing_avx512() {
  if (const char* m = missing_avx2()) return m;
  if (!__builtin_cpu_supports("avx512f")) return "AVX512F";
  if (!__builtin_cpu_supports("avx512bw")) return "AVX512BW";
  if (!__builtin_cpu_supports("avx512vl")) return "AVX512VL";
  return __builtin_cpu_supports("avx512dq") ? nullptr : "AVX512DQ";
}
const char* missing_avx512bf16() {
  if (const char* m = missing_avx512()) return m;
  return __builtin_cpu_supports("avx512bf16") ? nullptr : "AVX512_BF16";
}
const char* missing_amx() {
  if (const char* m = missing_avx512bf16()) return m;
  if (!__builtin_cpu_supports("amx-tile")) return "AMX-TILE";
  if (!__builtin_cpu_supports("amx-bf16")) return "AMX-BF16";
  return amx_tile_permitted() ? nullptr : "the AMX tile state (Linux refused this process ARCH_REQ_XCOMP_PERM)";
}

// Lowest first.
const Level kLevels[] = {
    {"default", &isa_default::kOps, [] { return static_cast<const char*>(nullptr); }},
    {"avx2", &isa_avx2::kOps, missing_avx2},
    {"avx512", &isa_avx512::kOps, missing_avx512},
    {"avx512bf16", &isa_avx512bf16::kOps, missing_avx512bf16},
    {"amx", &isa_amx::kOps, missing_amx},
};

struct Choice {
  const Level* level = nullptr;
  std::string error;
};

Choice choose() {
  __builtin_cpu_init();
  Choice c;
  const char* forced = std::getenv("DCP_OPS_CPU_CAPABILITY");
  if (forced != nullptr && *forced != '\0') {
    const Level* named = nullptr;
    std::string names;
    for (const Level& l : kLevels) {
      names += std::string(names.empty() ? "" : ", ") + l.name;
      if (std::strcmp(l.name, forced) == 0) named = &l;
    }
    if (named == nullptr) {
      c.error = std::string("DCP_OPS_CPU_CAPABILITY=") + forced + " names no ISA level (" + names + ")";
    } else if (named->ops == nullptr) {
      c.error = std::string("DCP_OPS_CPU_CAPABILITY=") + forced + ": this library's CPU kernels were built for " +
                built_levels() + " only (DCP_OPS_CPU_ISA)";
    } else if (const char* m = named->missing()) {
      c.error = std::string("DCP_OPS_CPU_CAPABILITY=") + forced + ": this CPU lacks " + m;
    } else {
      c.level = named;
    }
    return c;
  }
  const char* lacks = nullptr;
  for (const Level& l : kLevels) {
    if (l.ops == nullptr) continue;
    const char* m = l.missing();
    if (m == nullptr)
      c.level = &l;  // the highest that runs
    else if (c.level == nullptr)
      lacks = m;
  }
  if (c.level == nullptr)
    c.error = "dcp_ops's CPU kernels were built for " + built_levels() + " only (DCP_OPS_CPU_ISA) and this CPU lacks " +
              (lacks ? lacks : "them") + "; build with DCP_OPS_CPU_ISA=auto (every level)";
  return c;
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

const char* active_level() { return choice().level ? choice().level->name : nullptr; }

const std::string& level_error() { return choice().error; }

std::string built_levels() {
  std::string names;
  for (const Level& l : kLevels)
    if (l.ops != nullptr) names += std::string(names.empty() ? "" : ",") + l.name;
  return names;
}

const Ops& active_ops() {
  const Choice& c = choice();
  TORCH_CHECK(c.level != nullptr, c.error);
  return *c.level->ops;
}

}  // namespace dcp_ops::cpu
