"""Static cost of the tensor-core split passes, read from the built library's SASS (no GPU needed).

For each instantiation of gqa_mma_kernel, mla_mma_kernel, mla_tiled_kernel and mla_wgmma_kernel in dcp_ops._C, on one
arch: the hot loop (the loop with the most tensor work; its static body, which the full-tile path runs once per
iteration), its instructions, tensor-core instructions (HMMA, or HGMMA on sm_90a), other instructions per tensor
instruction, shared loads (LDS / LDSM), barriers, inner loops, the registers and local memory (spills) from
`cuobjdump -res-usage`, and, with the (KV token x query head) pairs one CTA iteration covers, warp instructions and
tensor work per token-head next to the minimum ((D_k + D_v) MACs / 2048 per m16n8k16). Tensor work is counted in
m16n8k16-equivalents (2048 MACs): an HMMA.16816 is one; an HGMMA.64xNx16, which the 4 warps of a warpgroup issue
together, is 64 N 16 MACs a warpgroup, N / 2 equivalents.
Each record says whether the launchers take that instantiation on the arch's device (`launched`: the one decision of
cuda/split_choice.h, read through _C.split_choice). docs/design.md §8's static targets are for sm_90a, bf16,
precision "native", MLA 512 + 64.

    python bench/gpu/sass_budget.py [--lib PATH] [--arch sm_90a] [--smem BYTES] [--json PATH]
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16"}
HGMMA_N = re.compile(r"HGMMA\.64x(\d+)x16")
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def cuobjdump() -> str:
    """cuobjdump from the CUDA toolkit, or the copy inside the triton package that torch installs."""
    import importlib.util
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cands = [os.path.join(home, "bin", "cuobjdump"), shutil.which("cuobjdump")]
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        cands.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "cuobjdump"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("sass_budget: cuobjdump not found (CUDA toolkit, PATH, or the triton package)")


def default_lib() -> str:
    libs = glob.glob(os.path.join(ROOT, "dcp_ops", "_C*.so"))
    if not libs:
        sys.exit("sass_budget: dcp_ops/_C*.so not found; build it first (scripts/setup.sh)")
    return libs[0]


def geometry(name: str) -> Optional[dict]:
    """What one instantiation computes, from its mangled name: op, dtype, dims, precision, warps per CTA, the
    (KV token x query head) pairs one CTA iteration covers (every warp runs the loop body once per iteration), and
    its kernel family and tile (query rows, KV tokens) as cuda/split_choice.h names them."""
    dtype = next((v for k, v in DTYPES.items() if k in name), None)
    args = [int(x) for x in re.findall(r"Li(\d+)E", name)]
    if dtype is None:
        return None
    for family in ("mla_tiled_kernel", "mla_wgmma_kernel"):  # <T, DL, DR, BN, F8>: 8 warps (2 warpgroups for
        if family in name:  # wgmma), 64 rows x BN tokens, one 16-bit query term, P once
            dl, dr, bn = args
            return dict(op="mla", dtype=dtype, cache="e4m3" if "Lb1E" in name else dtype, dims=f"{dl}+{dr}",
                        precision="native", warps=8, token_heads=bn * 64, macs=2 * dl + dr, family=family,
                        rows=64, tokens=bn)
    if "mla_mma_kernel" in name:  # <T, DL, DR> (and _fp8): DL / 64 warps, 16 heads x 16 tokens, 3 query terms, P in 2
        dl, dr = args
        return dict(op="mla", dtype=dtype, cache="e4m3" if "mla_mma_kernel_fp8" in name else dtype,
                    dims=f"{dl}+{dr}", precision="fp32", warps=dl // 64, token_heads=256, macs=2 * dl + dr,
                    family="mla_mma_kernel", rows=16, tokens=0)
    if "gqa_mma_kernel" in name:  # <T, D, GT, PT, F8>: 4 warps, each its own 16 tokens x GT heads
        d, gt, pt = args
        return dict(op="gqa", dtype=dtype, cache="e4m3" if "Lb1E" in name else dtype, dims=f"{d}",
                    precision="native" if pt == 1 else "fp32", warps=4, token_heads=4 * 16 * gt, macs=2 * d,
                    family="gqa_mma_kernel", rows=gt, tokens=0)
    return None


def launched(geo: dict, arch: str, smem_optin: int = 0) -> Optional[bool]:
    """Whether the launchers take this instantiation on an `arch` device with smem_optin bytes of shared memory a
    block (0: the arch's flagship's, A100 / H100 / B200) for its op, dims and precision (16-bit query), by the one
    decision they make (cuda/split_choice.h, through _C.split_choice); GQA for geo's rows per KV head. None where
    dcp_ops._C is not built or has no CUDA sources. The MLA wgmma pass follows DCP_OPS_MLA_WGMMA as the launchers do."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    try:
        from dcp_ops import _C
    except ImportError:  # not built here: the SASS can still be read, without the launchers' choice
        return None
    if not hasattr(_C, "split_choice"):
        return None
    dims = [int(x) for x in geo["dims"].split("+")] + [0]
    kernel, rows, _, tokens, _ = _C.split_choice(geo["op"], dims[0], dims[1], 2, geo["precision"] == "native",
                                                 rows=geo["rows"], arch=int(re.sub(r"\D", "", arch)),
                                                 smem_optin=smem_optin)
    return kernel == geo["family"] and rows == geo["rows"] and tokens == geo["tokens"]


