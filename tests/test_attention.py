"""gqa_decode_partial and mla_decode_partial against the float64 reference on fresh random paged caches."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn, sharp_mla_case
from tolerances import assert_lse_matches, assert_matches

lens_st = st.lists(st.integers(0, 150), min_size=1, max_size=4)


@given(dtype=st.sampled_from(DTYPES), head_dim=st.sampled_from([64, 128, 256]), group=st.sampled_from([1, 2, 4, 8]),
       hkv=st.sampled_from([1, 2]), block_size=st.sampled_from([1, 8, 16, 64]), lens=lens_st,
       seed=st.integers(0, 2**31 - 1))
def test_gqa_matches_reference(dtype, head_dim, group, hkv, block_size, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    k, table = paged_cache(lens, block_size, (hkv, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))  # same used slots as k, NaN elsewhere
    q = randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, scale)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, scale)
    assert out.dtype == dtype
    assert_matches(out, r_out, dtype, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("group,head_dim", [(3, 72), (5, 40), (6, 96), (7, 20), (12, 128), (16, 64), (1, 13)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_uneven_groups_and_head_dims(group, head_dim, dtype):
    """Group sizes that do not fill a vector and head dims that are not a multiple of one take the kernels' tail paths."""
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    lens = [1, 17, 100, 0, 63]
    k, table = paged_cache(lens, 16, (2, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), 2 * group, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, head_dim ** -0.5)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, head_dim ** -0.5)
    assert_matches(out, r_out, dtype, "out")
    assert_lse_matches(lse, r_lse, "lse")


def test_gqa_empty_sequences_give_zero_and_neg_inf():
    gen = torch.Generator().manual_seed(0)
    k, table = paged_cache([0, 5, 0], 4, (2, 64), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, torch.randn_like(k))
    q = randn(3, 4, 64, gen=gen)
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, torch.tensor([0, 5, 0], dtype=torch.int32), 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isinf(lse[[0, 2]]).all() and (lse[[0, 2]] < 0).all()
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch_gives_empty_outputs(dtype):
    """T = 0 (no decode requests this step): both ops and the reference return [0, H, D] outputs and [0, H] LSE."""
    gen = torch.Generator().manual_seed(2)
    k, _ = paged_cache([5], 4, (2, 64), dtype, gen)
    table, seq_lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    q = randn(0, 8, 64, dtype=dtype, gen=gen)
    out, lse = dcp_ops.gqa_decode_partial(q, k, k, table, seq_lens, 0.125)
    r_out, r_lse = ref.gqa_decode_partial(q, k, k, table, seq_lens, 0.125)
    assert out.shape == r_out.shape == (0, 8, 64) and out.dtype == dtype
    assert lse.shape == r_lse.shape == (0, 8) and lse.dtype == torch.float32
    kv, _ = paged_cache([5], 4, (32 + 16,), dtype, gen)
    w_uv = randn(4, 32, 24, dtype=dtype, gen=gen)
    args = (randn(0, 4, 32, dtype=dtype, gen=gen), randn(0, 4, 16, dtype=dtype, gen=gen), kv, table, seq_lens, 0.2)
    out, lse = dcp_ops.mla_decode_partial(*args, w_uv=w_uv)
    r_out, r_lse = ref.mla_decode_partial(*args, w_uv=w_uv)
    assert out.shape == r_out.shape == (0, 4, 24) and out.dtype == dtype
    assert lse.shape == r_lse.shape == (0, 4) and lse.dtype == torch.float32


