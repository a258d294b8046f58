"""A derandomized fuzz of malformed and non-finite inputs to every op, on the CPU kernels and on the CUDA sources
under the SIMT executor (docs/design.md §7). Each case runs in a child process, so that a crash (a signal) or a hang
fails that case and names it, rather than killing the run. A case passes when the op returns, or raises a
ValueError / TypeError / RuntimeError / IndexError whose message names the op (and so the argument, as every
refusal here is written)."""
import math
import multiprocessing as mp
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE_TIMEOUT_S = 20.0
I32 = torch.int32


def _worker(conn, simt_lib):
    """Runs (backend, op, args, kwargs) cases from conn until it closes; answers ("ok" | type name, message)."""
    import dcp_ops  # noqa: F401  (registers torch.ops.dcp_ops)
    if simt_lib:
        torch.ops.load_library(simt_lib)
    torch.set_num_threads(1)
    while True:
        try:
            backend, op, args, kwargs = conn.recv()
        except EOFError:
            return
        if backend == "selftest":  # the harness's own check: a case that kills its process
            os.abort()
        try:
            fn = getattr(getattr(torch.ops, backend), op)
            fn(*args, **kwargs)
            conn.send(("ok", ""))
        except Exception as e:  # noqa: BLE001  (reported to the parent, which judges it)
            conn.send((type(e).__name__, str(e)[:400]))


class Child:
    """A worker process, restarted after a case that kills it or hangs."""

    def __init__(self, simt_lib):
        self.simt_lib, self.proc = simt_lib, None

    def run(self, case):
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, self.simt_lib), daemon=True)
            self.proc.start()
        self.conn.send(case)
        if not self.conn.poll(CASE_TIMEOUT_S):  # neither an answer nor the end of the pipe: a hang
            self.proc.kill()
            self.proc.join()
            self.proc = None
            return ("hang", "")
        try:
            return self.conn.recv()
        except EOFError:  # the worker died during the case
            self.proc.join()
            code, self.proc = self.proc.exitcode, None
            return (f"crash (exit code {code})", "")

    def close(self):
        if self.proc is not None:
            self.conn.close()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def child(simt_ops):
    lib = next((os.path.join(ROOT, "build", "simt", f) for f in os.listdir(os.path.join(ROOT, "build", "simt"))
                if f.startswith("dcp_ops_simt") and f.endswith(".so")), None)
    c = Child(lib)
    yield c
    c.close()


# Valid base cases, then one or two mutations. Shapes are small: the point is the edges, not the arithmetic.
def _paged(draw, entry, dtype):
    nb, bs = draw(st.integers(1, 4)), draw(st.sampled_from([1, 4, 16]))
    T, mb = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    cache = torch.randn(nb, bs, *entry).to(dtype)
    table = torch.randint(0, nb, (T, mb), dtype=I32)
    lens = torch.randint(0, mb * bs + 1, (T,), dtype=I32)
    return cache, table, lens, T


FLOATS = [torch.float32, torch.bfloat16, torch.float16]
BAD_SCALARS = [0.0, -1.0, math.nan, math.inf, 1e-30, 1e30]
SCALES = [lambda: torch.tensor([0.5]), lambda: torch.tensor(2.0), lambda: None, lambda: torch.ones(2),  # fp8 scales
          lambda: torch.ones(1, dtype=torch.float64), lambda: torch.tensor([math.nan]), lambda: torch.zeros(1),
          lambda: torch.ones(1, 1), lambda: torch.ones(1, dtype=I32)]


