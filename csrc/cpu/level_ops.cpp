// This ISA level's CPU ops as csrc/cpu_levels.cpp takes them: a table of constants (no code runs at load).
#include "cpu/level.h"
#include "cpu_levels.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

// This level's copies of the entry points (cpu/attention.cpp, cpu/merge.cpp, cpu/write_kv.cpp).
decltype(dcp_ops::gqa_decode_partial_cpu) gqa_decode_partial_cpu;
decltype(dcp_ops::mla_decode_partial_cpu) mla_decode_partial_cpu;
decltype(dcp_ops::merge_partials_cpu) merge_partials_cpu;
decltype(dcp_ops::correct_partial_cpu) correct_partial_cpu;
decltype(dcp_ops::pack_exchange_cpu) pack_exchange_cpu;
decltype(dcp_ops::merge_exchange_cpu) merge_exchange_cpu;
decltype(dcp_ops::write_kv_cpu) write_kv_cpu;

extern const Ops kOps;
const Ops kOps = {&gqa_decode_partial_cpu, &mla_decode_partial_cpu, &merge_partials_cpu, &correct_partial_cpu,
                  &pack_exchange_cpu,      &merge_exchange_cpu,     &write_kv_cpu};

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
