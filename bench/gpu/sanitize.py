"""Small cases of every CUDA kernel, for compute-sanitizer (racecheck, synccheck, memcheck, initcheck).

    compute-sanitizer --tool racecheck --error-exitcode 1 python bench/gpu/sanitize.py

Each case runs once, synchronises, and checks its result against the float64 reference, so a wrong answer fails
too; bench/gpu/run.sh runs it under each tool where compute-sanitizer exists. Kept small: racecheck slows a kernel
by orders of magnitude. Paths: GQA native (mma.sync) and fp32, bf16 and fp8 caches, multi-token; MLA native on the
tiled kernel with 64- and 32-token tiles (DCP_OPS_TEST_SMEM_OPTIN) and the fallback, fp32 (split-term), fp8, and on
sm_90 the wgmma kernel (DCP_OPS_MLA_WGMMA=1) with both tiles; the split plan; the merges, pack / exchange; write_kv.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import dcp_ops  # noqa: E402
from dcp_ops import reference as ref  # noqa: E402
from conftest import paged_cache, randn  # noqa: E402
from tolerances import assert_decode, assert_matches  # noqa: E402

FP8 = torch.float8_e4m3fn


def cuda(*xs):
    return [x.cuda() if torch.is_tensor(x) else x for x in xs]


def quantized(x, scale):
    return (x / scale).clamp(-448, 448).to(FP8)


def gqa(cache, precision, multi):
    gen = torch.Generator().manual_seed(1)
    lens, n_q = [90, 17], [3, 1]
    k, table = paged_cache(lens, 16, (2, 128), torch.float32, gen)
    v = torch.where(torch.isnan(k), k, randn(*k.shape, gen=gen))
    scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.05])) if cache == FP8 else {}
    k, v = (quantized(k, 0.05), quantized(v, 0.05)) if cache == FP8 else (k.to(cache), v.to(cache))
    kw = dict(scales)
    if multi:
        positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, n_q)])
        kw["cu_seqlens_q"] = torch.tensor([0, 3, 4], dtype=torch.int32)
        seq_lens = (positions + 1).int()
    else:
        seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (randn(len(seq_lens), 8, 128, dtype=torch.bfloat16, gen=gen), k, v, table, seq_lens, 0.09)
    out, lse = dcp_ops.gqa_decode_partial(*cuda(*args), precision=precision,
                                          **{n: t.cuda() for n, t in kw.items()})
    torch.cuda.synchronize()
    assert_decode(out.cpu(), lse.cpu(), ref.gqa_decode_partial, args, torch.bfloat16, precision, "gqa", **kw)


def mla(cache, precision, optin, wgmma=False):
    os.environ["DCP_OPS_MLA_WGMMA"] = "1" if wgmma else "0"
    if optin:
        os.environ["DCP_OPS_TEST_SMEM_OPTIN"] = str(optin)
    else:
        os.environ.pop("DCP_OPS_TEST_SMEM_OPTIN", None)
    gen = torch.Generator().manual_seed(2)
    lens = [100, 3]
    kv, table = paged_cache(lens, 64, (576,), torch.float32, gen)
    scales = dict(kv_scale=torch.tensor([0.02])) if cache == FP8 else {}
    kv = quantized(kv, 0.02) if cache == FP8 else kv.to(cache)
    positions = torch.tensor([97, 98, 99, 2])
    kw = dict(scales, cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32))
    args = (randn(4, 16, 512, dtype=torch.bfloat16, gen=gen), randn(4, 16, 64, dtype=torch.bfloat16, gen=gen), kv,
            table, (positions + 1).int(), 576 ** -0.5)
    out, lse = dcp_ops.mla_decode_partial(*cuda(*args), precision=precision,
                                          **{n: t.cuda() for n, t in kw.items()})
    torch.cuda.synchronize()
    assert_decode(out.cpu(), lse.cpu(), ref.mla_decode_partial, args, torch.bfloat16, precision, "mla", **kw)


def merges():
    outs, lses = torch.randn(3, 4, 8, 64).bfloat16(), torch.randn(3, 4, 8)
    out, lse = dcp_ops.merge_partials(*cuda(outs, lses))
    torch.cuda.synchronize()
    assert_matches(out.cpu(), ref.merge_partials(outs, lses)[0], torch.bfloat16, "merge")
    sends = [dcp_ops.pack_exchange(*cuda(outs[r], lses[r]), 2) for r in range(2)]
    m_out = torch.full((4, 4, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    m_lse = torch.full((4, 4), float("nan"), device="cuda")
    dcp_ops.merge_exchange(torch.stack([s[0] for s in sends]), out=m_out, lse=m_lse)
    part = outs[1].clone().cuda()
    dcp_ops.correct_partial(part, lses.cuda(), 1)
    cache = torch.zeros(4, 8, 2, 64, device="cuda")
    dcp_ops.write_kv(cache, torch.randn(5, 2, 64, device="cuda"),
                     torch.tensor([0, -1, 31, 9, 3], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()


def main():
    cases = [(gqa, c, p, m) for c in (torch.bfloat16, FP8) for p in ("native", "fp32") for m in (False, True)]
    cases += [(mla, c, "native", o) for c in (torch.bfloat16, FP8) for o in (None, 166912, 60000)]
    cases += [(mla, c, "fp32", None) for c in (torch.bfloat16, FP8)]
    if torch.cuda.get_device_capability() == (9, 0):
        cases += [(mla, c, "native", o, True) for c in (torch.bfloat16, FP8) for o in (None, 166912)]
    for fn, *args in cases:
        fn(*args)
        print(f"{fn.__name__}{tuple(str(a).replace('torch.', '') for a in args)}: ok", flush=True)
    merges()
    print("merges, pack / exchange, correct_partial, write_kv: ok")


if __name__ == "__main__":
    main()
