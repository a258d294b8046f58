"""The main job: a real DCP decode run on N ranks, checked against unsharded float64 attention.

Every rank builds the same unsharded paged cache, keeps only its shard (dcp_ops.Placement.shard), and runs dcp_attention
in every mode for a DeepSeek-V3-shaped MLA layer (128 heads, 512 + 64 latent, w_uk / w_uv; also verifying 2 MTP tokens
per sequence, and on an FP8 e4m3 cache) and a GQA layer. Each rank
checks its heads against the float64 reference over the *unsharded* cache; rank 0 prints the table.
--device cpu: N CPU processes over gloo. --device cuda: one process per GPU over NCCL (the shard, queries and
weights move to the rank's GPU; the reference stays on the CPU). Both run the same code below. Launched by torchrun
(or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), each process is one rank of the
launcher's group (env://, multi-node included) instead of spawning its own.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dcp_ops
from dcp_ops import reference as ref

NAN = float("nan")
MLA_HEADS = 128  # DeepSeek-V3


def _paged(lens, block_size, entry, dtype, gen):
    need = [-(-n // block_size) for n in lens]
    table = torch.arange(sum(need)).int()
    table = table[torch.randperm(len(table), generator=gen)]
    rows, used = [], 0
    for k in need:
        rows.append(table[used:used + k])
        used += k
    width = max(need)
    block_table = torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])
    cache = torch.randn(sum(need), block_size, *entry, generator=gen).to(dtype)
    return cache, block_table


def _layers(args, world, dtype):
    gen = torch.Generator().manual_seed(args.seed)
    B, L = args.batch, args.context
    lens = [L - 37 * b for b in range(B)]  # ragged lengths, none a multiple of the block size
    layers = []
    H, latent, rope, d_nope, d_v = MLA_HEADS, 512, 64, 128, 128
    kv, table = _paged(lens, 64, (latent + rope,), dtype, gen)
    w_uk = (torch.randn(H, d_nope, latent, generator=gen) * d_nope ** -0.5).to(dtype)
    w_uv = (torch.randn(H, latent, d_v, generator=gen) * latent ** -0.5).to(dtype)
    q_nope = torch.randn(B, H, d_nope, generator=gen).to(dtype)
    q_pe = torch.randn(B, H, rope, generator=gen).to(dtype)
    layers.append(dict(name="MLA 128h w_uk+w_uv", kind="mla", cache=(kv,), table=table, lens=lens,
                       q=torch.cat([q_nope, q_pe], -1), w_uk=w_uk, w_uv=w_uv, scale=(d_nope + rope) ** -0.5,
                       rope=rope, d_out=d_v, row_bytes=(latent + rope) * kv.element_size()))
    # MTP: the same layer verifying 2 tokens per sequence (the cache holds them; positions L - 2 and L - 1), each
    # attending the keys up to its own position on every rank (multi-token decode, docs/design.md §6)
    positions = torch.tensor([p for n in lens for p in (n - 2, n - 1)])
    q_mtp = torch.cat([torch.randn(2 * B, H, d_nope, generator=gen), torch.randn(2 * B, H, rope, generator=gen)], -1)
    layers.append(dict(name="MLA 128h MTP 2 tok", kind="mla", cache=(kv,), table=table, lens=lens,
                       q=q_mtp.to(dtype), w_uk=w_uk, w_uv=w_uv, scale=(d_nope + rope) ** -0.5, rope=rope, d_out=d_v,
                       row_bytes=(latent + rope) * kv.element_size(), positions=positions,
                       cu=torch.arange(0, 2 * B + 1, 2, dtype=torch.int32)))
    # FP8: the same layer's cache stored as e4m3 with a per-tensor scale (vLLM's kv_cache_dtype=fp8); KV if TP is a
    # bf16 cache's
    kv_scale = kv.float().abs().amax().reshape(1) / 448
    kv8 = (kv.float() / kv_scale).to(torch.float8_e4m3fn)
    layers.append(dict(name="MLA 128h fp8 w_uk+w_uv", kind="mla", cache=(kv8,), table=table, lens=lens,
                       q=torch.cat([q_nope, q_pe], -1), w_uk=w_uk, w_uv=w_uv, scale=(d_nope + rope) ** -0.5,
                       rope=rope, d_out=d_v, row_bytes=latent + rope, tp_row_bytes=(latent + rope) * 2,
                       scales=dict(kv_scale=kv_scale)))
    q_lat = torch.randn(B, H, latent, generator=gen).to(dtype)
    layers.append(dict(name="MLA 128h latent", kind="mla", cache=(kv,), table=table, lens=lens,
                       q=torch.cat([q_lat, q_pe], -1), w_uk=None, w_uv=None, scale=(d_nope + rope) ** -0.5,
                       rope=rope, d_out=latent, row_bytes=(latent + rope) * kv.element_size()))
    Hq, Hkv, D = 8 * world, 1, 128
    k, gtable = _paged(lens, 16, (Hkv, D), dtype, gen)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    layers.append(dict(name=f"GQA {Hq}q/{Hkv}kv d128", kind="gqa", cache=(k, v), table=gtable, lens=lens,
                       q=torch.randn(B, Hq, D, generator=gen).to(dtype), scale=D ** -0.5, d_out=D,
                       row_bytes=2 * Hkv * D * k.element_size()))
    return layers


def _reference(layer, heads):
    """float64 unsharded attention for the given heads (causal over the query positions in a multi-token layer)."""
    seq_lens = torch.tensor(layer["lens"], dtype=torch.int32)
    cu = layer.get("cu")
    if cu is not None:
        seq_lens = (layer["positions"] + 1).int()
    if layer["kind"] == "gqa":  # all heads (the head -> KV head map needs them all), then this rank's slice
        return ref.gqa_decode_partial(layer["q"], *layer["cache"], layer["table"], seq_lens, layer["scale"],
                                      cu_seqlens_q=cu)[0][:, heads]
    q = layer["q"][:, heads]
    rope = layer["rope"]
    w_uk = layer["w_uk"][heads] if layer["w_uk"] is not None else None
    w_uv = layer["w_uv"][heads] if layer["w_uv"] is not None else None
    split = q.shape[-1] - rope
    return ref.mla_decode_partial(q[..., :split], q[..., split:], layer["cache"][0], layer["table"], seq_lens,
                                  layer["scale"], w_uk, w_uv, cu_seqlens_q=cu, **layer.get("scales", {}))[0]


def _backend(args, local_rank):
    """(process-group backend, this rank's device)."""
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def _launched() -> bool:
    """Whether a launcher (torchrun, or any env:// launcher) started this process as one rank of a group."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank, world, init_file, args, results):
    """One rank: init_file names the file:// store of spawned ranks; None means a launcher's env:// variables."""
    torch.set_num_threads(max(1, args.threads))
    backend, dev = _backend(args, int(os.environ.get("LOCAL_RANK", rank)) if init_file is None else rank)
    init = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    rows = []
    for layer in _layers(args, world, dtype):
        seq_lens = torch.tensor(layer["lens"], dtype=torch.int32)
        place = dcp_ops.Placement(world, rank, layer["cache"][0].shape[1], args.interleave)
        cu = layer.get("cu")
        local = (place.local_causal_lens(layer["positions"]) if cu is not None else place.local_seq_lens(seq_lens))
        local, cu = local.to(dev), cu.to(dev) if cu is not None else None
        shards = [place.shard_kv(c, layer["table"], seq_lens, fill=NAN).to(dev) for c in layer["cache"]]
        table = layer["table"].to(dev)
        scales = {name: x.to(dev) for name, x in layer.get("scales", {}).items()}
        if layer["kind"] == "gqa":
            shard = dcp_ops.GQAShard(shards[0], shards[1], table, local, layer["scale"], cu, placement=place)
        else:
            w_uk, w_uv = (w.to(dev) if w is not None else None for w in (layer["w_uk"], layer["w_uv"]))
            shard = dcp_ops.MLAShard(shards[0], table, local, layer["scale"], layer["rope"], w_uk, w_uv, cu,
                                     placement=place, **scales)
        H = layer["q"].shape[1]
        h_loc = H // world
        mine = slice(rank * h_loc, (rank + 1) * h_loc)
        expected = _reference(layer, mine)
        q_loc = layer["q"][:, mine].contiguous().to(dev)
        ws = dcp_ops.Workspace()
        for mode in dcp_ops.distributed.MODES:
            times = []
            for _ in range(args.steps):
                dist.barrier()
                _sync(dev)
                t0 = time.perf_counter()
                out = dcp_ops.dcp_attention(q_loc, shard, mode=mode, workspace=ws)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            got = (out[:, mine] if mode == "ag" else out).cpu()
            err = (got.double() - expected).abs().max()
            worst = torch.tensor([err.item()], device=dev)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            tmed = torch.tensor([statistics.median(times)], device=dev)
            dist.all_reduce(tmed, op=dist.ReduceOp.MAX)
            full_kv = sum(layer["lens"]) * layer.get("tp_row_bytes", layer["row_bytes"])
            kv_rank = int(place.local_seq_lens(seq_lens).sum()) * layer["row_bytes"]
            sent = dcp_ops.exchange_bytes(mode, layer["q"].shape[0], H, layer["d_out"], world, dtype,
                                          q_dim=layer["q"].shape[-1])
            rows.append((layer["name"], mode, worst.item(), kv_rank, full_kv, sent, tmed.item()))
    if rank == 0:
        results.extend(rows)
    dist.barrier()
    dist.destroy_process_group()


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dcp_ops demo", description=__doc__)
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: 4 on cpu; every visible GPU, at most 4, on cuda)")
    p.add_argument("--context", type=int, default=16384, help="tokens per sequence (before sharding)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 4))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: CPU ranks over gloo; cuda: one rank per GPU over NCCL")
    args = p.parse_args(argv)
    launched = _launched()
    if launched:  # torchrun (env://): this process is one rank; the launcher fixes the world size
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world):
            p.error(f"--world-size {args.world_size} differs from the launcher's WORLD_SIZE {world}")
        args.world_size = world
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            p.error("--device cuda: no CUDA device is visible")
        if args.world_size is None:
            args.world_size = min(4, gpus)
        if args.world_size > gpus and not launched:
            p.error(f"--device cuda runs one rank per GPU: --world-size {args.world_size} needs that many GPUs, "
                    f"{gpus} visible")
    elif args.world_size is None:
        args.world_size = 4
    if args.world_size < 1 or MLA_HEADS % args.world_size:
        p.error(f"--world-size must divide the MLA layer's {MLA_HEADS} heads among the ranks, got {args.world_size}")
    t0 = time.perf_counter()
    if launched:
        rows = []
        rank = int(os.environ["RANK"])
        _worker(rank, args.world_size, None, args, rows)
        if rank != 0:  # rank 0 prints the table (and carries the verdict: every rank checked its own heads)
            return 0
    else:
        with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_worker, args=(args.world_size, os.path.join(d, "store"), args, results),
                     nprocs=args.world_size)
            rows = list(results)
    tol = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}[args.dtype]
    where = "CPU ranks (gloo)" if args.device == "cpu" else "GPU ranks (NCCL)"
    print(f"DCP decode on {args.world_size} {where}, {args.dtype}, batch {args.batch}, context up to "
          f"{args.context} tokens, interleave {args.interleave}; reference: float64 attention over the unsharded cache")
    hdr = f"{'layer':<22} {'mode':<6} {'max |err|':>10} {'KV/rank':>11} {'KV if TP':>11} {'sent/rank':>11} {'ms/step':>8}"
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for name, mode, err, kv_rank, full_kv, sent, t in rows:
        ok &= err <= tol
        print(f"{name:<22} {mode:<6} {err:>10.2e} {_fmt_bytes(kv_rank):>11} {_fmt_bytes(full_kv):>11} "
              f"{_fmt_bytes(sent):>11} {t * 1e3:>8.1f}")
    print(f"KV per rank is {100 / args.world_size:.0f}% of a replicated (TP) cache of the same dtype (the fp8 "
          f"layer's TP column: bf16, so {50 / args.world_size:.1f}%); "
          f"all modes {'agree' if ok else 'DISAGREE'} with unsharded attention (tolerance {tol:g}); "
          f"wall time {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
