"""dcp_ops.Placement, a rank's one source of KV placement (docs/design.md §3), and the engine path it serves: prefill
KV written to its owners with slot_mapping + write_kv, decode lengths from local_seq_lens, shards that refuse a group
they were not written for; per-step helpers that read no device data on the host (compiled with fullgraph=True, run
on meta tensors) and return int32."""
import datetime

import pytest
import torch
import torch.distributed as dist

import dcp_ops
from dcp_ops import reference as ref
from conftest import init_gloo, paged_cache, randn, spawn_ranks
from tolerances import assert_lse_matches, assert_matches

I32 = torch.int32


def _table(B, max_blocks, gen):
    return torch.randperm(B * max_blocks, generator=gen).view(B, max_blocks).int()


@pytest.mark.parametrize("world,rank,bs,interleave", [(1, 0, 16, 1), (2, 1, 16, 4), (3, 2, 8, 8), (4, 0, 4, 1)])
def test_methods_are_the_free_functions(world, rank, bs, interleave):
    gen = torch.Generator().manual_seed(world * 10 + rank)
    p = dcp_ops.Placement(world, rank, bs, interleave)
    table = _table(3, 6, gen)
    positions = torch.randint(0, 6 * bs * world, (50,), generator=gen)  # int64, as engines keep them
    seq_ids = torch.randint(0, 3, (50,), generator=gen)
    lens = torch.randint(0, 6 * bs * world + 1, (3,), generator=gen)
    pairs = [(p.owner_rank(positions), dcp_ops.owner_rank(positions, world, interleave)),
             (p.local_index(positions), dcp_ops.local_index(positions, world, interleave)),
             (p.local_seq_lens(lens), dcp_ops.local_seq_lens(lens, world, rank, interleave)),
             (p.local_causal_lens(positions), dcp_ops.local_causal_lens(positions, world, rank, interleave)),
             (p.slot_mapping(table, seq_ids, positions),
              dcp_ops.slot_mapping(table, seq_ids, positions, bs, world, rank, interleave))]
    for got, want in pairs:
        assert got.dtype == torch.int32 and torch.equal(got, want)
    # local_causal_lens: this rank's tokens at positions <= p, straight from the formula
    assert p.local_causal_lens(positions).tolist() == [ref.local_seq_len(q + 1, world, rank, interleave)
                                                       for q in positions.tolist()]
    cache = torch.randn(3 * 6, bs, 2, 8, generator=gen)
    lens = torch.randint(0, 6 * bs + 1, (3,), generator=gen)  # what the unsharded cache holds under this table
    assert torch.equal(p.shard_kv(cache, table, lens), dcp_ops.shard_kv(cache, table, lens, world, interleave)[rank])


def test_placement_refuses_bad_numbers():
    with pytest.raises(ValueError, match=r"Placement: rank must be in \[0, world_size = 2\), got 2"):
        dcp_ops.Placement(2, 2, 16)
    with pytest.raises(ValueError, match=r"Placement: interleave \(3\) must divide block_size \(16\)"):
        dcp_ops.Placement(2, 0, 16, 3)
    with pytest.raises(TypeError, match="Placement: block_size must be an int, got float"):
        dcp_ops.Placement(2, 0, 16.0)
    with pytest.raises(ValueError, match=r"Placement.shard_kv: cache must be \[num_blocks, block_size = 16"):
        dcp_ops.Placement(2, 0, 16).shard_kv(torch.zeros(4, 8, 3), torch.zeros(1, 1, dtype=I32),
                                             torch.zeros(1, dtype=I32))


def test_helpers_return_int32_that_the_ops_take():
    """An engine's int64 lengths go through local_seq_lens straight into the decode op."""
    gen = torch.Generator().manual_seed(1)
    k, table = paged_cache([20, 7], 8, (1, 16), torch.float32, gen)
    p = dcp_ops.Placement(2, 1, 8)
    lens = p.local_seq_lens(torch.tensor([40, 14]))  # int64 in
    assert lens.dtype == torch.int32 and lens.tolist() == [20, 7]
    out, _ = dcp_ops.gqa_decode_partial(randn(2, 2, 16, gen=gen), k, k, table, lens, 0.25)
    assert torch.isfinite(out).all()


