"""Every op rejects bad input with a message naming the op, the argument, the expectation and what came."""
import pytest
import torch

import dcp_ops

I32 = torch.int32


def gqa_args(**over):
    a = dict(q=torch.randn(2, 8, 64), k_cache=torch.randn(4, 16, 2, 64), v_cache=torch.randn(4, 16, 2, 64),
             block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), seq_lens=torch.tensor([20, 32], dtype=I32),
             scale=0.125)
    a.update(over)
    return a


GQA_BAD = [
    (dict(q=torch.randn(2, 8)), r"gqa_decode_partial: q must be 3-D \[T, H_q, D\], got shape \[2, 8\]"),
    (dict(q=torch.randn(2, 8, 64).double()), "q must be float32, bfloat16 or float16, got Double"),
    (dict(k_cache=torch.randn(4, 16, 2, 64).half()), "k_cache must have dtype Float, got Half"),
    (dict(v_cache=torch.randn(4, 16, 2, 32)), "v_cache must have the shape of k_cache"),
    (dict(k_cache=torch.randn(4, 16, 2, 32), v_cache=torch.randn(4, 16, 2, 32)), r"k_cache.shape\[3\] \(head dim"),
    (dict(q=torch.randn(2, 7, 64)), r"q heads \(7\) must be a multiple of the cache's KV heads \(2\)"),
    (dict(block_table=torch.tensor([[0, 1], [2, 3]])), "block_table must have dtype Int, got Long"),
    (dict(seq_lens=torch.tensor([20, 32])), "seq_lens must have dtype Int, got Long"),
    (dict(seq_lens=torch.tensor([20], dtype=I32)), r"seq_lens.shape\[0\] \(batch"),
    (dict(seq_lens=torch.tensor([20, 33], dtype=I32)), r"seq_lens\[1\] = 33 must be in \[0, max_blocks \* block_size = 32\]"),
    (dict(seq_lens=torch.tensor([-1, 3], dtype=I32)), r"seq_lens\[0\] = -1"),
    (dict(block_table=torch.tensor([[0, 9], [2, 3]], dtype=I32)), r"block_table\[0, 1\] = 9 is outside the cache's \[0, num_blocks = 4\)"),
    (dict(block_table=torch.tensor([[0, -1], [2, 3]], dtype=I32)), r"block_table\[0, 1\] = -1"),
    (dict(q=torch.randn(2, 64, 8).transpose(1, 2)), "q must have a contiguous last dimension"),
    (dict(scale=0.0), "scale must be a finite positive number, got 0"),
    (dict(scale=float("nan")), "scale must be a finite positive number"),
    (dict(k_cache=torch.randn(4, 0, 2, 64), v_cache=torch.randn(4, 0, 2, 64)), "block_size .* must be positive"),
]


@pytest.mark.parametrize("over,msg", GQA_BAD)
def test_gqa_rejects(over, msg):
    with pytest.raises(RuntimeError, match=msg):
        dcp_ops.gqa_decode_partial(**gqa_args(**over))


def test_gqa_unused_table_entries_are_not_checked():
    # ids past a sequence's last block are padding: never read, so never rejected
    out, _ = dcp_ops.gqa_decode_partial(**gqa_args(block_table=torch.tensor([[0, 99], [2, 3]], dtype=I32),
                                                   seq_lens=torch.tensor([16, 32], dtype=I32)))
    assert torch.isfinite(out).all()


def mla_args(**over):
    a = dict(q_nope=torch.randn(2, 4, 32), q_pe=torch.randn(2, 4, 16), kv_cache=torch.randn(3, 8, 48),
             block_table=torch.tensor([[0, 1], [2, 0]], dtype=I32), seq_lens=torch.tensor([9, 3], dtype=I32),
             scale=0.1, w_uk=None, w_uv=None)
    a.update(over)
    return a


