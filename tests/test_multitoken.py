"""Multi-token decode (speculative decoding, MTP; docs/design.md §6): query tokens cu_seqlens_q[b] .. [b+1]-1 of
block-table row b, each attending this rank's keys at global positions up to its own (local_causal_lens). The central
invariant: every rank's partial over its shard, merged, equals causal attention over the unsharded cache."""
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref
from conftest import init_gloo, paged_cache, randn, spawn_ranks
from tolerances import assert_decode, assert_lse_matches, assert_matches

I32 = torch.int32


def _queries(lens, n_q):
    """The global positions of the last n_q[b] tokens of each sequence b [T], and cu_seqlens_q [B + 1]."""
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, n_q)])
    return positions, torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist(), dtype=I32)


def _batch(lens, n_q, block_size, kind, dtype, gen, heads=4, rope=16, absorb=False, head_dim=32, latent=48):
    """An unsharded paged cache holding every sequence's tokens (draft tokens included) and the queries: the last
    n_q[b] positions of sequence b. Returns (cache tensors, table, q args, positions [T], cu_seqlens_q [B + 1])."""
    if kind == "gqa":
        k, table = paged_cache(lens, block_size, (2, head_dim), dtype, gen)
        v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
        caches = (k, v)
    else:
        kv, table = paged_cache(lens, block_size, (latent + rope,), dtype, gen)
        caches = (kv,)
    positions, cu = _queries(lens, n_q)
    T = int(cu[-1])
    if kind == "gqa":
        qargs = (randn(T, 2 * heads, head_dim, dtype=dtype, gen=gen),)
    else:
        w_uk = randn(heads, 24, latent, dtype=dtype, gen=gen, scale=24 ** -0.5) if absorb else None
        w_uv = randn(heads, latent, 20, dtype=dtype, gen=gen, scale=latent ** -0.5) if absorb else None
        qargs = (randn(T, heads, 24 if absorb else latent, dtype=dtype, gen=gen),
                 randn(T, heads, rope, dtype=dtype, gen=gen), w_uk, w_uv)
    return caches, table, qargs, positions, cu


def _call(fn, kind, caches, table, qargs, seq_lens, cu, scale, **kw):
    if kind == "gqa":
        return fn(qargs[0], *caches, table, seq_lens, scale, cu_seqlens_q=cu, **kw)
    return fn(qargs[0], qargs[1], caches[0], table, seq_lens, scale, qargs[2], qargs[3], cu_seqlens_q=cu, **kw)


def _ref(kind, caches, table, qargs, seq_lens, cu, scale, **kw):
    if kind == "gqa":
        return ref.gqa_decode_partial(qargs[0], *caches, table, seq_lens, scale, cu_seqlens_q=cu, **kw)
    return ref.mla_decode_partial(qargs[0], qargs[1], caches[0], table, seq_lens, scale, qargs[2], qargs[3],
                                  cu_seqlens_q=cu, **kw)


