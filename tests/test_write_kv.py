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


FP8 = torch.float8_e4m3fn


def _fp8_values(T, E, gen, dtype):
    """Values across e4m3's whole range once divided by a scale of 0.5: subnormals, ties, the 448 / 464 / 480 edges,
    beyond them, +-inf and NaN."""
    x = torch.randn(T, E, generator=gen) * torch.exp2(torch.randint(-14, 12, (T, E), generator=gen).float())
    edges = torch.tensor([0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9, 2.0 ** -6, 232.0, 448.0, 456.0, 464.0, 470.0,
                          480.0, -500.0, 1e6, float("inf"), float("-inf"), float("nan")]) * 0.5
    flat = x.view(-1)
    flat[:min(len(edges), flat.numel())] = edges[:flat.numel()]
    return x.to(dtype)


def _assert_fp8_equal(got, want):
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan_g, nan_w = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_g, nan_w)
    assert torch.equal(torch.where(nan_g, 0, g), torch.where(nan_w, 0, w)), (got.float()[g != w], want.float()[g != w])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["cpu", pytest.param("simt", marks=pytest.mark.simt)])
def test_write_kv_into_an_fp8_cache_is_torchs_saturated_conversion(request, dtype, impl):
    # new / scale saturated to +-448 and rounded to nearest even, NaN kept; -1 slots skipped; bitwise (NaN's sign and
    # payload aside) the reference, which converts with torch's own float -> float8_e4m3fn
    op = dcp_ops.write_kv if impl == "cpu" else request.getfixturevalue("simt_ops").write_kv
    gen = torch.Generator().manual_seed(7)
    T, E, num_blocks, bs = 24, 64, 5, 8
    new = _fp8_values(T, E, gen, dtype)
    cache = (torch.randn(num_blocks, bs, 2, E // 2, generator=gen) * 8).to(FP8)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T].to(torch.int32)
    slots[::5] = -1
    scale = torch.tensor([0.5])
    expected = ref.write_kv(cache, new.view(T, 2, E // 2), slots, scale)
    op(cache, new.view(T, 2, E // 2), slots, scale=scale)
    _assert_fp8_equal(cache, expected)
    assert float(expected.float().abs().nan_to_num(0).max()) == 448.0  # the saturation was exercised


@pytest.mark.parametrize("args,msg", [
    (lambda c, n, s: (c, n, s, None), r"write_kv: scale is required with a float8_e4m3fn cache"),
    (lambda c, n, s: (c.float(), n, s, torch.ones(1)), r"write_kv: scale is for float8_e4m3fn caches only, got one "
                                                       r"with a Float cache"),
    (lambda c, n, s: (c, n, s, torch.ones(2)), r"write_kv: scale must be a 1-element tensor \(shape \[\] or \[1\]\), "
                                               r"got shape \[2\]"),
    (lambda c, n, s: (c, n, s, torch.ones(1, 1)), r"write_kv: scale must be a 1-element tensor"),
    (lambda c, n, s: (c, n, s, torch.ones(1, dtype=torch.bfloat16)), r"write_kv: scale must have dtype Float"),
    (lambda c, n, s: (c, n.to(FP8), s, torch.ones(1)), r"write_kv: new must be float32, bfloat16 or float16"),
])
def test_write_kv_fp8_arguments_are_checked_by_name(args, msg):
    cache = torch.zeros(2, 4, 8).to(FP8)
    new, slots = torch.randn(3, 8), torch.tensor([0, 5, -1], dtype=torch.int32)
    *given, scale = args(cache, new, slots)
    with pytest.raises((ValueError, RuntimeError), match=msg):
        dcp_ops.write_kv(*given, scale=scale)
