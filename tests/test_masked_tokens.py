"""Masked tokens in multi-token decode (docs/design.md §2 "masked tokens"): a token past a row's causal length never
reaches that row, whatever it holds, rows that share a tile included. On tensor cores the query tokens of a sequence
share each P.V product (16 rows of an A tile x 16 tokens), and a masked token's P = 0 does not keep its V out
(0 x NaN is NaN), so the kernels mask V per query token where a tile's rows disagree on a token.

Each sequence is queried by its last n tokens (causal); its last n - 1 positions, masked for its first query token
and attended by its last, get NaN, +inf and -inf in K and V (MLA: the latent and rope parts of the one KV row). The
rows that mask all of them must be bitwise what the same call gives with the finite values there; every row must get
NaN where the float64 reference has NaN, an infinity (or NaN: precision "fp32" splits P, and a zero lower term times
an infinite V is NaN) where it has one, and a finite value where it is finite. The CUDA sources under the SIMT
executor: GQA d64 on the mma.sync kernel, MLA 256 + 64 on the tiled kernel (native; 64- and 32-token tiles) and on
the split-term one (fp32), on bf16, fp16 and float8_e4m3fn caches (which hold no infinities: NaN, the byte 0x7F,
only). Head counts whose rows straddle 16-row tiles: GQA 8 query heads per KV head x 2 tokens and 3 x 5; MLA 16 heads x
2 tokens, 5 x 3 and 24 x 2."""
import pytest
import torch

from dcp_ops import reference as ref
from conftest import paged_cache
from tolerances import LSE_TOL, assert_decode, assert_native_bound, tol_for

NAN, INF = float("nan"), float("inf")
FP8 = torch.float8_e4m3fn
I32 = torch.int32
CACHES = [torch.bfloat16, torch.float16, FP8]


def _name(x):
    return str(x).replace("torch.", "")


def _store(x32, dtype, scale):
    """An fp32 cache as `dtype`; float8_e4m3fn stores x / scale (NaN slots stay NaN)."""
    return torch.clamp(x32 / scale, -448.0, 448.0).to(FP8) if dtype == FP8 else x32.to(dtype)


def _queries(lens, n):
    """Each sequence's last n positions as queries: (seq_lens [T] = position + 1, cu_seqlens_q [B + 1], masking [T]:
    the first query token of each sequence, which masks every poisoned position of its sequence)."""
    positions = torch.cat([torch.arange(length - n, length) for length in lens])
    cu = torch.arange(0, n * len(lens) + 1, n, dtype=I32)
    return (positions + 1).to(I32), cu, (torch.arange(n * len(lens)) % n) == 0


