"""The CUDA kernels on a real GPU against the float64 reference (skipped, and reported so, without one)."""
import math

import pytest
import torch

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn
from tolerances import assert_decode, assert_lse_matches, assert_matches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (256, 4), (128, 16)])
def test_gqa_decode_on_gpu(dtype, head_dim, group, precision):
    gen = torch.Generator().manual_seed(head_dim + group)
    lens = [0, 37, 1000, 4097]
    k, table = paged_cache(lens, 16, (2, head_dim), dtype, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=dtype, gen=gen))
    q = randn(len(lens), 2 * group, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, lse = dcp_ops.gqa_decode_partial(q.cuda(), k.cuda(), v.cuda(), table.cuda(), seq_lens.cuda(), 0.1,
                                          precision=precision)
    assert_decode(out.cpu(), lse.cpu(), ref.gqa_decode_partial, (q, k, v, table, seq_lens, 0.1), dtype, precision,
                  "GQA on the GPU")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_family_on_gpu(dtype):
    outs = torch.randn(4, 8, 16, 128).to(dtype)
    lses = torch.randn(4, 8, 16) * 3
    lses[0, 0, 0], lses[:, 1, 1] = math.nan, -math.inf
    out, lse = dcp_ops.merge_partials(outs.cuda(), lses.cuda(), lse_base=2.0)
    r_out, r_lse = ref.merge_partials(outs, lses, 2.0)
    assert_matches(out.cpu(), r_out, dtype, "merge out")
    assert_lse_matches(lse.cpu(), r_lse, "merge lse")
    part = outs[2].clone().cuda()
    total = dcp_ops.correct_partial(part, lses.cuda(), 2)
    c_out, c_lse = ref.correct_partial(outs[2], lses, 2)
    assert_matches(part.cpu(), c_out, dtype, "corrected out")
    assert_lse_matches(total.cpu(), c_lse, "correct lse")
    # a world of 4: rank r packs its partial (outs[r], lses[r]); rank `me` receives head slice `me` of every send.
    # The NaN and -inf LSE rows above are empty partials (out 0, lse -inf where no rank has the row).
    sends = [dcp_ops.pack_exchange(outs[r].cuda(), lses[r].cuda(), 4) for r in range(4)]
    for me in range(4):
        m_out = torch.full((8, 4, 128), math.nan, dtype=dtype, device="cuda")  # poisoned: every element written
        m_lse = torch.full((8, 4), math.nan, device="cuda")
        dcp_ops.merge_exchange(torch.stack([s[me] for s in sends]), out=m_out, lse=m_lse)
        r_out, r_lse = ref.merge_partials(outs[:, :, 4 * me:4 * me + 4], lses[:, :, 4 * me:4 * me + 4])
        assert_matches(m_out.cpu(), r_out, dtype, f"exchange merge out on rank {me}")
        assert_lse_matches(m_lse.cpu(), r_lse, f"exchange merge lse on rank {me}")


def test_write_kv_on_gpu():
    cache = torch.zeros(4, 8, 2, 64, device="cuda")
    new = torch.randn(5, 2, 64, device="cuda")
    slots = torch.tensor([0, -1, 31, 9, 999], dtype=torch.int32, device="cuda")
    dcp_ops.write_kv(cache, new, slots)
    expected = ref.write_kv(torch.zeros(4, 8, 2, 64), new.cpu(), torch.tensor([0, -1, 31, 9, -1]))
    assert torch.equal(cache.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("absorb,up", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("heads,rope", [(128, 64), (16, 64), (5, 0)])
@pytest.mark.parametrize("precision", ["native", "fp32"])
def test_mla_decode_on_gpu(dtype, absorb, up, heads, rope, precision):
    gen = torch.Generator().manual_seed(heads + rope + 2 * absorb + up)
    lens = [0, 37, 1000, 4097]
    latent, d_nope, d_v = 512, 128, 128
    kv, table = paged_cache(lens, 64, (latent + rope,), dtype, gen)
    w_uk = randn(heads, d_nope, latent, dtype=dtype, gen=gen, scale=d_nope ** -0.5) if absorb else None
    w_uv = randn(heads, latent, d_v, dtype=dtype, gen=gen, scale=latent ** -0.5) if up else None
    q_nope = randn(len(lens), heads, d_nope if absorb else latent, dtype=dtype, gen=gen)
    q_pe = randn(len(lens), heads, rope, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = (d_nope + rope) ** -0.5
    cuda = [x.cuda() if x is not None else None for x in (q_nope, q_pe, kv, table, seq_lens)]
    out, lse = dcp_ops.mla_decode_partial(*cuda[:5], scale, w_uk.cuda() if absorb else None,
                                          w_uv.cuda() if up else None, precision=precision)
    assert out.dtype == dtype
    assert_decode(out.cpu(), lse.cpu(), ref.mla_decode_partial, (q_nope, q_pe, kv, table, seq_lens, scale, w_uk, w_uv),
                  dtype, precision, "MLA on the GPU")


@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
@pytest.mark.parametrize("optin", [None, 166912], ids=["device", "bn32"])
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_mla_multi_token_on_gpu(monkeypatch, cache, optin, wgmma):
    """Native MLA 512 + 64 with 2-4 query tokens a sequence (cu_seqlens_q, causal per token), on a bf16 and an fp8
    cache, with the device's shared memory (64-token tiles on an H100) and an A100's (DCP_OPS_TEST_SMEM_OPTIN: the
    32-token tiles); masked tokens past each query's length hold NaN. On sm_90 also the wgmma kernel
    (DCP_OPS_MLA_WGMMA=1)."""
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is sm_90a's")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1" if wgmma else "0")
    if optin is not None:
        monkeypatch.setenv("DCP_OPS_TEST_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(7)
    lens, n_q, heads = [700, 65, 130], [4, 2, 3], 16
    kv, table = paged_cache(lens, 64, (576,), torch.float32, gen)
    scales = {}
    if cache == torch.float8_e4m3fn:
        scales = dict(kv_scale=torch.tensor([0.02]))
        kv = (kv / 0.02).clamp(-448, 448).to(cache)
    else:
        kv = kv.to(cache)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, n_q)])
    cu = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist(), dtype=torch.int32)
    T = len(positions)
    args = (randn(T, heads, 512, dtype=torch.bfloat16, gen=gen), randn(T, heads, 64, dtype=torch.bfloat16, gen=gen),
            kv, table, (positions + 1).int(), 576 ** -0.5)
    out, lse = dcp_ops.mla_decode_partial(*[a.cuda() if torch.is_tensor(a) else a for a in args],
                                          cu_seqlens_q=cu.cuda(), **{k: v.cuda() for k, v in scales.items()})
    assert_decode(out.cpu(), lse.cpu(), ref.mla_decode_partial, args, torch.bfloat16, "native",
                  f"MLA multi-token on the GPU ({cache}, optin {optin})", cu_seqlens_q=cu, **scales)


@pytest.mark.parametrize("precision", ["native", "fp32"])
def test_gqa_fp8_multi_token_on_gpu(precision):
    gen = torch.Generator().manual_seed(8)
    lens, n_q = [300, 40], [5, 2]
    k, table = paged_cache(lens, 16, (2, 128), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, gen=gen))
    fp8 = torch.float8_e4m3fn
    k8, v8 = (k / 0.05).clamp(-448, 448).to(fp8), (v / 0.05).clamp(-448, 448).to(fp8)
    scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.05]))
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, n_q)])
    cu = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(len(positions), 8, 128, dtype=torch.bfloat16, gen=gen)
    args = (q, k8, v8, table, (positions + 1).int(), 0.09)
    out, lse = dcp_ops.gqa_decode_partial(*[a.cuda() if torch.is_tensor(a) else a for a in args], precision=precision,
                                          cu_seqlens_q=cu.cuda(), **{n: s.cuda() for n, s in scales.items()})
    assert_decode(out.cpu(), lse.cpu(), ref.gqa_decode_partial, args, torch.bfloat16, precision,
                  "GQA fp8 multi-token on the GPU", cu_seqlens_q=cu, **scales)