MLA_BAD = [
    (dict(q_nope=torch.randn(2, 4, 30)), r"q_nope.shape\[2\] .*D_latent.* must be 32, got 30"),
    (dict(q_pe=torch.randn(2, 3, 16)), r"q_pe.shape\[1\] \(heads, equal to q_nope's\) must be 4, got 3"),
    (dict(kv_cache=torch.randn(3, 8, 48).half()), "kv_cache must have dtype Float, got Half"),
    (dict(q_nope=torch.randn(2, 4, 24), w_uk=torch.randn(4, 24, 31)), r"w_uk.shape\[2\] \(D_latent"),
    (dict(q_nope=torch.randn(2, 4, 24), w_uk=torch.randn(3, 24, 32)), r"w_uk.shape\[0\] \(heads"),
    (dict(w_uv=torch.randn(4, 31, 8)), r"w_uv.shape\[1\] \(D_latent"),
    (dict(w_uv=torch.randn(4, 32)), r"w_uv must be 3-D \[H, D_latent, D_v\]"),
    (dict(block_table=torch.tensor([[0, 3], [2, 0]], dtype=I32)), r"block_table\[0, 1\] = 3 is outside"),
    (dict(seq_lens=torch.tensor([9, 17], dtype=I32)), r"seq_lens\[1\] = 17"),
]


@pytest.mark.parametrize("over,msg", MLA_BAD)
def test_mla_rejects(over, msg):
    with pytest.raises(RuntimeError, match="mla_decode_partial: " + msg):
        dcp_ops.mla_decode_partial(**mla_args(**over))


MERGE_BAD = [
    ((torch.randn(2, 3, 4), torch.randn(2, 3, 4)), r"outs must be 4-D \[N, T, H, D\]"),
    ((torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5)), r"lses.shape\[2\]"),
    ((torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4).double()), "lses must have dtype Float, got Double"),
    ((torch.randn(2, 3, 4, 8).int(), torch.randn(2, 3, 4)), "outs must be float32, bfloat16 or float16, got Int"),
    ((torch.randn(2, 3, 8, 4).transpose(-1, -2), torch.randn(2, 3, 4)), "outs must have a contiguous last dim"),
]


@pytest.mark.parametrize("args,msg", MERGE_BAD)
def test_merge_rejects(args, msg):
    with pytest.raises(RuntimeError, match="merge_partials: " + msg):
        dcp_ops.merge_partials(*args)


def test_merge_rejects_bad_base():
    with pytest.raises(RuntimeError, match="lse_base must be e or 2"):
        dcp_ops.merge_partials(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1), lse_base=1.0)


def test_correct_partial_rejects():
    with pytest.raises(RuntimeError, match=r"correct_partial: rank must be in \[0, N = 2\), got 2"):
        dcp_ops.correct_partial(torch.randn(3, 4, 8), torch.randn(2, 3, 4), 2)
    with pytest.raises(RuntimeError, match=r"correct_partial: lses.shape\[1\]"):
        dcp_ops.correct_partial(torch.randn(3, 4, 8), torch.randn(2, 2, 4), 0)


def test_exchange_rejects():
    with pytest.raises(ValueError, match=r"pack_exchange: out heads \(6\) must divide into world_size = 4"):
        dcp_ops.pack_exchange(torch.randn(2, 6, 8), torch.randn(2, 6), 4)
    with pytest.raises(RuntimeError, match=r"pack_exchange: send.shape\[3\] \(D \+ pad"):
        dcp_ops.pack_exchange(torch.randn(2, 6, 8), torch.randn(2, 6), 3, send=torch.empty(3, 2, 2, 9))
    with pytest.raises(RuntimeError, match="merge_exchange: recv last dim must be D"):
        dcp_ops.merge_exchange(torch.empty(2, 1, 1, 4), out=torch.empty(1, 1, 0), lse=torch.empty(1, 1))
    with pytest.raises(RuntimeError, match="merge_exchange: lse must have dtype Float"):
        dcp_ops.merge_exchange(torch.empty(2, 1, 1, 12), out=torch.empty(1, 1, 8), lse=torch.empty(1, 1).double())


WRITE_BAD = [
    ((torch.zeros(4, 8), torch.zeros(2), torch.zeros(2, dtype=I32)), "cache must be .*at least 3-D"),
    ((torch.zeros(4, 8, 16), torch.zeros(2, 15), torch.zeros(2, dtype=I32)), r"new must be \[T, \*E\]"),
    ((torch.zeros(4, 8, 16), torch.zeros(2, 16).half(), torch.zeros(2, dtype=I32)), "new must have dtype Float"),
    ((torch.zeros(4, 8, 16), torch.zeros(2, 16), torch.zeros(3, dtype=I32)), r"slot_mapping.shape\[0\]"),
    ((torch.zeros(4, 8, 16), torch.zeros(2, 16), torch.zeros(2)), "slot_mapping must have dtype int32"),
    ((torch.zeros(4, 8, 32)[..., ::2], torch.zeros(2, 16), torch.zeros(2, dtype=I32)), "cache must be dense"),
]


