"""Benchmark of every CUDA kernel: median of many CUDA-event timings, inputs rotated over more memory than L2.
The device's copy bandwidth and bf16 matmul rate are measured in the same run; a row's roofline time is
max(bytes / copy bandwidth, FLOPs / bf16 matmul rate) and "roof" is that over the measured time. Baselines: plain torch
on the same paged cache (bench/torch_baselines.py: gather + bmm / softmax, or scaled_dot_product_attention), and
FlashInfer's decode / merge kernels when importable; "vs best" is the fastest baseline's time over ours.

    python bench/gpu/bench_cuda.py [--json PATH]
"""
import argparse
import json
import os
import statistics
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]
import dcp_ops  # noqa: E402
import torch_baselines as tb  # noqa: E402


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


def matmul_rate():
    """bf16 torch.matmul rate, TFLOP/s, on random 8192^3 operands."""
    a, b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16), torch.randn(8192, 8192, device="cuda",
                                                                                     dtype=torch.bfloat16)
    ms = cuda_time(lambda x, y: x @ y, [(a, b)], reps=20)
    return 2 * 8192 ** 3 / ms / 1e9


def torch_ms(fns, sets, ours):
    """Median ms of each plain-torch baseline, after checking its output against ours on the first set: a baseline
    that computes something else is a bug of this bench, not a comparison (5% of the largest output: far above bf16
    rounding, far below a wrong result)."""
    got = ours.float()
    times = {}
    for name, fn in fns.items():
        want = fn(*sets[0]).float()
        err = (want - got).abs().max().item()
        assert want.shape == got.shape and err <= 0.05 * got.abs().max().item(), \
            f"torch baseline {name} disagrees with dcp_ops: {err:.3g} (shapes {tuple(want.shape)}, {tuple(got.shape)})"
        times[name] = cuda_time(fn, sets)
    return times


def row(op, dtype, B, L, ms, moved, flops, ceil, baselines):
    """One table row: time, rates, roofline fraction, baselines (None: not run) and the speedup over the best."""
    roof = max(moved / ceil["copy_GBps"] / 1e6, flops / ceil["bf16_TFLOPs"] / 1e9)
    run = [v for v in baselines.values() if v is not None]
    return dict(op=op, dtype=str(dtype).replace("torch.", ""), B=B, L=L, ms=ms, GBps=moved / ms / 1e6,
                TFLOPs=flops / ms / 1e9, roofline_fraction=roof / ms, baselines_ms=baselines,
                speedup_vs_best=min(run) / ms if run else None)