def test_gqa_accepts_strided_views_of_a_combined_cache():
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 6, 16, 2, 128, generator=gen)  # [2, num_blocks, block_size, H_kv, D]
    k, v = kv[0], kv[1]
    table = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 33], dtype=torch.int32)
    q = randn(2, 8, 128, gen=gen)
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.1)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.1)
    assert_matches(out, r_out, torch.float32, "out")
    assert_lse_matches(lse, r_lse, "lse")
    # non-contiguous head-strided cache view: every other KV head of a 4-head cache
    wide = torch.randn(6, 16, 4, 128, generator=gen)
    out2, _ = dcp_ops.gqa_decode_partial(q, wide[:, :, ::2], wide[:, :, 1::2], table, seq_lens, 0.1)
    r2, _ = ref.gqa_decode_partial(q, wide[:, :, ::2], wide[:, :, 1::2], table, seq_lens, 0.1)
    assert_matches(out2, r2, torch.float32, "out (head-strided cache)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_as_views_of_a_fused_projection(dtype):
    """Engines slice q out of a fused QKV (GQA) or [latent | rope] (MLA) projection: strided token and head dims."""
    gen = torch.Generator().manual_seed(5)
    lens = [33, 0, 70]
    k, table = paged_cache(lens, 16, (2, 64), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    qkv = randn(3, (8 + 2 + 2) * 64, dtype=dtype, gen=gen)
    q = qkv[:, : 8 * 64].view(3, 8, 64)  # token stride 768, not 512
    assert not q.is_contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    assert_matches(out, r_out, dtype, "out (GQA)")
    assert_lse_matches(lse, r_lse, "lse (GQA)")

    kv, table = paged_cache(lens, 16, (128 + 32,), dtype, gen)
    q_full = randn(3, 4, 128 + 32, dtype=dtype, gen=gen)
    q_nope, q_pe = q_full[..., :128], q_full[..., 128:]  # head stride 160 in both
    out, lse = dcp_ops.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, 160 ** -0.5)
    r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, 160 ** -0.5)
    assert_matches(out, r_out, dtype, "out (MLA)")
    assert_lse_matches(lse, r_lse, "lse (MLA)")


@given(dtype=st.sampled_from(DTYPES), heads=st.sampled_from([1, 4, 16]), dims=st.sampled_from([(512, 64), (128, 32),
       (64, 16)]), absorb=st.booleans(), up=st.booleans(), block_size=st.sampled_from([1, 16, 64]), lens=lens_st,
       seed=st.integers(0, 2**31 - 1))