@pytest.mark.parametrize("args,msg", WRITE_BAD)
def test_write_kv_rejects(args, msg):
    with pytest.raises(RuntimeError, match="write_kv: " + msg):
        dcp_ops.write_kv(*args)


def _on_meta(args, name):
    return {k: (v.to("meta") if k == name else v) for k, v in args.items()}


# One argument on another device than the rest. Without a GPU the other device is meta, whose kernel (the fake one)
# then runs instead of the CPU one: it must refuse, not return empty outputs.
DEVICE_CASES = (
    [("gqa_decode_partial", gqa_args(), name) for name in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
    + [("mla_decode_partial", mla_args(w_uk=torch.randn(4, 32, 32), q_nope=torch.randn(2, 4, 32),
                                       w_uv=torch.randn(4, 32, 8)), name)
       for name in ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "w_uk", "w_uv")]
    + [("merge_partials", dict(outs=torch.randn(2, 3, 4, 8), lses=torch.randn(2, 3, 4)), name)
       for name in ("outs", "lses")]
    + [("correct_partial", dict(out=torch.randn(3, 4, 8), lses=torch.randn(2, 3, 4), rank=0), name)
       for name in ("out", "lses")]
    + [("pack_exchange", dict(out=torch.randn(2, 4, 8), lse=torch.randn(2, 4), world_size=2,
                              send=torch.empty(2, 2, 2, 12)), name) for name in ("out", "lse", "send")]
    + [("merge_exchange", dict(recv=torch.randn(2, 1, 2, 12), out=torch.empty(1, 2, 8), lse=torch.empty(1, 2)), name)
       for name in ("recv", "out", "lse")]
    + [("write_kv", dict(cache=torch.zeros(4, 8, 16), new=torch.zeros(2, 16),
                         slot_mapping=torch.tensor([1, -1], dtype=I32)), name)
       for name in ("cache", "new", "slot_mapping")]
)


@pytest.mark.parametrize("op,args,name", DEVICE_CASES, ids=[f"{op}-{name}" for op, _, name in DEVICE_CASES])
def test_mixed_devices_rejected(op, args, name):
    with pytest.raises(RuntimeError, match=f"{op}: .* must be on the same device as .*got (meta|cpu)"):
        getattr(dcp_ops, op)(**_on_meta(args, name))


@pytest.mark.parametrize("precision", ["bf16", ""])
def test_precision_is_refused_by_name(precision):
    """One check of the value, in the native op: the wrapper and the op itself refuse it alike."""
    want = rf"precision must be one of \('native', 'fp32'\), got '{precision}'"
    with pytest.raises(ValueError, match="gqa_decode_partial: " + want):
        dcp_ops.gqa_decode_partial(**gqa_args(), precision=precision)
    with pytest.raises(ValueError, match="mla_decode_partial: " + want):
        dcp_ops.mla_decode_partial(**mla_args(), precision=precision)
    with pytest.raises(ValueError, match="gqa_decode_partial: " + want):
        torch.ops.dcp_ops.gqa_decode_partial(*gqa_args().values(), precision=precision)


def test_precision_must_be_a_string():
    with pytest.raises(TypeError, match="gqa_decode_partial: precision must be a str, got int 32"):
        dcp_ops.gqa_decode_partial(**gqa_args(), precision=32)
    with pytest.raises(TypeError, match="mla_decode_partial: precision must be a str, got NoneType"):
        dcp_ops.mla_decode_partial(**mla_args(), precision=None)


