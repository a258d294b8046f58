// Op registrations: the schemas of csrc/schemas.h and the CPU and CUDA kernels behind them.
#include <torch/library.h>

#include "cpu_levels.h"
#include "ops.h"
#include "schemas.h"

TORCH_LIBRARY(dcp_ops, m) {
  m.def(dcp_ops::schema::kGqaDecodePartial);
  m.def(dcp_ops::schema::kMlaDecodePartial);
  m.def(dcp_ops::schema::kMergePartials);
  m.def(dcp_ops::schema::kCorrectPartial);
  m.def(dcp_ops::schema::kPackExchange);
  m.def(dcp_ops::schema::kMergeExchange);
  m.def(dcp_ops::schema::kWriteKv);
}

TORCH_LIBRARY_IMPL(dcp_ops, CPU, m) {  // the kernels of the ISA level chosen at import (cpu_levels.h)
  using dcp_ops::cpu::Forward;
  using dcp_ops::cpu::Ops;
  m.impl("gqa_decode_partial", &Forward<&Ops::gqa_decode_partial>::call);
  m.impl("mla_decode_partial", &Forward<&Ops::mla_decode_partial>::call);
  m.impl("merge_partials", &Forward<&Ops::merge_partials>::call);
  m.impl("correct_partial", &Forward<&Ops::correct_partial>::call);
  m.impl("pack_exchange", &Forward<&Ops::pack_exchange>::call);
  m.impl("merge_exchange", &Forward<&Ops::merge_exchange>::call);
  m.impl("write_kv", &Forward<&Ops::write_kv>::call);
}

#ifdef DCP_OPS_WITH_CUDA
TORCH_LIBRARY_IMPL(dcp_ops, CUDA, m) {
  m.impl("gqa_decode_partial", &dcp_ops::gqa_decode_partial_cuda);
  m.impl("mla_decode_partial", &dcp_ops::mla_decode_partial_cuda);
  m.impl("merge_partials", &dcp_ops::merge_partials_cuda);
  m.impl("correct_partial", &dcp_ops::correct_partial_cuda);
  m.impl("pack_exchange", &dcp_ops::pack_exchange_cuda);
  m.impl("merge_exchange", &dcp_ops::merge_exchange_cuda);
  m.impl("write_kv", &dcp_ops::write_kv_cuda);
}
#endif
