"""Static checks of the CUDA kernels (no GPU needed): ptxas reports no spills and no stack frame on every arch."""
import os
import re
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
ARCHS = ["sm_80", "sm_90a", "sm_100a"]

INSTANTIATE = """
#include "kernels/gqa_decode.cuh"
#include "kernels/merge.cuh"
#include "kernels/write_kv.cuh"
// The launchers instantiate every kernel variant they can pick (16-byte packs and scalar, each head tile).
namespace dcp_ops::kernels {
template <typename T> void all(cudaStream_t s) {
  merge_partials<T>(MergeParams{}, s);
  merge<T, T>(MergeArgs<PackedLse>{}, s);
  merge<float, T>(MergeParams{}, s);
  correct_partial<T>(CorrectParams{}, s);
  pack_exchange<T>(PackParams{}, s);
  gqa_split<T>(GqaParams{}, s);
}
template void all<float>(cudaStream_t);
template void all<__nv_bfloat16>(cudaStream_t);
template void all<__half>(cudaStream_t);
cudaError_t write_kv_entry(cudaStream_t s) { return write_kv(WriteKvParams{}, s); }
}
"""


@pytest.mark.skipif(not (os.path.isfile(NVCC) or shutil.which("nvcc")), reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_have_no_spills_or_stack(arch):
    nvcc = NVCC if os.path.isfile(NVCC) else shutil.which("nvcc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "instantiate.cu")
        with open(src, "w") as f:
            f.write(INSTANTIATE)
        res = subprocess.run([nvcc, "-c", src, "-o", os.path.join(d, "k.o"), f"-arch={arch}", "-O3", "-std=c++17",
                              "-I", os.path.join(ROOT, "csrc"), "-Xptxas", "-v"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    report = res.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    names = " ".join(kernels)
    for family in ("merge_kernel", "correct_kernel", "pack_kernel", "write_kv_kernel", "gqa_split_kernel"):
        assert family in names, f"{family} not compiled: {names}"
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", report)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert len(frames) == len(kernels) and not any(frames), report
    assert spills and not any(spills), report
