"""Benchmark of every CUDA kernel: median of many CUDA-event timings, inputs rotated over more memory than L2,
device copy bandwidth measured in the same run; FlashInfer's decode / merge kernels as baselines when importable.

    python bench/gpu/bench_cuda.py [--json PATH]
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dcp_ops  # noqa: E402


def cuda_time(fn, sets, reps=50):
    """Median ms over reps, cycling through `sets` of inputs so no timing reads L2-resident data."""
    for s in sets[:3]:
        fn(*s)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time(lambda a, b: b.copy_(a), [(x, y)], reps=20)
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def enough_sets(bytes_per_set):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(16, -(-4 * l2 // max(bytes_per_set, 1))))


def flashinfer_decode_ms(sets, Hq, Hkv, D, bs):
    """FlashInfer's paged decode on the same inputs (NHD layout), or None with the reason printed."""
    try:
        import flashinfer
        q, k, v, table, lens = sets[0]
        B, nblk = table.shape
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD")
        indptr = torch.arange(0, B * nblk + 1, nblk, device="cuda", dtype=torch.int32)
        last = torch.full((B,), bs, device="cuda", dtype=torch.int32)
        wrapper.plan(indptr, table.flatten(), last, Hq, Hkv, D, bs, data_type=q.dtype)
        return cuda_time(lambda q, k, v, t, s: wrapper.run(q, (k, v)), sets)
    except Exception as e:  # a baseline that cannot run is reported, never silently dropped
        print(f"flashinfer decode baseline not run: {type(e).__name__}: {e}")
        return None


def flashinfer_merge_ms(sets):
    try:
        import flashinfer
        return cuda_time(lambda o, l: flashinfer.merge_states(o.transpose(0, 1).reshape(o.shape[1], o.shape[0], -1,
                                                                                        o.shape[3]),
                                                              l.transpose(0, 1).contiguous()), sets)
    except Exception as e:
        print(f"flashinfer merge baseline not run: {type(e).__name__}: {e}")
        return None


def gqa_rows(copy_bw):
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for B, L in ((1, 32768), (16, 32768), (64, 8192)):
            Hq, Hkv, D, bs = 64, 8, 128, 16
            nblk = L // bs
            kv_bytes = 2 * B * L * Hkv * D * 2
            sets = []
            for _ in range(enough_sets(kv_bytes)):
                k = torch.randn(B * nblk, bs, Hkv, D, device="cuda", dtype=dtype)
                v = torch.randn_like(k)
                table = torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
                sets.append((torch.randn(B, Hq, D, device="cuda", dtype=dtype), k, v, table,
                             torch.full((B,), L, device="cuda", dtype=torch.int32)))
            ms = cuda_time(lambda q, k, v, t, s: dcp_ops.gqa_decode_partial(q, k, v, t, s, D ** -0.5), sets)
            gbs = kv_bytes / ms / 1e6
            rows.append(dict(op="gqa_decode_partial", dtype=str(dtype)[6:], B=B, L=L, ms=ms, GBps=gbs,
                             copy_fraction=gbs / copy_bw, flashinfer_ms=flashinfer_decode_ms(sets, Hq, Hkv, D, bs)))
    return rows


def flashinfer_mla_ms(sets, H, latent, rope, bs, scale):
    """FlashInfer's MLA paged decode (absorbed query, latent output) on the same inputs, or None with the reason."""
    try:
        import flashinfer
        q_nope, q_pe, kv, table, lens = sets[0][:5]
        B, nblk = table.shape
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws)
        dev = dict(device="cuda", dtype=torch.int32)
        wrapper.plan(torch.arange(B + 1, **dev), torch.arange(0, B * nblk + 1, nblk, **dev), table.flatten(), lens,
                     H, latent, rope, bs, False, scale, q_nope.dtype, kv.dtype)
        return cuda_time(lambda qn, qp, c, *_: wrapper.run(qn, qp, c[..., :latent], c[..., latent:]), sets)
    except Exception as e:
        print(f"flashinfer MLA baseline not run: {type(e).__name__}: {e}")
        return None


