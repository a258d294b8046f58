"""CPU benchmark of the partial-attention and merge ops against the machine's measured ceilings and plain torch.

Measures, in the same run: large-buffer read and copy bandwidth, and the fp32 / bf16 torch.matmul rate. Then times
each op on decode shapes and the best plain-torch way to compute the same thing from the same paged cache
(gather the pages, then bmm + softmax, or scaled_dot_product_attention). The roofline time of a row is
max(KV bytes / read bandwidth, FLOPs / matmul rate), with the fp32 matmul rate for an fp32 row and the faster of the
fp32 and bf16 rates for a bf16 row; "roof" is roofline time / measured time. This VM's
speed drifts by up to 2x within seconds, so each row times the op, its baselines and the read and fp32 matmul probes
round-robin, one call each per round (interleaved(): at least 3 rounds, about 3 s; a baseline whose first call
takes over 5 s is timed by that call alone), and uses their medians; the row's probe rates are shown in the last two
columns. The op and the probes thereby see the same phases of the machine. Every timed call of a decode row starts
with the caches flushed, as a decode step finds a layer's KV cache; the merge rows are not flushed (their 16 MiB
inputs have just arrived from the exchange), though the torch merge timed between their calls evicts part of them.

The KV caches are allocated in 2 MiB transparent huge pages, as an engine keeping a long-lived multi-GB cache should:
the cache is read in random block order, and with 4 KiB pages every block costs TLB walks (GQA, 32K tokens, bf16, batch
16 on the machine of RESULTS.md: 66-67 ms against 75-83 ms with 4 KiB pages). torch does this when
THP_MEM_ALLOC_ENABLE=1 is set before its first allocation; `--4k-pages` leaves it off. torch does not align such
allocations to 2 MiB, so a tensor gets huge pages only for the aligned 2 MiB ranges it spans whole: the multi-MiB
caches nearly all of theirs, the 16-head w_uk (exactly 2 MiB in bf16) none, as a weight loaded by itself would.
The header says which pages the run got (the OS may refuse huge pages).

    python bench/bench_cpu.py [--quick] [--json PATH] [--4k-pages]
"""
import argparse
import json
import os
import statistics
import sys
import time

if __name__ == "__main__" and "--4k-pages" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read once, at torch's first allocation

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcp_ops  # noqa: E402
import torch_baselines  # noqa: E402  (this directory is on sys.path when run as a script)

BASELINE_BUDGET_S = 20.0  # a baseline predicted slower than this (at the measured matmul rate) is not run


def timeit(fn, min_reps=3, budget_s=1.0):
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(budget_s=1.0):
    """The machine's ceilings at the start of the run: read and copy bandwidth, fp32 and bf16 matmul rates."""
    probes = Probes()
    rates = probes.rates({k: timeit(fn, budget_s=budget_s) for k, fn in probes.fns().items()})
    y = torch.empty_like(probes.x)
    copy = 2 * probes.x.numel() * 4 / timeit(lambda: y.copy_(probes.x), budget_s=budget_s)
    a16, b16 = torch.randn(512, 512).bfloat16(), torch.randn(512, 512).bfloat16()
    bf16 = 2 * 512 ** 3 / timeit(lambda: a16 @ b16, min_reps=1, budget_s=0.5)
    return dict(rates, copy_GBps=copy / 1e9, bf16_GFLOPs=bf16 / 1e9)