@st.composite
def cases(draw):
    torch.manual_seed(draw(st.integers(0, 2**16)))
    backend = draw(st.sampled_from(["dcp_ops", "dcp_ops_simt"]))
    op = draw(st.sampled_from(["gqa_decode_partial", "mla_decode_partial", "merge_partials", "correct_partial",
                               "pack_exchange", "merge_exchange", "write_kv"]))
    dtype = draw(st.sampled_from(FLOATS))
    mut = draw(st.sampled_from(["none", "zero_dim", "dtype", "nonfinite", "index", "scalar", "stride", "alias",
                                "rank"]))
    if op == "gqa_decode_partial":
        D = draw(st.sampled_from([0, 8, 64, 128]))
        hkv = draw(st.integers(0, 2))
        k, table, lens, T = _paged(draw, (hkv, D), dtype)
        v = torch.randn_like(k.float()).to(dtype)
        q = torch.randn(T, hkv * draw(st.integers(0, 3)), D).to(dtype)
        args = [q, k, v, table, lens, 0.125]
    elif op == "mla_decode_partial":
        lat, rope = draw(st.sampled_from([0, 16, 128, 256])), draw(st.sampled_from([0, 16, 64]))
        kv, table, lens, T = _paged(draw, (lat + rope,), dtype)
        H = draw(st.integers(0, 3))
        absorb = draw(st.booleans())
        q_nope = torch.randn(T, H, 8 if absorb else lat).to(dtype)
        w_uk = torch.randn(H, 8, lat).to(dtype) if absorb else None
        args = [q_nope, torch.randn(T, H, rope).to(dtype), kv, table, lens, 0.1, w_uk, None]
    elif op in ("merge_partials", "correct_partial"):
        N, T, H, D = (draw(st.integers(0, 3)) for _ in range(4))
        outs, lses = torch.randn(N, T, H, D).to(dtype), torch.randn(N, T, H)
        args = ([outs, lses, math.e, draw(st.sampled_from(["empty", "propagate"]))] if op == "merge_partials" else
                [outs[0].clone() if N else torch.randn(T, H, D).to(dtype), lses, draw(st.integers(-1, 3)), math.e,
                 "propagate"])
    elif op == "pack_exchange":
        N, T, hl, D = draw(st.integers(0, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 2)), draw(st.integers(0, 9))
        pad = 16 // torch.empty((), dtype=dtype).element_size()
        args = [torch.randn(T, N * hl, D).to(dtype), torch.randn(T, N * hl),
                torch.empty(N, T, hl, D + pad, dtype=dtype)]
    elif op == "merge_exchange":
        N, T, hl, D = draw(st.integers(0, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 2)), draw(st.integers(0, 9))
        pad = 16 // torch.empty((), dtype=dtype).element_size()
        args = [torch.randn(N, T, hl, D + pad).to(dtype), torch.empty(T, hl, D, dtype=dtype), torch.empty(T, hl),
                "propagate"]
    else:
        nb, bs, T = draw(st.integers(0, 3)), draw(st.integers(1, 4)), draw(st.integers(0, 5))
        args = [torch.zeros(nb, bs, 3, dtype=dtype), torch.randn(T, 3).to(dtype),
                torch.randint(-1, max(nb * bs, 1), (T,), dtype=I32)]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    i = draw(st.sampled_from(tensors))
    a = args[i]
    if mut == "zero_dim" and a.dim():
        shape = list(a.shape)
        shape[draw(st.integers(0, a.dim() - 1))] = 0
        args[i] = a.new_zeros(shape) if a.dtype in (I32, torch.int64) else torch.randn(shape).to(a.dtype)
    elif mut == "dtype":
        args[i] = a.to(draw(st.sampled_from([torch.float64, torch.int64, I32, torch.bfloat16, torch.uint8])))
    elif mut == "nonfinite" and a.is_floating_point() and a.numel():
        args[i] = a.clone()
        args[i].view(-1)[draw(st.integers(0, a.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    elif mut == "index" and a.dtype == I32 and a.numel():
        args[i] = a.clone()
        args[i].view(-1)[draw(st.integers(0, a.numel() - 1))] = draw(st.sampled_from([-7, 2**31 - 1, 10**6]))
    elif mut == "scalar":
        floats = [j for j, x in enumerate(args) if isinstance(x, float)]
        if floats:
            args[draw(st.sampled_from(floats))] = draw(st.sampled_from(BAD_SCALARS))
    elif mut == "stride" and a.dim() >= 2 and a.shape[-1] > 1:
        args[i] = a.transpose(-1, -2) if draw(st.booleans()) else a[..., ::2]
    elif mut == "alias" and a.dim() and a.shape[0] > 1:  # an expanded view: stride 0 over dim 0
        args[i] = a[:1].expand_as(a)
    elif mut == "rank" and op == "correct_partial":
        args[2] = draw(st.sampled_from([-5, 10**9]))
    kwargs = {}
    if op.endswith("decode_partial") and draw(st.booleans()):  # an fp8 cache (or not) and scales: valid, or refused
        caches = [1, 2] if op == "gqa_decode_partial" else [2]
        if draw(st.booleans()):
            for j in caches:
                if args[j].is_floating_point():
                    args[j] = args[j].float().to(torch.float8_e4m3fn)
        for name in (["k_scale", "v_scale"] if op == "gqa_decode_partial" else ["kv_scale"]):
            kwargs[name] = draw(st.sampled_from(SCALES))()
    if op.endswith("decode_partial"):  # the keyword arguments: valid, refused, or inconsistent with the batch
        if draw(st.booleans()):
            kwargs["precision"] = draw(st.sampled_from(["native", "fp32", "bf16", ""]))
        if draw(st.booleans()):
            B = args[3].shape[0] if args[3].dim() else 0
            cu = torch.randint(-2, 5, (draw(st.integers(0, B + 2)),)).cumsum(0)  # often not [0 .. T], B + 1 long
            kwargs["cu_seqlens_q"] = cu.to(draw(st.sampled_from([I32, torch.int64])))
    return (backend, op, tuple(args), kwargs)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_malformed_inputs_never_crash_or_hang(child, case):
    backend, op, args, kwargs = case
    kind, msg = child.run(case)
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
    assert not kind.startswith(("crash", "hang")), f"{backend}.{op}{shapes} {kwargs}: {kind}"
    if kind != "ok":
        assert kind in ("ValueError", "TypeError", "RuntimeError", "IndexError"), f"{op}{shapes}: {kind}: {msg}"
        assert op in msg, f"{backend}.{op}{shapes}: the refusal does not name the op: {kind}: {msg}"


def test_the_harness_reports_a_crash_as_that_case(child):
    assert child.run(("selftest", "abort", (), {}))[0].startswith("crash")
    assert child.run(("dcp_ops", "merge_partials", (torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1)), {}))[0] == "ok"
