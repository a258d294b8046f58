"""dcp_attention across real gloo process groups: each rank's result equals unsharded float64 attention for its heads."""
import dataclasses
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

import dcp_ops
from dcp_ops import reference as ref
from conftest import init_gloo, spawn_ranks
from tolerances import assert_lse_matches, assert_matches, assert_within_baseline


def _case(world, kind, absorb, interleave, gen, rope=16):
    lens = [27, 0, 31]
    if kind == "gqa":
        k = torch.randn(12, 8, 2, 32, generator=gen)
        v = torch.randn(12, 8, 2, 32, generator=gen)
        table = torch.randperm(12, generator=gen)[:12].view(3, 4).int()
        q = torch.randn(3, 4 * world, 32, generator=gen)
        return dict(kind=kind, caches=(k, v), table=table, lens=lens, q=q, scale=32 ** -0.5)
    kv = torch.randn(12, 8, 48 + rope, generator=gen)
    table = torch.randperm(12, generator=gen).view(3, 4).int()
    H = 2 * world
    w_uk = torch.randn(H, 24, 48, generator=gen) * 0.2 if absorb else None
    w_uv = torch.randn(H, 48, 20, generator=gen) * 0.2 if absorb else None
    q = torch.randn(3, H, (24 if absorb else 48) + rope, generator=gen)
    return dict(kind=kind, caches=(kv,), table=table, lens=lens, q=q, scale=0.15, w_uk=w_uk, w_uv=w_uv, rope=rope)


def _expected(c):
    """Unsharded float64 (out [T, H, D_out], lse [T, H]) over all heads."""
    seq_lens = torch.tensor(c["lens"], dtype=torch.int32)
    if c["kind"] == "gqa":
        return ref.gqa_decode_partial(c["q"], *c["caches"], c["table"], seq_lens, c["scale"])
    q, split = c["q"], c["q"].shape[-1] - c["rope"]
    return ref.mla_decode_partial(q[..., :split], q[..., split:], c["caches"][0], c["table"], seq_lens, c["scale"],
                                  c["w_uk"], c["w_uv"])


def _worker(rank, world, init_file, split):
    init_gloo(rank, world, init_file)
    if split:  # two DCP groups of world/2 ranks inside the world (as TP 4 / DCP 2)
        n = world // 2
        groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(2)]
        group, grank, gsize = groups[rank // n], rank % n, n
    else:
        group, grank, gsize = None, rank, world
    for kind, absorb, rope in (("gqa", False, 0), ("mla", False, 16), ("mla", True, 16), ("mla", True, 0)):
        for interleave in (1, 4):
            c = _case(gsize, kind, absorb, interleave, torch.Generator().manual_seed(7), rope)
            seq_lens = torch.tensor(c["lens"], dtype=torch.int32)
            local = dcp_ops.local_seq_lens(seq_lens, gsize, grank, interleave)
            shards = [dcp_ops.shard_kv(x, c["table"], seq_lens, gsize, interleave, fill=float("nan"))[grank]
                      for x in c["caches"]]
            shard = (dcp_ops.GQAShard(shards[0], shards[1], c["table"], local, c["scale"]) if kind == "gqa" else
                     dcp_ops.MLAShard(shards[0], c["table"], local, c["scale"], rope, c["w_uk"], c["w_uv"]))
            H = c["q"].shape[1]
            h_loc = H // gsize
            mine = slice(grank * h_loc, (grank + 1) * h_loc)
            want_all, want_lse_all = _expected(c)
            ws = dcp_ops.Workspace()
            for mode in ("a2a", "ag_rs", "ag"):
                for replicated in (False, True):
                    q = c["q"] if replicated else c["q"][:, mine].contiguous()
                    out, lse = dcp_ops.dcp_attention(q, shard, group, mode=mode, q_replicated=replicated,
                                                     return_lse=True, workspace=ws)
                    heads = slice(None) if mode == "ag" else mine  # "ag" returns every head
                    want, want_lse = want_all[:, heads], want_lse_all[:, heads]
                    what = f"rank {rank} {kind} absorb={absorb} I={interleave} {mode} q_replicated={replicated}"
                    assert_matches(out, want, torch.float32, what)
                    assert bool((lse[1] == float("-inf")).all())  # request 1 is empty on every rank
                    assert_lse_matches(lse, want_lse, what)
                    made = ws.allocations  # the same step again reuses every buffer, and returns the same ones
                    again = dcp_ops.dcp_attention(q, shard, group, mode=mode, q_replicated=replicated,
                                                  return_lse=True, workspace=ws)
                    assert ws.allocations == made, what
                    kept = {"a2a": (out, lse), "ag_rs": (out,), "ag": ()}[mode]  # results that are workspace buffers
                    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again, kept)), what
            if kind == "gqa" and interleave == 1:  # merge_across: only ag_rs rescales its input, in place
                part, part_lse = dcp_ops.gqa_decode_partial(c["q"], *shards, c["table"], local, c["scale"])
                for mode in ("a2a", "ag", "ag_rs"):
                    mine_out = part.clone()
                    _, total = dcp_ops.merge_across(mine_out, part_lse, group, mode=mode)
                    if mode == "ag_rs":
                        scale = (part_lse[:, mine] - total).exp().nan_to_num(0.0).unsqueeze(-1)
                        torch.testing.assert_close(mine_out[:, mine], part[:, mine] * scale)
                    else:
                        assert torch.equal(mine_out, part), mode
            if kind == "mla" and interleave == 1:  # a rope_dim the query cannot hold is refused by name
                bad = dataclasses.replace(shard, rope_dim=c["q"].shape[-1])
                with pytest.raises(ValueError, match="MLAShard.rope_dim must be in"):
                    dcp_ops.dcp_attention(c["q"], bad, group, q_replicated=True)
                if absorb:  # w_uk / w_uv fix the latent width: a rope_dim that disagrees with them is refused
                    bad = dataclasses.replace(shard, rope_dim=rope + 8)
                    with pytest.raises(ValueError, match=f"rope_dim {rope + 8} does not match the cache and w_uk"
                                                         f".*rope_dim must be {rope}"):
                        dcp_ops.dcp_attention(c["q"], bad, group, q_replicated=True)
    dist.barrier()  # no rank leaves while another still exchanges
    dist.destroy_process_group()


