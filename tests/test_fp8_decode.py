"""The decode ops on float8_e4m3fn caches (docs/design.md §6): against the float64 reference on the dequantized cache
(stored value x scale), for fp32 / bf16 / fp16 queries, both precisions, block sizes 1-64, empty shards and NaN in
the unused slots; every refusal named."""
import pytest
import torch

import dcp_ops
from dcp_ops import reference as ref
from conftest import DTYPES, paged_cache, randn
from tolerances import assert_decode

FP8 = torch.float8_e4m3fn


def quantize(cache, scale):
    """An fp32 cache stored as e4m3 with `scale` (NaN slots stay NaN), as write_kv stores it."""
    return torch.clamp(cache / scale, -448.0, 448.0).to(FP8)


def scale_of(x):
    return torch.tensor([x], dtype=torch.float32)


def gqa_case(lens, block_size, hq, hkv, d, dtype, gen, k_s=0.02, v_s=0.5):
    """GQA arguments on e4m3 K and V caches of different scales (values spread over e4m3's range)."""
    k32, table = paged_cache(lens, block_size, (hkv, d), torch.float32, gen)
    v32 = torch.where(torch.isnan(k32), k32, torch.randn(k32.shape, generator=gen))
    k_scale, v_scale = scale_of(k_s), scale_of(v_s)
    q = randn(len(lens), hq, d, dtype=dtype, gen=gen)
    return (q, quantize(k32 * 3, k_scale), quantize(v32, v_scale), table, torch.tensor(lens, dtype=torch.int32),
            d ** -0.5), dict(k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("block_size,hq,hkv,d", [(1, 4, 4, 16), (16, 8, 2, 64), (64, 32, 2, 128), (8, 16, 1, 40)])
def test_gqa_fp8_cache(dtype, precision, block_size, hq, hkv, d):
    gen = torch.Generator().manual_seed(block_size * 131 + hq + d)
    args, scales = gqa_case([0, 1, 37, 130], block_size, hq, hkv, d, dtype, gen)
    out, lse = dcp_ops.gqa_decode_partial(*args, precision=precision, **scales)
    assert out.dtype == dtype
    assert_decode(out, lse, ref.gqa_decode_partial, args, dtype, precision, f"gqa fp8 {dtype}", **scales)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))  # the empty shard


def mla_case(lens, block_size, heads, latent, rope, dtype, gen, absorb=False, up=False, kv_s=0.01):
    kv32, table = paged_cache(lens, block_size, (latent + rope,), torch.float32, gen)
    kv_scale = scale_of(kv_s)
    nope = 32 if absorb else latent
    w_uk = randn(heads, nope, latent, dtype=dtype, gen=gen, scale=nope ** -0.5) if absorb else None
    w_uv = randn(heads, latent, 24, dtype=dtype, gen=gen, scale=latent ** -0.5) if up else None
    q_nope = randn(len(lens), heads, nope, dtype=dtype, gen=gen)
    q_pe = randn(len(lens), heads, rope, dtype=dtype, gen=gen)
    args = (q_nope, q_pe, quantize(kv32 * 2, kv_scale), table, torch.tensor(lens, dtype=torch.int32),
            (latent + rope) ** -0.5, w_uk, w_uv)
    return args, dict(kv_scale=kv_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", ["native", "fp32"])
@pytest.mark.parametrize("block_size,heads,latent,rope,absorb,up", [
    (64, 16, 512, 64, False, False), (1, 4, 64, 16, True, False), (16, 128, 128, 64, False, True),
    (32, 8, 96, 0, True, True)])
def test_mla_fp8_cache(dtype, precision, block_size, heads, latent, rope, absorb, up):
    gen = torch.Generator().manual_seed(block_size + heads * 7 + latent)
    args, scales = mla_case([0, 70, 3], block_size, heads, latent, rope, dtype, gen, absorb, up)
    out, lse = dcp_ops.mla_decode_partial(*args, precision=precision, **scales)
    assert out.dtype == dtype
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, precision, f"mla fp8 {dtype}", **scales)


