"""The non-finite contract (docs/design.md §2) on every op, on the CPU kernels and on the CUDA sources under the SIMT
executor, against the float64 reference: a NaN score poisons its row (out and lse NaN); a -inf score is a token of
weight 0, and a row of only -inf scores is empty (lse -inf, out 0); a +inf score gives what the reference gives (lse
+inf, out NaN). The merges read NaN and +inf LSE as empty partials by default and let them through with
nonfinite_lse="propagate". Zero-size dimensions never crash; outputs written in place must not overlap themselves."""
import math

import pytest
import torch

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn
from tolerances import LSE_TOL, assert_native_bound, tol_for

NAN, INF = float("nan"), float("inf")


def assert_same_nonfinite(out, lse, r_out, r_lse, dtype, what, native=None):
    """NaN exactly where the reference has NaN, infinite LSE exactly where it has one (with its sign), and the
    finite values within the table's bound; native: the same-precision reference's (out, lse) (reference.py's
    round_to), for precision="native", whose finite values are held to assert_native's bound (assert_native_bound)."""
    out, lse = out.double(), lse.double()
    assert out.shape == r_out.shape and lse.shape == r_lse.shape, what
    for name, a, b in (("out", out, r_out), ("lse", lse, r_lse)):
        bad = torch.isnan(a) != torch.isnan(b)
        assert not bad.any(), f"{what}: {name} NaN at {bad.nonzero()[:4].tolist()} differs from the reference"
    inf = torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), inf) and torch.equal(lse[inf], r_lse[inf]), \
        f"{what}: lse {lse.tolist()} against {r_lse.tolist()}"
    fin = torch.isfinite(r_out)
    assert torch.equal(torch.isfinite(out), fin), f"{what}: out's infinities differ from the reference"
    lfin = torch.isfinite(r_lse)
    if native is None:
        torch.testing.assert_close(out[fin], r_out[fin], msg=lambda m: f"{what}: out {m}",
                                   **tol_for(dtype, r_out[fin]))
        torch.testing.assert_close(lse[lfin], r_lse[lfin], msg=lambda m: f"{what}: lse {m}", **LSE_TOL)
        return
    assert_native_bound(out[fin], lse[lfin], (r_out[fin], r_lse[lfin]), (native[0][fin], native[1][lfin]), what)


# Poisons of a case: (description, function of (q, k, v, slot, lens) that writes non-finite values in place). slot(t,
# j) is the cache index of token j of sequence t. q[..., 0] > 0 for every head, so a key with -inf in dim 0 scores -inf
# against every head of its KV head (GQA), or, in dim `rope0` of the rope part, against every head (MLA).
def _neg_inf_tokens(tokens):
    def poison(q, k, v, slot, lens, d0):
        for j in tokens(lens[0]):
            k[slot(0, j)][..., d0] = -INF
    return poison


def _neg_inf_query_on_positive_keys(q, k, v, slot, lens, d0):
    """Every key's element d0 made positive and query (1, 2)'s -inf there: each of the row's scores is -inf (an empty
    row), while tokens a kernel does not read (past the length, zero-filled) must stay out of it (0 x -inf is NaN).
    Where the query is pre-absorption (narrower than d0) only the keys change."""
    k[..., d0] = k[..., d0].abs() + 0.5
    if d0 < q.shape[-1]:
        q[1, 2, d0] = -INF


POISONS = [
    ("NaN in the query", lambda q, k, v, slot, lens, d0: q[0, 1].__setitem__(5, NAN)),
    ("-inf in the query against positive keys (an empty row)", _neg_inf_query_on_positive_keys),
    ("NaN in an attended key", lambda q, k, v, slot, lens, d0: k[slot(1, 10)].view(-1).__setitem__(3, NAN)),
    ("+inf in the query", lambda q, k, v, slot, lens, d0: q[1, 2].__setitem__(4, INF)),
    ("-inf score of the first token", _neg_inf_tokens(lambda n: [0])),
    ("-inf score of the last token", _neg_inf_tokens(lambda n: [n - 1])),
    ("-inf scores of the first 64 tokens", _neg_inf_tokens(lambda n: range(64))),
    ("-inf scores of all but the last token", _neg_inf_tokens(lambda n: range(n - 1))),
    ("-inf scores of every token (an empty row)", _neg_inf_tokens(lambda n: range(n))),
    ("-inf scores of every other token", _neg_inf_tokens(lambda n: range(0, n, 2))),
]


