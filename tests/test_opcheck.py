"""torch.library.opcheck on every op (schema, fake kernel, dispatch), and the schema-stability pin."""
import math

import torch

import dcp_ops
from conftest import paged_cache

I32 = torch.int32


def _gqa():
    gen = torch.Generator().manual_seed(0)
    k, table = paged_cache([5, 20], 8, (2, 64), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, torch.randn_like(k))
    return (torch.randn(2, 4, 64), k, v, table, torch.tensor([5, 20], dtype=I32), 0.125)


def _mla(absorb):
    gen = torch.Generator().manual_seed(1)
    kv, table = paged_cache([7, 0], 8, (40,), torch.float32, gen)
    w_uk = torch.randn(4, 16, 32) if absorb else None
    w_uv = torch.randn(4, 32, 8) if absorb else None
    return (torch.randn(2, 4, 16 if absorb else 32), torch.randn(2, 4, 8), kv, table,
            torch.tensor([7, 0], dtype=I32), 0.1, w_uk, w_uv)


def test_opcheck_every_op():
    ops = torch.ops.dcp_ops
    torch.library.opcheck(ops.gqa_decode_partial, _gqa())
    torch.library.opcheck(ops.mla_decode_partial, _mla(False))
    torch.library.opcheck(ops.mla_decode_partial, _mla(True))
    torch.library.opcheck(ops.gqa_decode_partial, _gqa(), {"precision": "fp32"})
    torch.library.opcheck(ops.mla_decode_partial, _mla(True), {"precision": "fp32"})
    torch.library.opcheck(ops.merge_partials, (torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4), math.e))
    torch.library.opcheck(ops.merge_partials, (torch.randn(3, 2, 4, 16).bfloat16(), torch.randn(3, 2, 4), 2.0))
    torch.library.opcheck(ops.merge_partials, (torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4), math.e, "propagate"))
    torch.library.opcheck(ops.correct_partial, (torch.randn(2, 4, 16), torch.randn(3, 2, 4), 1, math.e))
    torch.library.opcheck(ops.correct_partial, (torch.randn(2, 4, 16), torch.randn(3, 2, 4), 1, math.e, "propagate"))
    torch.library.opcheck(ops.pack_exchange, (torch.randn(2, 4, 16), torch.randn(2, 4), torch.empty(2, 2, 2, 20)))
    torch.library.opcheck(ops.merge_exchange, (torch.randn(2, 3, 2, 20), torch.empty(3, 2, 16), torch.empty(3, 2)))
    torch.library.opcheck(ops.merge_exchange, (torch.randn(2, 3, 2, 20), torch.empty(3, 2, 16), torch.empty(3, 2),
                                               "propagate"))
    torch.library.opcheck(ops.write_kv, (torch.zeros(3, 4, 2, 8), torch.randn(5, 2, 8),
                                         torch.tensor([0, -1, 11, 4, 7], dtype=I32)))
    # an fp8 cache: torch's schema check compares tensors by arithmetic that float8 lacks ("mul_cpu_reduced_float"
    # not implemented), so the fake kernel and the compiled paths are checked
    torch.library.opcheck(ops.write_kv, (torch.zeros(3, 4, 2, 8).to(torch.float8_e4m3fn), torch.randn(5, 2, 8),
                                         torch.tensor([0, -1, 11, 4, 7], dtype=I32), torch.tensor([0.25])),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    # the decode ops on fp8 caches with their scales (the same two checks, for the same reason)
    q, k, v, table, lens, scale = _gqa()
    fp8 = dict(test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(ops.gqa_decode_partial, (q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), table,
                                                   lens, scale),
                          {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([2.0])}, **fp8)
    m = _mla(True)
    torch.library.opcheck(ops.mla_decode_partial, (*m[:2], m[2].to(torch.float8_e4m3fn), *m[3:]),
                          {"kv_scale": torch.tensor([0.25])}, **fp8)


def test_compiled_merge_matches_eager():
    outs, lses = torch.randn(4, 3, 2, 32), torch.randn(4, 3, 2)
    compiled = torch.compile(dcp_ops.merge_partials, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(outs, lses), dcp_ops.merge_partials(outs, lses)):
        torch.testing.assert_close(a, b)


SCHEMAS = {
    "gqa_decode_partial": "dcp_ops::gqa_decode_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
                          "Tensor seq_lens, float scale, *, str precision=\"native\", Tensor? cu_seqlens_q=None, "
                          "Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor out, Tensor lse)",
    "mla_decode_partial": "dcp_ops::mla_decode_partial(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
                          "Tensor seq_lens, float scale, Tensor? w_uk=None, Tensor? w_uv=None, *, "
                          "str precision=\"native\", Tensor? cu_seqlens_q=None, Tensor? kv_scale=None) -> "
                          "(Tensor out, Tensor lse)",
    "merge_partials": "dcp_ops::merge_partials(Tensor outs, Tensor lses, float lse_base=2.7182818284590451, "
                      "str nonfinite_lse=\"empty\") -> (Tensor out, Tensor lse)",
    "correct_partial": "dcp_ops::correct_partial(Tensor(a!) out, Tensor lses, int rank, "
                       "float lse_base=2.7182818284590451, str nonfinite_lse=\"empty\") -> Tensor",
    "pack_exchange": "dcp_ops::pack_exchange(Tensor out, Tensor lse, Tensor(a!) send) -> ()",
    "merge_exchange": "dcp_ops::merge_exchange(Tensor recv, Tensor(a!) out, Tensor(b!) lse, "
                      "str nonfinite_lse=\"empty\") -> ()",
    "write_kv": "dcp_ops::write_kv(Tensor(a!) cache, Tensor new, Tensor slot_mapping, Tensor? scale=None) -> ()",
}


def test_schemas_are_stable():
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.dcp_ops, name).default._schema) == schema, name


def test_simt_library_keeps_the_public_schemas(simt_ops):
    """torch.ops.dcp_ops_simt.* (the CUDA kernels under the SIMT executor) take exactly the public ops' arguments,
    names and defaults included, so a test calls every CUDA kernel as an engine calls the op."""
    for name, schema in SCHEMAS.items():
        assert str(getattr(simt_ops, name).default._schema) == schema.replace("dcp_ops::", "dcp_ops_simt::"), name
