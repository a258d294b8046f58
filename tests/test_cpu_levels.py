"""The CPU kernels' ISA levels (csrc/cpu/level.h, csrc/cpu_levels.cpp): one library holds a copy of the kernels per
level, the import picks the best this CPU runs or the one DCP_OPS_CPU_CAPABILITY names, the CPU suites pass under
every level this CPU has, and no code compiled for a level above the baseline can run before that level is chosen."""
import os
import re
import subprocess
import sys

import pytest

import dcp_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = ["default", "avx2", "avx512", "avx512bf16", "amx"]  # lowest first
# /proc/cpuinfo flags each level needs beyond the one below it (csrc/cpu_levels.cpp checks the same with GCC's
# __builtin_cpu_supports, which also asks the OS).
FLAGS = {"default": [], "avx2": ["avx2", "fma", "f16c"], "avx512": ["avx512f", "avx512bw", "avx512vl", "avx512dq"],
         "avx512bf16": ["avx512_bf16"], "amx": ["amx_tile", "amx_bf16"]}
# The CPU suites run again under each level: every op's CPU kernel against the float64 reference.
SUITES = ["tests/test_attention.py", "tests/test_merge.py", "tests/test_nonfinite.py", "tests/test_fp8_decode.py",
          "tests/test_multitoken.py", "tests/test_write_kv.py"]


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def runnable():
    """The levels this CPU has, lowest first."""
    flags, have = cpu_flags(), []
    for level in LEVELS:
        if not all(f in flags for f in FLAGS[level]):
            break
        have.append(level)
    return have


def import_with(level, code="import dcp_ops; print(dcp_ops._C.cpu_isa)"):
    env = dict(os.environ, DCP_OPS_CPU_CAPABILITY=level)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_picks_the_best_level_built_that_this_cpu_has():
    built = dcp_ops._C.cpu_levels.split(",")
    assert built == [lv for lv in LEVELS if lv in built], built
    if os.environ.get("DCP_OPS_CPU_ISA", "auto") == "auto":
        assert built == LEVELS
    forced = os.environ.get("DCP_OPS_CPU_CAPABILITY")
    expected = forced or [lv for lv in runnable() if lv in built][-1]
    if expected == "amx" and not forced:  # also needs Linux's grant of the tile state, which only the import asks for
        pytest.skip("AMX CPU: whether Linux grants the tile state is not known here")
    assert dcp_ops._C.cpu_isa == expected


@pytest.mark.parametrize("level", LEVELS)
def test_cpu_suites_pass_under_each_level(level):
    if level not in runnable():
        pytest.skip(f"this CPU lacks {level} ({', '.join(FLAGS[level])})")
    if level not in dcp_ops._C.cpu_levels.split(","):
        pytest.skip(f"this library was built without the {level} level (DCP_OPS_CPU_ISA)")
    chosen = import_with(level)
    assert chosen.returncode == 0 and chosen.stdout.strip() == level, chosen.stderr
    if level == dcp_ops._C.cpu_isa:
        return  # the suites run under this level already, in this process
    env = dict(os.environ, DCP_OPS_CPU_CAPABILITY=level)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not simt", *SUITES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert re.search(r"\d+ passed", tail) and " failed" not in tail, tail


def test_a_level_the_cpu_lacks_or_no_level_is_refused_by_name():
    bad = import_with("avx1024")
    assert bad.returncode != 0
    assert "ImportError: DCP_OPS_CPU_CAPABILITY=avx1024 names no ISA level (default, avx2, avx512, avx512bf16, amx)" \
        in bad.stderr, bad.stderr
    lacking = [lv for lv in LEVELS if lv not in runnable()]
    if not lacking:
        pytest.skip("this CPU has every level")
    refused = import_with(lacking[0])
    assert refused.returncode != 0
    missing = {"avx2": "AVX2", "avx512": "AVX512F", "avx512bf16": "AVX512_BF16", "amx": "AMX-TILE"}[lacking[0]]
    assert f"ImportError: DCP_OPS_CPU_CAPABILITY={lacking[0]}: this CPU lacks {missing}" in refused.stderr, \
        refused.stderr


# A level's namespace in a mangled name (csrc/cpu/level.h), or ATen's own per-ISA namespaces (at::vec::AVX2, ...).
LEVEL_CODE = re.compile(r"\d+isa_(avx2|avx512|avx512bf16|amx)|\d(AVX2|AVX512)")
# An instruction that needs more than x86-64's baseline (SSE2): a VEX / EVEX encoding (v-mnemonics), 256 / 512-bit or
# mask registers, AMX tiles.
BEYOND_BASELINE = re.compile(r"^\s*[0-9a-f]+:\s+(v\w+|tile\w+|tdp\w+|ldtilecfg|sttilecfg)\b|%[yz]mm\d|%k[0-7]\b|%tmm")


def functions(path):
    """(address, mangled name, its instruction lines) for every function in path's .text, as objdump disassembles it."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text", path], capture_output=True,
                          text=True, check=True).stdout
    addr, name, body = None, None, []
    for line in dump.splitlines():
        head = re.match(r"^([0-9a-f]+) <(.+)>:$", line)
        if head:
            if name is not None:
                yield addr, name, body
            addr, name, body = int(head.group(1), 16), head.group(2), []
        elif name is not None and line.strip():
            body.append(line)
    if name is not None:
        yield addr, name, body


def local_addresses(path):
    """Addresses of the local (file-scope) functions: GCC's clones (.constprop, .isra) of a function are local to the
    object that made them, so only that object's code calls them."""
    syms = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {int(f[0], 16) for f in (line.split() for line in syms.splitlines()) if len(f) >= 3 and f[1] == "t"}


def test_only_a_levels_own_functions_hold_its_instructions():
    """Where two levels instantiate the same inline function of a library header (std::, c10::), the linker keeps one
    copy for both: were it a higher level's, the baseline code would run AVX instructions on a CPU without them. So
    every function with an instruction beyond the baseline must be in a higher level's namespace, reached only
    through that level's table, or be a local function (a clone GCC made in one object) that only such functions call;
    and no load-time initializer may call into one."""
    funcs = list(functions(dcp_ops._C.__file__))
    local = local_addresses(dcp_ops._C.__file__)
    callers = {}  # address -> the addresses of the functions whose code names it (calls, jumps, address taken)
    for addr, _, body in funcs:
        for line in body:
            for target in re.findall(r"\b([0-9a-f]+) <", line.split(":", 1)[1]):
                callers.setdefault(int(target, 16), set()).add(addr)
    level = {addr for addr, name, _ in funcs if LEVEL_CODE.search(name)}
    beyond = {addr: name for addr, name, body in funcs
              if addr not in level and any(BEYOND_BASELINE.search(line) for line in body)}
    # A local function that only level code (or another such local function) names runs only within that level.
    ok, changed = set(level), True
    while changed:
        changed = False
        for addr in beyond:
            if addr in local and addr not in ok and callers.get(addr) and callers[addr] - {addr} <= ok:
                ok.add(addr)
                changed = True
    leaks = sorted({name for addr, name in beyond.items() if addr not in ok})
    init_calls = [line for addr, name, body in funcs if name.startswith("_GLOBAL__sub_I")
                  for line in body if "call" in line and LEVEL_CODE.search(line)]
    if dcp_ops._C.cpu_levels != "default":  # the check sees the higher levels' code
        assert sum(1 for addr, _, body in funcs if addr in level and any(BEYOND_BASELINE.search(x) for x in body)) > 100
    assert not leaks, f"{len(leaks)} functions outside the levels' namespaces use AVX instructions: {leaks[:20]}"
    assert not init_calls, init_calls
