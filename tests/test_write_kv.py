"""write_kv: owner-only KV append into flat slots, both cache layouts, against the reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref


@given(layout=st.sampled_from(["gqa", "mla"]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16,
       torch.uint8]), block_size=st.sampled_from([1, 4, 16]), T=st.integers(0, 20), slot_dtype=st.sampled_from(
       [torch.int32, torch.int64]), seed=st.integers(0, 2**31 - 1))
def test_write_kv_matches_reference(layout, dtype, block_size, T, slot_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    entry = (2, 16) if layout == "gqa" else (40,)
    num_blocks = 6
    cache = (torch.randn(num_blocks, block_size, *entry, generator=gen) * 50).to(dtype)
    new = (torch.randn(T, *entry, generator=gen) * 50).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots = torch.cat([slots, torch.full((max(0, T - len(slots)),), -1, dtype=torch.long)])  # slots stay unique
    drop = torch.rand(T, generator=gen) < 0.3
    slots = torch.where(drop, torch.full_like(slots, -1), slots)
    expected = ref.write_kv(cache, new, slots)
    dcp_ops.write_kv(cache, new, slots.to(slot_dtype))
    assert torch.equal(cache, expected)


def test_write_kv_into_strided_k_and_v_views():
    kv = torch.zeros(2, 4, 8, 2, 16)
    new_k, new_v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([0, 9, -1, 31, 17], dtype=torch.int32)
    dcp_ops.write_kv(kv[0], new_k, slots)
    dcp_ops.write_kv(kv[1], new_v, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kv[0, s // 8, s % 8], new_k[t]) and torch.equal(kv[1, s // 8, s % 8], new_v[t])
    assert int((kv != 0).any(-1).any(-1).sum()) == 8  # 4 tokens x (K, V), nothing else touched


@pytest.mark.parametrize("bad", [-2, 32, 1000])
def test_write_kv_rejects_out_of_range_slots_without_writing(bad):
    cache = torch.zeros(4, 8, 16)
    with pytest.raises(RuntimeError, match=r"write_kv: slot_mapping\[1\]"):
        dcp_ops.write_kv(cache, torch.ones(2, 16), torch.tensor([3, bad], dtype=torch.int32))
    assert not cache.any()
