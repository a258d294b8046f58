"""Shared-memory bank conflicts of the tensor-core MLA kernels, counted by the SIMT executor.

Every warp-wide shared access the kernel makes through the executor (its ldmatrix loads of Q, K, V and P, and its P
stores, st_shared_u32) must take the fewest wavefronts its size allows: the 16-byte-chunk swizzles put the 8 rows an
ldmatrix phase reads, and the 8 rows a warp's P stores touch, on distinct banks. Both token tiles: BN = 64 (128-byte P
rows) and BN = 32 (64-byte P rows, the configuration of devices with less shared memory, chosen here through
DCP_SIMT_SMEM_OPTIN), bf16 and fp8 caches (whose tiles are converted into the same 16-bit layout), latent 512 + 64 and
256 + 0, one query token and two (rows of two tokens in one row group). So must the cp.async writes of the tiled
kernel's tiles and of the split-term kernel's steps (the executor's async_bank_stats).
"""
import pytest
import torch

from conftest import paged_cache

pytestmark = pytest.mark.simt

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def mma_sync_device(monkeypatch):
    """The tiled and split-term kernels' counts: a device that takes them (sm_80, the wgmma pass off), whatever the
    environment says (a CI rerun under DCP_SIMT_ARCH=90)."""
    monkeypatch.setenv("DCP_SIMT_ARCH", "80")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "0")


# (latent, rope, shared memory a block may opt in to, the token tile the kernel then takes): an H100's 227 KiB takes
# 64-token tiles; an A100's 163 KiB takes 32 at 512 + 64, and 100000 bytes takes 32 at 256 + 0
CONFIGS = [(512, 64, None, 64), (512, 64, 166912, 32), (256, 0, None, 64), (256, 0, 100000, 32)]


@pytest.mark.parametrize("latent,rope,optin,tile", CONFIGS, ids=["512-bn64", "512-bn32", "256-bn64", "256-bn32"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_tiled_mla_kernel_is_bank_conflict_free(simt_ops, monkeypatch, latent, rope, optin, tile, cache_dtype,
                                                tokens):
    if optin is not None:
        monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(latent + rope + tile + tokens)
    lens = [tile + 7] * tokens  # two tiles, the second partial
    kv, table = paged_cache(lens[:1], 64, (latent + rope,), torch.float32, gen)
    kv = kv.to(cache_dtype)
    H = 16
    q_nope = torch.randn(tokens, H, latent, generator=gen).bfloat16()
    q_pe = torch.randn(tokens, H, rope, generator=gen).bfloat16()
    seq_lens = torch.tensor([lens[0] - tokens + 1 + i for i in range(tokens)], dtype=torch.int32)
    kwargs = dict(cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32)) if tokens > 1 else {}
    if cache_dtype == FP8:
        kwargs["kv_scale"] = torch.tensor([1.0])
    simt_ops.bank_stats(True)
    out, lse = simt_ops.mla_decode_partial(q_nope, q_pe, kv, table, seq_lens, 0.05, **kwargs)
    requests, wavefronts, ideal = simt_ops.bank_stats(True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert requests > 0, "the tiled kernel made no counted shared access: it did not run"
    assert wavefronts == ideal, (f"{requests} warp-wide shared accesses took {wavefronts} wavefronts, "
                                 f"{wavefronts - ideal} more than the {ideal} their sizes need (bank conflicts)")


def _run_mla(simt_ops, monkeypatch, latent, rope, optin, cache_dtype, precision="native"):
    if optin is not None:
        monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(optin))
    gen = torch.Generator().manual_seed(latent + rope)
    kv, table = paged_cache([100], 64, (latent + rope,), torch.float32, gen)
    kwargs = dict(kv_scale=torch.tensor([1.0])) if cache_dtype == FP8 else {}
    out, _ = simt_ops.mla_decode_partial(torch.randn(1, 16, latent, generator=gen).bfloat16(),
                                         torch.randn(1, 16, rope, generator=gen).bfloat16(), kv.to(cache_dtype),
                                         table, torch.tensor([100], dtype=torch.int32), 0.05, precision=precision,
                                         **kwargs)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("latent,rope,optin,tile", CONFIGS, ids=["512-bn64", "512-bn32", "256-bn64", "256-bn32"])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_tiled_mla_kernel_cp_async_writes(simt_ops, monkeypatch, latent, rope, optin, tile, cache):
    """The KV tiles' cp.async writes: at BN 64 two rows share a phase (4 threads a row), and the odd row's chunk
    order puts them on the other half of the banks (16-bit tiles, and e4m3 raw rows of 128-byte multiples)."""
    simt_ops.async_bank_stats(True)
    _run_mla(simt_ops, monkeypatch, latent, rope, optin, torch.bfloat16 if cache == "bf16" else FP8)
    requests, wavefronts, ideal = simt_ops.async_bank_stats(True)
    assert requests > 0 and wavefronts == ideal, (requests, wavefronts, ideal)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_split_term_mla_kernel_cp_async_writes(simt_ops, monkeypatch, cache):
    simt_ops.async_bank_stats(True)
    _run_mla(simt_ops, monkeypatch, 512, 64, None, torch.bfloat16 if cache == "bf16" else FP8, precision="fp32")
    requests, wavefronts, ideal = simt_ops.async_bank_stats(True)
    assert requests > 0 and wavefronts == ideal, (requests, wavefronts, ideal)


@pytest.mark.parametrize("latent,rope,optin,tile", CONFIGS, ids=["512-bn64", "512-bn32", "256-bn64", "256-bn32"])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_wgmma_mla_kernel_shared_writes(simt_ops, monkeypatch, latent, rope, optin, tile, cache):
    """The wgmma kernel's own shared writes (its operands are read by the tensor cores, not by warp-wide loads): the
    KV tiles' and the query's cp.async writes, and the P stores."""
    monkeypatch.setenv("DCP_SIMT_ARCH", "90")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1")
    simt_ops.kernel_log(True)
    simt_ops.bank_stats(True)
    simt_ops.async_bank_stats(True)
    _run_mla(simt_ops, monkeypatch, latent, rope, optin, torch.bfloat16 if cache == "bf16" else FP8)
    stores, copies = simt_ops.bank_stats(True), simt_ops.async_bank_stats(True)
    assert any(k.startswith(f"mla_wgmma_kernel<") and k.endswith(f", {tile}, {str(cache == 'fp8').lower()}>")
               for k in simt_ops.kernel_log(True))
    assert stores[0] > 0 and copies[0] > 0
    assert copies[1] == copies[2], f"cp.async: {copies[1]} wavefronts, {copies[1] - copies[2]} over the ideal"
    assert stores[1] == stores[2], f"P stores: {stores[1]} wavefronts, {stores[1] - stores[2]} over the ideal"
