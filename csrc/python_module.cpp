// The Python extension module dcp_ops._C: loading it runs the TORCH_LIBRARY registrations and chooses the CPU kernels'
// ISA level (cpu_levels.h), failing the import with the reason where none can run; it records build facts.
#include <Python.h>

#include <string>

#include "cpu_levels.h"
#include "ops.h"

#ifndef DCP_OPS_CUDA_ARCHS
#define DCP_OPS_CUDA_ARCHS ""
#endif

extern "C" PyObject* PyInit__C(void) {
  const char* level = dcp_ops::cpu::active_level();
  if (level == nullptr) {
    PyErr_SetString(PyExc_ImportError, dcp_ops::cpu::level_error().c_str());
    return nullptr;
  }
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "dcp_ops native ops (see torch.ops.dcp_ops)", -1, nullptr};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
  PyModule_AddStringConstant(m, "cpu_isa", level);  // the CPU kernels' ISA level in use
  PyModule_AddStringConstant(m, "cpu_levels", dcp_ops::cpu::built_levels().c_str());  // those built, lowest first
  PyModule_AddStringConstant(m, "cuda_archs", DCP_OPS_CUDA_ARCHS);
  PyModule_AddIntConstant(m, "exchange_pad_bytes", dcp_ops::kExchangePadBytes);  // dcp_ops.ops.exchange_pad  // TORCH_CUDA_ARCH_LIST of the build, "" without CUDA
#ifdef DCP_OPS_WITH_CUDA
  PyModule_AddIntConstant(m, "with_cuda", 1);
#else
  PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  return m;
}