@pytest.mark.parametrize("d", [256, 40])
def test_every_e4m3_value_is_read_exactly(d):
    """A one-token sequence's output is its V row times v_scale: with v_scale 1 and an fp32 query, every e4m3 byte
    (subnormals, +-448, zeros, NaN) must come out as torch converts it; d = 40 reads partial vectors."""
    gen = torch.Generator().manual_seed(d)
    codes = torch.randperm(256, generator=gen).to(torch.uint8)
    n = (256 + d - 1) // d
    v = torch.cat([codes, codes])[:n * d].reshape(n, 1, 1, d).view(FP8)
    k = torch.randn(n, 1, 1, d, generator=gen).to(FP8)
    q = torch.randn(n, 1, d, generator=gen)
    table = torch.arange(n, dtype=torch.int32)[:, None]
    out, lse = dcp_ops.gqa_decode_partial(q, k, v, table, torch.ones(n, dtype=torch.int32), 0.1,
                                          k_scale=scale_of(1.0), v_scale=scale_of(1.0))
    expected = v.float().reshape(n, 1, d)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    torch.testing.assert_close(lse.double(), (q.double() * k.double().reshape(n, 1, d)).sum(-1) * 0.1)


def test_multi_token_decode_on_fp8():
    gen = torch.Generator().manual_seed(3)
    args, scales = gqa_case([50, 9], 16, 8, 2, 32, torch.bfloat16, gen)
    q = randn(5, 8, 32, dtype=torch.bfloat16, gen=gen)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([48, 49, 50, 8, 9], dtype=torch.int32)
    margs = (q, args[1], args[2], args[3], lens, args[5])
    out, lse = dcp_ops.gqa_decode_partial(*margs, cu_seqlens_q=cu, **scales)
    assert_decode(out, lse, ref.gqa_decode_partial, margs, torch.bfloat16, "native", "gqa fp8 multi-token",
                  cu_seqlens_q=cu, **scales)


def _gqa_args():
    gen = torch.Generator().manual_seed(0)
    return gqa_case([5], 4, 2, 1, 16, torch.float32, gen)


@pytest.mark.parametrize("change,msg", [
    (dict(k_scale=None), r"gqa_decode_partial: k_scale is required with a float8_e4m3fn k_cache"),
    (dict(v_scale=None), r"gqa_decode_partial: v_scale is required with a float8_e4m3fn v_cache"),
    (dict(k_scale=torch.ones(2)), r"gqa_decode_partial: k_scale must be a 1-element tensor"),
    (dict(v_scale=torch.ones(1, dtype=torch.float64)), r"gqa_decode_partial: v_scale must have dtype Float"),
    (dict(k_scale=torch.ones(1, device="meta")), r"k_scale must be on the same device as"),
])
def test_gqa_fp8_arguments_are_checked_by_name(change, msg):
    args, scales = _gqa_args()
    scales.update(change)
    with pytest.raises((ValueError, RuntimeError), match=msg):
        dcp_ops.gqa_decode_partial(*args, **scales)


def test_gqa_scales_need_fp8_caches_and_both_caches_fp8():
    args, scales = _gqa_args()
    q, k, v = args[:3]
    with pytest.raises(RuntimeError, match=r"gqa_decode_partial: k_scale is for float8_e4m3fn caches only, got one "
                                           r"with a Float k_cache"):
        dcp_ops.gqa_decode_partial(q, k.float(), v.float(), *args[3:], **scales)
    with pytest.raises(RuntimeError, match=r"gqa_decode_partial: v_cache must have dtype Float8_e4m3fn, got Float"):
        dcp_ops.gqa_decode_partial(q, k, v.float(), *args[3:], **scales)


def test_mla_fp8_arguments_are_checked_by_name():
    gen = torch.Generator().manual_seed(1)
    args, scales = mla_case([5], 4, 2, 32, 16, torch.bfloat16, gen)
    with pytest.raises(RuntimeError, match=r"mla_decode_partial: kv_scale is required with a float8_e4m3fn kv_cache"):
        dcp_ops.mla_decode_partial(*args)
    kv16 = args[2].to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"mla_decode_partial: kv_scale is for float8_e4m3fn caches only, got one "
                                           r"with a BFloat16 kv_cache"):
        dcp_ops.mla_decode_partial(args[0], args[1], kv16, *args[3:], **scales)
    with pytest.raises(RuntimeError, match=r"mla_decode_partial: kv_scale must be a 1-element tensor"):
        dcp_ops.mla_decode_partial(*args, kv_scale=torch.ones(1, 1))