@pytest.mark.parametrize("world,split", [(2, False), (3, False), (4, True), (6, True)])
def test_dcp_attention_matches_unsharded(world, split):
    spawn_ranks(_worker, world, split)


def _low_precision_worker(rank, world, init_file):
    """bf16 / fp16 in every mode: the merge accumulates in fp32 (docs/design.md §2), so the result is within 2x of the
    same-precision baseline: partials rounded to the dtype, merged exactly, rounded once (docs/design.md §7)."""
    init_gloo(rank, world, init_file)
    gen = torch.Generator().manual_seed(11)
    lens = torch.tensor([300, 0, 77, 513], dtype=torch.int32)
    block_size, Hkv, G, D = 16, 1, 8 * world, 64
    num_blocks = len(lens) * math.ceil(int(lens.max()) / block_size)
    table = torch.randperm(num_blocks, generator=gen).view(len(lens), -1).int()
    local = dcp_ops.local_seq_lens(lens, world, rank)
    h_loc = Hkv * G // world
    mine = slice(rank * h_loc, (rank + 1) * h_loc)
    for dtype in (torch.bfloat16, torch.float16):
        k, v = (torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype) for _ in range(2))
        q = (torch.randn(len(lens), Hkv * G, D, generator=gen) * 2).to(dtype)
        scale = D ** -0.5
        want, _ = ref.gqa_decode_partial(q, k, v, table, lens, scale)
        shards = [dcp_ops.shard_kv(x, table, lens, world, fill=float("nan")) for x in (k, v)]
        parts = [ref.gqa_decode_partial(q, shards[0][r], shards[1][r], table,
                                        dcp_ops.local_seq_lens(lens, world, r), scale) for r in range(world)]
        base, _ = ref.merge_partials(torch.stack([p[0].to(dtype) for p in parts]),
                                     torch.stack([p[1] for p in parts]))
        shard = dcp_ops.GQAShard(shards[0][rank], shards[1][rank], table, local, scale)
        for mode in ("a2a", "ag_rs", "ag"):
            out = dcp_ops.dcp_attention(q[:, mine].contiguous(), shard, mode=mode)
            heads = slice(None) if mode == "ag" else mine
            assert out.dtype == dtype
            assert_within_baseline(out, want[:, heads], base[:, heads].to(dtype), f"rank {rank} {dtype} {mode}")
        # merge_across("ag_rs") still rescales a bf16 / fp16 input in place (its fp32 terms rounded to the dtype)
        part, part_lse = dcp_ops.gqa_decode_partial(q, shards[0][rank], shards[1][rank], table, local, scale)
        rescaled = part.clone()
        _, total = dcp_ops.merge_across(rescaled, part_lse, mode="ag_rs")
        w = (part_lse[:, mine] - total).exp().nan_to_num(0.0).unsqueeze(-1)
        assert_matches(rescaled[:, mine], part[:, mine].double() * w, dtype, f"rank {rank} {dtype} ag_rs in place")
    dist.barrier()  # no rank leaves while another still exchanges
    dist.destroy_process_group()


def test_dcp_attention_low_precision_merges_in_fp32():
    world = 5
    spawn_ranks(_low_precision_worker, world)


