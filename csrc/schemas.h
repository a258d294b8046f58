// The op schemas, the stable public surface (tests/test_opcheck.py pins them): registered by csrc/ops.cpp for
// torch.ops.dcp_ops and, with the CUDA launchers, by tests/simt/simt_ops.cpp for torch.ops.dcp_ops_simt.
#pragma once

namespace dcp_ops::schema {

constexpr const char* kGqaDecodePartial =
    "gqa_decode_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float scale, "
    "*, str precision=\"native\", Tensor? cu_seqlens_q=None, Tensor? k_scale=None, Tensor? v_scale=None) "
    "-> (Tensor out, Tensor lse)";
constexpr const char* kMlaDecodePartial =
    "mla_decode_partial(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
    "float scale, Tensor? w_uk=None, Tensor? w_uv=None, *, str precision=\"native\", Tensor? cu_seqlens_q=None, "
    "Tensor? kv_scale=None) -> (Tensor out, Tensor lse)";
constexpr const char* kMergePartials =
    "merge_partials(Tensor outs, Tensor lses, float lse_base=2.718281828459045, str nonfinite_lse=\"empty\") "
    "-> (Tensor out, Tensor lse)";
constexpr const char* kCorrectPartial =
    "correct_partial(Tensor(a!) out, Tensor lses, int rank, float lse_base=2.718281828459045, "
    "str nonfinite_lse=\"empty\") -> Tensor";
constexpr const char* kPackExchange = "pack_exchange(Tensor out, Tensor lse, Tensor(a!) send) -> ()";
constexpr const char* kMergeExchange =
    "merge_exchange(Tensor recv, Tensor(a!) out, Tensor(b!) lse, str nonfinite_lse=\"empty\") -> ()";
constexpr const char* kWriteKv =
    "write_kv(Tensor(a!) cache, Tensor new, Tensor slot_mapping, Tensor? scale=None) -> ()";

}  // namespace dcp_ops::schema