def _sharded_case(kind, gen):
    """An unsharded fp8 case (fp32 query, so the bound is the fp32 row) over 4 sequences, one of them empty."""
    lens = [45, 0, 130, 7]
    if kind == "gqa":
        return gqa_case(lens, 16, 8, 2, 32, torch.float32, gen)
    return mla_case(lens, 16, 8, 64, 16, torch.float32, gen, absorb=True, up=True)


def _partial(kind, args, scales, cache_args, lens):
    if kind == "gqa":
        return dcp_ops.gqa_decode_partial(args[0], *cache_args, args[3], lens, args[5], **scales)
    return dcp_ops.mla_decode_partial(args[0], args[1], *cache_args, args[3], lens, *args[5:], **scales)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 4), (4, 16), (6, 2)])
def test_sharded_fp8_decode_is_unsharded_attention(kind, world, interleave):
    """shard_kv of fp8 caches (bytes moved as they are, NaN fill), each rank's partial, merged: unsharded attention
    over the dequantized cache."""
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    args, scales = _sharded_case(kind, gen)
    caches = args[1:3] if kind == "gqa" else args[2:3]
    table, lens = args[3], args[4]
    shards = [dcp_ops.shard_kv(c, table, lens, world, interleave, fill=float("nan")) for c in caches]
    outs, lses = zip(*[_partial(kind, args, scales, [s[r] for s in shards], dcp_ops.local_seq_lens(
        lens, world, r, interleave)) for r in range(world)])
    out, lse = dcp_ops.merge_partials(torch.stack(outs), torch.stack(lses))
    fn = ref.gqa_decode_partial if kind == "gqa" else ref.mla_decode_partial
    assert_decode(out, lse, fn, args, torch.float32, "native", f"{kind} fp8 world {world} I {interleave}", **scales)


def _dcp_worker(rank, world, init_file):
    import torch.distributed as dist
    from conftest import init_gloo
    init_gloo(rank, world, init_file)
    for kind in ("gqa", "mla"):
        args, scales = _sharded_case(kind, torch.Generator().manual_seed(5))
        lens, table = args[4], args[3]
        local = dcp_ops.local_seq_lens(lens, world, rank)
        caches = args[1:3] if kind == "gqa" else args[2:3]
        mine = [dcp_ops.shard_kv(c, table, lens, world, fill=float("nan"))[rank] for c in caches]
        if kind == "gqa":
            shard = dcp_ops.GQAShard(mine[0], mine[1], table, local, args[5], **scales)
            q_full = args[0]
        else:
            shard = dcp_ops.MLAShard(mine[0], table, local, args[5], args[1].shape[-1], args[6], args[7], **scales)
            q_full = torch.cat([args[0], args[1]], -1)
        fn = ref.gqa_decode_partial if kind == "gqa" else ref.mla_decode_partial
        want, want_lse = fn(*args, **scales)
        h_loc = q_full.shape[1] // world
        heads = slice(rank * h_loc, (rank + 1) * h_loc)
        for mode in ("a2a", "ag_rs", "ag"):
            for replicated in (False, True):
                q = q_full if replicated else q_full[:, heads].contiguous()
                out, lse = dcp_ops.dcp_attention(q, shard, mode=mode, q_replicated=replicated, return_lse=True)
                sel = slice(None) if mode == "ag" else heads
                what = f"rank {rank} {kind} fp8 {mode} q_replicated={replicated}"
                torch.testing.assert_close(out.double(), want[:, sel], rtol=1e-5, atol=1e-5, msg=what)
                torch.testing.assert_close(lse.double(), want_lse[:, sel], rtol=1e-6, atol=1e-5, msg=what)
    dist.barrier()
    dist.destroy_process_group()


def test_dcp_attention_on_fp8_caches():
    from conftest import spawn_ranks
    spawn_ranks(_dcp_worker, 4)


