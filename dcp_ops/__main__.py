"""python -m dcp_ops demo [...]: the distributed DCP demo (see dcp_ops/demo.py)."""
import sys

from . import demo

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        sys.exit("usage: python -m dcp_ops demo [--world-size N] [--context TOKENS] [...]; see --help")
    sys.exit(demo.main(sys.argv[2:]))
