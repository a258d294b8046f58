// Op schemas and backend registrations. Schemas are the stable public surface (tests/test_schema.py pins them).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(dcp_ops, m) {
  m.def("gqa_decode_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, *, str precision=\"native\") -> (Tensor out, Tensor lse)");
  m.def("mla_decode_partial(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, Tensor? w_uk=None, Tensor? w_uv=None, *, str precision=\"native\") "
        "-> (Tensor out, Tensor lse)");
  m.def("merge_partials(Tensor outs, Tensor lses, float lse_base=2.718281828459045) -> (Tensor out, Tensor lse)");
  m.def("correct_partial(Tensor(a!) out, Tensor lses, int rank, float lse_base=2.718281828459045) -> Tensor");
  m.def("pack_exchange(Tensor out, Tensor lse, Tensor(a!) send) -> ()");
  m.def("merge_exchange(Tensor recv, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("write_kv(Tensor(a!) cache, Tensor new, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(dcp_ops, CPU, m) {
  m.impl("gqa_decode_partial", &dcp_ops::gqa_decode_partial_cpu);
  m.impl("mla_decode_partial", &dcp_ops::mla_decode_partial_cpu);
  m.impl("merge_partials", &dcp_ops::merge_partials_cpu);
  m.impl("correct_partial", &dcp_ops::correct_partial_cpu);
  m.impl("pack_exchange", &dcp_ops::pack_exchange_cpu);
  m.impl("merge_exchange", &dcp_ops::merge_exchange_cpu);
  m.impl("write_kv", &dcp_ops::write_kv_cpu);
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
