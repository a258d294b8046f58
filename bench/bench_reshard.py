"""transfer_runs on a 1M-token sequence between two 8-rank layouts: plan time, and the bytes reshard_kv moves against
the minimum.

For each pair of layouts (interleave and block size changes) it prints the plan's time (median of --repeats, one
host thread by default: the planner is host work), its runs and their mean length, and the bytes reshard_kv moves
for DeepSeek-V3's MLA cache (576 bf16 per token) when the same 8 processes hold both sides: across processes (the
tokens whose owner changes: no plan can move fewer) and in all, against the minimum, the tokens whose owner or slot
changes. A block-size change needs new caches, so there every token's slot changes.

    python bench/bench_reshard.py [--tokens 1048576] [--repeats 7] [--threads 1]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcp_ops  # noqa: E402

TOKEN_BYTES = 576 * 2  # DeepSeek-V3 MLA: 512 latent + 64 rope, bf16
PAIRS = [((8, 64, 1), (8, 64, 64)), ((8, 64, 64), (8, 64, 1)), ((8, 16, 16), (8, 64, 64)), ((8, 16, 1), (8, 64, 1)),
         ((8, 64, 1), (8, 16, 16)), ((8, 16, 1), (4, 16, 1))]


def _slots(p: dcp_ops.Placement, table: torch.Tensor, n: int):
    """Owner and (block, offset) of every position of one sequence, from the placement's own functions."""
    pos = torch.arange(n)
    j = p.local_index(pos).long()
    return p.owner_rank(pos), table[0, j // p.block_size].long(), j % p.block_size


def _row(src_layout, dst_layout, n: int, repeats: int):
    src, dst = dcp_ops.Placement(src_layout[0], 0, *src_layout[1:]), dcp_ops.Placement(dst_layout[0], 0, *dst_layout[1:])
    gen = torch.Generator().manual_seed(0)
    table = lambda p: torch.randperm(n // (p.world_size * p.block_size) + 1, generator=gen)[None].int()  # noqa: E731
    same_cache = src.block_size == dst.block_size  # resize in place: one cache and table on each process
    src_table = table(src if src.world_size < dst.world_size else dst) if same_cache else table(src)
    dst_table = src_table if same_cache else table(dst)
    lens = torch.tensor([n])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runs = dcp_ops.transfer_runs(src, dst, lens, src_table, dst_table)
        times.append(time.perf_counter() - t0)
    across = int(runs[runs[:, 1] != runs[:, 4], 7].sum())
    if same_cache:
        (ro, bo, oo), (rn, bn, on) = _slots(src, src_table, n), _slots(dst, dst_table, n)
        minimum = int(((ro != rn) | (bo != bn) | (oo != on)).sum())
    else:
        minimum = n
    gb = lambda tokens: tokens * TOKEN_BYTES / 1e9  # noqa: E731
    return (f"| {src_layout} | {dst_layout} | {statistics.median(times) * 1e3:.1f} | {len(runs)} | {n / len(runs):.1f} "
            f"| {gb(across):.2f} | {gb(n):.2f} | {gb(minimum):.2f} | {n / max(minimum, 1):.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"transfer_runs, one sequence of {args.tokens} tokens, {args.threads} host thread(s); layouts are "
          f"(world_size, block_size, interleave); GB for {TOKEN_BYTES} bytes per token\n")
    print("| src | dst | plan ms | runs | tokens per run | GB across processes | GB moved | GB minimum | moved / min |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for src, dst in PAIRS:
        print(_row(src, dst, args.tokens, args.repeats))


if __name__ == "__main__":
    main()