def _spots(lens, n, table, block_size):
    """The poisoned tokens: the last n - 1 positions of each sequence, as (cache slot (block, offset), index i among
    its sequence's, whether it is the sequence's last position)."""
    out = []
    for b, length in enumerate(lens):
        for i, pos in enumerate(range(length - n + 1, length)):
            out.append(((int(table[b, pos // block_size]), pos % block_size), i, pos == length - 1))
    return out


def _set(cache, where, value):
    """cache[where] = value; in a float8_e4m3fn cache every poison is NaN, the byte 0x7F."""
    if cache.dtype == FP8:
        cache.view(torch.uint8)[where] = 0x7F
    else:
        cache[where] = value


def _poison_dims(cache, spots):
    """NaN, +inf and -inf in dims 4i + 1, + 2, + 3 of poisoned token i (of every KV head; MLA: of the latent, so in a
    key and a value): each token's own dims, so a row that attends one poisoned token and masks another shows which
    reached it."""
    cache = cache.clone()
    for slot, i, _ in spots:
        for d, x in zip(range(4 * i + 1, 4 * i + 4), (NAN, INF, -INF)):
            _set(cache, (*slot, ..., d), x)
    return cache


def _poison_scores(cache, spots, dim, last_values):
    """Key dim `dim` (where every query is positive): -inf at each sequence's earlier poisoned positions (a score of
    -inf: weight 0 for the rows that attend them), last_values[h] at its last one for KV head h (+inf: a +inf score;
    NaN: a NaN score). Never a NaN and a +inf score in one row, whose LSE the reference and the kernels read apart."""
    cache = cache.clone()
    for slot, _, last in spots:
        for h, x in enumerate(last_values):
            _set(cache, (*slot, h, dim) if cache.dim() == 4 else (*slot, dim), x if last else -INF)
    return cache


def _check(got, clean, want, masking, what, dtype, native=None, values_only=False):
    """got: (out, lse) of a call with poisoned tokens; clean: the same call with their finite values; want: the float64
    reference of the poisoned call, native: its same-precision reference (precision "native"; None: "fp32"), whose
    bound (or, for "fp32", the table's rows for dtype) holds the finite elements. masking: the query tokens whose
    rows mask every poisoned token. values_only: only V is poisoned (GQA), so the scores are the clean call's and
    every finite element must be too."""
    out, lse = got[0].double(), got[1].double()
    c_out, c_lse = clean[0].double(), clean[1].double()
    r_out, r_lse = want
    assert torch.isfinite(out[masking]).all() and torch.isfinite(lse[masking]).all(), \
        f"{what}: a masked token's non-finite value reached a row that masks it"
    assert torch.equal(out[masking], c_out[masking]) and torch.equal(lse[masking], c_lse[masking]), \
        f"{what}: the rows that mask the poisoned tokens changed"
    nan = torch.isnan(r_out)
    assert torch.isnan(out[nan]).all(), \
        f"{what}: out is not NaN where the reference is: {(nan & ~torch.isnan(out)).nonzero()[:4].tolist()}"
    inf = torch.isinf(r_out)
    assert not torch.isfinite(out[inf]).any(), f"{what}: out is finite where the reference is infinite"
    both = inf & torch.isinf(out)
    assert torch.equal(out[both], r_out[both]), f"{what}: an infinity of the wrong sign"
    fin = torch.isfinite(r_out)
    assert torch.isfinite(out[fin]).all(), \
        f"{what}: out is not finite where the reference is: {(fin & ~torch.isfinite(out)).nonzero()[:4].tolist()}"
    assert torch.equal(torch.isnan(lse), torch.isnan(r_lse)), f"{what}: lse NaN {lse.tolist()} vs {r_lse.tolist()}"
    linf = torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), linf) and torch.equal(lse[linf], r_lse[linf]), \
        f"{what}: lse infinities {lse.tolist()} vs {r_lse.tolist()}"
    if values_only:
        assert torch.equal(out[fin], c_out[fin]) and torch.equal(lse, c_lse), \
            f"{what}: a finite element differs from the clean call's"
    lfin = torch.isfinite(r_lse)
    if native is not None:
        assert_native_bound(out[fin], lse[lfin], (r_out[fin], r_lse[lfin]), (native[0][fin], native[1][lfin]), what)
    else:
        torch.testing.assert_close(out[fin], r_out[fin], msg=lambda m: f"{what}: out {m}", **tol_for(dtype, r_out[fin]))
        torch.testing.assert_close(lse[lfin], r_lse[lfin], msg=lambda m: f"{what}: lse {m}", **LSE_TOL)


GQA_SHAPES = [  # (query heads per KV head, query tokens per sequence, lengths): 2 KV heads of d64, blocks of 16
    (8, 2, [66, 19]),  # a 16-row tile of 2 tokens x 8 heads
    (3, 5, [66, 21]),  # 15 rows of 5 tokens x 3 heads; the poisons straddle the steps of tokens 48.. and 64..
]


@pytest.mark.simt
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("cache_dtype", CACHES, ids=_name)
@pytest.mark.parametrize("G,n,lens", GQA_SHAPES, ids=["8x2", "3x5"])
def test_gqa_masked_tokens_never_reach_a_row(simt_ops, G, n, lens, cache_dtype, precision):
    gen = torch.Generator().manual_seed(100 * G + n)
    k32, table = paged_cache(lens, 16, (2, 64), torch.float32, gen)
    v32 = torch.where(torch.isnan(k32), k32, torch.randn(k32.shape, generator=gen))
    scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.5])) if cache_dtype == FP8 else {}
    k = _store(k32, cache_dtype, 0.05)
    v = _store(v32, cache_dtype, 0.5)
    seq_lens, cu, masking = _queries(lens, n)
    dtype = torch.bfloat16 if cache_dtype == FP8 else cache_dtype  # the query's
    q = torch.randn(len(seq_lens), 2 * G, 64, generator=gen)
    q[..., 0] = q[..., 0].abs() + 0.5  # a -inf / +inf in key dim 0 scores -inf / +inf for every head
    q = q.to(dtype)
    spots = _spots(lens, n, table, 16)

    def call(kc, vc):
        return simt_ops.gqa_decode_partial(q, kc, vc, table, seq_lens, 0.125, precision=precision, cu_seqlens_q=cu,
                                           **scales)

    what = f"GQA {G}q/kv x {n} tokens, {_name(cache_dtype)} cache, {precision}"
    clean = call(k, v)
    assert_decode(*clean, ref.gqa_decode_partial, (q, k, v, table, seq_lens, 0.125), dtype, precision, what,
                  cu_seqlens_q=cu, **scales)
    for variant, (kp, vp) in (("values", (k, _poison_dims(v, spots))),
                              ("keys", (_poison_scores(k, spots, 0, (NAN, INF)), v))):
        args = (q, kp, vp, table, seq_lens, 0.125)
        want = ref.gqa_decode_partial(*args, cu_seqlens_q=cu, **scales)
        native = ref.gqa_decode_partial(*args, cu_seqlens_q=cu, round_to=dtype, **scales) if precision == "native" \
            else None
        _check(call(kp, vp), clean, want, masking, f"{what}, poisoned {variant}", dtype, native,
               values_only=variant == "values")