def _check_invariant(op_of, kind, world, interleave, block_size, lens, n_q, absorb, seed, **dims):
    gen = torch.Generator().manual_seed(seed)
    caches, table, qargs, positions, cu = _batch(lens, n_q, block_size, kind, torch.float32, gen, absorb=absorb,
                                                 **dims)
    seq_lens = torch.tensor(lens, dtype=I32)
    outs, lses = [], []
    for r in range(world):
        place = dcp_ops.Placement(world, r, block_size, interleave)
        shards = [place.shard_kv(c, table, seq_lens, fill=float("nan")) for c in caches]
        local = dcp_ops.local_causal_lens(positions, world, r, interleave)
        out, lse = _call(op_of, kind, shards, table, qargs, local, cu, 0.2)
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = ref.merge_partials(torch.stack(outs), torch.stack(lses))
    want, want_lse = _ref(kind, caches, table, qargs, (positions + 1).int(), cu, 0.2)  # causal, unsharded
    what = f"{kind} world {world} I={interleave} bs={block_size} lens={lens} n_q={n_q}"
    assert_matches(merged, want, torch.float32, what)
    assert_lse_matches(merged_lse.float(), want_lse, what)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["gqa", "mla"]), world=st.integers(1, 6), i_kind=st.sampled_from(["1", "2", "bs"]),
       block_size=st.sampled_from([2, 4, 8]), seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 5)),
                                                           min_size=1, max_size=4),
       absorb=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sharded_multi_token_decode_is_causal_attention(kind, world, i_kind, block_size, seqs, absorb, seed):
    interleave = {"1": 1, "2": 2, "bs": block_size}[i_kind]
    lens = [max(n, q) for n, q in seqs]
    n_q = [q for _, q in seqs]
    _check_invariant(dcp_ops.ops._ops.gqa_decode_partial if kind == "gqa" else dcp_ops.ops._ops.mla_decode_partial,
                     kind, world, interleave, block_size, lens, n_q, absorb, seed)


def test_a_rank_that_owns_none_of_a_querys_keys_gives_it_an_empty_row():
    # world 4, interleave 4: positions 0-3 on rank 0 only; a query at position 1 has no key on ranks 1-3
    gen = torch.Generator().manual_seed(1)
    caches, table, qargs, positions, cu = _batch([2, 9], [2, 3], 4, "gqa", torch.float32, gen)
    local = dcp_ops.local_causal_lens(positions, 4, 2, 4)
    assert local.tolist() == [0, 0, 0, 0, 1]
    out, lse = dcp_ops.gqa_decode_partial(qargs[0], *caches, table, local, 0.2, cu_seqlens_q=cu)
    assert (lse[:4] == -math.inf).all() and (out[:4] == 0).all() and torch.isfinite(lse[4]).all()
    _check_invariant(dcp_ops.ops._ops.gqa_decode_partial, "gqa", 4, 4, 4, [2, 9], [2, 3], False, 1)


@pytest.mark.simt
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("world,interleave", [(1, 1), (3, 1), (2, 4)])
def test_sharded_multi_token_decode_cuda_source(simt_ops, kind, world, interleave):
    # dims the CUDA kernels take (GQA head dim 64, MLA 128 + 64), fp32: the SIMT kernels
    _check_invariant(simt_ops.gqa_decode_partial if kind == "gqa" else simt_ops.mla_decode_partial, kind, world,
                     interleave, 4, [37, 5, 1, 20], [3, 5, 1, 2], kind == "mla", 7, head_dim=64, latent=128, rope=64)


def _gqa_cuda_source_case(simt_ops, lens, n_q, heads, dtype, precision, gen):
    """The CUDA source of gqa_decode_partial (2 KV heads of d64, blocks of 16) on the last n_q[b] tokens of each
    sequence as queries, causal, against the multi-token reference."""
    k, table = paged_cache(lens, 16, (2, 64), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    positions, cu = _queries(lens, n_q)
    seq_lens = (positions + 1).int()
    q = randn(len(positions), heads, 64, dtype=dtype, gen=gen)
    out, lse = simt_ops.gqa_decode_partial(q, k, v, table, seq_lens, 0.125, precision=precision, cu_seqlens_q=cu)
    assert_decode(out, lse, ref.gqa_decode_partial, (q, k, v, table, seq_lens, 0.125), dtype, precision,
                  f"GQA {heads}q/2kv multi-token", cu_seqlens_q=cu)


def _mla_cuda_source_case(simt_ops, lens, n_q, heads, dtype, precision, gen):
    """The same for mla_decode_partial, latent 256 + rope 64."""
    kv, table = paged_cache(lens, 16, (256 + 64,), dtype, gen)
    positions, cu = _queries(lens, n_q)
    seq_lens = (positions + 1).int()
    T = len(positions)
    args = (randn(T, heads, 256, dtype=dtype, gen=gen), randn(T, heads, 64, dtype=dtype, gen=gen), kv, table, seq_lens,
            320 ** -0.5)
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision, cu_seqlens_q=cu)
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, precision, f"MLA {heads} heads multi-token",
                  cu_seqlens_q=cu)