def enough_sets(bytes_per_set):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(16, int(-(-4 * l2 // max(bytes_per_set, 1)))))


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


def gqa_rows(ceil):
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
            scale = D ** -0.5
            ms = cuda_time(lambda q, k, v, t, s: dcp_ops.gqa_decode_partial(q, k, v, t, s, scale), sets)
            ours = dcp_ops.gqa_decode_partial(*sets[0], scale)[0]
            base = torch_ms(dict(bmm=lambda q, k, v, t, s: tb.gqa_bmm(q, k, v, t, L, scale, dtype),
                                 sdpa=lambda q, k, v, t, s: tb.gqa_sdpa(q, k, v, t, L, scale)), sets, ours)
            base["flashinfer"] = flashinfer_decode_ms(sets, Hq, Hkv, D, bs)
            rows.append(row("gqa_decode_partial 64q/8kv native", dtype, B, L, ms, kv_bytes, 4 * B * L * Hq * D, ceil,
                            base))
            ms32 = cuda_time(lambda q, k, v, t, s: dcp_ops.gqa_decode_partial(q, k, v, t, s, scale, precision="fp32"),
                             sets)
            rows.append(row("gqa_decode_partial 64q/8kv fp32", dtype, B, L, ms32, kv_bytes, 4 * B * L * Hq * D, ceil,
                            base))
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


def paged_latent_cache(B, L, bs, width):
    """A bf16 latent cache of B sequences of L tokens in blocks of bs, its block table in a random block order."""
    nblk = L // bs
    kv = torch.randn(B * nblk, bs, width, device="cuda", dtype=torch.bfloat16)
    return kv, torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)


def latent_query_sets(B, L, H, latent, rope, bs):
    """Input sets (q_nope as the latent query, q_pe, a bf16 paged latent cache, its table, seq_lens = L) for
    mla_decode_partial, as many as enough_sets asks for B x L tokens."""
    sets = []
    for _ in range(enough_sets(B * L * (latent + rope) * 2)):
        kv, table = paged_latent_cache(B, L, bs, latent + rope)
        sets.append((torch.randn(B, H, latent, device="cuda", dtype=torch.bfloat16),
                     torch.randn(B, H, rope, device="cuda", dtype=torch.bfloat16), kv, table,
                     torch.full((B,), L, device="cuda", dtype=torch.int32)))
    return sets


def mla_rows(ceil):
    """DeepSeek-V3 shapes (128 heads, 512 + 64): latent query (the FlashInfer comparison), and w_uk + w_uv fused."""
    rows = []
    H, latent, rope, d_nope, d_v, bs = 128, 512, 64, 128, 128, 64
    for fused in (False, True):
        for B, L in ((1, 32768), (16, 32768), (64, 8192)):
            kv_bytes = B * L * (latent + rope) * 2
            sets = []
            for _ in range(enough_sets(kv_bytes)):
                kv, table = paged_latent_cache(B, L, bs, latent + rope)
                q_nope = torch.randn(B, H, d_nope if fused else latent, device="cuda", dtype=torch.bfloat16)
                w = (torch.randn(H, d_nope, latent, device="cuda", dtype=torch.bfloat16) * d_nope ** -0.5,
                     torch.randn(H, latent, d_v, device="cuda", dtype=torch.bfloat16) * latent ** -0.5) if fused \
                    else (None, None)
                sets.append((q_nope, torch.randn(B, H, rope, device="cuda", dtype=torch.bfloat16), kv, table,
                             torch.full((B,), L, device="cuda", dtype=torch.int32), *w))
            scale = (d_nope + rope) ** -0.5
            ms = cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a[:5], scale, *a[5:]), sets)
            ours = dcp_ops.mla_decode_partial(*sets[0][:5], scale, *sets[0][5:])[0]
            base = torch_ms(dict(bmm=lambda qn, qp, c, t, s, wk=None, wv=None:
                                 tb.mla_bmm(qn, qp, c, t, L, scale, wk, torch.bfloat16, wv),
                                 sdpa=lambda qn, qp, c, t, s, wk=None, wv=None:
                                 tb.mla_sdpa(qn, qp, c, t, L, scale, wk, wv)), sets, ours)
            base["flashinfer"] = None if fused else flashinfer_mla_ms(sets, H, latent, rope, bs, scale)
            flops = 2 * B * H * L * (2 * latent + rope) + (4 * B * H * latent * d_nope if fused else 0)
            name = "mla_decode_partial 128h" + (" w_uk+w_uv" if fused else "")
            rows.append(row(name + " native", torch.bfloat16, B, L, ms, kv_bytes, flops, ceil, base))
            # precision="fp32": the split-term kernel, on the same inputs against the same baselines
            ms32 = cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a[:5], scale, *a[5:], precision="fp32"), sets)
            rows.append(row(name + " fp32", torch.bfloat16, B, L, ms32, kv_bytes, flops, ceil, base))
    rows.append(mtp_row(ceil, H, latent, rope, bs))
    return rows + flashmla_shape_rows(ceil)


def flashmla_shape_rows(ceil, latent=512, rope=64, bs=64):
    """FlashMLA's decode benchmark shapes (batch 16 / 64 / 128 x 4K / 32K, 128 and 16 heads, absorbed query), both
    precisions, against FlashInfer's MLA decode only (the torch baselines of mla_rows take minutes at these sizes)."""
    rows = []
    scale = (128 + rope) ** -0.5
    for H in (128, 16):
        for B in (16, 64, 128):
            for L in (4096, 32768):
                kv_bytes = B * L * (latent + rope) * 2
                sets = latent_query_sets(B, L, H, latent, rope, bs)
                base = dict(flashinfer=flashinfer_mla_ms(sets, H, latent, rope, bs, scale))
                flops = 2 * B * H * L * (2 * latent + rope)
                for precision in ("native", "fp32"):
                    ms = cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a, scale, precision=precision), sets)
                    rows.append(row(f"mla_decode_partial {H}h (FlashMLA shape) {precision}", torch.bfloat16, B, L,
                                    ms, kv_bytes, flops, ceil, base))
                del sets
    return rows


