// The ISA level of this copy of the CPU kernels. Every source of csrc/cpu is compiled once per level into the one
// library (setup.py, CMakeLists.txt: default, avx2, avx512, avx512bf16, amx), with that level's compiler flags and
// with -DDCP_OPS_CPU_LEVEL=isa_<level>, the inline namespace that every file here opens inside dcp_ops::cpu. So each
// level's functions, templates and tables have their own symbols and one level's code never stands in for another's;
// code outside csrc/cpu is compiled once, for the baseline ISA. csrc/cpu_levels.cpp picks the level at import.
//
// A level's code runs only once that level is chosen: nothing here may need a dynamic initializer (a static object
// whose constructor would run at load on any CPU); tests/test_cpu_levels.py checks that no load-time initializer of
// the library calls into a level's code.
#pragma once

#ifndef DCP_OPS_CPU_LEVEL
#error "csrc/cpu is compiled once per ISA level with -DDCP_OPS_CPU_LEVEL=isa_<level> (see setup.py)"
#endif
