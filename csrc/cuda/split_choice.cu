// describe_split_pass (ops.h): cuda/split_choice.h's decision for a described device, so that a tool without a GPU
// (bench/gpu/sass_budget.py, through _C.split_choice) reads the same choice the launchers make.
#include <stdexcept>

#include "cuda/split_choice.h"
#include "ops.h"

namespace dcp_ops {

SplitPassInfo describe_split_pass(const std::string& op, int dim0, int dim1, int q_elem_bytes, bool native,
                                  int64_t rows, int arch, int smem_optin) {
  const Device dev{arch, smem_optin > 0 ? smem_optin : flagship_smem_optin(arch), 1};
  SplitPass s;
  if (op == "mla")
    s = mla_split_choice(dim0, dim1, q_elem_bytes, native, dev);
  else if (op == "gqa")
    s = gqa_split_choice(dim0, q_elem_bytes, rows, dev);
  else
    throw std::invalid_argument("split_choice: op must be 'mla' or 'gqa', got '" + op + "'");
  return {s.name, s.rows, s.granule, s.tokens, s.smem};
}

}  // namespace dcp_ops
