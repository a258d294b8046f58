"""The CUDA kernels on a real GPU against the float64 reference (skipped, and reported so, without one)."""
import math

import pytest
import torch

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn
from tolerances import assert_lse_matches, assert_matches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (256, 4), (128, 16)])
def test_gqa_decode_on_gpu(dtype, head_dim, group):
    gen = torch.Generator().manual_seed(head_dim + group)
    lens = [0, 37, 1000, 4097]
    k, table = paged_cache(lens, 16, (2, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), 2 * group, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.gqa_decode_partial(q.cuda(), k.cuda(), v.cuda(), table.cuda(), seq_lens.cuda(), 0.1)
    r_out, r_lse = ref.gqa_decode_partial(q, k, v, table, seq_lens, 0.1)
    assert_matches(out.cpu(), r_out, dtype, "out")
    assert_lse_matches(lse.cpu(), r_lse, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_family_on_gpu(dtype):
    outs = torch.randn(4, 8, 16, 128).to(dtype)
    lses = torch.randn(4, 8, 16) * 3
    lses[0, 0, 0], lses[:, 1, 1] = math.nan, -math.inf
    out, lse = dcp_ops.merge_partials(outs.cuda(), lses.cuda(), 2.0)
    r_out, r_lse = ref.merge_partials(outs, lses, 2.0)
    assert_matches(out.cpu(), r_out, dtype, "merge out")
    assert_lse_matches(lse.cpu(), r_lse, "merge lse")
    part = outs[2].clone().cuda()
    total = dcp_ops.correct_partial(part, lses.cuda(), 2)
    c_out, c_lse = ref.correct_partial(outs[2], lses, 2)
    assert_matches(part.cpu(), c_out, dtype, "corrected out")
    assert_lse_matches(total.cpu(), c_lse, "correct lse")
    send = dcp_ops.pack_exchange(outs[0].cuda(), lses[0].cuda(), 4)
    m_out, m_lse = dcp_ops.merge_exchange(send[:1].contiguous())
    assert torch.equal(m_out.cpu(), outs[0][:, :4])


def test_write_kv_on_gpu():
    cache = torch.zeros(4, 8, 2, 64, device="cuda")
    new = torch.randn(5, 2, 64, device="cuda")
    slots = torch.tensor([0, -1, 31, 9, 999], dtype=torch.int32, device="cuda")
    dcp_ops.write_kv(cache, new, slots)
    expected = ref.write_kv(torch.zeros(4, 8, 2, 64), new.cpu(), torch.tensor([0, -1, 31, 9, -1]))
    assert torch.equal(cache.cpu(), expected)