MLA_SHAPES = [  # (heads, query tokens per sequence, lengths, block size): latent 256 + rope 64
    (16, 2, [66, 18], 64),  # tiled: row groups of one token each, the first one's all masking token 65
    (5, 3, [50, 19], 16),  # 15 rows of 3 tokens: one row group (tiled), one 16-row tile (mma.sync)
    (24, 2, [41, 17], 64),  # a token's heads straddle row groups 0 / 1 (tiled), tiles 0 / 1 (mma.sync)
    (2, 6, [45, 21], 16),  # 5 poisoned tokens: the wgmma kernel's second warpgroup cleans the fifth one's values
]
# (cache, precision, DCP_SIMT_SMEM_OPTIN): native on the tiled kernel with 64-token tiles, and with 32 (too little
# shared memory for 64 at 256 + 64, as an A100 at 512 + 64; bf16 and fp8); fp32 on the split-term kernel
MLA_PATHS = [pytest.param(c, p, o, id=f"{_name(c)}-{i}") for c in CACHES
             for p, o, i in (("native", None, "native-bn64"), ("native", 100000, "native-bn32"), ("fp32", None, "fp32"))
             if not (o is not None and c == torch.float16)]


@pytest.mark.simt
@pytest.mark.parametrize("cache_dtype,precision,optin", MLA_PATHS)
@pytest.mark.parametrize("H,n,lens,block_size", MLA_SHAPES, ids=["16x2", "5x3", "24x2", "2x6"])
def test_mla_masked_tokens_never_reach_a_row(simt_ops, monkeypatch, H, n, lens, block_size, cache_dtype, precision,
                                             optin):
    if optin is not None:
        monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(10 * H + n)
    kv32, table = paged_cache(lens, block_size, (256 + 64,), torch.float32, gen)
    scales = dict(kv_scale=torch.tensor([0.01])) if cache_dtype == FP8 else {}
    kv = _store(kv32 * 2, cache_dtype, 0.01)
    seq_lens, cu, masking = _queries(lens, n)
    dtype = torch.bfloat16 if cache_dtype == FP8 else cache_dtype
    T = len(seq_lens)
    q_nope = torch.randn(T, H, 256, generator=gen).to(dtype)
    q_pe = torch.randn(T, H, 64, generator=gen)
    q_pe[..., 0] = q_pe[..., 0].abs() + 0.5  # a -inf / +inf in rope dim 0 scores -inf / +inf for every head
    q_pe = q_pe.to(dtype)
    spots = _spots(lens, n, table, block_size)
    scale = 320 ** -0.5

    def call(cache, q=q_nope):
        return simt_ops.mla_decode_partial(q, q_pe, cache, table, seq_lens, scale, precision=precision,
                                           cu_seqlens_q=cu, **scales)

    what = f"MLA {H} heads x {n} tokens, {_name(cache_dtype)} cache, {precision} (optin {optin})"
    clean = call(kv)
    assert_decode(*clean, ref.mla_decode_partial, (q_nope, q_pe, kv, table, seq_lens, scale), dtype, precision, what,
                  cu_seqlens_q=cu, **scales)
    for variant, kvp in (("latent", _poison_dims(kv, spots)), ("rope", _poison_scores(kv, spots, 256, (INF,)))):
        args = (q_nope, q_pe, kvp, table, seq_lens, scale)
        want = ref.mla_decode_partial(*args, cu_seqlens_q=cu, **scales)
        native = ref.mla_decode_partial(*args, cu_seqlens_q=cu, round_to=dtype, **scales) if precision == "native" \
            else None
        _check(call(kvp), clean, want, masking, f"{what}, poisoned {variant}", dtype, native)
    # A -inf score on an infinite value: +inf in latent dim 4 i + 2 of poisoned token i, where every query is negative,
    # so the rows that attend the token give it weight 0 and 0 x inf = NaN in that column (the reference's), while the
    # rows that mask it get nothing of it (a kernel that zeroes masked values must still let these through).
    dims = [4 * i + 2 for _, i, _ in spots]
    q_neg = q_nope.clone()
    q_neg[..., dims] = -(q_neg[..., dims].float().abs() + 0.5).to(q_neg.dtype)
    kvp = kv.clone()
    for slot, i, _ in spots:
        _set(kvp, (*slot, 4 * i + 2), INF)
    args = (q_neg, q_pe, kvp, table, seq_lens, scale)
    want = ref.mla_decode_partial(*args, cu_seqlens_q=cu, **scales)
    native = ref.mla_decode_partial(*args, cu_seqlens_q=cu, round_to=dtype, **scales) if precision == "native" \
        else None
    _check(call(kvp, q_neg), call(kv, q_neg), want, masking, f"{what}, a -inf score on +inf", dtype, native)
