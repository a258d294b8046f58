"""The one decision of each decode op's split pass (csrc/cuda/split_choice.h) on the executor's device, and that the
launch runs the kernel it names (the executor's kernel log)."""
import pytest
import torch

from dcp_ops import reference as ref
from test_simt import _mla_case
from tolerances import assert_decode

pytestmark = pytest.mark.simt

H100 = 232448  # shared memory a block may opt in to on sm_90


@pytest.mark.parametrize("arch,smem,native,elem,want", [
    (80, H100, True, 2, ("mla_tiled_kernel", 64, 64, 64)),
    (90, H100, True, 2, ("mla_tiled_kernel", 64, 64, 64)),
    (100, H100, True, 2, ("mla_tiled_kernel", 64, 64, 64)),
    (80, 166912, True, 2, ("mla_tiled_kernel", 64, 32, 32)),   # an A100's opt-in: BN 32
    (80, 99 * 1024, True, 2, ("mla_mma_kernel", 16, 64, 0)),   # sm_86 / sm_89: the split-term kernel
    (80, H100, False, 2, ("mla_mma_kernel", 16, 64, 0)),       # precision "fp32"
    (80, H100, True, 4, ("mla_split_kernel", 4, 64, 0)),       # an fp32 query
    ("90+wgmma", H100, True, 2, ("mla_wgmma_kernel", 64, 64, 64)),
    ("90+wgmma", 166912, True, 2, ("mla_wgmma_kernel", 64, 32, 32)),
    ("90+wgmma", 99 * 1024, True, 2, ("mla_mma_kernel", 16, 64, 0)),
    ("90+wgmma", H100, False, 2, ("mla_mma_kernel", 16, 64, 0)),
    ("80+wgmma", H100, True, 2, ("mla_tiled_kernel", 64, 64, 64)),  # wgmma is sm_90a's only
])
def test_mla_split_choice(simt_ops, monkeypatch, arch, smem, native, elem, want):
    arch = str(arch)
    if arch.endswith("+wgmma"):  # the switch of the wgmma pass (csrc/cuda/split_choice.h)
        arch = arch[:-len("+wgmma")]
        monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1")
    else:
        monkeypatch.delenv("DCP_OPS_MLA_WGMMA", raising=False)
    monkeypatch.setenv("DCP_SIMT_ARCH", arch)
    monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(smem))
    name, rows, granule, tokens, smem_used = simt_ops.mla_split_choice(512, 64, elem, native)
    assert (name, rows, granule, tokens) == want
    assert (smem_used > 0) == (tokens > 0) and smem_used <= smem


@pytest.mark.parametrize("D,elem,rows,want", [
    (128, 2, 8, ("gqa_mma_kernel", 8)), (64, 2, 12, ("gqa_mma_kernel", 16)),
    (256, 2, 8, ("gqa_split_kernel", 8)), (128, 4, 3, ("gqa_split_kernel", 4)),
])
def test_gqa_split_choice(simt_ops, D, elem, rows, want):
    name, R, granule = simt_ops.gqa_split_choice(D, elem, rows)
    assert (name, R, granule) == (*want, 64)


def test_unknown_arch_is_refused(simt_ops, monkeypatch):
    monkeypatch.setenv("DCP_SIMT_ARCH", "75")
    with pytest.raises(Exception, match="DCP_SIMT_ARCH must be 80, 90 or 100, got 75"):
        simt_ops.mla_split_choice(512, 64, 2, True)


@pytest.mark.parametrize("smem,native,wgmma", [(H100, True, False), (166912, True, False), (99 * 1024, True, False),
                                               (H100, False, False), (H100, True, True), (166912, True, True)])
def test_the_launch_runs_the_chosen_kernel(simt_ops, monkeypatch, smem, native, wgmma):
    monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(smem))
    monkeypatch.setenv("DCP_SIMT_ARCH", "90" if wgmma else "80")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1" if wgmma else "0")
    name, _, _, tokens, _ = simt_ops.mla_split_choice(256, 64, 2, native)
    args = _mla_case([70, 5], 16, 256, 64, False, False, 16, torch.bfloat16, torch.Generator().manual_seed(3))
    simt_ops.kernel_log(True)
    precision = "native" if native else "fp32"
    out, lse = simt_ops.mla_decode_partial(*args, precision=precision)
    log = simt_ops.kernel_log(True)
    split = [k for k in log if k.startswith("mla_")]
    assert len(split) == 1 and split[0].startswith(name + "<"), log
    if tokens:
        assert split[0].endswith(f", {tokens}, false>"), split[0]
    assert simt_ops.last_kernel() == ""  # the log was reset; the merge ran before the reset
    assert_decode(out, lse, ref.mla_decode_partial, args, torch.bfloat16, precision, "MLA " + name)


@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("wgmma", [False, True])
def test_the_built_library_makes_the_same_choice(simt_ops, monkeypatch, arch, wgmma):
    """_C.split_choice (the nvcc-built library, for tools that read its SASS: bench/gpu/sass_budget.py) answers as
    the executor's launchers decide, for a device described by arch and shared memory."""
    from dcp_ops import _C
    if not hasattr(_C, "split_choice"):
        pytest.skip("dcp_ops._C was built without the CUDA sources")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1" if wgmma else "0")
    monkeypatch.setenv("DCP_SIMT_ARCH", str(arch))
    for smem in (H100, 166912, 99 * 1024):
        monkeypatch.setenv("DCP_SIMT_SMEM_OPTIN", str(smem))
        for latent, rope in ((512, 64), (256, 0), (128, 64)):
            for native in (True, False):
                for elem in (2, 4):
                    got = _C.split_choice("mla", latent, rope, elem, native, arch=arch, smem_optin=smem)
                    assert got == tuple(simt_ops.mla_split_choice(latent, rope, elem, native)), (smem, latent, native)
        for D, rows in ((128, 8), (64, 12), (256, 8)):
            got = _C.split_choice("gqa", D, 0, 2, True, rows=rows, arch=arch, smem_optin=smem)
            assert got[:3] == tuple(simt_ops.gqa_split_choice(D, 2, rows)), (smem, D, rows)
    # the default shared memory is the arch's flagship's: an A100's takes 32-token tiles at 512 + 64, an H100's 64
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "0")
    assert _C.split_choice("mla", 512, 64, 2, True, arch=arch)[3] == (32 if arch == 80 else 64)
    with pytest.raises(ValueError, match="op must be 'mla' or 'gqa', got 'mha'"):
        _C.split_choice("mha", 128, 0, 2, True, arch=arch)