@pytest.mark.simt
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_token_decode_on_tensor_cores(simt_ops, dtype, precision):
    """The tensor-core kernels (GQA d64; MLA 256 + 64, the tiled one in native) with query rows of several tokens of a
    sequence, against the multi-token reference."""
    gen = torch.Generator().manual_seed(3)
    _gqa_cuda_source_case(simt_ops, [130, 17, 64], [4, 1, 2], 8, dtype, precision, gen)
    _mla_cuda_source_case(simt_ops, [130, 17, 64], [4, 1, 2], 16, dtype, precision, gen)


@pytest.mark.simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch,optin,kernel", [
    ("80", 100000, "mla_tiled_kernel"), ("80", 60000, "mla_mma_kernel"),
    ("90", 100000, "mla_wgmma_kernel"), ("90", 60000, "mla_mma_kernel"),
], ids=["bn32", "fallback", "wgmma-bn32", "wgmma-fallback"])
def test_native_mla_with_less_shared_memory(simt_ops, monkeypatch, dtype, arch, optin, kernel):
    """Native 16-bit MLA 256 + 64 multi-token where a block may opt in to less shared memory: 100000 bytes take the
    tiled kernel's 32-token tiles (87552 bytes; 64 need 132864), or on sm_90 with the wgmma pass switched on its
    twin's (87424 bytes); 60000 bytes hold no tile, so the launcher falls back to the split-term kernel (an fp32
    query: more accurate than native asks). The executor's kernel log tells which ran."""
    monkeypatch.setenv("DCP_SIMT_ARCH", arch)
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1" if arch == "90" else "0")
    monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(optin % 97)
    lens, n_q = [100, 40], [3, 2]
    kv, table = paged_cache(lens, 16, (256 + 64,), dtype, gen)
    positions, cu = _queries(lens, n_q)
    T = len(positions)
    args = (randn(T, 16, 256, dtype=dtype, gen=gen), randn(T, 16, 64, dtype=dtype, gen=gen), kv, table,
            (positions + 1).int(), 320 ** -0.5)
    simt_ops.kernel_log(True)
    out, lse = simt_ops.mla_decode_partial(*args, cu_seqlens_q=cu)
    ran = [k for k in simt_ops.kernel_log(True) if k.startswith("mla_")]
    assert len(ran) == 1 and ran[0].startswith(kernel + "<"), ran
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, "native", f"MLA native, optin {optin}",
                  cu_seqlens_q=cu)


@pytest.mark.simt
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("heads", [5, 24])
def test_multi_token_rows_that_straddle_row_tiles(simt_ops, heads, precision):
    """Head counts that do not divide a block's rows (64 tiled, 16 on mma.sync, 4 SIMT): a query token's heads land in
    two row tiles of its sequence, each masked at the token's own length."""
    _mla_cuda_source_case(simt_ops, [90, 7, 33], [14, 1, 3], heads, torch.bfloat16, precision,
                          torch.Generator().manual_seed(heads))


@pytest.mark.simt
@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "native"), (torch.bfloat16, "fp32"),
                                             (torch.float32, "native")])
def test_gqa_multi_token_rows_that_straddle_row_tiles(simt_ops, dtype, precision):
    """3 query heads per KV head: a token's heads land in two row tiles (16 rows on mma.sync, 8 in the SIMT kernel)."""
    _gqa_cuda_source_case(simt_ops, [90, 7, 33], [14, 1, 3], 6, dtype, precision, torch.Generator().manual_seed(11))


