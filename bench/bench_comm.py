"""Exchange cost per DCP mode and world size: bytes each rank sends per layer and time per layer.

Times one decode layer's communication as dcp_attention runs it: the Q all-gather (pre-absorption MLA query, 192
wide) plus the merge exchange of the partial outputs (merge_across), for DeepSeek-V3 MLA with and without w_uv
before the merge. gloo on CPU; `--device cuda` uses NCCL, one process per GPU.

    python bench/bench_comm.py [--worlds 2 3 4] [--batch 8] [--json PATH]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcp_ops  # noqa: E402

H, Q_DIM = 128, 192  # DeepSeek-V3: 128 heads, 128 nope + 64 rope query gathered before absorption
PAYLOADS = {"latent (512)": 512, "w_uv before merge (128)": 128}


def _worker(rank, world, init_file, args, results):
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    T = args.batch
    heads = H // world * world  # 128 heads do not split over 3 ranks: 126 there
    q = torch.randn(T, heads // world, Q_DIM, device=device).to(dtype)
    rows = []
    for payload, d in PAYLOADS.items():
        out = torch.randn(T, heads, d, device=device).to(dtype)
        lse = torch.randn(T, heads, device=device)
        for mode in dcp_ops.distributed.MODES:
            ws = dcp_ops.Workspace()
            times = []
            for i in range(args.iters + 3):
                o = out.clone()  # ag_rs rescales its input in place
                dist.barrier()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                dcp_ops.gather_heads(q, workspace=ws)
                dcp_ops.merge_across(o, lse, mode=mode, workspace=ws)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sent = dcp_ops.exchange_bytes(mode, T, heads, d, world, dtype, q_dim=Q_DIM)
            rows.append(dict(world=world, heads=heads, payload=payload, mode=mode, bytes_per_rank=sent, ms=t.item() * 1e3))
    if rank == 0:
        results.extend(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--batch", type=int, default=8, help="decode tokens (T = B)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_worker, args=(world, os.path.join(d, "store"), args, results), nprocs=world)
            rows.extend(results)
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"DCP exchange per layer, DeepSeek-V3 MLA ({H} heads, Q gather {Q_DIM} wide), {args.dtype}, T={args.batch}, "
          f"{backend}; time = Q all-gather + merge exchange, median of {args.iters}, slowest rank")
    hdr = f"{'N':>2} {'heads':>5} {'payload':<24} {'mode':<6} {'KiB sent/rank':>13} {'ms/layer':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['world']:>2} {r['heads']:>5} {r['payload']:<24} {r['mode']:<6} {r['bytes_per_rank'] / 1024:>13.1f} {r['ms']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=backend, dtype=args.dtype, batch=args.batch, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
