"""The central invariant: shard an unsharded cache, attend per shard, merge == unsharded attention."""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn
from tolerances import assert_lse_matches, assert_matches, assert_within_baseline

world_st = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8])


def interleave_for(choice, block_size):
    return {"one": 1, "two": 2 if block_size % 2 == 0 else 1, "block": block_size}[choice]


@given(dtype=st.sampled_from(DTYPES), N=world_st, inter=st.sampled_from(["one", "two", "block"]),
       block_size=st.sampled_from([4, 16]), lens=st.lists(st.integers(0, 120), min_size=1, max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_gqa_shard_merge_equals_unsharded(dtype, N, inter, block_size, lens, seed):
    I = interleave_for(inter, block_size)
    gen = torch.Generator().manual_seed(seed)
    Hkv, G, D = 2, 4, 64
    k, table = paged_cache(lens, block_size, (Hkv, D), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), Hkv * G, D, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    nan = float("nan")
    k_shards = dcp_ops.shard_kv(k, table, seq_lens, N, I, fill=nan)
    v_shards = dcp_ops.shard_kv(v, table, seq_lens, N, I, fill=nan)
    outs, lses = [], []
    for r in range(N):
        o, lse = dcp_ops.gqa_decode_partial(q, k_shards[r], v_shards[r], table,
                                            dcp_ops.local_seq_lens(seq_lens, N, r, I), D ** -0.5)
        outs.append(o)
        lses.append(lse)
    out, lse = dcp_ops.merge_partials(torch.stack(outs), torch.stack(lses))
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, D ** -0.5)
    if dtype == torch.float32:
        assert_matches(out, r_out, dtype, "merged out")
    else:  # partials are rounded to the dtype before the merge, the merge rounds again
        parts = [ref.gqa_decode_partial(q, k_shards[r], v_shards[r], table,
                                        dcp_ops.local_seq_lens(seq_lens, N, r, I), D ** -0.5) for r in range(N)]
        base, _ = ref.merge_partials(torch.stack([p[0].to(dtype) for p in parts]), torch.stack([p[1] for p in parts]))
        assert_within_baseline(out, r_out, base.to(dtype), "merged out")
    assert_lse_matches(lse, r_lse, "merged lse")


@given(N=world_st, inter=st.sampled_from(["one", "two", "block"]), absorb=st.booleans(), up=st.booleans(),
       lens=st.lists(st.integers(0, 100), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_mla_shard_merge_equals_unsharded(N, inter, absorb, up, lens, seed):
    block_size = 8
    I = interleave_for(inter, block_size)
    gen = torch.Generator().manual_seed(seed)
    H, latent, rope, d_nope, d_v = 4, 64, 16, 32, 24
    kv, table = paged_cache(lens, block_size, (latent + rope,), torch.float32, gen)
    w_uk = randn(H, d_nope, latent, gen=gen, scale=d_nope ** -0.5) if absorb else None
    w_uv = randn(H, latent, d_v, gen=gen, scale=latent ** -0.5) if up else None
    q_nope = randn(len(lens), H, d_nope if absorb else latent, gen=gen)
    q_pe = randn(len(lens), H, rope, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    shards = dcp_ops.shard_kv(kv, table, seq_lens, N, I, fill=float("nan"))
    parts = [dcp_ops.mla_decode_partial(q_nope, q_pe, shards[r], table, dcp_ops.local_seq_lens(seq_lens, N, r, I),
                                        scale, w_uk, w_uv) for r in range(N)]
    out, lse = dcp_ops.merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    r_out, r_lse = ref.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv)
    assert_matches(out, r_out, torch.float32, "merged out")
    assert_lse_matches(lse, r_lse, "merged lse")
    empty = seq_lens == 0
    assert bool((lse[empty] == -math.inf).all())
