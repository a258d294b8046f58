"""The SIMT executor (csrc/simt/simt.h) and the CUDA kernel sources it runs on the CPU, against the reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ops import reference as ref
from conftest import DTYPES
from tolerances import assert_decode, assert_lse_matches, assert_matches

pytestmark = pytest.mark.simt


def test_warp_shuffle_reduction_and_ballot(simt_ops):
    x = torch.randint(0, 9, (100,)).float()  # 4 warps, the last one partial
    sums, ballots = simt_ops.warp_reduce(x)
    padded = torch.cat([x, torch.zeros(28)]).view(4, 32)
    assert torch.equal(sums, padded.sum(1))
    odd = (padded.int() % 2 == 1) & (torch.arange(128).view(4, 32) < 100)
    want = [sum(1 << i for i in range(32) if odd[w, i]) for w in range(4)]
    assert [b & 0xFFFFFFFF for b in ballots.tolist()] == want


def test_shared_memory_transpose(simt_ops):
    x = torch.randn(3, 32, 32)
    assert torch.equal(simt_ops.transpose32(x), x.transpose(1, 2))


def test_atomic_histogram_with_dynamic_shared_memory(simt_ops):
    x = torch.randint(0, 10, (1000,), dtype=torch.int32)
    assert torch.equal(simt_ops.histogram(x, 10), torch.bincount(x, minlength=10).int())


def test_missing_barrier_is_caught(simt_ops):
    x = torch.randn(128)
    for reader in (0, 127):
        torch.testing.assert_close(simt_ops.block_sum(x, True, reader), x.sum().view(1))
    # Without the barrier the reader sums before some thread has written y (it sees stale x slots). Which reader
    # runs too early depends on the schedule, but both cannot run last.
    y = torch.randn(128) + 5
    racy = []
    for reader in (0, 127):
        simt_ops.block_sum(x, True, 0)  # the slots hold x again
        racy.append(simt_ops.block_sum(y, False, reader))
    assert not all(torch.allclose(r, y.sum().view(1)) for r in racy)


@pytest.mark.parametrize("schedule,first", [("forward", 0), ("reverse", 127), ("random:7", None)])
def test_schedule_orders_the_fibers(simt_ops, monkeypatch, schedule, first):
    """The reader of a racy sum sees the writers that ran before it: under forward thread 0 runs first (sees only its
    own slot), under reverse thread 127 does; a random schedule puts neither reliably first or last."""
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", schedule)
    y = torch.arange(1, 129, dtype=torch.float32)
    sums = []
    for reader in (0, 127):
        simt_ops.block_sum(torch.zeros(128), True, 0)  # every slot 0: what a reader sees of a writer not yet run
        sums.append(simt_ops.block_sum(y, False, reader).item())
    if first == 0:
        assert sums == [1.0, float(y.sum())]
    elif first == 127:
        assert sums == [float(y.sum()), 128.0]
    else:  # each reader saw some but not all of the writers
        assert all(0 < s < float(y.sum()) for s in sums) and len(set(sums)) == 2


def test_unknown_schedule_is_refused(simt_ops, monkeypatch):
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", "sideways")
    with pytest.raises(Exception, match="DCP_SIMT_SCHEDULE"):
        simt_ops.block_sum(torch.randn(32), True, 0)


def test_async_copies_land_at_their_wait(simt_ops):
    x = torch.randn(64 * 8)
    seen = simt_ops.async_copy(x)
    want = x.view(64, 8)
    poison = torch.full((64, 4), float("nan"))  # the executor fills dynamic shared memory with 0xff bytes: NaN
    assert torch.isnan(seen[0]).all(), "a read before the wait must see the poison, not the copy"
    torch.testing.assert_close(seen[1], torch.cat([want[:, :4], poison], 1), equal_nan=True)
    assert torch.isnan(seen[1][:, 4:]).all()
    assert torch.equal(seen[2], want)


@pytest.mark.parametrize("stride,ways", [(1, 1), (2, 2), (3, 1), (8, 8), (32, 32)])
def test_bank_conflict_counter(simt_ops, stride, ways):
    simt_ops.bank_stats(True)
    assert torch.equal(simt_ops.strided_store(stride), torch.arange(32).float())
    requests, wavefronts, ideal = simt_ops.bank_stats(True)
    assert (requests, wavefronts, ideal) == (1, ways, 1)


def test_divergent_barrier_is_reported(simt_ops):
    with pytest.raises(RuntimeError, match="divergence"):
        simt_ops.divergent_barrier()


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(DTYPES), N=st.integers(1, 5), T=st.integers(1, 3), H=st.integers(1, 3),
       D=st.sampled_from([8, 12, 64, 128]), base=st.sampled_from([math.e, 2.0]), strided=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_merge_partials_cuda_source(simt_ops, dtype, N, T, H, D, base, strided, seed):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(N, T, 2 * H if strided else H, D, generator=g).to(dtype)
    if strided:
        outs = outs[:, :, ::2]  # head stride 2*D: 16-byte packs only when D allows
    lses = torch.randn(N, T, H, generator=g) * 3
    lses[0, 0, 0] = float("nan")
    lses[:, -1, -1] = float("-inf")
    out, lse = simt_ops.merge_partials(outs, lses, base)
    r_out, r_lse = ref.merge_partials(outs, lses, base)
    assert_matches(out, r_out, dtype, "out (CUDA source on the SIMT executor)")
    assert_lse_matches(lse, r_lse, "lse (CUDA source on the SIMT executor)")


@settings(max_examples=8, deadline=None)
@given(dtype=st.sampled_from(DTYPES), N=st.integers(1, 4), T=st.integers(1, 3), H=st.integers(1, 3),
       D=st.sampled_from([7, 16, 64]), base=st.sampled_from([math.e, 2.0]), data=st.data(),
       seed=st.integers(0, 2**31 - 1))
def test_correct_partial_cuda_source(simt_ops, dtype, N, T, H, D, base, data, seed):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(N, T, H, D, generator=g).to(dtype)
    lses = torch.randn(N, T, H, generator=g) * 3
    lses[:, 0, 0] = float("-inf")
    rank = data.draw(st.integers(0, N - 1))
    out = outs[rank].clone()
    r_out, r_lse = ref.correct_partial(out, lses, rank, base)
    lse = simt_ops.correct_partial(out, lses, rank, base)
    assert_matches(out, r_out, dtype, "corrected out")
    assert_lse_matches(lse, r_lse, "lse")


@settings(max_examples=8, deadline=None)
@given(dtype=st.sampled_from(DTYPES), N=st.sampled_from([1, 2, 3]), T=st.integers(1, 3), hl=st.integers(1, 2),
       D=st.sampled_from([5, 8, 64]), seed=st.integers(0, 2**31 - 1))
def test_pack_and_merge_exchange_cuda_source(simt_ops, dtype, N, T, hl, D, seed):
    g = torch.Generator().manual_seed(seed)
    pad = 16 // torch.empty((), dtype=dtype).element_size()
    parts = [(torch.randn(T, N * hl, D, generator=g).to(dtype), torch.randn(T, N * hl, generator=g)) for _ in range(N)]
    parts[0][1][0, 0] = float("nan")
    sends = []
    for out, lse in parts:
        send = torch.full((N, T, hl, D + pad), float("nan"), dtype=dtype)
        simt_ops.pack_exchange(out, lse, send)
        payload, lse_slices = ref.pack_exchange(out, lse, N)
        assert torch.equal(send[..., :D].double(), payload)
        got_lse = send[..., D:].contiguous().view(torch.float32)[..., 0].double()
        assert torch.equal(got_lse.nan_to_num(-1.0), lse_slices.nan_to_num(-1.0))
        assert not send[..., D:].contiguous().view(torch.uint8)[..., 4:].any()
        sends.append(send)
    for me in range(N):
        recv = torch.stack([s[me] for s in sends])
        out = torch.full((T, hl, D), float("nan"), dtype=dtype)
        lse = torch.full((T, hl), float("nan"))
        simt_ops.merge_exchange(recv, out, lse)
        r_out, r_lse = ref.merge_partials(torch.stack([p[0][:, me * hl:(me + 1) * hl] for p in parts]),
                                          torch.stack([p[1][:, me * hl:(me + 1) * hl] for p in parts]))
        assert_matches(out, r_out, dtype, f"merged out, rank {me}")
        assert_lse_matches(lse, r_lse, f"merged lse, rank {me}")


@settings(max_examples=8, deadline=None)
@given(entry=st.sampled_from([(2, 16), (40,), (3,)]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       T=st.integers(0, 12), seed=st.integers(0, 2**31 - 1))
def test_write_kv_cuda_source(simt_ops, entry, dtype, T, seed):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(4, 4, *entry, generator=g).to(dtype)
    new = torch.randn(T, *entry, generator=g).to(dtype)
    slots = torch.randperm(16, generator=g)[:T]
    slots = torch.cat([slots, torch.full((max(0, T - 16),), -1)]).int()
    if T:
        slots[0] = -1
    expected = ref.write_kv(cache, new, slots)
    simt_ops.write_kv(cache, new, slots)
    assert torch.equal(cache, expected)
    bad = torch.full((T,), 999, dtype=torch.int32)  # out of range: skipped on the GPU, never written
    before = cache.clone()
    simt_ops.write_kv(cache, new, bad)
    assert torch.equal(cache, before)


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(DTYPES), head_dim=st.sampled_from([64, 128, 256]), group=st.sampled_from([1, 3, 8, 16]),
       hkv=st.sampled_from([1, 2]), block_size=st.sampled_from([1, 16]),
       lens=st.lists(st.integers(0, 40), min_size=1, max_size=2), precision=st.sampled_from(["native", "fp32"]),
       seed=st.integers(0, 2**31 - 1))
def test_gqa_decode_cuda_source(simt_ops, dtype, head_dim, group, hkv, block_size, lens, precision, seed):
    from conftest import paged_cache, randn
    gen = torch.Generator().manual_seed(seed)
    k, table = paged_cache(lens, block_size, (hkv, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = simt_ops.gqa_decode_partial(q, k, v, table, seq_lens, head_dim ** -0.5, precision=precision)
    assert_decode(out, lse, ref.gqa_decode_partial, (q, k, v, table, seq_lens, head_dim ** -0.5), dtype, precision,
                  "GQA CUDA source")


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group,hkv,block_size", [(128, 8, 2, 16), (64, 24, 1, 5), (128, 16, 1, 64),
                                                           (64, 1, 3, 1), (128, 3, 2, 7)])
def test_gqa_decode_cuda_source_tensor_cores_over_many_tokens(simt_ops, dtype, head_dim, group, hkv, block_size,
                                                              precision):
    # The tensor-core kernel (16-bit caches, head dims 64 / 128): several 16-token steps per warp, several splits,
    # lengths that end inside a step and inside a block, head tiles of 8 and 16 rows with unused rows (groups 1, 3,
    # 24), block sizes below, at and above a step.
    from conftest import paged_cache, randn
    gen = torch.Generator().manual_seed(head_dim + group + block_size)
    lens = [1100, 0, 17, 513]
    k, table = paged_cache(lens, block_size, (hkv, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen, scale=3.0)  # sharper softmax than 1.0
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = simt_ops.gqa_decode_partial(q, k, v, table, seq_lens, head_dim ** -0.5, precision=precision)
    assert_decode(out, lse, ref.gqa_decode_partial, (q, k, v, table, seq_lens, head_dim ** -0.5), dtype, precision,
                  "GQA tensor-core CUDA source")


def _mla_case(T_lens, heads, latent, rope, absorb, up, block_size, dtype, gen):
    from conftest import paged_cache, randn
    kv, table = paged_cache(T_lens, block_size, (latent + rope,), dtype, gen)
    T, d_nope, d_v = len(T_lens), 48, 40  # odd projection widths: partial column tiles in head_project
    w_uk = randn(heads, d_nope, latent, dtype=dtype, gen=gen, scale=d_nope ** -0.5) if absorb else None
    w_uv = randn(heads, latent, d_v, dtype=dtype, gen=gen, scale=latent ** -0.5) if up else None
    q_nope = randn(T, heads, d_nope if absorb else latent, dtype=dtype, gen=gen)
    q_pe = randn(T, heads, rope, dtype=dtype, gen=gen)
    return q_nope, q_pe, kv, table, torch.tensor(T_lens, dtype=torch.int32), (latent + rope) ** -0.5, w_uk, w_uv


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(DTYPES), dims=st.sampled_from([(512, 64), (256, 0), (128, 64)]),
       heads=st.integers(1, 6), absorb=st.booleans(), up=st.booleans(), block_size=st.sampled_from([1, 16]),
       lens=st.lists(st.integers(0, 40), min_size=1, max_size=2), precision=st.sampled_from(["native", "fp32"]),
       seed=st.integers(0, 2**31 - 1))
def test_mla_decode_cuda_source(simt_ops, dtype, dims, heads, absorb, up, block_size, lens, precision, seed):
    args = _mla_case(lens, heads, *dims, absorb, up, block_size, dtype, torch.Generator().manual_seed(seed))
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision)
    assert out.dtype == dtype
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, precision, "MLA CUDA source")


def test_mla_decode_cuda_source_many_tokens_and_splits(simt_ops):
    # 11 queries: two token tiles of head_project; 700 tokens of capacity: two KV splits merged by merge_kernel
    lens = [700, 0, 3, 17, 64, 65, 1, 2, 40, 699, 5]
    args = _mla_case(lens, 5, 128, 64, True, True, 64, torch.float32, torch.Generator().manual_seed(7))
    out, lse = simt_ops.mla_decode_partial(*args)
    r_out, r_lse = ref.mla_decode_partial(*args)
    assert_matches(out, r_out, torch.float32, "out (MLA CUDA source)")
    assert_lse_matches(lse, r_lse, "lse (MLA CUDA source)")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,latent,rope,block_size,absorb", [(16, 512, 64, 64, True), (20, 256, 0, 5, False),
                                                                  (5, 512, 0, 16, True), (3, 256, 64, 1, False),
                                                                  (128, 512, 64, 64, True), (65, 256, 64, 16, False)])
def test_mla_decode_cuda_source_tensor_cores_over_many_tokens(simt_ops, dtype, heads, latent, rope, block_size,
                                                               absorb, precision):
    # The tensor-core kernel (16-bit caches, latent 256 / 512): several 16-token steps through both shared-memory
    # stages, two KV splits, lengths that end inside a step and inside a block, head tiles with unused rows (5, 3, and
    # 20 = 16 + 4), a sharper softmax than the default (query x 3), and block sizes below, at and above a step.
    lens = [700, 0, 17, 33]
    q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv = _mla_case(
        lens, heads, latent, rope, absorb, absorb, block_size, dtype, torch.Generator().manual_seed(heads + latent))
    q_nope, q_pe = (q_nope.float() * 3).to(dtype), (q_pe.float() * 3).to(dtype)
    args = (q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision)
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, precision, "MLA tensor-core CUDA source")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_decode_cuda_source_precision_is_the_one_asked_for(simt_ops, dtype):
    # DeepSeek's 512 + 64 with w_uk at a sharper softmax (query x 3): "native" rounds the absorbed query to one 16-bit
    # term, which moves the scores, and so the LSE, far more than 1e-5; "fp32" splits it into three, which do not.
    # So native's LSE sits near the same-precision reference's and visibly off the exact one, and fp32's on the exact.
    lens = [300, 129]
    q_nope, q_pe, kv, table, seq_lens, scale, w_uk, _ = _mla_case(lens, 16, 512, 64, True, False, 64, dtype,
                                                                  torch.Generator().manual_seed(4))
    args = ((q_nope.float() * 3).to(dtype), (q_pe.float() * 3).to(dtype), kv, table, seq_lens, scale, w_uk)
    exact, same = ref.mla_decode_partial(*args), ref.mla_decode_partial(*args, round_to=dtype)
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    _, lse_fp32 = simt_ops.mla_decode_partial(*args, precision="fp32")
    _, lse_native = simt_ops.mla_decode_partial(*args, precision="native")
    assert err(lse_fp32, exact[1]) <= 1e-5
    assert err(same[1], exact[1]) >= 1e-4  # the case is sharp enough to tell the modes apart
    assert err(lse_native, exact[1]) >= 1e-4, "native computed more exactly than one 16-bit query term allows"
    assert err(lse_native, same[1]) <= err(same[1], exact[1]) / 4


@pytest.mark.parametrize("seed", [0, 1])
def test_mla_decode_cuda_source_fp32_sharp_softmax(simt_ops, seed):
    from conftest import sharp_mla_case
    args = sharp_mla_case([400, 300], seed)
    out, lse = simt_ops.mla_decode_partial(*args)
    r_out, r_lse = ref.mla_decode_partial(*args)
    assert_matches(out, r_out, torch.float32, "out (MLA CUDA source)")
    assert_lse_matches(lse, r_lse, "lse (MLA CUDA source)")


def test_mla_decode_cuda_source_rejects_unsupported_dims(simt_ops):
    args = _mla_case([5], 2, 96, 64, False, False, 16, torch.float32, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="D_latent 128, 256 or 512 and rope dim 0 or 64, got 96 \\+ 64"):
        simt_ops.mla_decode_partial(*args)


def test_decode_cuda_sources_take_an_empty_batch(simt_ops):
    args = _mla_case([], 3, 128, 64, True, True, 16, torch.float32, torch.Generator().manual_seed(1))
    out, lse = simt_ops.mla_decode_partial(*args)
    assert out.shape == (0, 3, 40) and lse.shape == (0, 3)
    k = torch.randn(4, 16, 1, 64)
    out, lse = simt_ops.gqa_decode_partial(torch.randn(0, 2, 64), k, k, torch.zeros(0, 1, dtype=torch.int32),
                                           torch.zeros(0, dtype=torch.int32), 0.1)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_mla_decode_cuda_source_takes_strided_views(simt_ops):
    # as dcp_attention calls it: q_nope and q_pe are slices of one gathered query; w_uk and w_uv are column-strided
    q_nope, q_pe, kv, table, lens, scale, w_uk, w_uv = _mla_case([9, 33], 3, 256, 64, True, True, 16,
                                                                 torch.bfloat16, torch.Generator().manual_seed(3))
    q = torch.cat([q_nope, q_pe], -1)
    w_uk_t = w_uk.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last dim strided
    w_uv_t = w_uv.transpose(1, 2).contiguous().transpose(1, 2)
    for precision in ("native", "fp32"):
        out, lse = simt_ops.mla_decode_partial(q[..., :48], q[..., 48:], kv, table, lens, scale, w_uk_t, w_uv_t,
                                               precision=precision)
        assert_decode(out, lse, ref.mla_decode_partial, (q_nope, q_pe, kv, table, lens, scale, w_uk, w_uv),
                      torch.bfloat16, precision, "strided views")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_cuda_sources_skip_blocks_outside_the_cache(simt_ops, kind):
    # A GPU kernel cannot raise: tokens whose block id is outside the cache (or negative) are skipped, never read.
    # Request 0's second block is out of range and request 1's is negative, so each attends its first 16 tokens.
    from conftest import randn
    gen = torch.Generator().manual_seed(11)
    entry = (2, 64) if kind == "gqa" else (128 + 64,)
    cache = randn(3, 16, *entry, gen=gen)
    table = torch.tensor([[0, 7], [1, -5]], dtype=torch.int32)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    short = (table[:, :1].contiguous(), torch.tensor([16, 16], dtype=torch.int32))
    if kind == "gqa":
        v = randn(*cache.shape, gen=gen)
        q = randn(2, 4, 64, gen=gen)
        out, lse = simt_ops.gqa_decode_partial(q, cache, v, table, lens, 0.125)
        r_out, r_lse = ref.gqa_decode_partial(q, cache, v, *short, 0.125)
    else:
        q_nope, q_pe = randn(2, 3, 128, gen=gen), randn(2, 3, 64, gen=gen)
        out, lse = simt_ops.mla_decode_partial(q_nope, q_pe, cache, table, lens, 0.07)
        r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, cache, *short, 0.07)
    assert_matches(out, r_out, torch.float32, f"{kind} out, out-of-range blocks skipped")
    assert_lse_matches(lse, r_lse, f"{kind} lse, out-of-range blocks skipped")


def _check_split_plan(lens, cu, capacity, granule, G, Hkv, R, work, unit, tok, sms=8):
    """The plan's invariants (kernels/split_plan.cuh): units of R (query token, head) rows per sequence and KV head;
    each unit's items cover its longest row's clamped length once, in order, as consecutive items whose rows are the
    unit's; no budget of one wave (one block per SM) holds more than B tiles; every other item unused."""
    T = len(lens)
    seqs = [(b, 1) for b in range(T)] if cu is None else [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    clamped = [max(0, min(n, capacity)) for n in lens]
    units = []  # (b, t0, kvh, rt, rows, length)
    for b, (t0, n) in enumerate(seqs):
        rts = -(-n * G // R)
        for q in range(n):
            assert tok[t0 + q].tolist() == [len(units), q * G, rts], (t0 + q, tok[t0 + q].tolist())
        for kvh in range(Hkv):
            for rt in range(rts):
                rows = min(R, n * G - rt * R)
                length = max(clamped[t0 + q] for q in range(rt * R // G, (rt * R + rows - 1) // G + 1))
                units.append((b, t0, kvh, rt, rows, length))
    tiles = [-(-u[5] // granule) for u in units]
    budget = max(1, -(-sum(tiles) // sms))
    owner, load = {}, [0] * sms
    for u, (b, t0, kvh, rt, rows, length) in enumerate(units):
        first, count = unit[u].tolist()
        assert count == 0 if length == 0 else count >= 1, (u, length, count)
        pos = 0
        for i in range(first, first + count):
            it = work[i].tolist()
            assert it[:5] == [b, t0, rows, kvh, rt * R] and it[5] == pos and pos < it[6] <= length, (u, i, it)
            assert it[5] % granule == 0 and (it[6] % granule == 0 or it[6] == length)
            owner[i] = u
            load[i - u] += -(-(it[6] - it[5]) // granule)
            pos = it[6]
        assert pos == length, (u, pos, length)
    for i in range(work.shape[0]):
        assert i in owner or int(work[i, 0]) == -1, (i, work[i].tolist())
    assert max(load) <= budget and sum(load) == sum(tiles)


@pytest.mark.parametrize("case", range(16))
def test_split_plan_covers_every_row_once_and_fills_one_wave(simt_ops, case):
    # the decode launchers' device-side plan: random mixes of lengths (0, past the capacity, one long among short),
    # of query tokens per sequence (multi-token decode), heads per KV head, KV heads and rows per block
    gen = torch.Generator().manual_seed(case)
    B = [1, 2, 3, 7, 40, 300][case % 6]
    capacity = [64, 1000, 4096][case % 3]
    n_q = torch.randint(0 if case % 5 == 4 else 1, 5, (B,), generator=gen) if case % 2 else torch.ones(B, dtype=int)
    cu = [0] + torch.cumsum(n_q, 0).tolist()
    T = cu[-1]
    lens = torch.randint(-3, capacity + 200, (T,), generator=gen, dtype=torch.int32)
    if case % 4 == 1 and T > 0:
        lens[:] = torch.randint(0, 5, (T,), generator=gen, dtype=torch.int32)
        lens[0] = capacity
    granule = [64, 32, 16, 1][case % 4]
    G, Hkv, R = [(1, 8, 8), (4, 2, 8), (8, 1, 16), (128, 1, 64), (16, 1, 64), (5, 1, 4), (8, 4, 2), (2, 1, 1)][case % 8]
    cu_t = torch.tensor(cu, dtype=torch.int32) if case % 2 else None
    work, unit, tok = simt_ops.split_plan(lens, cu_t, capacity, granule, G, Hkv, R)
    _check_split_plan(lens.tolist(), cu if case % 2 else None, capacity, granule, G, Hkv, R, work, unit, tok)


@pytest.mark.parametrize("G,R", [(1, 1), (128, 64)])
def test_split_plan_gives_one_long_sequence_a_block_per_sm(simt_ops, G, R):
    # batch 1 (the case a capacity-based plan leaves to a few blocks): the wave's 8 blocks get equal pieces
    work, unit, tok = simt_ops.split_plan(torch.tensor([4096], dtype=torch.int32), None, 1 << 20, 64, G, 1, R)
    units = G // R
    per = 4096 * units // 8
    assert tok.tolist() == [[0, 0, units]]
    pieces = [(u, a, min(4096, a + per)) for u in range(units) for a in range(0, 4096, per)]
    assert unit.tolist() == [[u * (1 + 8 // units), 8 // units] for u in range(units)]
    used = [w for w in work.tolist() if w[0] >= 0]
    assert [(w[4] // R, w[5], w[6]) for w in used] == pieces


@pytest.mark.parametrize("cu", [[0, 5, 2, 3], [2, 1, 0, 3], [-4, 9, 9, 1], [0, 0, 0, 7]])
def test_split_plan_stays_in_bounds_for_a_malformed_cu_seqlens_q(simt_ops, cu):
    # on a GPU cu_seqlens_q's values are not read by the host: a malformed one must not make the plan (and so the
    # split pass) touch rows outside [0, T); the ops refuse it by name where it is on the CPU
    lens = torch.tensor([5, 9, 2], dtype=torch.int32)
    work, unit, tok = simt_ops.split_plan(lens, torch.tensor(cu, dtype=torch.int32), 64, 4, 4, 2, 8)
    for w in work.tolist():
        if w[0] >= 0:
            assert 0 <= w[0] < 3 and 0 <= w[1] and w[1] + (w[4] + w[2] - 1) // 4 < 3 and 0 <= w[5] < w[6] <= 9, w
    for t in tok.tolist():
        assert t[0] == -1 or 0 <= t[0] + 2 * t[2] - 1 < unit.shape[0], t


def test_split_plan_shares_a_sequences_tiles_among_its_query_tokens(simt_ops):
    # MTP: 16 heads x 4 query tokens = the 64 rows of one tiled-kernel block, so each KV tile is read once for all
    lens = torch.tensor([997, 998, 999, 1000], dtype=torch.int32)
    work, unit, tok = simt_ops.split_plan(lens, torch.tensor([0, 4], dtype=torch.int32), 1 << 20, 64, 16, 1, 64)
    assert tok.tolist() == [[0, 16 * q, 1] for q in range(4)] and unit.tolist() == [[0, 8]]
    used = [w for w in work.tolist() if w[0] >= 0]
    assert len(used) == 8 and all(w[:5] == [0, 0, 64, 0, 0] for w in used) and used[-1][6] == 1000


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("heads", [1, 5, 16, 128])
@pytest.mark.parametrize("absorb,up", [(False, False), (True, True)])
def test_mla_decode_cuda_source_precisions_at_the_design_shapes(simt_ops, heads, absorb, up, precision):
    # docs/design.md §7's MLA shapes for both precisions: 512 + 64, lengths 0, 1 and not multiples of 16 or 64
    args = _mla_case([0, 1, 37, 130], heads, 512, 64, absorb, up, 16, torch.bfloat16,
                     torch.Generator().manual_seed(heads + absorb))
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision)
    assert_decode(out, lse, ref.mla_decode_partial, args, torch.bfloat16, precision, f"MLA {heads} heads")
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_decode_cuda_source_precisions_at_the_design_shapes(simt_ops, group, head_dim, precision):
    from conftest import paged_cache, randn
    gen = torch.Generator().manual_seed(group + head_dim)
    lens = [0, 1, 37, 130]
    k, table = paged_cache(lens, 16, (2, head_dim), torch.float16, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=torch.float16, gen=gen))
    q = randn(len(lens), 2 * group, head_dim, dtype=torch.float16, gen=gen)
    args = (q, k, v, table, torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5)
    out, lse = simt_ops.gqa_decode_partial(*args, precision=precision)
    assert_decode(out, lse, ref.gqa_decode_partial, args, torch.float16, precision, f"GQA group {group}")
