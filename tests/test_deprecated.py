"""Call forms and names kept for one release (dcp_ops/_deprecated.py): each warns and gives what the new form gives."""
import math

import pytest
import torch

import dcp_ops

I32 = torch.int32


def _merge_inputs(gen):
    return torch.randn(3, 2, 4, 8, generator=gen), torch.randn(3, 2, 4, generator=gen)


def test_positional_options_warn_and_match_the_keyword_form():
    gen = torch.Generator().manual_seed(0)
    outs, lses = _merge_inputs(gen)
    want = dcp_ops.merge_partials(outs, lses, lse_base=2.0, nonfinite_lse="propagate")
    with pytest.warns(DeprecationWarning, match=r"merge_partials: passing lse_base, nonfinite_lse by position"):
        got = dcp_ops.merge_partials(outs, lses, 2.0, "propagate")
    for a, b in zip(got, want):
        assert torch.equal(a, b)

    a, b = outs[0].clone(), outs[0].clone()
    want_total = dcp_ops.correct_partial(a, lses, 0, lse_base=math.e)
    with pytest.warns(DeprecationWarning, match="correct_partial: passing lse_base by position"):
        got_total = dcp_ops.correct_partial(b, lses, 0, math.e)
    assert torch.equal(got_total, want_total) and torch.equal(a, b)

    send = dcp_ops.pack_exchange(outs[0], lses[0], 2)
    out, lse = torch.full((2, 2, 8), math.nan), torch.full((2, 2), math.nan)
    with pytest.warns(DeprecationWarning, match="merge_exchange: passing out, lse by position"):
        got_out, got_lse = dcp_ops.merge_exchange(send, out, lse)
    assert got_out is out and got_lse is lse
    want_out, want_lse = dcp_ops.merge_exchange(send)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_keyword_only_refusals_are_type_errors():
    outs, lses = _merge_inputs(torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="takes 2 positional arguments but 5 were given"):
        dcp_ops.merge_partials(outs, lses, math.e, "empty", "extra")
    with pytest.raises(TypeError, match="got multiple values for argument 'lse_base'"):
        dcp_ops.merge_partials(outs, lses, math.e, lse_base=2.0)


def test_shard_kv_returns_a_list_and_its_old_forms_warn():
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(6, 4, 3, generator=gen)
    table = torch.arange(6, dtype=I32).view(2, 3)
    lens = torch.tensor([9, 12], dtype=I32)
    shards = dcp_ops.shard_kv(cache, table, lens, 2, 2, fill=math.nan)
    assert isinstance(shards, list) and len(shards) == 2
    assert isinstance(dcp_ops.shard_kv(cache, table, lens, 1), list)  # one rank: still a list
    p = dcp_ops.Placement(2, 1, 4, 2)
    assert torch.equal(p.shard_kv(cache, table, lens, fill=math.nan).nan_to_num(7), shards[1].nan_to_num(7))
    with pytest.warns(DeprecationWarning, match="shard_kv: rank= is deprecated"):
        one = dcp_ops.shard_kv(cache, table, lens, 2, 2, fill=math.nan, rank=1)
    assert torch.equal(one.nan_to_num(7), shards[1].nan_to_num(7))
    with pytest.warns(DeprecationWarning, match="shard_kv: passing fill by position"):
        old = dcp_ops.shard_kv(cache, table, lens, 2, 2, math.nan)
    assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip(old, shards))
    with pytest.warns(DeprecationWarning, match="Placement.shard is deprecated .* use Placement.shard_kv"):
        assert torch.equal(p.shard(cache, table, lens, math.nan).nan_to_num(7), shards[1].nan_to_num(7))
    with pytest.warns(DeprecationWarning, match="unshard_kv: passing fill by position"):
        back = dcp_ops.unshard_kv(shards, table, lens, 2, 0.0)
    assert torch.equal(back, dcp_ops.unshard_kv(shards, table, lens, 2, fill=0.0))


def test_placement_owner_is_owner_rank():
    p = dcp_ops.Placement(4, 0, 8, 2)
    positions = torch.arange(40)
    with pytest.warns(DeprecationWarning, match="Placement.owner is deprecated .* use Placement.owner_rank"):
        old = p.owner(positions)
    assert torch.equal(old, p.owner_rank(positions))
    assert torch.equal(p.owner_rank(positions), dcp_ops.owner_rank(positions, 4, 2))
