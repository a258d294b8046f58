"""KV placement helpers against the scalar formulas of docs/design.md §3 (dcp_ops.reference), and shard/unshard."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref

group_st = st.tuples(st.integers(1, 8), st.sampled_from([1, 2, 4, 16]))  # (world_size, interleave)


@given(group=group_st, lens=st.lists(st.integers(0, 300), min_size=1, max_size=6), dtype=st.sampled_from(
       [torch.int32, torch.int64]))
def test_owner_and_local_lengths_match_formulas(group, lens, dtype):
    N, I = group
    positions = torch.arange(max(lens) + 1, dtype=dtype)
    owners = dcp_ops.owner_rank(positions, N, I)
    assert owners.dtype == torch.int32  # every helper returns int32, what the ops take (docs/design.md §2)
    assert owners.tolist() == [ref.owner_rank(p, N, I) for p in positions.tolist()]
    seq_lens = torch.tensor(lens, dtype=dtype)
    total = torch.zeros_like(seq_lens)
    for r in range(N):
        local = dcp_ops.local_seq_lens(seq_lens, N, r, I)
        assert local.dtype == torch.int32
        assert local.tolist() == [ref.local_seq_len(n, N, r, I) for n in lens]
        total += local
    assert torch.equal(total, seq_lens)


@given(group=group_st, block_mult=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_slot_mapping_matches_formula_and_is_a_bijection(group, block_mult, seed):
    N, I = group
    bs = I * block_mult
    gen = torch.Generator().manual_seed(seed)
    B, max_blocks = 3, 5
    table = torch.randperm(B * max_blocks, generator=gen).view(B, max_blocks).int()
    seq_ids = torch.randint(0, B, (40,), generator=gen).int()
    positions = torch.randint(0, max_blocks * bs * N, (40,), generator=gen).int()
    owners = dcp_ops.owner_rank(positions, N, I)
    for r in range(N):
        slots = dcp_ops.slot_mapping(table, seq_ids, positions, bs, N, r, I)
        assert slots.dtype == torch.int32
        expected = [ref.slot(table[s].tolist(), p, bs, N, r, I) for s, p in zip(seq_ids.tolist(),
                                                                             positions.tolist())]
        assert slots.tolist() == expected
        assert torch.equal(slots >= 0, owners == r)
    # every (request, position) of one request lands on a distinct slot of its owner
    for r in range(N):
        pos = torch.arange(max_blocks * bs * N, dtype=torch.int32)
        s = dcp_ops.slot_mapping(table, torch.zeros_like(pos), pos, bs, N, r, I)
        mine = s[s >= 0]
        assert len(torch.unique(mine)) == len(mine)


@given(group=group_st, block_mult=st.integers(1, 3), lens=st.lists(st.integers(0, 90), min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_shard_then_unshard_round_trips(group, block_mult, lens, seed):
    N, I = group
    bs = I * block_mult
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens) + 1
    table = torch.randperm(len(lens) * max_blocks, generator=gen).view(len(lens), max_blocks).int()
    cache = torch.randn(len(lens) * max_blocks, bs, 2, 3, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    shards = dcp_ops.shard_kv(cache, table, seq_lens, N, I, fill=float("nan"))
    assert len(shards) == N
    for r, shard in enumerate(shards):  # each shard holds exactly its local tokens, in local order
        local = dcp_ops.local_seq_lens(seq_lens, N, r, I)
        for b, n in enumerate(lens):
            mine = [p for p in range(n) if ref.owner_rank(p, N, I) == r]
            assert len(mine) == int(local[b])
            for j, p in enumerate(mine):
                assert torch.equal(shard[table[b, j // bs], j % bs], cache[table[b, p // bs], p % bs])
    back = dcp_ops.unshard_kv(shards, table, seq_lens, I, fill=float("nan"))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        idx = (table[b, pos // bs].long(), pos % bs)
        assert torch.equal(back[idx], cache[idx])


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="owner_rank: world_size must be >= 1, got 0"):
        dcp_ops.owner_rank(torch.arange(4), 0)
    with pytest.raises(TypeError, match="owner_rank: positions must be an int32 or int64 tensor, got torch.float32"):
        dcp_ops.owner_rank(torch.arange(4.0), 2)
    with pytest.raises(ValueError, match=r"local_seq_lens: rank must be in \[0, world_size = 2\), got 2"):
        dcp_ops.local_seq_lens(torch.tensor([5]), 2, 2)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        dcp_ops.owner_rank(torch.tensor([-1]), 2)
    with pytest.raises(ValueError, match="local_index: interleave must be >= 1, got 0"):
        dcp_ops.layout.local_index(torch.arange(4), 2, 0)
    with pytest.raises(ValueError, match="local_index: positions must be >= 0, got min -3"):
        dcp_ops.layout.local_index(torch.tensor([1, -3]), 2)
    with pytest.raises(TypeError, match="local_index: positions must be an int32 or int64 tensor, got torch.float32"):
        dcp_ops.layout.local_index(torch.arange(4.0), 2)
    with pytest.raises(ValueError, match=r"slot_mapping: interleave \(3\) must divide block_size \(16\)"):
        dcp_ops.slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), 16, 2, 0, 3)
    with pytest.raises(ValueError, match="needs block-table column 2"):
        dcp_ops.slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                             torch.tensor([64], dtype=torch.int32), 16, 2, 0)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 is the block of token 1 \(position 2\)"):
        # block size 1: position 2's slot on its owner (rank 0) would be -1 * 1 + 0 = -1, a silently skipped token
        dcp_ops.slot_mapping(torch.tensor([[3, -1]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                             torch.tensor([0, 2], dtype=torch.int32), 1, 2, 0)
    with pytest.raises(ValueError, match=r"seq_ids must be in \[0, B = 1\)"):
        dcp_ops.slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), 16, 2, 0)
    with pytest.raises(ValueError, match="shard_kv: block_table ids in use"):
        dcp_ops.shard_kv(torch.zeros(2, 4, 8), torch.tensor([[0, 5]], dtype=torch.int32),
                         torch.tensor([8], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="exceeds block_table capacity"):
        dcp_ops.shard_kv(torch.zeros(2, 4, 8), torch.tensor([[0, 1]], dtype=torch.int32),
                         torch.tensor([9], dtype=torch.int32), 2)