def wgmma_rows(ceil, H=128, latent=512, rope=64, bs=64, L=32768):
    """On sm_90: the wgmma MLA kernel (DCP_OPS_MLA_WGMMA=1) next to the mma.sync tiled kernel and torch's bmm on the
    same inputs, DeepSeek-V3's 128 heads at batch 1, 16 and 64 x 32K (docs/design.md §8: batch 16 <= 0.27 ms on an
    H200, batch 1 >= 0.6 of the memory roofline). Also the two kernels' largest output difference."""
    if torch.cuda.get_device_capability() != (9, 0):
        print("wgmma rows not run: not an sm_90 device")
        return []
    rows, scale = [], (128 + rope) ** -0.5
    for B in (1, 16, 64):
        kv_bytes = B * L * (latent + rope) * 2
        sets = latent_query_sets(B, L, H, latent, rope, bs)
        flops = 2 * B * H * L * (2 * latent + rope)
        timed = {}
        for switch in ("0", "1"):
            os.environ["DCP_OPS_MLA_WGMMA"] = switch
            timed[switch] = (cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a, scale), sets),
                             dcp_ops.mla_decode_partial(*sets[0], scale))
        os.environ.pop("DCP_OPS_MLA_WGMMA")
        base = torch_ms(dict(bmm=lambda qn, qp, c, t, s: tb.mla_bmm(qn, qp, c, t, L, scale, None, torch.bfloat16,
                                                                    None)), sets, timed["0"][1][0])
        diff = (timed["1"][1][0].float() - timed["0"][1][0].float()).abs().max().item()
        print(f"wgmma vs mma.sync, batch {B}: largest output difference {diff:.3g}")
        rows.append(row("mla_decode_partial 128h native mma.sync", torch.bfloat16, B, L, timed["0"][0], kv_bytes,
                        flops, ceil, base))
        rows.append(row("mla_decode_partial 128h native wgmma", torch.bfloat16, B, L, timed["1"][0], kv_bytes,
                        flops, ceil, base))
        del sets
    return rows


def mtp_row(ceil, H, latent, rope, bs, B=16, L=32768):
    """Multi-token decode (MTP: 2 query tokens per sequence, causal), DeepSeek-V3 shapes, native; no torch baseline."""
    kv_bytes = B * L * (latent + rope) * 2
    sets = []
    for _ in range(enough_sets(kv_bytes)):
        kv, table = paged_latent_cache(B, L, bs, latent + rope)
        lens = torch.tensor([L - 1, L] * B, device="cuda", dtype=torch.int32)  # each query's causal length
        cu = torch.arange(0, 2 * B + 1, 2, device="cuda", dtype=torch.int32)
        sets.append((torch.randn(2 * B, H, latent, device="cuda", dtype=torch.bfloat16),
                     torch.randn(2 * B, H, rope, device="cuda", dtype=torch.bfloat16), kv, table, lens, cu))
    scale = (128 + rope) ** -0.5
    ms = cuda_time(lambda qn, qp, c, t, s, cu: dcp_ops.mla_decode_partial(qn, qp, c, t, s, scale, cu_seqlens_q=cu),
                   sets)
    return row("mla_decode_partial 128h MTP 2 tok native", torch.bfloat16, B, L, ms, kv_bytes,
               2 * 2 * B * H * L * (2 * latent + rope), ceil, {})