def test_per_step_helpers_read_nothing_on_the_host():
    """On a device (here: meta tensors, which have no data to read) the helpers only launch tensor ops: no .item(),
    int() or .tolist() of their inputs. So they neither sync a GPU nor break a CUDA graph."""
    p = dcp_ops.Placement(4, 3, 16, 2)
    positions = torch.empty(10, dtype=torch.int64, device="meta")
    table = torch.empty(3, 5, dtype=I32, device="meta")
    seq_ids = torch.empty(10, dtype=I32, device="meta")
    for out in (p.owner_rank(positions), p.local_index(positions), p.local_causal_lens(positions),
                p.local_seq_lens(positions), p.slot_mapping(table, seq_ids, positions)):
        assert out.device.type == "meta" and out.dtype == torch.int32 and out.shape == (10,)


def test_per_step_helpers_compile_without_graph_breaks():
    p = dcp_ops.Placement(3, 1, 8, 2)

    def step(table, seq_ids, positions, seq_lens):
        return (p.slot_mapping(table, seq_ids, positions), p.local_seq_lens(seq_lens),
                p.local_causal_lens(positions), p.owner_rank(positions))

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    gen = torch.Generator().manual_seed(2)
    args = (_table(2, 4, gen), torch.randint(0, 2, (9,), generator=gen).int(),
            torch.randint(0, 4 * 8 * 3, (9,), generator=gen), torch.randint(0, 97, (2,), generator=gen))
    for got, want in zip(compiled(*args), step(*args)):
        assert torch.equal(got, want)


def test_slot_mapping_without_host_checks_never_writes_a_token_it_cannot_place(monkeypatch):
    """Where value checks do not run (a device; here forced off), a token with a row, column or block id out of range
    gets slot -1 (write_kv skips it) instead of a slot in some other request's block."""
    import dcp_ops.layout as layout
    monkeypatch.setattr(layout, "_host_checks", lambda *t: False)
    table = torch.tensor([[3, -1], [5, 6]], dtype=I32)
    seq_ids = torch.tensor([0, 0, 1, 2, -1, 1], dtype=I32)
    positions = torch.tensor([2, 9, 9, 0, 0, 40], dtype=I32)  # bs 4, world 2: column p // 8
    slots = dcp_ops.slot_mapping(table, seq_ids, positions, 4, 2, 0)
    # token 0: position 2, column 0 of row 0 (block 3), owner 0, local index 1 -> 13; token 1: row 0's column 1 is -1;
    # token 2: row 1 column 1 (block 6), position 9 is owned by rank 1; tokens 3, 4: rows out of range; token 5:
    # column 5 is past the table
    assert slots.tolist() == [13, -1, -1, -1, -1, -1]


