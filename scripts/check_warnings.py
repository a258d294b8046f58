"""Fails when a build log holds a compiler warning that our code causes.

    python scripts/check_warnings.py build/build.log

A warning is ours when it is located in this repository, or when one of the functions GCC says it was inlined from
(`inlined from '...' at FILE:LINE`) is: GCC reports a bad intrinsic call inside its own headers, so the inlining
chain says whose call it was. The other warnings (inside torch's headers, reached from no code of ours) are counted
and allowed. nvcc's own warnings (`nvcc warning : ...`) are ours too: they are about our flags.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GCC = re.compile(r"^(?P<file>[^\s:]+):\d+(?::\d+)?: warning: ")
NVCC_FRONTEND = re.compile(r"^(?P<file>[^\s(]+)\(\d+\): warning")
INLINED = re.compile(r"inlined from .* at (?P<file>[^\s:]+):\d+")
CONTEXT = ("In function", "In member function", "In static member function", "In instantiation of",
           "In file included from", "In lambda function", "In constructor", "In destructor")


def in_repo(path: str) -> bool:
    """A file of this repository, not one of the installed packages under it (.venv)."""
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(ROOT, path))
    rel = os.path.relpath(full, os.path.realpath(ROOT))
    return not rel.startswith("..") and not rel.split(os.sep)[0].startswith(".venv")


def classify(lines):
    """(ours, allowed): the warning lines of each kind, each of ours with the inlining frames that make it ours."""
    ours, allowed, context = [], [], []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(CONTEXT) or stripped.startswith("inlined from") or stripped.startswith("from "):
            context.append(stripped)
            continue
        m = GCC.match(line) or NVCC_FRONTEND.match(line)
        if m:
            frames = [f.group("file") for f in map(INLINED.search, context) if f]
            mine = [f for f in frames if in_repo(f)]
            if in_repo(m.group("file")) or mine:
                ours.append(line.rstrip() + "".join(f"\n    via {f}" for f in mine))
            else:
                allowed.append(line.rstrip())
            context = []
        elif "nvcc warning" in line:
            ours.append(line.rstrip())
        elif line and not line.startswith(" "):
            context = []
    return ours, allowed


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    with open(argv[1], errors="replace") as f:
        ours, allowed = classify(f.read().splitlines())
    print(f"check_warnings: {len(ours)} warning(s) from our code, {len(allowed)} inside torch's headers (allowed)")
    for w in ours:
        print(w)
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
