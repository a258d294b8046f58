"""Accuracy of the bench's bf16 torch baseline against dcp_ops, both against the float64 reference.

bench_cpu.py's `bmm` baseline for a bf16 MLA row with w_uk computes as an engine's bf16 path does: the absorbed query
and the probabilities rounded to bf16, bf16 matmuls. dcp_ops keeps the tolerance table of tests/tolerances.py (one
bf16 rounding of an accurate result, rtol 2^-8 + atol 1e-3; LSE within 1e-5). This prints each one's worst output
error as a multiple of that bound (1.0 = at the bound), on fresh random inputs, so that a row where the baseline is
faster can be read against what it gives up.

    python bench/baseline_accuracy.py [--context 4096] [--heads 16 128] [--seed 1]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcp_ops  # noqa: E402
from dcp_ops import reference  # noqa: E402
from bench_cpu import gather  # noqa: E402  (this directory is on sys.path when run as a script)

RTOL, ATOL = 2.0 ** -8, 1e-3  # tests/tolerances.py, bf16


def worst(actual, expected):
    return ((actual.double() - expected).abs() / (RTOL * expected.abs() + ATOL)).max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    latent, rope, d_nope, bs, dt = 512, 64, 128, 64, torch.bfloat16
    L = -(-args.context // bs) * bs
    print(f"MLA 512+64 with w_uk, bf16, {L} tokens, batch 1: worst output error / bf16 bound (<= 1 passes)")
    for H in args.heads:
        gen = torch.Generator().manual_seed(args.seed)
        kv = torch.randn(L // bs, bs, latent + rope, generator=gen).to(dt)
        table = torch.randperm(L // bs, generator=gen).view(1, -1).int()
        lens = torch.tensor([L], dtype=torch.int32)
        w_uk = (torch.randn(H, d_nope, latent, generator=gen) * d_nope ** -0.5).to(dt)
        q_nope = torch.randn(1, H, d_nope, generator=gen).to(dt)
        q_pe = torch.randn(1, H, rope, generator=gen).to(dt)
        scale = (d_nope + rope) ** -0.5
        ref_o, ref_lse = reference.mla_decode_partial(q_nope.double(), q_pe.double(), kv.double(), table, lens, scale,
                                                      w_uk.double())
        out, lse = dcp_ops.mla_decode_partial(q_nope, q_pe, kv, table, lens, scale, w_uk)
        # bench_cpu.py's bmm baseline, dtype bf16
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], -1)
        K = gather(kv, table, L)
        s = torch.bmm(q, K.transpose(1, 2)) * scale
        base = torch.bmm(torch.softmax(s.float(), -1).to(dt), K[..., :latent])
        print(f"  {H:>3} heads: dcp_ops {worst(out, ref_o):6.2f} (LSE max error "
              f"{(lse.double() - ref_lse).abs().max().item():.1e}), torch bmm bf16 {worst(base, ref_o):6.2f}")


if __name__ == "__main__":
    main()