# The CUDA sources under the SIMT executor (outputs start as NaN there, so an unwritten element fails).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,hq,hkv,block_size", [(64, 8, 2, 16), (128, 4, 4, 1), (256, 3, 1, 64)])
def test_gqa_fp8_cache_cuda_source(simt_ops, dtype, d, hq, hkv, block_size):
    gen = torch.Generator().manual_seed(d + hq)
    args, scales = gqa_case([0, 37, 90], block_size, hq, hkv, d, dtype, gen)
    for precision in ("native", "fp32"):
        out, lse = simt_ops.gqa_decode_partial(*args, precision=precision, **scales)
        assert out.dtype == dtype
        assert_decode(out, lse, ref.gqa_decode_partial, args, dtype, precision, f"simt gqa fp8 {dtype}", **scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent,rope,absorb,up", [(512, 64, False, False), (128, 0, True, True)])
def test_mla_fp8_cache_cuda_source(simt_ops, dtype, latent, rope, absorb, up):
    gen = torch.Generator().manual_seed(latent + rope)
    args, scales = mla_case([40, 0, 9], 16, 8, latent, rope, dtype, gen, absorb, up)
    for precision in ("native", "fp32"):
        out, lse = simt_ops.mla_decode_partial(*args, precision=precision, **scales)
        assert out.dtype == dtype
        assert_decode(out, lse, ref.mla_decode_partial, args, dtype, precision, f"simt mla fp8 {dtype}", **scales)


def test_every_e4m3_value_is_read_exactly_cuda_source(simt_ops):
    gen = torch.Generator().manual_seed(9)
    v = torch.randperm(256, generator=gen).to(torch.uint8).reshape(1, 1, 1, 256).view(FP8)
    k = torch.randn(1, 1, 1, 256, generator=gen).to(FP8)
    out, _ = simt_ops.gqa_decode_partial(torch.randn(1, 1, 256, generator=gen), k, v,
                                         torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1,
                                         k_scale=scale_of(1.0), v_scale=scale_of(1.0))
    expected = v.float().reshape(1, 1, 256)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


# The tiled tensor-core kernel on fp8 caches (native, 16-bit queries, latent 256 / 512): e4m3 tiles copied raw and
# converted in shared memory. optin: the shared memory the executor reports (an A100's takes the 32-token tile).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,latent,rope,block_size,absorb,optin", [
    (16, 512, 64, 64, True, None), (20, 256, 0, 5, False, None), (16, 512, 64, 16, False, 163840),
    (5, 256, 64, 1, True, 163840)])
def test_mla_fp8_cache_tiled_cuda_source(simt_ops, monkeypatch, dtype, heads, latent, rope, block_size, absorb,
                                         optin):
    if optin is not None:
        monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(heads + latent + block_size)
    args, scales = mla_case([300, 0, 17, 70], block_size, heads, latent, rope, dtype, gen, absorb, absorb)
    out, lse = simt_ops.mla_decode_partial(*args, precision="native", **scales)
    assert_decode(out, lse, ref.mla_decode_partial, args, dtype, "native", f"simt tiled mla fp8 {dtype}", **scales)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_fp8_native_runs_on_the_tiled_kernel(simt_ops, dtype):
    """At a sharp softmax (query x 3) one 16-bit query term moves the LSE by more than 1e-4, which the SIMT kernel's
    fp32 query does not: native's LSE is the tiled kernel's, fp32's the SIMT kernel's."""
    gen = torch.Generator().manual_seed(4)
    args, scales = mla_case([300, 129], 64, 16, 512, 64, dtype, gen, absorb=True)
    args = ((args[0].float() * 3).to(dtype), (args[1].float() * 3).to(dtype), *args[2:])
    exact = ref.mla_decode_partial(*args, **scales)
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    _, lse_native = simt_ops.mla_decode_partial(*args, precision="native", **scales)
    _, lse_fp32 = simt_ops.mla_decode_partial(*args, precision="fp32", **scales)
    assert err(lse_fp32, exact[1]) <= 1e-5
    assert err(lse_native, exact[1]) >= 1e-4