def fp8_rows(ceil, B=16, L=32768):
    """FP8 e4m3 caches (bf16 queries, per-tensor scales) next to the bf16 rows: GQA 64q/8kv d128 and MLA 128h 512 + 64,
    the KV bytes being half the bf16 rows'. Against torch's bmm on the dequantized gathered pages."""
    rows = []
    ks = 0.02  # the per-tensor scale of both caches (K and V alike), as a tensor for the op and a float for torch
    k_scale = torch.tensor([ks], device="cuda")
    Hq, Hkv, D, bs = 64, 8, 128, 16
    kv_bytes = 2 * B * L * Hkv * D
    sets = []
    for _ in range(enough_sets(kv_bytes)):
        k, v = (torch.randn(B * L // bs, bs, Hkv, D, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
        table = torch.randperm(B * L // bs, device="cuda", dtype=torch.int32).view(B, -1)
        sets.append((torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16), k, v, table,
                     torch.full((B,), L, device="cuda", dtype=torch.int32)))
    scale = D ** -0.5
    ms = cuda_time(lambda q, k, v, t, s: dcp_ops.gqa_decode_partial(q, k, v, t, s, scale, k_scale=k_scale,
                                                                    v_scale=k_scale), sets)
    ours = dcp_ops.gqa_decode_partial(*sets[0], scale, k_scale=k_scale, v_scale=k_scale)[0]
    base = torch_ms(dict(bmm=lambda q, k, v, t, s: tb.gqa_bmm(q, k, v, t, L, scale * ks, torch.bfloat16) * ks),
                    sets, ours)
    rows.append(row("gqa_decode_partial 64q/8kv fp8 e4m3", torch.bfloat16, B, L, ms, kv_bytes, 4 * B * L * Hq * D,
                    ceil, base))
    H, latent, rope, bs = 128, 512, 64, 64
    kv_bytes = B * L * (latent + rope)
    sets = []
    for _ in range(enough_sets(kv_bytes)):
        kv, table = paged_latent_cache(B, L, bs, latent + rope)
        sets.append((torch.randn(B, H, latent, device="cuda", dtype=torch.bfloat16),
                     torch.randn(B, H, rope, device="cuda", dtype=torch.bfloat16), kv.to(torch.float8_e4m3fn), table,
                     torch.full((B,), L, device="cuda", dtype=torch.int32)))
    scale = (128 + rope) ** -0.5
    ms = cuda_time(lambda *a: dcp_ops.mla_decode_partial(*a, scale, kv_scale=k_scale), sets)
    ours = dcp_ops.mla_decode_partial(*sets[0], scale, kv_scale=k_scale)[0]
    base = torch_ms(dict(bmm=lambda qn, qp, c, t, s: tb.mla_bmm(qn, qp, c, t, L, scale * ks, None,
                                                                torch.bfloat16) * ks), sets, ours)
    rows.append(row("mla_decode_partial 128h fp8 e4m3", torch.bfloat16, B, L, ms, kv_bytes,
                    2 * B * H * L * (2 * latent + rope), ceil, base))
    return rows


def merge_rows(ceil):
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        N, T, H, D = 8, 64, 128, 512
        moved = N * T * H * D * torch.empty((), dtype=dtype).element_size() * (1 + 1 / N)
        sets = [(torch.randn(N, T, H, D, device="cuda", dtype=dtype), torch.randn(N, T, H, device="cuda"))
                for _ in range(enough_sets(moved))]
        ms = cuda_time(lambda o, l: dcp_ops.merge_partials(o, l), sets)
        base = torch_ms(dict(torch=lambda o, l: tb.merge(o, l)[0]), sets, dcp_ops.merge_partials(*sets[0])[0])
        base["flashinfer"] = flashinfer_merge_ms(sets)
        rows.append(row(f"merge_partials N{N} H{H} D{D}", dtype, T, N, ms, moved, 0, ceil, base))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda.py: no GPU found; nothing was run.", file=sys.stderr)
        return 2
    ceil = dict(copy_GBps=copy_bandwidth(), bf16_TFLOPs=matmul_rate())
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: copy {ceil['copy_GBps']:.0f} GB/s (read + "
          f"write), bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s")
    rows = gqa_rows(ceil) + mla_rows(ceil) + wgmma_rows(ceil) + fp8_rows(ceil) + merge_rows(ceil)
    hdr = (f"{'op':<44} {'dtype':<8} {'B/T':>4} {'L/N':>6} {'ms':>8} {'GB/s':>6} {'TFLOP/s':>7} {'roof':>5} "
           f"{'bmm':>8} {'sdpa':>8} {'torch':>8} {'flashinf':>8} {'vs best':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        b = r["baselines_ms"]
        cell = [f"{b[k]:>8.3f}" if b.get(k) is not None else f"{'-':>8}"
                for k in ("bmm", "sdpa", "torch", "flashinfer")]
        vs = f"{r['speedup_vs_best']:>6.2f}x" if r["speedup_vs_best"] is not None else f"{'-':>7}"
        print(f"{r['op']:<44} {r['dtype']:<8} {r['B']:>4} {r['L']:>6} {r['ms']:>8.3f} {r['GBps']:>6.0f} "
              f"{r['TFLOPs']:>7.1f} {r['roofline_fraction']:>5.2f} {' '.join(cell)} {vs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, ceilings=ceil, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
