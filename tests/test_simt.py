"""The SIMT executor (csrc/simt/simt.h) and the CUDA kernel sources it runs on the CPU, against the reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ops import reference as ref
from conftest import DTYPES
from tolerances import assert_lse_matches, assert_matches

pytestmark = pytest.mark.simt


def test_warp_shuffle_reduction_and_ballot(simt_ops):
    x = torch.randint(0, 9, (100,)).float()  # 4 warps, the last one partial
    sums, ballots = simt_ops.warp_reduce(x)
    padded = torch.cat([x, torch.zeros(28)]).view(4, 32)
    assert torch.equal(sums, padded.sum(1))
    odd = (padded.int() % 2 == 1) & (torch.arange(128).view(4, 32) < 100)
    want = [sum(1 << i for i in range(32) if odd[w, i]) for w in range(4)]
    assert [b & 0xFFFFFFFF for b in ballots.tolist()] == want


def test_shared_memory_transpose(simt_ops):
    x = torch.randn(3, 32, 32)
    assert torch.equal(simt_ops.transpose32(x), x.transpose(1, 2))


def test_atomic_histogram_with_dynamic_shared_memory(simt_ops):
    x = torch.randint(0, 10, (1000,), dtype=torch.int32)
    assert torch.equal(simt_ops.histogram(x, 10), torch.bincount(x, minlength=10).int())


def test_missing_barrier_is_caught(simt_ops):
    x = torch.randn(128)
    torch.testing.assert_close(simt_ops.block_sum(x, True), x.sum().view(1))
    y = torch.randn(128) + 5  # thread 0 sums before the others write y: it sees stale (x) slots
    racy = simt_ops.block_sum(y, False)
    assert not torch.allclose(racy, y.sum().view(1))


def test_divergent_barrier_is_reported(simt_ops):
    with pytest.raises(RuntimeError, match="divergence"):
        simt_ops.divergent_barrier()


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(DTYPES), N=st.integers(1, 5), T=st.integers(1, 3), H=st.integers(1, 3),
       D=st.sampled_from([8, 12, 64, 128]), base=st.sampled_from([math.e, 2.0]), strided=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_merge_partials_cuda_source(simt_ops, dtype, N, T, H, D, base, strided, seed):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(N, T, 2 * H if strided else H, D, generator=g).to(dtype)
    if strided:
        outs = outs[:, :, ::2]  # head stride 2*D: 16-byte packs only when D allows
    lses = torch.randn(N, T, H, generator=g) * 3
    lses[0, 0, 0] = float("nan")
    lses[:, -1, -1] = float("-inf")
    out, lse = simt_ops.merge_partials(outs, lses, base)
    r_out, r_lse = ref.merge_partials(outs, lses, base)
    assert_matches(out, r_out, dtype, "out (CUDA source on the SIMT executor)")
    assert_lse_matches(lse, r_lse, "lse (CUDA source on the SIMT executor)")
