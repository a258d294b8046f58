"""dcp_ops.compat.vllm against vLLM's written formulas: base e and 2, NaN / +inf LSE, empty shards, real groups."""
import math

import pytest
import torch
import torch.distributed as dist

from conftest import init_gloo, spawn_ranks
from dcp_ops.compat import vllm as V
from tolerances import assert_within_baseline

INF, NAN = math.inf, math.nan


def formula(outs, lses, base):
    """vLLM's correct_attn_out / merge, written out: NaN and +inf LSE -> -inf; L = log_b(sum_r b^lse_r);
    each rank's output weighted by b^(lse_r - L); an all-empty position gives 0 and -inf. float64."""
    l = lses.double()
    l = torch.where(torch.isnan(l) | (l == INF), torch.full_like(l, -INF), l)
    mx = l.max(0).values
    safe = torch.where(mx == -INF, torch.zeros_like(mx), mx)
    w = torch.pow(base, l - safe)
    total = torch.log(w.sum(0)) / math.log(base) + safe
    w = torch.pow(base, l - total)
    w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
    o = torch.where(w[..., None] > 0, outs.double(), torch.zeros((), dtype=torch.float64))
    return w, o, total


def partials(N, B, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(N, B, H, D, generator=g)
    lses = torch.randn(N, B, H, generator=g) * 3
    lses[0, 0, 0], lses[1 % N, 0, 1] = NAN, INF
    lses[:, 1, 0] = -INF  # empty on every rank
    outs[lses.isnan() | (lses == INF) | (lses == -INF)] = NAN
    return outs, lses


@pytest.mark.parametrize("base_e", [True, False])
def test_correct_attn_out_matches_formula(base_e):
    base = math.e if base_e else 2.0
    outs, lses = partials(3, 4, 2, 16, 0)
    w, o, total = formula(outs, lses, base)
    for r in range(3):
        out = outs[r].clone()
        got, lse = V.correct_attn_out(out, lses, r, None, is_lse_base_on_e=base_e)
        assert got.data_ptr() == out.data_ptr()  # in place, as vLLM
        torch.testing.assert_close(got.double(), w[r][..., None] * o[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse.double(), total, rtol=1e-6, atol=1e-5)


def vllm_get_dcp_local_seq_lens(seq_lens, dcp_size=1, dcp_rank=None, cp_kv_cache_interleave_size=1):
    """vLLM's own implementation (vllm/v1/attention/backends/utils.py), the oracle."""
    num_requests = seq_lens.size(0)
    if dcp_rank is None:
        rank_offsets = torch.arange(dcp_size, dtype=torch.int32).unsqueeze(0).repeat(num_requests, 1)
    else:
        rank_offsets = torch.Tensor([[dcp_rank]]).to(dtype=torch.int32)
    seq_lens_tiled = seq_lens.to(torch.int32).unsqueeze(-1).repeat(1, rank_offsets.shape[1])
    base = seq_lens_tiled // cp_kv_cache_interleave_size // dcp_size * cp_kv_cache_interleave_size
    remainder = seq_lens_tiled - base * dcp_size
    remainder = torch.clip(remainder - rank_offsets * cp_kv_cache_interleave_size, 0, cp_kv_cache_interleave_size)
    return (base + remainder).squeeze(1)


@pytest.mark.parametrize("size,inter", [(1, 1), (2, 1), (3, 2), (4, 16), (6, 4), (8, 1)])
def test_get_dcp_local_seq_lens_matches_vllm(size, inter):
    seq_lens = torch.tensor([0, 1, 5, 17, 64, 1000, 4097], dtype=torch.int32)
    assert torch.equal(V.get_dcp_local_seq_lens(seq_lens, size, None, inter),
                       vllm_get_dcp_local_seq_lens(seq_lens, size, None, inter))
    for r in range(size):
        got = V.get_dcp_local_seq_lens(seq_lens, size, r, inter)
        assert got.dtype == torch.int32 and torch.equal(got, vllm_get_dcp_local_seq_lens(seq_lens, size, r, inter))


def test_mask_empty_lse():
    lse = torch.randn(5, 2)
    got = V.mask_empty_lse(lse, torch.tensor([3, 0, 2], dtype=torch.int32))  # rows 3, 4 are padding
    assert torch.equal(got[[0, 2]], lse[[0, 2]]) and bool((got[[1, 3, 4]] == -INF).all())
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)  # request 0: rows 0-1, request 1: row 2, rows 3-4 padding
    got = V.mask_empty_lse(lse, torch.tensor([4, 0], dtype=torch.int32), qsl)
    assert torch.equal(got[:2], lse[:2]) and bool((got[2:] == -INF).all())


def _worker(rank, world, init_file):
    init_gloo(rank, world, init_file)
    outs, lses = partials(world, 3, 2 * world, 8, 1)
    for base_e in (True, False):
        base = math.e if base_e else 2.0
        w, o, total = formula(outs, lses, base)
        merged = (w[..., None] * o).sum(0)
        mine = slice(rank * 2, rank * 2 + 2)
        for fn, heads in ((V.cp_lse_ag_out_rs, mine), (V.dcp_a2a_lse_reduce, mine),
                          (V.cp_lse_ag_out_ar, slice(None))):
            out, lse = fn(outs[rank].clone(), lses[rank].clone(), dist.group.WORLD, None, return_lse=True,
                          is_lse_base_on_e=base_e)
            torch.testing.assert_close(out.double(), merged[:, heads], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{fn.__name__} base_e={base_e}: {m}")
            torch.testing.assert_close(lse.double(), total[:, heads], rtol=1e-6, atol=1e-5)
            # bf16 / fp16 partials: the merge's sum is fp32 in every adapter, so the result is within 2x of the
            # exact merge of the same partials rounded once (docs/design.md §2, §7).
            for dtype in (torch.bfloat16, torch.float16):
                low = outs.to(dtype)
                lw, lo, _ = formula(low, lses, base)
                exact = (lw[..., None] * lo).sum(0)[:, heads]
                got = fn(low[rank].clone(), lses[rank].clone(), dist.group.WORLD, None, is_lse_base_on_e=base_e)
                assert got.dtype == dtype
                assert_within_baseline(got, exact, exact.to(dtype), f"{fn.__name__} {dtype} base_e={base_e}")
    dist.barrier()  # no rank leaves while another still exchanges
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 6])
def test_collective_adapters_match_formula(world):
    spawn_ranks(_worker, world)