CU_BAD = [
    (torch.tensor([0, 2, 3], dtype=I32), r"cu_seqlens_q.shape\[0\] \(B \+ 1, one more than block_table's rows\) "
                                         r"must be 4, got 3"),
    (torch.tensor([1, 2, 3, 4], dtype=I32), r"cu_seqlens_q\[0\] must be 0, got 1"),
    (torch.tensor([0, 3, 2, 4], dtype=I32), r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[2\] = 2 < "
                                            r"cu_seqlens_q\[1\] = 3"),
    (torch.tensor([0, 1, 2, 3], dtype=I32), r"cu_seqlens_q\[B = 3\] must be the number of query tokens T = 4, got 3"),
    (torch.tensor([0, 1, 2, 4]), "cu_seqlens_q must have dtype Int, got Long"),
    (torch.tensor([[0, 1, 2, 4]], dtype=I32), r"cu_seqlens_q must be 1-D \[B \+ 1\]"),
]


@pytest.mark.parametrize("cu,msg", CU_BAD)
def test_cu_seqlens_q_is_checked_by_name(cu, msg):
    k = torch.randn(4, 8, 1, 16)
    table = torch.tensor([[0], [1], [2]], dtype=I32)
    with pytest.raises(RuntimeError, match="gqa_decode_partial: " + msg):
        dcp_ops.gqa_decode_partial(torch.randn(4, 2, 16), k, k, table, torch.ones(4, dtype=I32), 0.1, cu_seqlens_q=cu)
    with pytest.raises(RuntimeError, match="mla_decode_partial: " + msg):
        dcp_ops.mla_decode_partial(torch.randn(4, 2, 12), torch.randn(4, 2, 4), torch.randn(4, 8, 16), table,
                                   torch.ones(4, dtype=I32), 0.1, cu_seqlens_q=cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,heads", [("gqa", 2), ("gqa", 12), ("mla", 16), ("mla", 5)])
def test_cpu_units_of_a_sequences_query_tokens(kind, heads, dtype):
    """The CPU kernels take up to 8 query tokens of a sequence as one unit of work sharing each KV tile's reads, each
    token masked at its own length: 14 draft tokens (two units), 9, 1 and an empty sequence's none, through the FMA,
    bf16 dot-product (and AMX, where built) paths of GQA and MLA."""
    gen = torch.Generator().manual_seed(heads)
    lens, n_q = [300, 40, 77, 1], [14, 9, 1, 0]
    caches, table, qargs, positions, cu = _batch(lens, n_q, 16, kind, dtype, gen, heads=heads, rope=16, latent=64)
    seq_lens = (positions + 1).int()
    op = dcp_ops.ops._ops.gqa_decode_partial if kind == "gqa" else dcp_ops.ops._ops.mla_decode_partial
    out, lse = _call(op, kind, caches, table, qargs, seq_lens, cu, 0.2)
    fn = ref.gqa_decode_partial if kind == "gqa" else ref.mla_decode_partial
    args = ((qargs[0], *caches, table, seq_lens, 0.2) if kind == "gqa" else
            (qargs[0], qargs[1], caches[0], table, seq_lens, 0.2, qargs[2], qargs[3]))
    assert_decode(out, lse, fn, args, dtype, "native", f"cpu units {kind} {heads} heads {dtype}", cu_seqlens_q=cu)


def test_a_block_id_outside_the_cache_names_the_sequences_row():
    k = torch.randn(4, 8, 1, 16)
    table, cu = torch.tensor([[0, 1], [2, 9]], dtype=I32), torch.tensor([0, 3, 5], dtype=I32)
    with pytest.raises(RuntimeError, match=r"block_table\[1, 1\] = 9 is outside the cache's \[0, num_blocks = 4\)"):
        dcp_ops.gqa_decode_partial(torch.randn(5, 2, 16), k, k, table, torch.tensor([1, 2, 3, 8, 9], dtype=I32), 0.1,
                                   cu_seqlens_q=cu)


def test_seq_lens_are_per_query_token():
    k = torch.randn(4, 8, 1, 16)
    table, cu = torch.tensor([[0], [1]], dtype=I32), torch.tensor([0, 3, 4], dtype=I32)
    with pytest.raises(RuntimeError, match=r"seq_lens.shape\[0\]"):
        dcp_ops.gqa_decode_partial(torch.randn(4, 2, 16), k, k, table, torch.ones(2, dtype=I32), 0.1, cu_seqlens_q=cu)
    with pytest.raises(RuntimeError, match=r"seq_lens\[3\] = 9 must be in \[0, max_blocks \* block_size = 8\]"):
        dcp_ops.gqa_decode_partial(torch.randn(4, 2, 16), k, k, table, torch.tensor([1, 2, 3, 9], dtype=I32), 0.1,
                                   cu_seqlens_q=cu)


def test_multi_token_ops_trace_with_their_fake_kernels():
    k = torch.randn(4, 8, 1, 16)
    args = (torch.randn(4, 2, 16), k, k, torch.tensor([[0], [1]], dtype=I32), torch.tensor([1, 2, 3, 5], dtype=I32),
            0.25)
    torch.library.opcheck(torch.ops.dcp_ops.gqa_decode_partial, args,
                          {"cu_seqlens_q": torch.tensor([0, 3, 4], dtype=I32)})
    mla = (torch.randn(4, 2, 12), torch.randn(4, 2, 4), torch.randn(4, 8, 16), torch.tensor([[0], [1]], dtype=I32),
           torch.tensor([1, 2, 3, 5], dtype=I32), 0.25)
    torch.library.opcheck(torch.ops.dcp_ops.mla_decode_partial, mla,
                          {"cu_seqlens_q": torch.tensor([0, 3, 4], dtype=I32)})


def _dcp_worker(rank, world, init_file):
    """dcp_attention on multi-token batches in every mode, with the query gathered and replicated, GQA and MLA
    (w_uk, w_uv): each rank's heads equal causal attention over the unsharded cache."""
    init_gloo(rank, world, init_file)
    lens, n_q = [23, 4, 31], [3, 1, 4]
    for kind, absorb in (("gqa", False), ("mla", True), ("mla", False)):
        gen = torch.Generator().manual_seed(11)
        caches, table, qargs, positions, cu = _batch(lens, n_q, 4, kind, torch.float32, gen, heads=2 * world,
                                                     absorb=absorb)
        seq_lens = torch.tensor(lens, dtype=I32)
        place = dcp_ops.Placement(world, rank, 4, 2)
        shards = [place.shard_kv(c, table, seq_lens, fill=float("nan")) for c in caches]
        local = place.local_causal_lens(positions)
        if kind == "gqa":
            shard = dcp_ops.GQAShard(*shards, table, local, 0.2, cu_seqlens_q=cu, placement=place)
            q = qargs[0]
        else:
            shard = dcp_ops.MLAShard(shards[0], table, local, 0.2, 16, qargs[2], qargs[3], cu_seqlens_q=cu,
                                     placement=place)
            q = torch.cat([qargs[0], qargs[1]], -1)
        want, want_lse = _ref(kind, caches, table, qargs, (positions + 1).int(), cu, 0.2)
        h_loc = q.shape[1] // world
        mine = slice(rank * h_loc, (rank + 1) * h_loc)
        for mode in ("a2a", "ag_rs", "ag"):
            for replicated in (False, True):
                out, lse = dcp_ops.dcp_attention(q if replicated else q[:, mine].contiguous(), shard, mode=mode,
                                                 q_replicated=replicated, return_lse=True)
                heads = slice(None) if mode == "ag" else mine
                what = f"rank {rank} {kind} absorb={absorb} {mode} replicated={replicated}"
                assert out.shape[0] == q.shape[0], what
                assert_matches(out, want[:, heads], torch.float32, what)
                assert_lse_matches(lse, want_lse[:, heads], what)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_attention_multi_token(world):
    spawn_ranks(_dcp_worker, world)