def test_exchange_bytes_shrinks_with_w_uv():
    latent = dcp_ops.exchange_bytes("a2a", 8, 128, 512, 4, torch.bfloat16)
    up = dcp_ops.exchange_bytes("a2a", 8, 128, 128, 4, torch.bfloat16)
    assert up < latent / 3.5
    with pytest.raises(ValueError, match="mode must be one of"):
        dcp_ops.exchange_bytes("ring", 8, 128, 128, 4, torch.bfloat16)


def _nan_worker(rank, world, init_file):
    """A NaN in one rank's attended key reaches every rank's output for that sequence, in every mode (the merge
    propagates our partials' NaN LSE); the other sequences stay finite and exact."""
    init_gloo(rank, world, init_file)
    for kind in ("gqa", "mla"):
        c = _case(world, kind, False, 1, torch.Generator().manual_seed(3))
        seq_lens = torch.tensor(c["lens"], dtype=torch.int32)
        caches = [x.clone() for x in c["caches"]]
        block, off = int(c["table"][2, 0]), 5  # sequence 2, global position 5: owned by rank 5 % world
        caches[0][block, off][..., 1] = float("nan")  # every KV head: every query head
        c["caches"] = tuple(caches)
        local = dcp_ops.local_seq_lens(seq_lens, world, rank)
        shards = [dcp_ops.shard_kv(x, c["table"], seq_lens, world, fill=float("nan"))[rank] for x in caches]
        shard = (dcp_ops.GQAShard(shards[0], shards[1], c["table"], local, c["scale"]) if kind == "gqa" else
                 dcp_ops.MLAShard(shards[0], c["table"], local, c["scale"], c["rope"]))
        want, want_lse = _expected(c)
        h_loc = c["q"].shape[1] // world
        mine = slice(rank * h_loc, (rank + 1) * h_loc)
        for mode in ("a2a", "ag_rs", "ag"):
            out, lse = dcp_ops.dcp_attention(c["q"][:, mine].contiguous(), shard, mode=mode, return_lse=True)
            heads = slice(None) if mode == "ag" else mine
            what = f"rank {rank} {kind} {mode}"
            assert torch.equal(torch.isnan(out), torch.isnan(want[:, heads])), what
            assert torch.equal(torch.isnan(lse), torch.isnan(want_lse[:, heads])), what
            assert torch.isnan(lse[2]).any() and torch.isfinite(out[0]).all(), what
            assert_matches(out[0], want[0, heads], torch.float32, what)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_attention_propagates_a_nan(world):
    spawn_ranks(_nan_worker, world)


def _mismatch_worker(rank, world, init_file):
    """check_group=True: ranks that disagree on a step all raise the same ValueError naming the field and each rank's
    value, with no abort and no hang; a consistent step passes the check and runs."""
    init_gloo(rank, world, init_file)
    c = _case(world, "gqa", False, 1, torch.Generator().manual_seed(5))
    seq_lens = torch.tensor(c["lens"], dtype=torch.int32)
    p = dcp_ops.Placement(world, rank, 8)
    shard = dcp_ops.GQAShard(*(p.shard_kv(x, c["table"], seq_lens) for x in c["caches"]), c["table"],
                             p.local_seq_lens(seq_lens), c["scale"])
    h_loc = c["q"].shape[1] // world
    q = c["q"][:, rank * h_loc:(rank + 1) * h_loc].contiguous()
    cases = [  # (what differs, this rank's q, mode, expected message)
        ("T", q[:2] if rank == 1 else q, "a2a", "disagree on T (query tokens): rank 0: 3, rank 1: 2"),
        ("mode", q, "ag" if rank == 1 else "a2a", "disagree on mode: rank 0: 'a2a', rank 1: 'ag'"),
        ("dtype", q.double().float() if rank == 0 else q, "a2a", None),  # the same dtype: no error
    ]
    for what, q_r, mode, msg in cases:
        if msg is None:
            dcp_ops.dcp_attention(q_r, shard, mode=mode, check_group=True)
            continue
        with pytest.raises(ValueError, match=re.escape("dcp_attention: the ranks of the group " + msg)):
            dcp_ops.dcp_attention(q_r, shard, mode=mode, check_group=True)
    os.environ["DCP_OPS_CHECK_GROUP"] = "1"  # the environment switch does the same
    with pytest.raises(ValueError, match="disagree on q_replicated"):
        dcp_ops.dcp_attention(c["q"] if rank == 0 else q, shard, q_replicated=rank == 0)
    del os.environ["DCP_OPS_CHECK_GROUP"]
    dist.barrier()
    dist.destroy_process_group()


def test_a_group_that_disagrees_raises_the_same_named_error_on_every_rank():
    spawn_ranks(_mismatch_worker, 2)