def test_engine_path_prefill_by_slots_equals_the_shard():
    """The engine path (README): each rank writes the prompt's KV with its own slot_mapping + write_kv into an empty
    cache; what it holds is, slot for slot, Placement.shard of the cache an unsharded engine would hold."""
    gen = torch.Generator().manual_seed(4)
    world, bs, interleave = 3, 8, 2
    lens = [45, 0, 17]
    table = _table(3, 6, gen)  # enough columns for the unsharded cache (45 tokens / 8)
    unsharded = torch.full((18, bs, 2, 4), float("nan"))
    kv = [randn(n, 2, 4, gen=gen) for n in lens]
    for b, n in enumerate(lens):
        for pos in range(n):
            unsharded[table[b, pos // bs], pos % bs] = kv[b][pos]
    seq_ids = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    for rank in range(world):
        p = dcp_ops.Placement(world, rank, bs, interleave)
        cache = torch.full_like(unsharded, float("nan"))
        dcp_ops.write_kv(cache, torch.cat(kv), p.slot_mapping(table, seq_ids, positions))
        shard = p.shard_kv(unsharded, table, torch.tensor(lens), fill=float("nan"))
        assert torch.equal(cache.nan_to_num(7.0), shard.nan_to_num(7.0)), rank


def test_engine_path_into_fp8_caches_equals_the_shard_of_the_quantized_cache():
    """FP8 caches (write_kv with a scale): each rank's quantized writes hold, byte for byte, Placement.shard of the
    cache an unsharded engine would quantize; unshard_kv gives that cache back."""
    gen = torch.Generator().manual_seed(5)
    world, bs, interleave = 2, 4, 1
    lens = [13, 6]
    table = _table(2, 4, gen)
    fp8, scale = torch.float8_e4m3fn, torch.tensor([0.125])
    seq_ids = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    kv = randn(sum(lens), 3, 8, gen=gen) * 40  # some beyond 448 x scale: saturated
    whole = dcp_ops.Placement(1, 0, bs, interleave)
    unsharded = torch.zeros(8, bs, 3, 8).to(fp8)
    dcp_ops.write_kv(unsharded, kv, whole.slot_mapping(table, seq_ids, positions), scale=scale)
    shards = []
    for rank in range(world):
        p = dcp_ops.Placement(world, rank, bs, interleave)
        cache = torch.zeros(8, bs, 3, 8).to(fp8)
        dcp_ops.write_kv(cache, kv, p.slot_mapping(table, seq_ids, positions), scale=scale)
        shard = p.shard_kv(unsharded, table, torch.tensor(lens), fill=0.0)
        assert torch.equal(cache.view(torch.uint8), shard.view(torch.uint8)), rank
        shards.append(cache)
    back = dcp_ops.unshard_kv(shards, table, torch.tensor(lens), interleave, fill=0.0)
    assert torch.equal(back.view(torch.uint8), unsharded.view(torch.uint8))


@pytest.fixture
def group1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield None
    dist.destroy_process_group()


def test_a_shard_refuses_a_group_it_was_not_written_for(group1):
    gen = torch.Generator().manual_seed(5)
    k, table = paged_cache([9, 3], 8, (1, 16), torch.float32, gen)
    lens = torch.tensor([9, 3], dtype=I32)
    q = randn(2, 2, 16, gen=gen)
    ok = dcp_ops.GQAShard(k, k, table, lens, 0.25, placement=dcp_ops.Placement(1, 0, 8))
    assert_matches(dcp_ops.dcp_attention(q, ok), ref.gqa_decode_partial(q, k, k, table, lens, 0.25)[0],
                   torch.float32, "matching placement")
    with pytest.raises(ValueError, match="dcp_attention: shard.placement is for rank 1 of 2, but this is rank 0 of "
                                         "a group of 1"):
        dcp_ops.dcp_attention(q, dcp_ops.GQAShard(k, k, table, lens, 0.25, placement=dcp_ops.Placement(2, 1, 8)))
    with pytest.raises(ValueError, match="dcp_attention: shard.placement has block_size 16, but the cache's is 8"):
        dcp_ops.dcp_attention(q, dcp_ops.GQAShard(k, k, table, lens, 0.25, placement=dcp_ops.Placement(1, 0, 16)))
    kv, table = paged_cache([9, 3], 8, (48,), torch.float32, gen)
    with pytest.raises(ValueError, match="shard.placement is for rank 0 of 3"):
        dcp_ops.dcp_attention(randn(2, 2, 48, gen=gen), dcp_ops.MLAShard(kv, table, lens, 0.2, 16,
                                                                          placement=dcp_ops.Placement(3, 0, 8)))


def _any_heads_worker(rank, world, init_file):
    """mode "ag" with q_replicated takes any head count (nothing is split across ranks); "a2a" still refuses."""
    init_gloo(rank, world, init_file)
    gen = torch.Generator().manual_seed(6)
    lens = [30, 0, 11]
    k, table = paged_cache(lens, 4, (2, 16), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, gen=gen))
    q = randn(3, 8, 16, gen=gen)  # 8 heads on 3 ranks
    seq_lens = torch.tensor(lens, dtype=I32)
    p = dcp_ops.Placement(world, rank, 4)
    shard = dcp_ops.GQAShard(p.shard_kv(k, table, seq_lens, fill=float("nan")), p.shard_kv(v, table, seq_lens, fill=float("nan")),
                             table, p.local_seq_lens(seq_lens), 0.25, placement=p)
    out, lse = dcp_ops.dcp_attention(q, shard, mode="ag", q_replicated=True, return_lse=True)
    want, want_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.25)
    assert_matches(out, want, torch.float32, f"rank {rank}")
    assert_lse_matches(lse, want_lse, f"rank {rank}")
    with pytest.raises(ValueError, match=r"q's heads \(8\) must divide into 3 ranks \(mode 'ag' takes any count\)"):
        dcp_ops.dcp_attention(q, shard, mode="a2a", q_replicated=True)
    dist.barrier()
    dist.destroy_process_group()


def test_ag_with_replicated_queries_takes_any_head_count():
    spawn_ranks(_any_heads_worker, 3)
