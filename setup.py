"""Build dcp_ops._C: C++ CPU kernels always, CUDA kernels when torch is a CUDA build and nvcc exists.

Environment:
  DCP_OPS_CUDA=auto|1|0     build the CUDA sources (auto: when torch.version.cuda and nvcc are present)
  TORCH_CUDA_ARCH_LIST      GPU archs (default "8.0;9.0a;10.0a")
  DCP_OPS_CPU_ISA=auto|amx|avx512bf16|avx512|avx2|default   vector ISA of the CPU kernels (auto: the build
                            machine's; avx512bf16 adds the bf16 dot-product instructions, amx those and the AMX
                            bf16 tile instructions)
  MAX_JOBS                  build parallelism (default: number of CPUs)
"""
import glob
import os
import shutil

if "CUDA_HOME" not in os.environ and os.path.isfile("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # torch guesses /usr/local from a wrapper nvcc otherwise
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0a")
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    flag = os.environ.get("DCP_OPS_CUDA", "auto").lower()
    if flag in ("0", "off", "false"):
        return False
    home = os.environ.get("CUDA_HOME", "")
    found = torch.version.cuda is not None and (
        os.path.isfile(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc") is not None)
    if flag in ("1", "on", "true") and not found:
        raise RuntimeError("DCP_OPS_CUDA=1 but torch is not a CUDA build or nvcc was not found (set CUDA_HOME)")
    return found


def cpu_isa() -> str:
    isa = os.environ.get("DCP_OPS_CPU_ISA", "auto").lower()
    if isa != "auto":
        return isa
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "default"
    if all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        if " avx512_bf16" not in flags:
            return "avx512"
        return "amx" if " amx_tile" in flags and " amx_bf16" in flags else "avx512bf16"
    if " avx2" in flags and " fma" in flags and " f16c" in flags:
        return "avx2"
    return "default"


AVX512_BF16_FLAGS = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-DDCP_OPS_AVX512_BF16", "-mavx512f",
                     "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "amx": AVX512_BF16_FLAGS + ["-DDCP_OPS_AMX", "-mamx-tile", "-mamx-bf16"],
    "avx512bf16": AVX512_BF16_FLAGS,
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": [],
}

with_cuda = want_cuda()
isa = cpu_isa()
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# -fopenmp: at::parallel_for is an inline OpenMP region; compiled without it, every CPU kernel runs on one thread.
cxx_flags = ["-O3", "-fopenmp", f'-DDCP_OPS_CPU_ISA="{isa}"'] + ISA_FLAGS[isa]
link_flags = ["-fopenmp"]
include_dirs = [os.path.join(ROOT, "csrc")]
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    ext = CUDAExtension(
        "dcp_ops._C", sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + ["-DDCP_OPS_WITH_CUDA",
                                                f'-DDCP_OPS_CUDA_ARCHS="{os.environ["TORCH_CUDA_ARCH_LIST"]}"'],
                            "nvcc": ["-O3", "-DDCP_OPS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=link_flags)
else:
    ext = CppExtension("dcp_ops._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags},
                       extra_link_args=link_flags)

setup(
    name="dcp_ops",
    version="0.1.0",
    description="Decode Context Parallelism attention primitives (CPU and CUDA kernels, torch.distributed)",
    packages=find_packages(include=["dcp_ops", "dcp_ops.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
)
