"""merge_partials, correct_partial, pack_exchange / merge_exchange against the float64 reference."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, randn
from tolerances import assert_lse_matches, assert_matches

INF, NAN = math.inf, math.nan


def random_partials(N, T, H, D, dtype, gen, special=True):
    """Partials with some empty shards (-inf, or NaN / +inf as other kernels write them) holding NaN outputs."""
    outs = randn(N, T, H, D, dtype=dtype, gen=gen)
    lses = randn(N, T, H, gen=gen, scale=3.0)
    if special:
        pick = torch.rand(N, T, H, generator=gen)
        lses[pick < 0.15] = -INF
        lses[(pick >= 0.15) & (pick < 0.2)] = NAN
        lses[(pick >= 0.2) & (pick < 0.25)] = INF
        outs[pick < 0.25] = NAN  # an empty shard's output must never leak into the merge
        lses[:, 0, 0] = -INF  # one position empty on every rank
    return outs, lses


@given(dtype=st.sampled_from(DTYPES), N=st.integers(1, 8), T=st.integers(1, 5), H=st.integers(1, 6),
       D=st.sampled_from([1, 7, 64, 128, 512]), base=st.sampled_from([math.e, 2.0]), seed=st.integers(0, 2**31 - 1))
def test_merge_partials_matches_reference(dtype, N, T, H, D, base, seed):
    gen = torch.Generator().manual_seed(seed)
    outs, lses = random_partials(N, T, H, D, dtype, gen)
    out, lse = dcp_ops.merge_partials(outs, lses, lse_base=base)
    r_out, r_lse = ref.merge_partials(outs, lses, base)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, r_out, dtype, "out")
    assert_lse_matches(lse, r_lse, "lse")
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and lse[0, 0] == -INF


def test_merge_partials_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(4)
    big = randn(5, 3, 8, 64, gen=gen)
    outs = big.transpose(0, 1)[:, :, ::2]  # [3, 5, 4, 64], strided in N, T and H
    lses = randn(5, 3, 4, gen=gen).transpose(0, 1)
    out, lse = dcp_ops.merge_partials(outs, lses)
    r_out, r_lse = ref.merge_partials(outs, lses)
    assert_matches(out, r_out, torch.float32, "out")
    assert_lse_matches(lse, r_lse, "lse")


def test_merge_base2_equals_natural():
    gen = torch.Generator().manual_seed(5)
    outs, lses = random_partials(4, 3, 2, 16, torch.float32, gen, special=False)
    a_out, a_lse = dcp_ops.merge_partials(outs, lses / math.log(2), lse_base=2.0)
    b_out, b_lse = dcp_ops.merge_partials(outs, lses)
    torch.testing.assert_close(a_out, b_out)
    torch.testing.assert_close(a_lse, b_lse)


@given(dtype=st.sampled_from(DTYPES), N=st.integers(1, 6), T=st.integers(1, 4), H=st.integers(1, 5),
       D=st.sampled_from([3, 64, 128]), base=st.sampled_from([math.e, 2.0]), data=st.data(),
       seed=st.integers(0, 2**31 - 1))
def test_correct_partial_matches_reference(dtype, N, T, H, D, base, data, seed):
    gen = torch.Generator().manual_seed(seed)
    outs, lses = random_partials(N, T, H, D, dtype, gen)
    rank = data.draw(st.integers(0, N - 1))
    out = outs[rank].clone()
    r_out, r_lse = ref.correct_partial(out, lses, rank, base)
    lse = dcp_ops.correct_partial(out, lses, rank, lse_base=base)
    assert_matches(out, r_out, dtype, "corrected out (in place)")
    assert_lse_matches(lse, r_lse, "lse")


def test_correct_then_sum_equals_merge():
    gen = torch.Generator().manual_seed(6)
    outs, lses = random_partials(3, 4, 2, 32, torch.float32, gen, special=False)
    corrected = [outs[r].clone() for r in range(3)]
    for r in range(3):
        dcp_ops.correct_partial(corrected[r], lses, r)
    merged, _ = dcp_ops.merge_partials(outs, lses)
    torch.testing.assert_close(sum(corrected), merged, rtol=1e-5, atol=1e-6)


@given(dtype=st.sampled_from(DTYPES), N=st.sampled_from([1, 2, 3, 4, 6]), T=st.integers(1, 4),
       hl=st.integers(1, 3), D=st.sampled_from([8, 64, 128]), seed=st.integers(0, 2**31 - 1))
def test_pack_exchange_layout_and_merge(dtype, N, T, hl, D, seed):
    gen = torch.Generator().manual_seed(seed)
    H = N * hl
    pad = dcp_ops.ops.exchange_pad(dtype)
    # what every rank r would send: its partial over all heads; rank `me` receives slice `me` of each
    partials = [(randn(T, H, D, dtype=dtype, gen=gen), randn(T, H, gen=gen, scale=3.0)) for _ in range(N)]
    partials[0][1][0, 0] = -INF
    sends = []
    for out, lse in partials:
        send = torch.full((N, T, hl, D + pad), NAN, dtype=dtype)  # poisoned: every element must be written
        dcp_ops.pack_exchange(out, lse, N, send=send)
        payload, lse_slices = ref.pack_exchange(out, lse, N)
        assert torch.equal(send[..., :D].double(), payload)
        assert torch.equal(send[..., D:].contiguous().view(torch.float32)[..., 0].double(), lse_slices)
        assert not send[..., D:].contiguous().view(torch.uint8)[..., 4:].any()  # rest of the pad zeroed
        sends.append(send)
    for me in range(N):
        recv = torch.stack([s[me] for s in sends])  # what all_to_all_single delivers to rank `me`
        out = torch.full((T, hl, D), NAN, dtype=dtype)
        lse = torch.full((T, hl), NAN)
        dcp_ops.merge_exchange(recv, out=out, lse=lse)
        outs = torch.stack([p[0][:, me * hl:(me + 1) * hl] for p in partials])
        lses = torch.stack([p[1][:, me * hl:(me + 1) * hl] for p in partials])
        r_out, r_lse = ref.merge_partials(outs, lses)
        assert_matches(out, r_out, dtype, f"merged out on rank {me}")
        assert_lse_matches(lse, r_lse, f"merged lse on rank {me}")


def test_pack_exchange_allocates_when_no_buffer():
    out, lse = torch.randn(2, 6, 16), torch.randn(2, 6)
    send = dcp_ops.pack_exchange(out, lse, 3)
    assert send.shape == (3, 2, 2, 16 + 4)
    m_out, m_lse = dcp_ops.merge_exchange(send[:1])
    torch.testing.assert_close(m_out, out[:, :2])
    torch.testing.assert_close(m_lse, lse[:, :2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_of_single_partial_is_identity(dtype):
    outs = torch.randn(1, 3, 4, 32).to(dtype)
    lses = torch.randn(1, 3, 4)
    out, lse = dcp_ops.merge_partials(outs, lses)
    assert torch.equal(out, outs[0])
    torch.testing.assert_close(lse, lses[0])
