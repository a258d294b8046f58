// The Python extension module dcp_ops._C: loading it runs the TORCH_LIBRARY registrations; it records build facts.
#include <Python.h>

#ifndef DCP_OPS_CPU_ISA
#define DCP_OPS_CPU_ISA "default"
#endif
#ifndef DCP_OPS_CUDA_ARCHS
#define DCP_OPS_CUDA_ARCHS ""
#endif

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "dcp_ops native ops (see torch.ops.dcp_ops)", -1, nullptr};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
  PyModule_AddStringConstant(m, "cpu_isa", DCP_OPS_CPU_ISA);
  PyModule_AddStringConstant(m, "cuda_archs", DCP_OPS_CUDA_ARCHS);  // TORCH_CUDA_ARCH_LIST of the build, "" without CUDA
#ifdef DCP_OPS_WITH_CUDA
  PyModule_AddIntConstant(m, "with_cuda", 1);
#else
  PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  return m;
}
