"""Mutation check of the CUDA kernels' synchronisation points: does removing one make a SIMT test fail?

    .venv/bin/python scripts/mutate_sync.py --list              # the sites, nothing built or run
    .venv/bin/python scripts/mutate_sync.py --table sync.md     # the whole check
    .venv/bin/python scripts/mutate_sync.py --only mla_decode_tiled --pytest-args "-m simt -k mla tests"

A site is a call of __syncthreads(), __syncwarp(...), cp_async_wait<N>() (csrc/kernels/cp_async.cuh) or of a named
barrier / mbarrier wait / wgmma wait (helper or inline asm) in csrc/kernels/*.cuh, outside comments and outside the
helpers' own definitions. Each mutant replaces one site's call by `/* mutated */` in a scratch copy of the tree
(`git ls-files` plus untracked files that git does not ignore, dcp_ops/_C*.so and build/simt, copied once into
--work), runs `pytest -x -q -m simt tests` there under each DCP_SIMT_SCHEDULE of --schedules until a test fails
(KILLED; a --timeout counts as killed) and restores the file. The unmutated copy runs first under each schedule and
must pass. A survivor whose line, or the comment block right above it, holds `mutate_sync:` (the reason it is
needed on hardware anyway) is reported JUSTIFIED. Exit status 0 when every site is killed or justified, else 1.

Slow: each mutant rebuilds the SIMT extension (about 25 s on 2 cores), then runs the tests until the first failure
(a survivor runs all of them under every schedule: about 4 minutes); the 20 sites of 2026-12-06 took 20 minutes.
Not run in CI.
Each run's pytest output is kept under WORK/mutate_sync_logs. Standard library only.
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Calls that are sites (matched in the source with comments blanked, and only when a `;` follows).
SITES = [
    r"\b__syncthreads\s*\(\s*\)",
    r"\b__syncwarp\s*\((?:[^()]|\([^()]*\))*\)",
    r"\b(?:cp_async_wait\w*|warpgroup_wait|wgmma_wait\w*)\s*(?:<[^<>;{}]*>)?\s*\((?:[^()]|\([^()]*\))*\)",
    r"\b(?:__pipeline_wait_prior|named_barrier_sync|bar_sync|mbarrier_(?:try_)?wait\w*)\s*\((?:[^()]|\([^()]*\))*\)",
    r'\basm\s*(?:volatile\s*|__volatile__\s*)?\((?:[^()"]|"(?:[^"\\]|\\.)*"|\([^()]*\))*\)',  # kept if ASM_SYNC
]
ASM_SYNC = re.compile(r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive|red)\b|\bmbarrier\.(?:try|test)_wait"
                      r"|\bwgmma\.wait_group|\bcp\.async\.(?:bulk\.)?wait_(?:group|all)")
SITE = re.compile("|".join(f"(?:{s})" for s in SITES))
# Functions whose bodies are the helpers themselves: their asm is not a site.
HELPER = re.compile(r"cp_async_wait\w*|\w*barrier\w*|bar_sync|wgmma_\w*|warpgroup_\w*|__sync\w*")
FUNC = re.compile(r"(?:__global__|__device__)\b[^;{}]*?\b(?!__launch_bounds__\b)([A-Za-z_]\w*)\s*\(")
LAMBDA = re.compile(r"\bauto\s+(\w+)\s*=\s*\[[^\]]*\]")


def blank(s):
    return re.sub(r"[^\n]", " ", s)


def strip(text):
    """(code, bare): text with its comments blanked, and also its string and character literals' contents blanked;
    newlines and offsets kept."""
    code, bare, i, n = [], [], 0, len(text)
    while i < n:
        if text.startswith("//", i) or text.startswith("/*", i):
            j = text.find("\n" if text[i + 1] == "/" else "*/", i + 2)
            j = n if j < 0 else j + (0 if text[i + 1] == "/" else 2)
            code.append(blank(text[i:j])), bare.append(blank(text[i:j]))
        elif text[i] in "\"'" and not (text[i] == "'" and i and text[i - 1].isalnum()):  # not a digit separator
            j = i + 1
            while j < n and text[j] not in (text[i], "\n"):
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            code.append(text[i:j]), bare.append(text[i] + blank(text[i + 1:j - 1]) + text[j - 1])
        else:
            j = i + 1
            code.append(text[i]), bare.append(text[i])
        i = j
    return "".join(code), "".join(bare)


def bodies(bare):
    """[(start, end, name)]: the brace spans of the __global__/__device__ functions and named lambdas."""
    spans = []
    for m in list(FUNC.finditer(bare)) + list(LAMBDA.finditer(bare)):
        o = re.compile(r"[;{]").search(bare, m.end())
        if not o or o.group() == ";":
            continue  # a declaration
        depth, j = 0, o.start()
        for j in range(o.start(), len(bare)):
            depth += {"{": 1, "}": -1}.get(bare[j], 0)
            if depth == 0:
                break
        spans.append((o.start(), j, m.group(1)))
    return spans



def _comment_above(lines, ln):
    """The block of // comment lines right above line ln (1-based), joined."""
    block, k = [], ln - 2
    while k >= 0 and lines[k].strip().startswith("//"):
        block.append(lines[k])
        k -= 1
    return "\n".join(reversed(block))