def anon_huge_kib():
    """This process's anonymous memory in transparent huge pages (KiB; 0 where Linux does not report it)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def huge_pages_in_use():
    """Whether a fresh 64 MiB tensor lands in 2 MiB pages."""
    before = anon_huge_kib()
    x = torch.ones(16 * 1024 * 1024)
    used = anon_huge_kib() - before >= 32 * 1024
    del x
    return used


def interleaved(fns, flush=None, budget_s=3.0, min_rounds=3, max_rounds=25, slow_s=5.0):
    """Median time of each fn of fns, timed round-robin (one call of each per round) so that all of them see the same
    phases of a drifting machine; flush, if given, runs untimed before every call. Every fn is called once first; a fn
    whose first call took over slow_s is not called again and that call is its time. slow_s is well above every op's
    time (under 1 s in every run of RESULTS.md but one: a 1.3 s call the machine slowed, which set the row's time when
    slow_s was 1 s), so only a baseline many times slower than the op is timed by a single call."""
    samples = {k: [] for k in fns}
    for k, fn in fns.items():
        if flush:
            flush()
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        if first > slow_s:
            samples[k].append(first)
    again = [k for k in fns if not samples[k]]
    start = time.perf_counter()
    for r in range(max_rounds):
        if r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        for k in again:
            if flush:
                flush()
            t0 = time.perf_counter()
            fns[k]()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


class Probes:
    """The read-bandwidth and fp32 matmul probes of ceilings(), as calls for interleaved()."""

    def __init__(self):
        self.x = torch.randn(128 * 1024 * 1024)  # 512 MiB, far larger than any cache
        self.a, self.b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def flush(self):
        """Evicts the caches (reads 64 MiB, twice the 32 MiB L3 of the machine in RESULTS.md)."""
        self.x[: 16 * 1024 * 1024].sum()

    def fns(self):
        return {"_read": lambda: self.x.sum(), "_mm32": lambda: self.a @ self.b}

    def rates(self, times):
        return dict(read_GBps=self.x.numel() * 4 / times["_read"] / 1e9,
                    fp32_GFLOPs=2 * 2048 ** 3 / times["_mm32"] / 1e9)


def paged(B, L, block_size, entry, dtype, gen):
    nblk = -(-L // block_size)
    cache = torch.randn(B * nblk, block_size, *entry, generator=gen).to(dtype)
    table = torch.randperm(B * nblk, generator=gen).view(B, nblk).int()
    return cache, table


FP8 = torch.float8_e4m3fn


def fp8(cache):
    """A cache stored as e4m3 with its per-tensor scale (amax / 448, as vLLM calibrates): (cache, scale [1])."""
    scale = cache.float().abs().amax().reshape(1) / 448
    return (cache.float() / scale).to(FP8), scale


def gqa_case(B, L, dtype, gen, Hq=16, Hkv=2, D=128, bs=16, kv_fp8=False):
    """kv_fp8: e4m3 caches with their scales (the query stays `dtype`); the torch baselines dequantize the gathered
    pages to the matmul dtype and fold the scales in (sdpa takes no fp8 tensors: not run)."""
    k, table = paged(B, L, bs, (Hkv, D), dtype, gen)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    lens = torch.full((B,), L, dtype=torch.int32)
    scale = D ** -0.5
    scales, ks, vs = {}, 1.0, 1.0
    if kv_fp8:
        (k, k_scale), (v, v_scale) = fp8(k), fp8(v)
        scales, ks, vs = dict(k_scale=k_scale, v_scale=v_scale), float(k_scale), float(v_scale)

    def ours():
        return dcp_ops.gqa_decode_partial(q, k, v, table, lens, scale, **scales)

    def bmm(dt):
        return lambda: torch_baselines.gqa_bmm(q, k, v, table, L, scale * ks, dt) * vs

    def sdpa():
        return torch_baselines.gqa_sdpa(q, k, v, table, L, scale)

    flops = 4 * B * L * Hq * D
    kv_bytes = 2 * B * L * Hkv * D * k.element_size()
    base = dict(bmm=bmm(dtype), bmm_fp32=bmm(torch.float32))
    return ours, base if kv_fp8 else dict(base, sdpa=sdpa), flops, kv_bytes


def mla_inputs(B, L, dtype, gen, H, absorb, latent=512, rope=64, d_nope=128, bs=64, kv_fp8=False):
    """The MLA rows' arguments of mla_decode_partial (by keyword): B sequences of L tokens in a paged latent cache
    (kv_fp8: stored as e4m3, with kv_scale)."""
    kv, table = paged(B, L, bs, (latent + rope,), dtype, gen)
    extra = {}
    if kv_fp8:
        kv, extra["kv_scale"] = fp8(kv)
    w_uk = (torch.randn(H, d_nope, latent, generator=gen) * d_nope ** -0.5).to(dtype) if absorb else None
    q_nope = torch.randn(B, H, d_nope if absorb else latent, generator=gen).to(dtype)
    q_pe = torch.randn(B, H, rope, generator=gen).to(dtype)
    return dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv, block_table=table,
                seq_lens=torch.full((B,), L, dtype=torch.int32), scale=(d_nope + rope) ** -0.5, w_uk=w_uk, **extra)


def mla_case(x):
    """ours, the torch baselines, FLOPs and KV bytes for the arguments x of mla_inputs."""
    q_nope, q_pe, kv, table, w_uk = (x[k] for k in ("q_nope", "q_pe", "kv_cache", "block_table", "w_uk"))
    scale = x["scale"]
    B, H, d_nope = q_nope.shape
    L, rope = int(x["seq_lens"].max()), q_pe.shape[-1]
    latent, absorb = kv.shape[-1] - rope, w_uk is not None
    ks = float(x["kv_scale"]) if "kv_scale" in x else 1.0

    def ours():
        return dcp_ops.mla_decode_partial(**x)

    def bmm(dt):
        return lambda: torch_baselines.mla_bmm(q_nope, q_pe, kv, table, L, scale * ks, w_uk, dt) * ks

    def sdpa():
        return torch_baselines.mla_sdpa(q_nope, q_pe, kv, table, L, scale, w_uk)

    flops = 2 * B * L * H * (latent + rope + latent) + (2 * B * H * d_nope * latent if absorb else 0)
    kv_bytes = B * L * (latent + rope) * kv.element_size()
    if kv.dtype == FP8:  # the matmuls run in the query's dtype; sdpa takes no fp8 tensors
        return ours, dict(bmm=bmm(q_nope.dtype), bmm_fp32=bmm(torch.float32)), flops, kv_bytes
    return ours, dict(bmm=bmm(kv.dtype), bmm_fp32=bmm(torch.float32), sdpa=sdpa), flops, kv_bytes


def mtp_rows(gen, probes, L=32768):
    """Multi-token decode (MTP / speculative), bf16, one sequence of L tokens: n query tokens verified in one call (each
    attending up to its own position; the kernels share each KV tile's reads among them) against one token, and
    against the same n queries as n separate sequences over the same cache (no sharing). Caches flushed every call."""
    rows = []
    lens = lambda n: torch.arange(L - n + 1, L + 1, dtype=torch.int32)  # noqa: E731
    for n in (2, 4):
        for name in ("GQA 16q/2kv d128", "MLA 16h 512+64", "MLA 128h 512+64 w_uk"):
            if name.startswith("GQA"):
                k, table = paged(1, L, 16, (2, 128), torch.bfloat16, gen)
                x = dict(q=torch.randn(1, 16, 128, generator=gen).to(torch.bfloat16), k_cache=k,
                         v_cache=torch.randn(k.shape, generator=gen).to(torch.bfloat16), block_table=table,
                         seq_lens=torch.tensor([L], dtype=torch.int32), scale=128 ** -0.5)
                op, qkeys = dcp_ops.gqa_decode_partial, ("q",)
            else:
                x = mla_inputs(1, L, torch.bfloat16, gen, 128 if "128h" in name else 16, "w_uk" in name)
                op, qkeys = dcp_ops.mla_decode_partial, ("q_nope", "q_pe")
            many = {key: torch.cat([x[key]] * n) for key in qkeys}
            mtp = dict(x, **many, seq_lens=lens(n), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32))
            sep = dict(x, **many, seq_lens=lens(n), block_table=x["block_table"].repeat(n, 1))
            times = interleaved(dict(probes.fns(), one=lambda: op(**x), mtp=lambda: op(**mtp), sep=lambda: op(**sep)),
                                flush=probes.flush)
            row = dict(op=f"{name} MTP {n} tok", dtype="bfloat16", context=L, batch=1, ms=times["mtp"] * 1e3,
                       one_token_ms=times["one"] * 1e3, separate_ms=times["sep"] * 1e3)
            rows.append(row)
            print(f"{row['op']:<30} bf16 {L}: {n} tokens {row['ms']:.2f} ms, one {row['one_token_ms']:.2f} ms, as "
                  f"{n} separate sequences {row['separate_ms']:.2f} ms", flush=True)
    return rows


def predicted_s(name, dtype, flops, ceil):
    rate = ceil["bf16_GFLOPs"] if (dtype != torch.float32 and name != "bmm_fp32") else ceil["fp32_GFLOPs"]
    return flops / (rate * 1e9)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4K and 32K, batch 1 only")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--4k-pages", action="store_true",  # acted on before torch's import, at the top of this file
                   help="leave torch's allocations in 4 KiB pages (default: 2 MiB transparent huge pages)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    pages = "2 MiB" if huge_pages_in_use() else "4 KiB"
    ceil = ceilings()
    print(f"machine: {torch.get_num_threads()} threads, read {ceil['read_GBps']:.1f} GB/s, copy "
          f"{ceil['copy_GBps']:.1f} GB/s, matmul fp32 {ceil['fp32_GFLOPs']:.1f} GFLOP/s, bf16 "
          f"{ceil['bf16_GFLOPs']:.2f} GFLOP/s (dcp_ops CPU ISA: {dcp_ops._C.cpu_isa}); tensors in {pages} pages")
    cases = []
    batches = [1] if args.quick else [1, 16]
    for dtype in (torch.float32, torch.bfloat16):
        for L in (4096, 32768):
            for B in batches:
                cases.append(("GQA 16q/2kv d128", dtype, L, B, lambda B=B, L=L, dt=dtype: gqa_case(B, L, dt, gen)))
            for H in (16, 128):
                for absorb in (False, True):
                    for B in ([1] if args.quick else ([1, 16] if H == 16 else [1, 4])):
                        name = f"MLA {H}h 512+64{' w_uk' if absorb else ''}"
                        cases.append((name, dtype, L, B, lambda B=B, L=L, dt=dtype, H=H, a=absorb:
                                      mla_case(mla_inputs(B, L, dt, gen, H, a))))
    # FP8 caches (bf16 queries) next to the bf16 rows above: the KV bytes column is what each reads
    for L in (4096, 32768):
        for B in batches:
            cases.append(("GQA 16q/2kv d128 fp8", torch.bfloat16, L, B,
                          lambda B=B, L=L: gqa_case(B, L, torch.bfloat16, gen, kv_fp8=True)))
            cases.append(("MLA 16h 512+64 fp8", torch.bfloat16, L, B,
                          lambda B=B, L=L: mla_case(mla_inputs(B, L, torch.bfloat16, gen, 16, False, kv_fp8=True))))
    rows = []
    hdr = (f"{'op':<22} {'dtype':<5} {'ctx':>6} {'B':>3} {'ms':>9} {'KV MB':>6} {'GB/s':>6} {'GFLOP/s':>8} {'roof':>5} "
           f"{'bmm':>9} {'bmm32':>9} {'sdpa':>9} {'vs best':>7} {'read':>5} {'mm32':>5}")
    print(hdr)
    print("-" * len(hdr))
    probes = Probes()
    for name, dtype, L, B, make in cases:
        ours, baselines, flops, kv_bytes = make()
        if dtype == torch.float32:
            baselines.pop("bmm_fp32")
        # Every call starts with the caches flushed, as a decode step finds a layer's KV cache (the other layers'
        # caches went through since the last step).
        fns = dict(probes.fns(), ours=ours)
        fns.update({b: fn for b, fn in baselines.items() if predicted_s(b, dtype, flops, ceil) < BASELINE_BUDGET_S})
        times = interleaved(fns, flush=probes.flush)
        t = times["ours"]
        row_ceil = dict(probes.rates(times), bf16_GFLOPs=ceil["bf16_GFLOPs"])
        # fp32 arithmetic is roofed by the fp32 matmul rate; a bf16 op by the faster of the two rates (on a CPU with
        # bf16 dot-product instructions torch's bf16 matmul is 3x the fp32 one, which no fp32 computation can reach)
        peak = (row_ceil["fp32_GFLOPs"] if dtype == torch.float32
                else max(row_ceil["fp32_GFLOPs"], row_ceil["bf16_GFLOPs"])) * 1e9
        roof_t = max(kv_bytes / (row_ceil["read_GBps"] * 1e9), flops / peak)
        base = {b: times.get(b) for b in baselines}  # None: predicted over BASELINE_BUDGET_S, not run
        best = min(v for v in base.values() if v is not None)
        row = dict(op=name, dtype=str(dtype).replace("torch.", ""), context=L, batch=B, ms=t * 1e3,
                   kv_MB=kv_bytes / 1e6, kv_GBps=kv_bytes / t / 1e9, GFLOPs=flops / t / 1e9,
                   roofline_fraction=roof_t / t,
                   baselines_ms={k: (v * 1e3 if v is not None else None) for k, v in base.items()},
                   speedup_vs_best_torch=best / t, ceilings=row_ceil)
        rows.append(row)

        def cell(k):
            if k not in base:
                return f"{'-':>9}"
            return f"{base[k] * 1e3:>9.1f}" if base[k] is not None else f"{'(skip)':>9}"
        print(f"{name:<22} {row['dtype'][:5]:<5} {L:>6} {B:>3} {t * 1e3:>9.2f} {row['kv_MB']:>6.1f} "
              f"{row['kv_GBps']:>6.1f} "
              f"{row['GFLOPs']:>8.1f} {row['roofline_fraction']:>5.2f} {cell('bmm')} {cell('bmm_fp32')} "
              f"{cell('sdpa')} {row['speedup_vs_best_torch']:>6.1f}x {row_ceil['read_GBps']:>5.1f} "
              f"{row_ceil['fp32_GFLOPs']:>5.0f}", flush=True)
    # merge: memory-bound, against copy bandwidth and the plain-torch merge
    for dtype in (torch.float32, torch.bfloat16):
        N, T, H, D = 4, 16, 128, 512
        outs = torch.randn(N, T, H, D).to(dtype)
        lses = torch.randn(N, T, H)

        times = interleaved({"ours": lambda: dcp_ops.merge_partials(outs, lses),
                             "torch": lambda: torch_baselines.merge(outs, lses)})
        t, tb = times["ours"], times["torch"]
        moved = outs.numel() * outs.element_size() * (1 + 1 / N) + lses.numel() * 4
        row = dict(op="merge_partials N4 T16 H128 D512", dtype=str(dtype).replace("torch.", ""), ms=t * 1e3,
                   GBps=moved / t / 1e9, copy_fraction=moved / t / 1e9 / ceil["copy_GBps"],
                   baselines_ms=dict(torch=tb * 1e3), speedup_vs_best_torch=tb / t)
        rows.append(row)
        print(f"{row['op']:<34} {row['dtype']:<9} {t * 1e3:>7.2f} ms {row['GBps']:>6.1f} GB/s "
              f"({row['copy_fraction']:.2f} of copy)  torch {tb * 1e3:.2f} ms  {tb / t:.1f}x")
    rows += mtp_rows(gen, probes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ceilings=ceil, threads=torch.get_num_threads(), pages=pages, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