WRAPPER_BAD = [  # the Python wrappers' own checks: each names its argument
    (lambda: dcp_ops.gqa_decode_partial(**gqa_args(scale="0.1")), TypeError,
     "gqa_decode_partial: scale must be a real number, got str"),
    (lambda: dcp_ops.gqa_decode_partial(**gqa_args(scale=None)), TypeError, "gqa_decode_partial: scale must be a real"),
    (lambda: dcp_ops.mla_decode_partial(**mla_args(scale=True)), TypeError, "mla_decode_partial: scale must be a real"),
    (lambda: dcp_ops.merge_partials(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1), lse_base="e"), TypeError,
     "merge_partials: lse_base must be a real number"),
    (lambda: dcp_ops.correct_partial(torch.randn(1, 1, 8), torch.randn(2, 1, 1), 1.0), TypeError,
     "correct_partial: rank must be an int, got float"),
    (lambda: dcp_ops.correct_partial(torch.randn(1, 1, 8), torch.randn(2, 1, 1), 0, lse_base=None), TypeError,
     "correct_partial: lse_base must be a real number"),
    (lambda: dcp_ops.pack_exchange(torch.randn(2, 4), torch.randn(2, 4), 2), ValueError,
     r"pack_exchange: out must be 3-D \[T, H, D\], got shape \[2, 4\]"),
    (lambda: dcp_ops.pack_exchange(torch.randn(1, 4, 8), torch.randn(1, 4), 2.0), TypeError,
     "pack_exchange: world_size must be an int, got float"),
    (lambda: dcp_ops.pack_exchange(torch.randn(1, 4, 8), torch.randn(1, 4), 4, send=torch.empty(2, 1, 2, 12)),
     ValueError, r"pack_exchange: send.shape\[0\] must be world_size = 4, got 2"),
    (lambda: dcp_ops.pack_exchange(torch.randn(1, 4, 8), torch.randn(1, 4), 3), ValueError,
     r"pack_exchange: out heads \(4\) must divide into world_size = 3 ranks"),
    (lambda: dcp_ops.merge_exchange(torch.randn(2, 1, 12)), ValueError, "merge_exchange: recv must be 4-D"),
    (lambda: dcp_ops.merge_exchange(torch.randn(2, 1, 1, 4)), ValueError,
     "merge_exchange: recv must be a float tensor whose rows hold D > 0 elements and the pad"),
    (lambda: dcp_ops.merge_exchange([1, 2]), TypeError, "merge_exchange: recv must be a tensor"),
    (lambda: dcp_ops.dcp_attention(torch.randn(1, 2, 8), None, workspace={}), TypeError,
     "dcp_attention: workspace must be a dcp_ops.Workspace or None, got dict"),
    (lambda: dcp_ops.dcp_attention([[1.0]], None), ValueError, "dcp_attention: q must be a 3-D tensor"),
    (lambda: dcp_ops.owner_rank(torch.arange(4), 2.0), TypeError, "owner_rank: world_size must be an int, got float"),
    (lambda: dcp_ops.local_seq_lens(torch.arange(4), 2, 0.5), TypeError, "local_seq_lens: rank must be an int"),
    (lambda: dcp_ops.slot_mapping(torch.zeros(1, 2, dtype=I32), torch.zeros(1, dtype=I32), torch.zeros(1, dtype=I32),
                                  16.0, 2, 0), TypeError, "slot_mapping: block_size must be an int"),
]


@pytest.mark.parametrize("call,exc,msg", WRAPPER_BAD)
def test_wrappers_name_the_bad_argument(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.simt
def test_cuda_alignment_refusals_name_the_cache(simt_ops):
    k = torch.randn(4, 16, 2, 64)
    v = torch.randn(4 * 16 * 2 * 64 + 1)[1:].view(4, 16, 2, 64)  # 4 bytes past a 16-byte boundary
    args = (torch.randn(2, 8, 64), k, v, torch.tensor([[0, 1], [2, 3]], dtype=I32), torch.tensor([20, 32], dtype=I32),
            0.125)
    with pytest.raises(RuntimeError, match="gqa_decode_partial: on CUDA the rows of v_cache must be 16-byte aligned"):
        simt_ops.gqa_decode_partial(*args)
    kv = torch.randn(3 * 8 * 192 + 2)[2:].view(3, 8, 192)  # 8 bytes past
    with pytest.raises(RuntimeError, match="mla_decode_partial: on CUDA the rows of kv_cache must be 16-byte aligned"):
        simt_ops.mla_decode_partial(torch.randn(2, 4, 128), torch.randn(2, 4, 64), kv,
                                    torch.tensor([[0, 1], [2, 0]], dtype=I32), torch.tensor([9, 3], dtype=I32), 0.1)