def find_sites(root):
    """[(file:line, context, justified, path relative to root, start, end)] of csrc/kernels/*.cuh in root; a second
    site on a line is file:line#2."""
    sites = []
    for path in sorted(glob.glob(os.path.join(root, "csrc", "kernels", "*.cuh"))):
        text = open(path).read()
        code, bare = strip(text)
        lines, code_lines, spans = text.split("\n"), code.split("\n"), bodies(bare)
        for m in SITE.finditer(code):
            if not re.match(r"\s*;", code[m.end():]) or re.search(r"\b(?:void|inline|__forceinline__)\s*$",
                                                                   code[max(0, m.start() - 40):m.start()]):
                continue  # not a call statement: a definition or declaration
            if bare[m.start()] != code[m.start()] or m.group().startswith("asm") and not ASM_SYNC.search(m.group()):
                continue  # inside a string literal, or asm that does not synchronise
            names = [name for a, b, name in sorted(spans) if a < m.start() < b]
            if any(HELPER.fullmatch(name) for name in names):
                continue
            ln = code.count("\n", 0, m.start()) + 1
            line, cline = lines[ln - 1], code_lines[ln - 1]
            k = next((k for k in range(len(line)) if line.startswith("//", k) and cline[k] == " "), None)
            comment = line[k + 2:].strip() if k is not None else ""
            context = ": ".join(filter(None, ["/".join(names) or "?", comment]))
            justified = "mutate_sync:" in line or "mutate_sync:" in _comment_above(lines, ln)
            site = f"{os.path.relpath(path, root)}:{ln}"
            same = sum(s[0].split("#")[0] == site for s in sites)
            sites.append((site + (f"#{same + 1}" if same else ""), context, justified, os.path.relpath(path, root),
                          m.start(), m.end()))
    return sites


def copy_tree(work):
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    files += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "dcp_ops", "_C*.so"))]
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):  # a tracked file may have been deleted
            os.makedirs(os.path.dirname(os.path.join(work, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(work, f))
    if os.path.isdir(os.path.join(ROOT, "build", "simt")):
        shutil.copytree(os.path.join(ROOT, "build", "simt"), os.path.join(work, "build", "simt"), dirs_exist_ok=True)


def run_tests(args, schedule, log):
    """(failed, what, seconds): what is the first failing test's node id, 'timeout', or pytest's exit status."""
    cmd = [args.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *shlex.split(args.pytest_args)]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env), "DCP_SIMT_SCHEDULE": schedule}
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=args.work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    timed_out = False
    try:
        out = p.communicate(timeout=args.timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the whole session: pytest and the compilers it started
        out, timed_out = p.communicate()[0] + "\n[mutate_sync: timeout]\n", True
    with open(log, "w") as f:
        f.write(out)
    if timed_out:
        return True, "timeout", time.time() - t0
    m = re.search(r"^(FAILED|ERROR) (\S+)", out, re.M)
    what = (m.group(2) + (" (error)" if m.group(1) == "ERROR" else "")) if m else f"pytest exit {p.returncode}"
    return p.returncode != 0, what, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the sites and exit")
    ap.add_argument("--only", help="only the sites whose file:line or context contains this")
    ap.add_argument("--work", help="the scratch copy's directory (default: a fresh temporary one)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--pytest-args", default="-m simt tests", help="the selection (default: %(default)s), "
                    "e.g. \"-m simt -k mla tests\"; -x -q -p no:cacheprovider are always given")
    ap.add_argument("--schedules", default="forward,reverse", help="DCP_SIMT_SCHEDULE values, tried in turn")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for pytest")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run (a timeout kills)")
    ap.add_argument("--table", help="also write the Markdown table to this file")
    args = ap.parse_args()
    schedules = [s for s in args.schedules.split(",") if s]

    if args.list:
        sites = [s for s in find_sites(ROOT) if not args.only or args.only in s[0] or args.only in s[1]]
        for site, context, justified, *_ in sites:
            print(f"{site}  {context}{'  [justified]' if justified else ''}")
        print(f"{len(sites)} sites")
        return 0
    args.work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="mutate_sync_"))
    print(f"copying the tree to {args.work}", flush=True)
    copy_tree(args.work)
    logs = os.path.join(args.work, "mutate_sync_logs")
    os.makedirs(logs, exist_ok=True)
    sites = [s for s in find_sites(args.work) if not args.only or args.only in s[0] or args.only in s[1]]
    print(f"{len(sites)} sites; schedules {', '.join(schedules)}; pytest {args.pytest_args}", flush=True)

    for schedule in schedules:
        log = os.path.join(logs, re.sub(r"[^\w.-]", "_", f"baseline_{schedule}") + ".log")
        failed, what, secs = run_tests(args, schedule, log)
        print(f"baseline {schedule}: {'FAILED by ' + what if failed else 'passed'} ({secs:.0f} s)", flush=True)
        if failed:
            print(f"the unmutated tree fails: see {log}", file=sys.stderr)
            return 2

    rows = []
    for site, context, justified, f, start, end in sites:
        path = os.path.join(args.work, f)
        original = open(path).read()
        with open(path, "w") as out:
            out.write(original[:start] + "/* mutated */" + original[end:])
        total = 0.0
        try:
            for schedule in schedules:
                tag = re.sub(r"[^\w.-]", "_", f"{site}_{schedule}")
                failed, what, secs = run_tests(args, schedule, os.path.join(logs, tag + ".log"))
                total += secs
                if failed:
                    break
        finally:
            with open(path, "w") as out:
                out.write(original)
        result = "KILLED" if failed else "JUSTIFIED" if justified else "SURVIVED"
        detail = f"by {what}, {schedule}" if failed else f"schedules {','.join(schedules)}"
        print(f"{result:9} {site}  {context}  ({detail}, {total:.0f} s)", flush=True)
        rows.append((site, context, result, what if failed else ""))

    table = ["| site | context | result | killing test |", "|---|---|---|---|"]
    table += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    print("\n" + "\n".join(table))
    if args.table:
        with open(args.table, "w") as out:
            out.write("\n".join(table) + "\n")
    return 0 if all(r[2] != "SURVIVED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
