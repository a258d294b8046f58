"""Static checks of the CUDA kernels (no GPU needed): ptxas reports no spills and no stack frame on every arch."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
ARCHS = ["sm_80", "sm_90a", "sm_100a"]

INSTANTIATE = """
#include "kernels/gqa_decode_mma.cuh"
#include "kernels/head_project.cuh"
#include "kernels/merge.cuh"
#include "kernels/mla_decode_mma.cuh"
#include "kernels/mla_decode_tiled.cuh"
#include "kernels/mla_decode_wgmma.cuh"
#include "kernels/split_plan.cuh"
#include "kernels/write_kv.cuh"
// The launchers instantiate every kernel variant they can pick (16-byte packs and scalar, each head tile).
namespace dcp_ops::kernels {
template <typename T> void all(cudaStream_t s) {
  merge_partials<T>(MergeParams{}, s);
  merge<T, T>(MergeArgs<PackedLse>{}, s);
  merge<float, T>(MergeParams{}, s);
  correct_partial<T>(CorrectParams{}, s);
  pack_exchange<T>(PackParams{}, s);
  gqa_split<T>(GqaParams{}, s);             // the SIMT kernels (any device)
  for (bool native : {true, false})
    for (bool fp8 : {false, true})  // and the tensor-core ones (16-bit T, sm_80+), P in 1 or 2 terms; fp8 caches
      gqa_split_pass<T>(GqaParams{}, s, true, native, fp8);
  gqa_split_pass<T>(GqaParams{}, s, false, true, true);  // the SIMT kernels on fp8 caches
  for (int latent : {128, 256, 512})
    for (int rope : {0, 64}) {
      mla_split<T>(MlaParams{}, latent, rope, s);
      mla_split<fp8_e4m3>(MlaParams{}, latent, rope, s);
      mla_split_pass<T>(MlaParams{}, latent, rope, s, true, false);  // "fp32" on tensor cores
      mla_split_pass<T>(MlaParams{}, latent, rope, s, true, true);   // ... on an fp8 cache
      if constexpr (sizeof(T) == 2)
        if (latent != 128)
          for (int bn : {64, 32}) {
            mla_tiled_pass<T>(MlaParams{}, latent, rope, bn, s);  // "native"
            mla_tiled_pass<T, true>(MlaParams{}, latent, rope, bn, s);  // ... on an fp8 cache
            mla_wgmma_pass<T>(MlaParams{}, latent, rope, bn, s);  // "native" on sm_90a (a trap elsewhere)
            mla_wgmma_pass<T, true>(MlaParams{}, latent, rope, bn, s);
          }
    }
  head_project<T, T, float>(ProjectParams{}, s);
  head_project<float, T, T>(ProjectParams{}, s);
  write_kv_fp8<T>(WriteKvParams{}, s);
}
template void all<float>(cudaStream_t);
template void all<__nv_bfloat16>(cudaStream_t);
template void all<__half>(cudaStream_t);
template cudaError_t merge<float, float>(const MergeParams&, cudaStream_t);
cudaError_t write_kv_entry(cudaStream_t s) { return write_kv(WriteKvParams{}, s); }
cudaError_t split_plan_entry(cudaStream_t s) { return split_plan(SplitPlanParams{}, s); }
}
"""


def _cuobjdump():
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.isfile(path) else shutil.which("cuobjdump")


_COMPILED = {}


def _compile(arch, tmp_path_factory):
    """(arch, ptxas -v report, cubin path) for every kernel variant, compiled once per arch."""
    if arch not in _COMPILED:
        nvcc = NVCC if os.path.isfile(NVCC) else shutil.which("nvcc")
        if nvcc is None:
            pytest.skip("nvcc not found")
        d = tmp_path_factory.mktemp(arch)
        src = d / "instantiate.cu"
        src.write_text(INSTANTIATE)
        cubin = d / "k.cubin"
        res = subprocess.run([nvcc, "-cubin", str(src), "-o", str(cubin), f"-arch={arch}", "-O3", "-std=c++17",
                              "-I", os.path.join(ROOT, "csrc"), "-Xptxas", "-v"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        _COMPILED[arch] = (arch, res.stderr, str(cubin))
    return _COMPILED[arch]


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request, tmp_path_factory):
    return _compile(request.param, tmp_path_factory)


def test_kernels_have_no_spills_or_stack(compiled):
    arch, report, _ = compiled
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    names = " ".join(kernels)
    for family in ("merge_kernel", "correct_kernel", "pack_kernel", "write_kv_kernel", "write_kv_fp8_kernel",
                   "split_plan_kernel", "gqa_split_kernel", "gqa_mma_kernel", "mla_split_kernel", "mla_mma_kernel",
                   "mla_tiled_kernel", "mla_wgmma_kernel", "head_project_kernel"):
        assert family in names, f"{arch}: {family} not compiled: {names}"
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", report)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert len(frames) == len(kernels) and not any(frames), f"{arch}: {report}"
    assert spills and not any(spills), f"{arch}: {report}"


def test_hot_loops_use_128_bit_global_loads(compiled):
    arch, _, cubin = compiled
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (it ships with triton)")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    functions = re.split(r"\n\s*Function : ", sass)
    checked = mma = 0
    for fn in functions[1:]:
        name = fn.split("\n", 1)[0]
        # the 16-byte-pack instantiations: VEC = 4 (fp32) or 8 (16-bit) for merge, every GQA variant (on fp8 caches
        # too: two lanes share a load in the SIMT kernel), MLA with a latent of 256 or 512 (128 gives 16-bit types
        # 8-byte packs); MLA's SIMT kernel on fp8 caches reads 8-byte packs, the tiled MLA kernel 16-byte ones by
        # cp.async (checked below)
        fp8 = "fp8_e4m3" in name or "Lb1E" in name
        wide = "gqa_split_kernel" in name or "gqa_mma_kernel" in name or (
            "merge_kernel" in name and re.search(r"Li(4|8)E", name) is not None) or (
            "mla_split_kernel" in name and not fp8 and re.search(r"Li(256|512)E", name) is not None)
        if not wide:
            continue
        checked += 1
        assert re.search(r"LDG\.E\.128", fn) or re.search(r"LDG\.E\.(?:EL\.)?128", fn), \
            f"{arch}: no 128-bit global load in {name}"
        if "gqa_mma_kernel" in name:
            mma += 1
            assert re.search(r"HMMA\.16816\.F32", fn), f"{arch}: no tensor-core mma in {name}"
    for fn in functions[1:]:  # GQA on fp8 caches: 16-byte loads only (two 8-byte e4m3 chunks or packs each)
        name = fn.split("\n", 1)[0]
        if ("gqa_mma_kernel" in name and "Lb1E" in name) or ("gqa_split_kernel" in name and "fp8_e4m3" in name):
            assert not re.search(r"LDG(?:\.\w+)*\.64\b", fn), f"{arch}: an 8-byte global load in {name}"
    tiled = 0
    for fn in functions[1:]:  # MLA on tensor cores: rows reach shared memory by 16-byte cp.async
        name = fn.split("\n", 1)[0]
        if "mla_mma_kernel" in name or "mla_tiled_kernel" in name:
            mma += 1
            assert re.search(r"HMMA\.16816\.F32", fn), f"{arch}: no tensor-core mma in {name}"
            assert re.search(r"LDGSTS\.E\.(?:BYPASS\.)?128", fn), f"{arch}: no 16-byte cp.async in {name}"
        if "mla_tiled_kernel" in name:  # operands from shared memory by ldmatrix (V by ldmatrix.trans)
            tiled += 1
            assert re.search(r"LDSM\.16\.M88\.4", fn) and re.search(r"LDSM\.16\.MT88\.4", fn), \
                f"{arch}: no ldmatrix / ldmatrix.trans in {name}"
    assert checked >= 30, f"{arch}: only {checked} wide kernels found in the SASS"
    wgmma = 0
    for fn in functions[1:]:  # the wgmma MLA kernel (sm_90a; elsewhere its body is a trap): operands by descriptor
        name = fn.split("\n", 1)[0]
        if "mla_wgmma_kernel" in name and arch == "sm_90a":
            wgmma += 1
            assert re.search(r"HGMMA\.64x\d+x16\.F32", fn), f"{arch}: no wgmma in {name}"
            assert re.search(r"LDGSTS\.E\.(?:BYPASS\.)?128", fn), f"{arch}: no 16-byte cp.async in {name}"
            assert not re.search(r"LDSM|HMMA", fn), f"{arch}: ldmatrix or mma.sync in {name}"
    assert wgmma == (32 if arch == "sm_90a" else 0), f"{arch}: {wgmma} wgmma MLA kernels with wgmma"
    assert tiled == 32, f"{arch}: {tiled} tiled MLA kernels, expected 2 types x 2 latents x 2 ropes x 2 token tiles " \
        "x 2 caches (16-bit, fp8)"
    assert mma == 80, f"{arch}: {mma} tensor-core kernels found in the SASS, expected 80 (2 types x 2 dims x 2 tiles " \
        "x 2 precisions x 2 caches for GQA; 2 types x 2 latents x 2 ropes x 2 caches for MLA fp32, and those x 2 " \
        "token tiles tiled)"


def _launched_native_mla(arch, cubin, smem_optin=0):
    """sass_budget's record of the bf16 512 + 64 native MLA instantiation the launchers take on `arch` (the one
    decision, cuda/split_choice.h, through _C.split_choice), with smem_optin bytes a block (0: the arch's
    flagship's: A100, H100)."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
    import sass_budget
    records = [r for r in sass_budget.budget(cubin, arch, smem_optin) if r["op"] == "mla" and r["cache"] == "bf16"
               and r["precision"] == "native" and r["dims"] == "512+64"]
    assert records, f"{arch}: no native bf16 512 + 64 MLA kernel in the SASS"
    if records[0]["launched"] is None:
        pytest.skip("dcp_ops._C was built without the CUDA sources (no _C.split_choice)")
    taken = [r for r in records if r["launched"]]
    assert len(taken) == 1, taken
    return taken[0]


def test_sass_budget_of_the_native_mla_kernel(compiled, monkeypatch):
    """docs/design.md §8's static targets, read as bench/gpu/sass_budget.py reads them: the sm_90a bf16 512 + 64 native
    MLA split pass at most 1.05x the minimum HMMA per (KV token x query head) and 2.5 warp instructions per one."""
    arch, _, cubin = compiled
    if arch != "sm_90a":
        pytest.skip("the static targets are set for sm_90a")
    monkeypatch.delenv("DCP_OPS_MLA_WGMMA", raising=False)  # the default pass: the tiled mma.sync kernel
    best = _launched_native_mla(arch, cubin)
    assert "mla_tiled_kernel" in best["kernel"] and best["token_heads"] == 64 * 64, best
    assert best["hmma_per_token_head"] <= 1.05 * best["hmma_min_per_token_head"], best
    assert best["warp_instructions_per_token_head"] <= 2.5, best
    assert best["spill_bytes"] == 0 and 0 < best["registers"] <= 255, best


def test_sass_budget_of_the_native_mla_kernel_on_sm80_is_within_1_4x_of_sm90a(tmp_path_factory, monkeypatch):
    """docs/design.md §8: on sm_80 (an A100's shared memory takes the 32-token tile) the same two figures within 1.4x
    of sm_90a's (64-token tile)."""
    monkeypatch.delenv("DCP_OPS_MLA_WGMMA", raising=False)
    a = _launched_native_mla("sm_80", _compile("sm_80", tmp_path_factory)[2])
    b = _launched_native_mla("sm_90a", _compile("sm_90a", tmp_path_factory)[2])
    assert a["token_heads"] == 32 * 64 and b["token_heads"] == 64 * 64, (a, b)
    assert a["warp_instructions_per_token_head"] <= 1.4 * b["warp_instructions_per_token_head"], (a, b)
    assert a["hmma_per_token_head"] <= 1.4 * b["hmma_per_token_head"], (a, b)
    assert a["spill_bytes"] == 0 and 0 < a["registers"] <= 255, a


@pytest.fixture
def wgmma_budget(compiled, monkeypatch):
    """The record of the wgmma MLA kernel the launchers take on sm_90a with the wgmma pass switched on."""
    arch, _, cubin = compiled
    if arch != "sm_90a":
        pytest.skip("wgmma is sm_90a's")
    monkeypatch.setenv("DCP_OPS_MLA_WGMMA", "1")
    r = _launched_native_mla(arch, cubin)
    assert "mla_wgmma_kernel" in r["kernel"] and r["token_heads"] == 64 * 64, r
    return r


def test_sass_budget_of_the_wgmma_mla_kernel(wgmma_budget):
    """The sm_90a wgmma kernel (bf16 512 + 64, 64-token tiles): the minimum tensor work (HGMMA counted in
    m16n8k16-equivalents), no spills, and its instructions held at their 2026-12-07 figure (1.164 warp instructions
    per token-head) while the target below is not met."""
    r = wgmma_budget
    assert r["hmma_per_token_head"] <= 1.05 * r["hmma_min_per_token_head"], r
    assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
    assert r["warp_instructions_per_token_head"] <= 1.2, r


@pytest.mark.xfail(strict=True, reason="docs/design.md §8: the wgmma kernel's hot loop is 1.164 warp instructions per "
                                       "token-head (2026-12-07), the target 0.9")
def test_wgmma_mla_kernel_meets_the_instruction_target(wgmma_budget):
    assert wgmma_budget["warp_instructions_per_token_head"] <= 0.9


# The SASS each barrier and tensor-copy wrapper (kernels/barriers.cuh, tma.cuh) must become in the self-test kernels that the executor runs
# (tests/simt/selftest_kernels.cuh), by arch: the wrappers' PTX assembles, and into the instruction named.
BARRIER_SASS = {
    "named_handoff": {"sm_80": ["BAR.ARV", "BAR.SYNC"], "sm_90a": ["BAR.ARV", "BAR.SYNC"]},
    "cp_async_arrive": {"sm_80": ["LDGSTS.E.BYPASS.128", "ARRIVES.LDGSTSBAR.64"],  # sm_80: mbarriers by LDS / ATOMS
                        "sm_90a": ["LDGSTS.E.BYPASS.128", "ARRIVES.LDGSTSBAR.64", "SYNCS.EXCH.64",
                                   "SYNCS.PHASECHK.TRANS64.TRYWAIT"]},
    "mbarrier_ring": {"sm_90a": ["SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "UBLKCP.S.G",
                                 "SYNCS.PHASECHK.TRANS64.TRYWAIT"]},
    "tma_boxILi3E": {"sm_90a": ["UTMALDG.3D", "SYNCS.ARRIVE.TRANS64"], "sm_80": ["BPT.TRAP"]},
    "tma_boxILi5E": {"sm_90a": ["UTMALDG.5D"]},
}
BARRIER_SOURCE = """#include "simt/selftest_kernels.cuh"
namespace simt_selftest {
template __global__ void tma_box<3>(const __grid_constant__ dcp_ops::kernels::TmaMap, TmaCoords, int, int,
                                    unsigned char*, int, bool);
template __global__ void tma_box<5>(const __grid_constant__ dcp_ops::kernels::TmaMap, TmaCoords, int, int,
                                    unsigned char*, int, bool);
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_barrier_wrappers_assemble_to_their_instructions(arch, tmp_path):
    nvcc = NVCC if os.path.isfile(NVCC) else shutil.which("nvcc")
    tool = _cuobjdump()
    if nvcc is None or tool is None:
        pytest.skip("nvcc or cuobjdump not found")
    src = tmp_path / "barriers.cu"
    src.write_text(BARRIER_SOURCE)
    cubin = tmp_path / "barriers.cubin"
    res = subprocess.run([nvcc, "-cubin", str(src), "-o", str(cubin), f"-arch={arch}", "-O3", "-std=c++17", "-I",
                          os.path.join(ROOT, "csrc"), "-I", os.path.join(ROOT, "tests")], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions = {fn.split("\n", 1)[0]: fn for fn in re.split(r"\n\s*Function : ", sass)[1:]}
    for kernel, by_arch in BARRIER_SASS.items():
        fn = next((body for name, body in functions.items() if kernel in name), None)
        assert fn is not None, f"{arch}: {kernel} not compiled"
        for op in by_arch.get(arch, []):
            assert op in fn, f"{arch}: no {op} in {kernel}"
