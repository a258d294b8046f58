"""Accuracy of the bench's bf16 torch baseline against dcp_ops, both against the float64 reference.

bench_cpu.py's `bmm` baseline for a bf16 MLA row with w_uk computes as an engine's bf16 path does: the absorbed query
and the probabilities rounded to bf16, bf16 matmuls. dcp_ops keeps the tolerance table of tests/tolerances.py (one
bf16 rounding of an accurate result; LSE within 1e-5). This prints each one's worst output error as a multiple of that
bound (1.0 = at the bound), on fresh random inputs, so that a row where the baseline is faster can be read against
what it gives up.

    python bench/baseline_accuracy.py [--context 4096] [--heads 16 128] [--seed 1]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from bench_cpu import mla_case, mla_inputs  # noqa: E402  (this directory is on sys.path when run as a script)
from dcp_ops import reference  # noqa: E402
from tolerances import TOL  # noqa: E402  (the one tolerance table)


def worst(actual, expected):
    """The largest |actual - expected| / (rtol |expected| + atol), with the table's bf16 bounds."""
    tol = TOL[torch.bfloat16]
    return ((actual.double() - expected).abs() / (tol["rtol"] * expected.abs() + tol["atol"])).max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    L = args.context
    print(f"MLA 512+64 with w_uk, bf16, {L} tokens, batch 1: worst output error / bf16 bound (<= 1 passes)")
    for H in args.heads:
        x = mla_inputs(1, L, torch.bfloat16, torch.Generator().manual_seed(args.seed), H, absorb=True)
        ours, baselines, _, _ = mla_case(x)
        out, lse = ours()
        base = baselines["bmm"]()  # the bench's bf16 bmm baseline
        ref_o, ref_lse = reference.mla_decode_partial(**{k: v.double() if torch.is_tensor(v) and v.is_floating_point()
                                                         else v for k, v in x.items()})
        print(f"  {H:>3} heads: dcp_ops {worst(out, ref_o):6.2f} (LSE max error "
              f"{(lse.double() - ref_lse).abs().max().item():.1e}), torch bmm bf16 {worst(base, ref_o):6.2f}")


if __name__ == "__main__":
    main()
