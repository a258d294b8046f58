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
#include "kernels/merge.cuh"
// The launchers instantiate every kernel variant they can pick (16-byte packs and scalar).
template cudaError_t dcp_ops::kernels::merge_partials<float>(const dcp_ops::kernels::MergeParams&, cudaStream_t);
template cudaError_t dcp_ops::kernels::merge_partials<__nv_bfloat16>(const dcp_ops::kernels::MergeParams&,
                                                                     cudaStream_t);
template cudaError_t dcp_ops::kernels::merge_partials<__half>(const dcp_ops::kernels::MergeParams&, cudaStream_t);
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
    assert len(kernels) == 6, report
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", report)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert len(frames) == len(kernels) and not any(frames), report
    assert spills and not any(spills), report
