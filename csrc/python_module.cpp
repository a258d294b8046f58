// The Python extension module dcp_ops._C: loading it runs the TORCH_LIBRARY registrations and chooses the CPU kernels'
// ISA level (cpu_levels.h), failing the import with the reason where none can run; it records build facts.
#include <Python.h>

#include <exception>
#include <string>

#include "cpu_levels.h"
#include "ops.h"

#ifndef DCP_OPS_CUDA_ARCHS
#define DCP_OPS_CUDA_ARCHS ""
#endif

#ifdef DCP_OPS_WITH_CUDA
// _C.split_choice(op, dim0, dim1, q_elem_bytes, native, rows=0, arch=90, smem_optin=0) -> (kernel, rows, granule,
// tokens, smem): the split pass the launchers take on that device (ops.h's describe_split_pass).
static PyObject* split_choice(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"op", "dim0", "dim1", "q_elem_bytes", "native", "rows", "arch", "smem_optin", nullptr};
  const char* op = nullptr;
  int dim0 = 0, dim1 = 0, elem = 0, native = 1, arch = 90, smem = 0;
  long long rows = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siiip|Lii", const_cast<char**>(names), &op, &dim0, &dim1, &elem,
                                   &native, &rows, &arch, &smem))
    return nullptr;
  try {
    const dcp_ops::SplitPassInfo s = dcp_ops::describe_split_pass(op, dim0, dim1, elem, native != 0, rows, arch, smem);
    return Py_BuildValue("(siiii)", s.kernel.c_str(), s.rows, s.granule, s.tokens, s.smem);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}
static PyMethodDef methods[] = {
    {"split_choice", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(split_choice)),
     METH_VARARGS | METH_KEYWORDS, "the split pass a decode op takes on a described device (cuda/split_choice.h)"},
    {nullptr, nullptr, 0, nullptr}};
#else
static PyMethodDef* methods = nullptr;
#endif

extern "C" PyObject* PyInit__C(void) {
  const char* level = dcp_ops::cpu::active_level();
  if (level == nullptr) {
    PyErr_SetString(PyExc_ImportError, dcp_ops::cpu::level_error().c_str());
    return nullptr;
  }
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "dcp_ops native ops (see torch.ops.dcp_ops)", -1, methods};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
  PyModule_AddStringConstant(m, "cpu_isa", level);  // the CPU kernels' ISA level in use
  PyModule_AddStringConstant(m, "cpu_levels", dcp_ops::cpu::built_levels().c_str());  // those built, lowest first
  PyModule_AddStringConstant(m, "cuda_archs", DCP_OPS_CUDA_ARCHS);  // TORCH_CUDA_ARCH_LIST of the build, "" without CUDA
  PyModule_AddIntConstant(m, "exchange_pad_bytes", dcp_ops::kExchangePadBytes);  // dcp_ops.ops.exchange_pad
#ifdef DCP_OPS_WITH_CUDA
  PyModule_AddIntConstant(m, "with_cuda", 1);
#else
  PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  return m;
}
