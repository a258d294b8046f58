"""Build dcp_ops._C: C++ CPU kernels always, CUDA kernels when torch is a CUDA build and nvcc exists.

Environment:
  DCP_OPS_CUDA=auto|1|0     build the CUDA sources (auto: when torch.version.cuda and nvcc are present)
  TORCH_CUDA_ARCH_LIST      GPU archs (default "8.0;9.0a;10.0a")
  DCP_OPS_CPU_ISA=auto|native|amx|avx512bf16|avx512|avx2|default   ISA levels of the CPU kernels: auto builds
                            every level into the library and the import picks the best this CPU runs
                            (DCP_OPS_CPU_CAPABILITY=<level> forces one); native or a level's name builds that one
                            level (native: the build machine's); avx512bf16 adds the bf16 dot-product instructions
                            to avx512, amx those and the AMX bf16 tile instructions
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


def native_level() -> str:
    """The build machine's ISA level, from /proc/cpuinfo."""
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


AVX2_FLAGS = ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
AVX512_FLAGS = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-mavx512dq", "-mfma", "-mf16c"]
LEVEL_FLAGS = {  # lowest first; csrc/cpu_levels.cpp checks the same features at import
    "default": [],
    "avx2": AVX2_FLAGS,
    "avx512": AVX512_FLAGS,
    "avx512bf16": AVX512_FLAGS + ["-DDCP_OPS_AVX512_BF16", "-mavx512bf16"],
    "amx": AVX512_FLAGS + ["-DDCP_OPS_AVX512_BF16", "-mavx512bf16", "-DDCP_OPS_AMX", "-mamx-tile", "-mamx-bf16"],
}


def cpu_levels() -> list:
    isa = os.environ.get("DCP_OPS_CPU_ISA", "auto").lower()
    if isa == "auto":
        return list(LEVEL_FLAGS)
    level = native_level() if isa == "native" else isa
    if level not in LEVEL_FLAGS:
        raise RuntimeError(f"DCP_OPS_CPU_ISA={isa}: expected auto, native or one of {', '.join(LEVEL_FLAGS)}")
    return [level]


class BuildExt(BuildExtension):
    """Compiles the sources of csrc/cpu once per ISA level (csrc/cpu/level.h), each with its level's flags into its own
    directory, and links those objects after the extension's own, lowest level first: where levels share an inline
    function of a library header (std::, c10::), the linker keeps the first copy, the baseline one."""

    def build_extension(self, ext):
        flags = ext.extra_compile_args
        objects = []
        for level in levels:
            post = {"cxx": flags["cxx"] + LEVEL_FLAGS[level] + [f"-DDCP_OPS_CPU_LEVEL=isa_{level}"]}
            if "nvcc" in flags:
                post["nvcc"] = flags["nvcc"]
            objects += self.compiler.compile(CPU_SOURCES, output_dir=os.path.join(self.build_temp, "cpu", level),
                                             include_dirs=ext.include_dirs, extra_postargs=post, depends=ext.depends)
        ext.extra_objects = objects + list(ext.extra_objects or [])
        super().build_extension(ext)


with_cuda = want_cuda()
levels = cpu_levels()
CPU_SOURCES = sorted(glob.glob("csrc/cpu/*.cpp"))
sources = sorted(glob.glob("csrc/*.cpp"))  # compiled once, for the baseline ISA
depends = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True) + CPU_SOURCES)
# -fopenmp: at::parallel_for is an inline OpenMP region; compiled without it, every CPU kernel runs on one thread.
cxx_flags = ["-O3", "-fopenmp"]
link_flags = ["-fopenmp"]
include_dirs = [os.path.join(ROOT, "csrc")]
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    ext = CUDAExtension(
        "dcp_ops._C", sources, include_dirs=include_dirs, depends=depends,
        extra_compile_args={"cxx": cxx_flags + ["-DDCP_OPS_WITH_CUDA",
                                                f'-DDCP_OPS_CUDA_ARCHS="{os.environ["TORCH_CUDA_ARCH_LIST"]}"'],
                            "nvcc": ["-O3", "-DDCP_OPS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=link_flags)
else:
    ext = CppExtension("dcp_ops._C", sources, include_dirs=include_dirs, depends=depends,
                       extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)

setup(
    name="dcp_ops",
    version="0.2.0",
    description="Decode Context Parallelism attention primitives (CPU and CUDA kernels, torch.distributed)",
    packages=find_packages(include=["dcp_ops", "dcp_ops.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.10",
)