def functions(sass: str) -> Dict[str, List[Tuple[int, str, str]]]:
    """Mangled name -> [(address, opcode, operands)] for every function in cuobjdump -sass output."""
    out: Dict[str, List[Tuple[int, str, str]]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = INSTR.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def loops(code: List[Tuple[int, str, str]]) -> List[Tuple[int, int]]:
    """(first, last) instruction indices of every loop: a branch back to an earlier address. A branch back into the
    middle of a loop from past its end is not one: ptxas places cold paths (a shuffle's non-converged fallback) after
    the function's loops and returns from them so, and such a span would count another loop's body with its own."""
    index = {addr: i for i, (addr, _, _) in enumerate(code)}
    found = []
    for i, (addr, op, rest) in enumerate(code):
        if op.split(".")[0] in ("BRA", "JMP"):
            m = BRANCH_TARGET.search(rest)
            if m and int(m.group(1), 16) <= addr and int(m.group(1), 16) in index:
                found.append((index[int(m.group(1), 16)], i))
    return [(f, l) for f, l in found if not any(a < f <= b < l for a, b in found)]


def tensor_work(op: str) -> float:
    """m16n8k16-equivalents of one warp's tensor-core instruction: an HMMA is one; an HGMMA.64xNx16 is N / 2 for its
    warpgroup, so N / 8 for each of the 4 warps that issue it."""
    if op.startswith("HMMA"):
        return 1.0
    m = HGMMA_N.match(op)
    return int(m.group(1)) / 8 if m else 0.0


def hot_loop(code) -> Optional[dict]:
    cands = loops(code)
    if not cands:
        return None
    hmma = lambda a, b: sum(tensor_work(op) for _, op, _ in code[a:b + 1])  # noqa: E731
    nested = lambda f, l: sum(1 for a, b in cands if f <= a and b < l and (a, b) != (f, l))  # noqa: E731
    # the loop with the most tensor work; on a tie the one with fewer loops inside (a kernel's multi-token tail
    # repeats the step's products in a loop over query tokens), then the longer
    first, last = max(cands, key=lambda ab: (hmma(*ab), -nested(*ab), ab[1] - ab[0]))
    body = [op for _, op, _ in code[first:last + 1] if op != "NOP"]
    kinds = Counter(op.split(".")[0] for op in body)
    inner = nested(first, last)
    return dict(instructions=len(body), tensor=kinds["HMMA"] + kinds["HGMMA"], work=hmma(first, last),
                shared_loads=kinds["LDS"] + kinds["LDSM"],
                barriers=kinds["BAR"], inner_loops=inner)


def resources(tool: str, lib: str, arch: str) -> Dict[str, Tuple[int, int]]:
    """Mangled name -> (registers, local memory bytes per thread) from cuobjdump -res-usage."""
    text = subprocess.run([tool, "-res-usage", "-arch", arch, lib], capture_output=True, text=True, check=True).stdout
    res, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"REG:(\d+).*LOCAL:(\d+)", line)
        if m and cur:
            res[cur] = (int(m.group(1)), int(m.group(2)))
    return res