def gqa_case(dtype, poison, lens=(100, 33), block_size=16, hkv=2, group=4, D=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, table = paged_cache(list(lens), block_size, (hkv, D), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), hkv * group, D, dtype=dtype, gen=gen)
    q[..., 0] = q[..., 0].abs() + 0.5
    slot = lambda t, j: (int(table[t, j // block_size]), j % block_size)  # noqa: E731
    poison(q, k, v, slot, lens, 0)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32), D ** -0.5


def mla_case(dtype, poison, lens=(100, 33), block_size=16, heads=5, latent=128, rope=64, absorb=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv, table = paged_cache(list(lens), block_size, (latent + rope,), dtype, gen)
    w_uk = randn(heads, 32, latent, dtype=dtype, gen=gen, scale=32 ** -0.5) if absorb else None
    q_nope = randn(len(lens), heads, 32 if absorb else latent, dtype=dtype, gen=gen)
    q_pe = randn(len(lens), heads, rope, dtype=dtype, gen=gen)
    q_pe[..., 0] = q_pe[..., 0].abs() + 0.5
    slot = lambda t, j: (int(table[t, j // block_size]), j % block_size)  # noqa: E731
    # -inf keys in the rope part only (d0 = latent): a -inf latent element is also a value, and 0 x -inf is NaN in
    # P.V, in the reference too. The query poisons land in q_nope (pre-absorption with w_uk) or the latent query.
    q = q_nope if absorb else torch.cat([q_nope, q_pe], -1)
    poison(q, kv, None, slot, lens, latent)
    if not absorb:
        q_nope, q_pe = q[..., :latent].contiguous(), q[..., latent:].contiguous()
    return q_nope, q_pe, kv, table, torch.tensor(lens, dtype=torch.int32), (latent + rope) ** -0.5, w_uk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,poison", POISONS, ids=[p[0] for p in POISONS])
def test_gqa_nonfinite_on_cpu(dtype, what, poison):
    args = gqa_case(dtype, poison)
    out, lse = dcp_ops.gqa_decode_partial(*args)
    assert_same_nonfinite(out, lse, *ref.gqa_decode_partial(*args), dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("what,poison", POISONS, ids=[p[0] for p in POISONS])
def test_mla_nonfinite_on_cpu(dtype, absorb, what, poison):
    args = mla_case(dtype, poison, absorb=absorb)
    out, lse = dcp_ops.mla_decode_partial(*args)
    assert_same_nonfinite(out, lse, *ref.mla_decode_partial(*args), dtype, what)


def test_nan_in_w_uk_and_in_a_value_reach_the_output():
    args = list(mla_case(torch.float32, lambda *a: None, absorb=True))
    args[6] = args[6].clone()
    args[6][2, 0, 7] = NAN  # head 2's absorbed query: NaN in every token's row of head 2
    out, lse = dcp_ops.mla_decode_partial(*args)
    assert_same_nonfinite(out, lse, *ref.mla_decode_partial(*args), torch.float32, "NaN in w_uk")
    assert torch.isnan(lse[:, 2]).all() and torch.isfinite(lse[:, [0, 1, 3, 4]]).all()
    q, k, v, table, lens, scale = gqa_case(torch.float32, lambda *a: None)
    v[int(table[0, 0]), 3, 1, 9] = NAN  # sequence 0, token 3, KV head 1, dim 9: only that dim of its heads
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, lens, scale)
    assert_same_nonfinite(out, lse, *ref.gqa_decode_partial(q, k, v, table, lens, scale), torch.float32,
                          "NaN in a value")
    assert torch.isnan(out[0, 4:, 9]).all() and torch.isfinite(lse).all()


@pytest.mark.simt
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,poison", POISONS, ids=[p[0] for p in POISONS])
def test_gqa_nonfinite_cuda_source(simt_ops, dtype, precision, what, poison):
    # head dim 64, 16-bit: the tensor-core kernel; fp32: the SIMT kernel; several steps per warp and two splits.
    args = gqa_case(dtype, poison, lens=(600, 33))  # capacity 624: two KV splits
    out, lse = simt_ops.gqa_decode_partial(*args, precision=precision)
    native = precision == "native" and dtype != torch.float32
    assert_same_nonfinite(out, lse, *ref.gqa_decode_partial(*args), dtype, f"{what} ({precision})",
                          native=ref.gqa_decode_partial(*args, round_to=dtype) if native else None)


@pytest.mark.simt
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype,latent,absorb", [(torch.bfloat16, 512, True), (torch.float16, 256, False),
                                                 (torch.float32, 128, False)])
@pytest.mark.parametrize("what,poison", POISONS, ids=[p[0] for p in POISONS])
def test_mla_nonfinite_cuda_source(simt_ops, dtype, latent, absorb, precision, what, poison):
    # 16-bit latent 256 / 512: the tiled kernel (native) and the split-term one (fp32); fp32 latent 128: SIMT.
    args = mla_case(dtype, poison, lens=(200, 33), latent=latent, absorb=absorb)
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision)
    native = precision == "native" and dtype != torch.float32
    assert_same_nonfinite(out, lse, *ref.mla_decode_partial(*args), dtype, f"{what} ({precision})",
                          native=ref.mla_decode_partial(*args, round_to=dtype) if native else None)


def _lses_with_nonfinite(N, T, H, gen):
    lses = torch.randn(N, T, H, generator=gen) * 3
    lses[0, 0, 0] = NAN       # one NaN partial
    lses[1 % N, 0, 1] = INF   # one +inf partial
    lses[:, 1, 0] = -INF      # every partial empty
    lses[0, 1, 1] = NAN       # NaN beside empty ones
    return lses


@pytest.mark.parametrize("nonfinite_lse", ["empty", "propagate"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merges_nonfinite_lse(dtype, nonfinite_lse, simt_ops=None):
    _check_merges(dcp_ops.ops._ops, dtype, nonfinite_lse, "CPU")


@pytest.mark.simt
@pytest.mark.parametrize("nonfinite_lse", ["empty", "propagate"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merges_nonfinite_lse_cuda_source(simt_ops, dtype, nonfinite_lse):
    _check_merges(simt_ops, dtype, nonfinite_lse, "CUDA source")


def _check_merges(ops, dtype, nonfinite_lse, where):
    gen = torch.Generator().manual_seed(3)
    N, T, H, D = 3, 3, 2, 16
    outs = torch.randn(N, T, H, D, generator=gen).to(dtype)
    lses = _lses_with_nonfinite(N, T, H, gen)
    what = f"{where} {nonfinite_lse}"
    out, lse = ops.merge_partials(outs, lses, nonfinite_lse=nonfinite_lse)
    assert_same_nonfinite(out, lse, *ref.merge_partials(outs, lses, nonfinite_lse=nonfinite_lse), dtype,
                          f"merge_partials {what}")
    part = outs[1].clone()
    total = ops.correct_partial(part, lses, 1, nonfinite_lse=nonfinite_lse)
    r_part, r_total = ref.correct_partial(outs[1], lses, 1, nonfinite_lse=nonfinite_lse)
    assert_same_nonfinite(part, total, r_part, r_total, dtype, f"correct_partial {what}")
    pad = 16 // outs.element_size()
    recv = torch.zeros(N, T, H, D + pad, dtype=dtype)
    recv[..., :D] = outs
    recv[..., D:D + 4 // outs.element_size()] = lses.unsqueeze(-1).view(dtype)
    m_out, m_lse = torch.full((T, H, D), NAN, dtype=dtype), torch.full((T, H), NAN)
    ops.merge_exchange(recv, out=m_out, lse=m_lse, nonfinite_lse=nonfinite_lse)
    assert_same_nonfinite(m_out, m_lse, *ref.merge_exchange(outs, lses, nonfinite_lse), dtype,
                          f"merge_exchange {what}")
    if nonfinite_lse == "propagate":  # the rows the contract names
        assert torch.isnan(out[0, 0]).all() and math.isnan(lse[0, 0]) and math.isnan(lse[1, 1])
        assert torch.isnan(out[0, 1]).all() and lse[0, 1] == INF
    else:
        assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
    assert (out[1, 0] == 0).all() and lse[1, 0] == -INF


def test_merges_refuse_an_unknown_nonfinite_lse():
    outs, lses = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1)
    with pytest.raises(ValueError, match=r"merge_partials: nonfinite_lse must be one of \('empty', 'propagate'\)"):
        dcp_ops.merge_partials(outs, lses, nonfinite_lse="drop")
    with pytest.raises(ValueError, match=r"merge_partials: nonfinite_lse must be one of \('empty', 'propagate'\), "
                                         r"got 'x'"):
        torch.ops.dcp_ops.merge_partials(outs, lses, math.e, "x")
    with pytest.raises(TypeError, match="correct_partial: nonfinite_lse must be a str, got NoneType"):
        dcp_ops.correct_partial(outs[0], lses, 0, nonfinite_lse=None)
    with pytest.raises(ValueError, match="merge_exchange: nonfinite_lse"):
        dcp_ops.merge_exchange(torch.randn(2, 1, 1, 12), nonfinite_lse="Propagate")


# Zero-size dimensions: T = 0 and zero heads give empty outputs; a zero head dim is refused by name (ValueError).
@pytest.mark.parametrize("backend", ["cpu", "simt"])
def test_zero_size_dims(backend, request):
    ops = request.getfixturevalue("simt_ops") if backend == "simt" else dcp_ops.ops._ops
    k = torch.randn(3, 16, 2, 64)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32)
    out, lse = ops.gqa_decode_partial(torch.randn(2, 0, 64), k, k, table, lens, 0.1)
    assert out.shape == (2, 0, 64) and lse.shape == (2, 0)
    kv = torch.randn(3, 16, 192)
    out, lse = ops.mla_decode_partial(torch.randn(2, 0, 128), torch.randn(2, 0, 64), kv, table, lens, 0.1)
    assert out.shape == (2, 0, 128) and lse.shape == (2, 0)
    out, lse = ops.mla_decode_partial(torch.randn(0, 4, 128), torch.randn(0, 4, 64), kv, table[:0], lens[:0], 0.1)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)
    k0 = torch.randn(3, 16, 0, 64)
    with pytest.raises(ValueError, match=r"gqa_decode_partial: k_cache has 0 KV heads \(k_cache.shape\[2\]\)"):
        ops.gqa_decode_partial(torch.randn(2, 0, 64), k0, k0, table, lens, 0.1)
    z = torch.randn(3, 16, 2, 0)
    with pytest.raises(ValueError, match=r"gqa_decode_partial: q head dim \(q.shape\[2\]\) must be positive, got 0"):
        ops.gqa_decode_partial(torch.randn(2, 4, 0), z, z, table, lens, 0.1)
    with pytest.raises(ValueError, match=r"mla_decode_partial: kv_cache last dim \(64\) must exceed q_pe's rope dim"):
        ops.mla_decode_partial(torch.randn(2, 4, 0), torch.randn(2, 4, 64), torch.randn(3, 16, 64), table, lens, 0.1)
    with pytest.raises(ValueError, match=r"mla_decode_partial: q_nope's last dim \(D_nope, absorbed through w_uk\) "
                                         "must be positive, got 0"):
        ops.mla_decode_partial(torch.randn(2, 4, 0), torch.randn(2, 4, 64), kv, table, lens, 0.1,
                               torch.randn(4, 0, 128))
    out, lse = ops.mla_decode_partial(torch.randn(2, 4, 128), torch.randn(2, 4, 64), kv, table, lens, 0.1, None,
                                      torch.randn(4, 128, 0))  # D_v = 0: an empty output, lse as usual
    assert out.shape == (2, 4, 0) and torch.isfinite(lse[0]).all() and (lse[1] == -INF).all()
    for N, T, H, D in ((0, 2, 2, 8), (2, 0, 2, 8), (2, 2, 0, 8), (2, 2, 2, 0)):
        out, lse = ops.merge_partials(torch.randn(N, T, H, D), torch.randn(N, T, H), nonfinite_lse="propagate")
        assert out.shape == (T, H, D) and lse.shape == (T, H)
        if N == 0 and T * H:  # no partial at all: every row is empty
            assert (lse == -INF).all() and (out == 0).all()


@pytest.mark.parametrize("backend", ["cpu", "simt"])
def test_outputs_that_overlap_themselves_are_refused(backend, request):
    ops = request.getfixturevalue("simt_ops") if backend == "simt" else dcp_ops.ops._ops
    lses = torch.randn(2, 3, 4)
    out = torch.randn(1, 4, 8).expand(3, 4, 8)  # stride 0 over tokens
    with pytest.raises(ValueError, match="correct_partial: out is written in place and must not overlap itself"):
        ops.correct_partial(out, lses, 0, nonfinite_lse="empty")
    cache = torch.zeros(1, 4, 8).expand(2, 4, 8)
    with pytest.raises(ValueError, match="write_kv: cache is written in place and must not overlap itself"):
        ops.write_kv(cache, torch.randn(2, 8), torch.tensor([0, 5], dtype=torch.int32))
    recv = torch.randn(2, 3, 4, 8 + 4)
    with pytest.raises(ValueError, match="merge_exchange: out is written in place"):
        ops.merge_exchange(recv, out=torch.zeros(1, 4, 8).expand(3, 4, 8), lse=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="merge_exchange: lse is written in place"):
        ops.merge_exchange(recv, out=torch.zeros(3, 4, 8), lse=torch.zeros(1, 4).expand(3, 4))