def test_mla_fp8_multi_token_tiled_cuda_source(simt_ops):
    """MTP on an fp8 cache: 16 heads x 4 query tokens, the 64 rows of one tiled block, each masked causally."""
    gen = torch.Generator().manual_seed(8)
    args, scales = mla_case([90, 40], 16, 16, 512, 64, torch.bfloat16, gen)
    q_nope = randn(8, 16, 512, dtype=torch.bfloat16, gen=gen)
    q_pe = randn(8, 16, 64, dtype=torch.bfloat16, gen=gen)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    lens = torch.tensor([87, 88, 89, 90, 37, 38, 39, 40], dtype=torch.int32)
    margs = (q_nope, q_pe, args[2], args[3], lens, args[5])
    out, lse = simt_ops.mla_decode_partial(*margs, cu_seqlens_q=cu, **scales)
    assert_decode(out, lse, ref.mla_decode_partial, margs, torch.bfloat16, "native", "simt tiled mla fp8 MTP",
                  cu_seqlens_q=cu, **scales)


# Non-finite values through fp8 caches (docs/design.md §2): e4m3fn has NaN but no infinities, so the poisons that
# apply are a NaN key (stored as 0x7F) and a NaN or +inf query; the result must match the reference's non-finite
# pattern exactly, on the CPU and the CUDA sources (GQA d64 with a 16-bit query: the mma.sync kernel; MLA 512 + 64
# native: the tiled kernel).
def _fp8_poisons():
    from test_nonfinite import POISONS
    return [p for p in POISONS if p[0] in ("NaN in the query", "NaN in an attended key", "+inf in the query")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("what,poison", _fp8_poisons(), ids=[p[0] for p in _fp8_poisons()])
def test_fp8_nonfinite(simt_ops, dtype, what, poison):
    from test_nonfinite import assert_same_nonfinite, gqa_case as nf_gqa, mla_case as nf_mla
    one = scale_of(1.0)
    q, k, v, table, lens, scale = nf_gqa(torch.float32, poison)
    args = (q.to(dtype), k.to(FP8), v.to(FP8), table, lens, scale)
    r_out, r_lse = ref.gqa_decode_partial(*args, k_scale=one, v_scale=one)
    native = ref.gqa_decode_partial(*args, k_scale=one, v_scale=one, round_to=dtype) if dtype != torch.float32 else None
    for name, ops in (("cpu", dcp_ops.ops._ops), ("cuda source", simt_ops)):
        out, lse = ops.gqa_decode_partial(*args, k_scale=one, v_scale=one)
        assert_same_nonfinite(out, lse, r_out, r_lse, dtype, f"gqa fp8 {name}: {what}", native=native)
    q_nope, q_pe, kv, table, lens, scale, _ = nf_mla(torch.float32, poison, heads=16, latent=512)
    args = (q_nope.to(dtype), q_pe.to(dtype), kv.to(FP8), table, lens, scale)
    r_out, r_lse = ref.mla_decode_partial(*args, kv_scale=one)
    native = ref.mla_decode_partial(*args, kv_scale=one, round_to=dtype) if dtype != torch.float32 else None
    for name, ops in (("cpu", dcp_ops.ops._ops), ("cuda source", simt_ops)):
        out, lse = ops.mla_decode_partial(*args, kv_scale=one)
        assert_same_nonfinite(out, lse, r_out, r_lse, dtype, f"mla fp8 {name}: {what}", native=native)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gqa_fp8_multi_token_cuda_source(simt_ops, dtype):
    """GQA on an fp8 cache with 5 and 2 query tokens of 3 heads per KV head (bf16: the mma.sync kernel's 16-row tiles,
    which the rows straddle; fp32: the SIMT kernel), each causal at its own length."""
    gen = torch.Generator().manual_seed(12)
    args, scales = gqa_case([70, 33], 16, 6, 2, 64, dtype, gen)
    q = randn(7, 6, 64, dtype=dtype, gen=gen)
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    lens = torch.tensor([66, 67, 68, 69, 70, 32, 33], dtype=torch.int32)
    margs = (q, args[1], args[2], args[3], lens, args[5])
    for precision in ("native", "fp32"):
        out, lse = simt_ops.gqa_decode_partial(*margs, precision=precision, cu_seqlens_q=cu, **scales)
        assert_decode(out, lse, ref.gqa_decode_partial, margs, dtype, precision, f"simt gqa fp8 MTP {dtype}",
                      cu_seqlens_q=cu, **scales)