def budget(lib: str, arch: str, smem_optin: int = 0) -> List[dict]:
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", "-arch", arch, lib], capture_output=True, text=True, check=True).stdout
    res = resources(tool, lib, arch)
    records = []
    for name, code in functions(sass).items():
        geo = geometry(name)
        loop = hot_loop(code) if geo else None
        if geo is None or loop is None:
            continue
        regs, local = res.get(name, (-1, -1))
        per_iter = loop["work"] * geo["warps"]  # m16n8k16-equivalents
        records.append(dict(
            kernel=name, family=geo["family"], op=geo["op"], dtype=geo["dtype"], cache=geo["cache"], dims=geo["dims"],
            precision=geo["precision"], arch=arch, launched=launched(geo, arch, smem_optin),
            warps=geo["warps"], token_heads=geo["token_heads"], hmma_per_iteration=round(per_iter, 2),
            loop_instructions=loop["instructions"], loop_hmma=loop["tensor"],
            other_per_hmma=round((loop["instructions"] - loop["tensor"]) / max(loop["tensor"], 1), 2),
            shared_loads=loop["shared_loads"], barriers=loop["barriers"], inner_loops=loop["inner_loops"],
            registers=regs, spill_bytes=local,
            warp_instructions_per_token_head=round(loop["instructions"] * geo["warps"] / geo["token_heads"], 3),
            hmma_per_token_head=round(per_iter / geo["token_heads"], 4),
            hmma_min_per_token_head=round(geo["macs"] / 2048, 4)))
    records.sort(key=lambda r: (r["op"], r["precision"], r["dtype"], r["cache"], r["dims"], r["token_heads"],
                                r["family"]))
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default=None, help="the built extension (default dcp_ops/_C*.so)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--smem", type=int, default=0,
                    help="the device's shared memory a block, for the launched column (default: the arch's flagship)")
    ap.add_argument("--json", default=None, help="write one record per instantiation here")
    args = ap.parse_args(argv)
    records = budget(args.lib or default_lib(), args.arch, args.smem)
    if not records:
        print(f"sass_budget: no tensor-core split pass for {args.arch} in the library (built without CUDA?)")
        return 1
    print(f"tensor-core split passes, {args.arch}: hot loop per CTA iteration (all warps)")
    head = (f"{'':1} {'kernel':9} {'op':4} {'prec':6} {'dtype':5} {'cache':5} {'dims':7} {'warps':>5} {'tok x hd':>8} {'instr':>6} "
            f"{'HMMA':>5} "
            f"{'oth/HMMA':>8} {'LDS':>4} {'BAR':>4} {'inner':>5} {'regs':>4} {'spill':>5} "
            f"{'instr/th':>8} {'HMMA/th':>8} {'min':>6}")
    print(head)
    for r in records:
        print(f"{'*' if r['launched'] else ' ':1} {r['family'][4:-7]:9} {r['op']:4} {r['precision']:6} {r['dtype']:5} {r['cache']:5} {r['dims']:7} {r['warps']:>5} "
              f"{r['token_heads']:>8} "
              f"{r['loop_instructions']:>6} {r['loop_hmma']:>5} {r['other_per_hmma']:>8} {r['shared_loads']:>4} "
              f"{r['barriers']:>4} {r['inner_loops']:>5} {r['registers']:>4} {r['spill_bytes']:>5} "
              f"{r['warp_instructions_per_token_head']:>8} {r['hmma_per_token_head']:>8} "
              f"{r['hmma_min_per_token_head']:>6}")
    print("*: the instantiation the launchers take for its op, dims and precision on this arch (cuda/split_choice.h); "
          "instr, HMMA (HMMA or HGMMA instructions), LDS, BAR: one warp's hot-loop body; instr/th and HMMA/th: all "
          "warps' per (KV token x query head), HMMA/th in m16n8k16-equivalents; min: (D_k + D_v) / 2048")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