def test_mla_matches_reference(dtype, heads, dims, absorb, up, block_size, lens, seed):
    latent, rope = dims
    gen = torch.Generator().manual_seed(seed)
    kv, table = paged_cache(lens, block_size, (latent + rope,), dtype, gen)
    T = len(lens)
    d_nope, d_v = 96, 48
    w_uk = randn(heads, d_nope, latent, dtype=dtype, gen=gen, scale=d_nope ** -0.5) if absorb else None
    w_uv = randn(heads, latent, d_v, dtype=dtype, gen=gen, scale=latent ** -0.5) if up else None
    q_nope = randn(T, heads, d_nope if absorb else latent, dtype=dtype, gen=gen)
    q_pe = randn(T, heads, rope, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    out, lse = dcp_ops.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    assert out.shape == (T, heads, d_v if up else latent) and out.dtype == dtype
    assert_matches(out, r_out, dtype, "out")
    assert_lse_matches(lse, r_lse, "lse")


def test_mla_deepseek_shape_with_absorption():
    gen = torch.Generator().manual_seed(2)
    lens = [70, 0, 129]
    kv, table = paged_cache(lens, 64, (576,), torch.float32, gen)
    w_uk = randn(8, 128, 512, gen=gen, scale=128 ** -0.5)
    w_uv = randn(8, 512, 128, gen=gen, scale=512 ** -0.5)
    q_nope, q_pe = randn(3, 8, 128, gen=gen), randn(3, 8, 64, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 192 ** -0.5
    out, lse = dcp_ops.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    assert_matches(out, r_out, torch.float32, "out")
    assert_lse_matches(lse, r_lse, "lse")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())


@pytest.mark.parametrize("seed", range(4))
def test_mla_fp32_sharp_softmax_stays_within_tolerance(seed):
    """Sharp fp32 MLA attention (sharp_mla_case): the output stays within the table's 1e-5."""
    args = sharp_mla_case([2000, 1500], seed)
    out, lse = dcp_ops.mla_decode_partial(*args)
    r_out, r_lse = ref.mla_decode_partial(*args)
    assert_matches(out, r_out, torch.float32, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_many_heads_narrow_cache(dtype):
    """128 heads over a bf16 / fp16 latent cache: the kernel converts each tile of cache rows to fp32 once and runs
    both GEMMs on the copy; several full tiles and a partial one, with the latent (V) read from the same copy."""
    gen = torch.Generator().manual_seed(5)
    lens = [200, 0, 65]
    kv, table = paged_cache(lens, 64, (576,), dtype, gen)
    w_uk = randn(128, 128, 512, dtype=dtype, gen=gen, scale=128 ** -0.5)
    q_nope, q_pe = randn(3, 128, 128, dtype=dtype, gen=gen), randn(3, 128, 64, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, 192 ** -0.5, w_uk)
    r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, 192 ** -0.5, w_uk)
    assert_matches(out, r_out, dtype, "out")
    assert_lse_matches(lse, r_lse, "lse")


def test_long_context_uses_splits_and_stays_exact():
    # enough tokens that the kernel splits one sequence across threads and combines the splits
    gen = torch.Generator().manual_seed(3)
    lens = [3000]
    k, table = paged_cache(lens, 16, (1, 64), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, torch.randn_like(k))
    q = randn(1, 4, 64, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    assert_matches(out, r_out, torch.float32, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_mixed_lengths_any_thread_count(threads):
    """Threads claim (sequence, split) items longest sequence first, in whatever order they get to them: any thread
    count gives the reference's values on a batch mixing long, short and empty sequences, and the same bits on every
    run."""
    gen = torch.Generator().manual_seed(4)
    lens = [37, 2500, 0, 900, 1, 2500, 130]
    k, table = paged_cache(lens, 16, (2, 64), torch.bfloat16, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=torch.bfloat16, gen=gen))
    q = randn(len(lens), 8, 64, dtype=torch.bfloat16, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        runs = [dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.125) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    out, lse = runs[0]
    assert_matches(out, r_out, torch.bfloat16, "out")
    assert_lse_matches(lse, r_lse, "lse")
    for o, l in runs[1:]:
        assert torch.equal(o, out) and torch.equal(l, lse)


@pytest.mark.parametrize("heads,dims,hkv", [(16, (512, 64), 0), (32, (101, 16), 0), (128, (63, 0), 0),
                                            (16, (77, 0), 2), (32, (128, 0), 1)])
@pytest.mark.parametrize("sharp", [False, True])
def test_bf16_queries_on_a_bf16_cache_with_whole_vectors_of_heads(heads, dims, hkv, sharp):
    """bf16 queries (not absorbed) on a bf16 cache with 16 or more heads per KV head: in builds with AVX512_BF16 the
    scores are bf16 dot products of the unscaled query, scaled after (gemm_dp). Odd row widths take its last-pair
    path (row[K - 1], 0), which must not read past the row: the slot after a sequence's last token is NaN. hkv = 0
    is MLA (the latent is V); otherwise GQA with a separate V. Sharp: 3x the softmax scale."""
    latent, rope = dims
    gen = torch.Generator().manual_seed(heads + latent + hkv)
    lens = [1, 45, 0, 130]
    dt = torch.bfloat16
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = (3.0 if sharp else 1.0) * (latent + rope) ** -0.5
    if hkv == 0:
        kv, table = paged_cache(lens, 16, (latent + rope,), dt, gen)
        q_nope, q_pe = randn(4, heads, latent, dtype=dt, gen=gen), randn(4, heads, rope, dtype=dt, gen=gen)
        args = (q_nope, q_pe, kv, table, seq_lens, scale)
        out, lse = dcp_ops.mla_decode_partial(*args)
        r_out, r_lse = ref.mla_decode_partial(*args)
    else:
        k, table = paged_cache(lens, 16, (hkv, latent), dt, gen)
        v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dt, gen=gen))
        q = randn(4, hkv * heads, latent, dtype=dt, gen=gen)
        out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, scale)
        r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, scale)
    assert_matches(out, r_out, dt, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["gqa", "mla", "mla_w_uk"])