def mla_rows(copy_bw):
    """DeepSeek-V3 shapes (128 heads, 512 + 64): latent query (the FlashInfer comparison), and w_uk + w_uv fused."""
    rows = []
    H, latent, rope, d_nope, d_v, bs = 128, 512, 64, 128, 128, 64
    for fused in (False, True):
        for B, L in ((1, 32768), (16, 32768), (64, 8192)):
            nblk = L // bs
            kv_bytes = B * L * (latent + rope) * 2
            sets = []
            for _ in range(enough_sets(kv_bytes)):
                kv = torch.randn(B * nblk, bs, latent + rope, device="cuda", dtype=torch.bfloat16)
                table = torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
                q_nope = torch.randn(B, H, d_nope if fused else latent, device="cuda", dtype=torch.bfloat16)
                w = (torch.randn(H, d_nope, latent, device="cuda", dtype=torch.bfloat16) * d_nope ** -0.5,
                     torch.randn(H, latent, d_v, device="cuda", dtype=torch.bfloat16) * latent ** -0.5) if fused \
                    else (None, None)
                sets.append((q_nope, torch.randn(B, H, rope, device="cuda", dtype=torch.bfloat16), kv, table,
                             torch.full((B,), L, device="cuda", dtype=torch.int32), *w))
            scale = (d_nope + rope) ** -0.5
            ms = cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a[:5], scale, *a[5:]), sets)
            gbs = kv_bytes / ms / 1e6
            flops = 2 * B * H * L * (2 * latent + rope)
            rows.append(dict(op="mla_decode_partial" + (" w_uk+w_uv" if fused else ""), dtype="bfloat16", B=B, L=L,
                             ms=ms, GBps=gbs, TFLOPs=flops / ms / 1e9, copy_fraction=gbs / copy_bw,
                             flashinfer_ms=None if fused else flashinfer_mla_ms(sets, H, latent, rope, bs, scale)))
    return rows


def merge_rows(copy_bw):
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        N, T, H, D = 8, 64, 128, 512
        moved = N * T * H * D * torch.empty((), dtype=dtype).element_size() * (1 + 1 / N)
        sets = [(torch.randn(N, T, H, D, device="cuda", dtype=dtype), torch.randn(N, T, H, device="cuda"))
                for _ in range(enough_sets(moved))]
        ms = cuda_time(lambda o, l: dcp_ops.merge_partials(o, l), sets)
        gbs = moved / ms / 1e6
        rows.append(dict(op="merge_partials", dtype=str(dtype)[6:], B=T, L=N, ms=ms, GBps=gbs,
                         copy_fraction=gbs / copy_bw, flashinfer_ms=flashinfer_merge_ms(sets)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda.py: no GPU found; nothing was run.", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: measured copy bandwidth {bw:.0f} GB/s")
    rows = gqa_rows(bw) + mla_rows(bw) + merge_rows(bw)
    print(f"{'op':<28} {'dtype':<9} {'B/T':>4} {'L/N':>6} {'ms':>8} {'GB/s':>7} {'of copy':>7} {'TFLOP/s':>7} "
          f"{'flashinfer ms':>13}")
    for r in rows:
        fi = f"{r['flashinfer_ms']:>13.3f}" if r["flashinfer_ms"] is not None else f"{'-':>13}"
        tf = f"{r['TFLOPs']:>7.1f}" if "TFLOPs" in r else f"{'-':>7}"
        print(f"{r['op']:<28} {r['dtype']:<9} {r['B']:>4} {r['L']:>6} {r['ms']:>8.3f} {r['GBps']:>7.0f} "
              f"{r['copy_fraction']:>7.2f} {tf} {fi}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), copy_GBps=bw, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