def test_demo_on_gpu_ranks_over_nccl(capsys):
    from dcp_ops import demo
    world = min(4, torch.cuda.device_count())
    assert demo.main(["--device", "cuda", "--world-size", str(world), "--context", "4096", "--steps", "2",
                      "--dtype", "bfloat16"]) == 0
    assert f"DCP decode on {world} GPU ranks (NCCL)" in capsys.readouterr().out


def test_dcp_attention_step_replays_in_a_cuda_graph(tmp_path):
    # docs/design.md §5: no host synchronisation inside a step, buffers from a Workspace, so a step can be
    # graph-captured.
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(5)
        lens = [300, 0, 77]
        k, table = paged_cache(lens, 16, (2, 128), torch.bfloat16, gen)
        v = torch.where(torch.isnan(k), k, randn(*k.shape, dtype=torch.bfloat16, gen=gen))
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        shard = dcp_ops.GQAShard(k.cuda(), v.cuda(), table.cuda(), seq_lens.cuda(), 0.09)
        for mode in dcp_ops.distributed.MODES:
            ws = dcp_ops.Workspace()
            q_static = randn(3, 16, 128, dtype=torch.bfloat16, gen=gen).cuda()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: sizes the workspace outside the capture
                dcp_ops.dcp_attention(q_static, shard, mode=mode, workspace=ws, precision="fp32")
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = dcp_ops.dcp_attention(q_static, shard, mode=mode, workspace=ws, precision="fp32")
            q_new = randn(3, 16, 128, dtype=torch.bfloat16, gen=gen)
            q_static.copy_(q_new)
            graph.replay()
            torch.cuda.synchronize()
            want = ref.gqa_decode_partial(q_new, k, v, table, seq_lens, 0.09)[0]
            assert_matches(out.cpu(), want, torch.bfloat16, f"graph replay, mode {mode}")
    finally:
        dist.destroy_process_group()


def test_hf_generate_on_gpu_ranks_over_nccl(capsys):
    pytest.importorskip("transformers")
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import hf_generate
    world = 2 if torch.cuda.device_count() >= 2 else 1
    assert hf_generate.main(["--device", "cuda", "--world", str(world), "--steps", "4"]) == 0
    assert "GPU ranks (NCCL)" in capsys.readouterr().out