def test_nonfinite_value_stays_in_its_dims(case, dt):
    """An inf or NaN in a valid slot leaves the reference's non-finite outputs and no others. The tile kernels (bf16
    caches, amx builds) must not add any: P.V on V's cache rows multiplies a zero half of each P pair by the
    neighbouring dim (0 x inf), and a query split into bf16 terms multiplies zero or opposite-signed terms by a K
    element (q x inf must stay +-inf, a score of -inf a weight of 0). Finite outputs stay within the tolerances."""
    gen = torch.Generator().manual_seed(11)
    lens = [200, 64]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if case == "gqa":
        k, table = paged_cache(lens, 16, (2, 128), dt, gen)
        v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dt, gen=gen))
        v[table[0, 3].long(), 5, 0, 9] = float("inf")  # sequence 0, token 53, KV head 0, dim 9
        v[table[1, 1].long(), 2, 1, 40] = float("nan")  # sequence 1, token 18, KV head 1, dim 40
        args = (randn(2, 16, 128, dtype=dt, gen=gen), k, v, table, seq_lens, 128 ** -0.5)
        out, lse = dcp_ops.gqa_decode_partial(*args)
        r_out, r_lse = ref.gqa_decode_partial(*args)
    else:
        kv, table = paged_cache(lens, 64, (576,), dt, gen)
        kv[table[0, 1].long(), 7, 33] = float("-inf")  # sequence 0, token 71: latent dim 33 (in V and K)
        kv[table[1, 0].long(), 9, 540] = float("inf")  # sequence 1, token 9: rope dim 540 (in K only)
        w_uk = randn(16, 128, 512, dtype=dt, gen=gen, scale=128 ** -0.5) if case == "mla_w_uk" else None
        q_nope = randn(2, 16, 128 if w_uk is not None else 512, dtype=dt, gen=gen)
        args = (q_nope, randn(2, 16, 64, dtype=dt, gen=gen), kv, table, seq_lens, 192 ** -0.5, w_uk)
        out, lse = dcp_ops.mla_decode_partial(*args)
        r_out, r_lse = ref.mla_decode_partial(*args)
    bad = ~torch.isfinite(r_out)
    assert bad.any() and not bad.all()
    assert torch.equal(~torch.isfinite(out), bad)
    assert_matches(out[~bad], r_out[~bad], dt, "finite out")
    fine = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), fine)
    assert_lse_matches(lse[fine], r_lse[fine], "finite lse")


@pytest.mark.parametrize("case", ["gqa1_d64", "gqa4_d128", "gqa8_d128", "gqa8_d160", "gqa12_d64", "gqa16_d96",
                                  "gqa24_d256", "mla8_w_uk", "mla16", "mla16_w_uk", "mla32_w_uk", "mla128_w_uk_uv"])
@pytest.mark.parametrize("block_size", [1, 16, 48, 64])
def test_bf16_cache_on_tile_kernels(case, block_size):
    """A bf16 cache with row widths that are multiples of 32: in builds for the amx ISA level both GEMMs run on AMX
    tiles (csrc/cpu/amx.h). Covers whole and partial groups of 16 tokens, rows read in place (evenly strided) and
    copied (block sizes 1 and 48 break a group of 16 across blocks), heads padded to 16 (1, 4, 8, 12, 24), a query
    absorbed through w_uk (three bf16 terms) and a bf16 one (one term), at 3x the softmax scale,
    P.V with V's tiles read from the cache rows (up to 32 heads per KV head: pv_rows, O's columns even / odd apart;
    d96 ends on a lone chunk of 32 dims; up to 8 heads: pv_stacked, even and odd dims in one tile's two halves of rows, in
    blocks of 128 dims, d160 ending on a block of one chunk) and from V packed in pairs of rows (128 heads).
    Slots past each sequence are NaN, so a tile row read past a sequence fails."""
    gen = torch.Generator().manual_seed(block_size * 7 + len(case))
    lens = [1, 15, 16, 17, 0, 95, 300]
    dt = torch.bfloat16
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    T = len(lens)
    if case.startswith("gqa"):
        group, d = (int(x) for x in case[3:].split("_d"))
        k, table = paged_cache(lens, block_size, (2, d), dt, gen)
        v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dt, gen=gen))
        q = randn(T, 2 * group, d, dtype=dt, gen=gen)
        args = (q, k, v, table, seq_lens, 3 * d ** -0.5)
        out, lse = dcp_ops.gqa_decode_partial(*args)
        r_out, r_lse = ref.gqa_decode_partial(*args)
    else:
        heads = int(case[3:].split("_")[0])
        kv, table = paged_cache(lens, block_size, (576,), dt, gen)
        w_uk = randn(heads, 128, 512, dtype=dt, gen=gen, scale=128 ** -0.5) if "w_uk" in case else None
        w_uv = randn(heads, 512, 128, dtype=dt, gen=gen, scale=512 ** -0.5) if "uv" in case else None
        q_nope = randn(T, heads, 128 if w_uk is not None else 512, dtype=dt, gen=gen)
        q_pe = randn(T, heads, 64, dtype=dt, gen=gen)
        args = (q_nope, q_pe, kv, table, seq_lens, 3 * 192 ** -0.5, w_uk, w_uv)
        out, lse = dcp_ops.mla_decode_partial(*args)
        r_out, r_lse = ref.mla_decode_partial(*args)
    assert out.dtype == dt
    assert_matches(out, r_out, dt, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 48, 64])
def test_fp32_mla16_cache_on_tile_kernels(absorb, block_size):
    """An fp32 MLA cache with 16 heads: in builds for the amx ISA level both GEMMs run on AMX tiles over each tile's
    rows split exactly into three bf16 terms, against the query's three (fp32, or absorbed through w_uk) and P's three,
    six products each. Whole and partial groups of 16 tokens, rows from several blocks (1, 48), at 3x the softmax
    scale, within fp32's 1e-5 of the float64 reference; slots past each sequence are NaN."""
    gen = torch.Generator().manual_seed(block_size * 3 + absorb)
    lens = [1, 15, 16, 17, 0, 95, 300]
    T, dt = len(lens), torch.float32
    kv, table = paged_cache(lens, block_size, (576,), dt, gen)
    w_uk = randn(16, 128, 512, gen=gen, scale=128 ** -0.5) if absorb else None
    q_nope = randn(T, 16, 128 if absorb else 512, gen=gen)
    args = (q_nope, randn(T, 16, 64, gen=gen), kv, table, torch.tensor(lens, dtype=torch.int32), 3 * 192 ** -0.5,
            w_uk)
    out, lse = dcp_ops.mla_decode_partial(*args)
    r_out, r_lse = ref.mla_decode_partial(*args)
    assert_matches(out, r_out, dt, "out")
    assert_lse_matches(lse, r_lse, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernels_are_exact_under_both_precisions(dtype):
    """The CPU kernels compute exactly under precision "native" and "fp32" alike (docs/design.md §2): the same results,
    within the fp32 rows of the table."""
    gen = torch.Generator().manual_seed(9)
    lens = [70, 0, 5]
    k, table = paged_cache(lens, 16, (2, 64), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(3, 8, 64, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = [dcp_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.125, precision=p) for p in ("native", "fp32")]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.125)
    assert_matches(got[0][0], r_out, dtype, "GQA out")
    assert_lse_matches(got[0][1], r_lse, "GQA lse")
    kv, table = paged_cache(lens, 16, (128 + 64,), dtype, gen)
    args = (randn(3, 5, 32, dtype=dtype, gen=gen), randn(3, 5, 64, dtype=dtype, gen=gen), kv, table, seq_lens, 0.1,
            randn(5, 32, 128, dtype=dtype, gen=gen, scale=32 ** -0.5))
    got = [dcp_ops.mla_decode_partial(*args, precision=p) for p in ("native", "fp32")]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    r_out, r_lse = ref.mla_decode_partial(*args)
    assert_matches(got[0][0], r_out, dtype, "MLA out")
    assert_lse_matches(got[0][1], r_lse, "MLA lse")
