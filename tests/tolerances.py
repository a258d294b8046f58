"""The one tolerance table for every comparison with the float64 reference (dcp_ops/reference.py).

fp32: 1e-5 relative (docs/design.md §7). bf16: rtol 2^-8, the largest relative error of rounding the exact result to
bf16 (half its machine epsilon), so a kernel must round an accurate fp32 result once. fp16: rtol 2^-10, twice
fp16's largest rounding error (its machine epsilon). For results near 0 each adds an atol that scales with the
reference output's magnitude: 1/16 of rtol times the largest |expected| (ATOL_OF_MAX; fp32 arithmetic on terms of
that size errs far less), not a fixed one that would dominate rtol for every result below some size. Every
same-precision computation rounds at least once, so both are at least as strict as "within 2x of a same-precision
torch computation". LSE is fp32 arithmetic in every case: 1e-5 absolute. These rows are the bound of fp32 caches
and of precision="fp32".

precision="native" on 16-bit caches (assert_native): the worst error at most 2x that of the same-precision reference
(reference.py's round_to: the absorbed query and P rounded to the cache's type, the output rounded once), plus
NATIVE_ATOL; the LSE's worst error at most 2x that reference's LSE error + 1e-5.
"""
import torch

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2.0 ** -8),
    torch.float16: dict(rtol=2.0 ** -10),
}
ATOL_OF_MAX = 1 / 16  # a 16-bit row's atol: this times its rtol times max |expected|
LSE_TOL = dict(rtol=1e-6, atol=1e-5)
NATIVE_ATOL = 1e-5


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """actual (any dtype) against the float64 expected, with the table's bounds for `dtype`; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=False, msg=lambda m: f"{what}: {m}",
                               **tol_for(dtype, expected))


def tol_for(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """The table's (rtol, atol) for results of `dtype` against `expected`: a 16-bit row's atol from expected's
    largest finite magnitude."""
    tol = dict(TOL[dtype])
    if "atol" not in tol:
        finite = expected[torch.isfinite(expected)]
        top = finite.abs().max().item() if finite.numel() else 0.0
        tol["atol"] = ATOL_OF_MAX * tol["rtol"] * top
    return tol


def assert_lse_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32, f"{what}: lse dtype {actual.dtype}, expected float32"
    torch.testing.assert_close(actual.double(), expected.double(), msg=lambda m: f"{what}: {m}", **LSE_TOL)


def assert_within_baseline(actual: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor, what: str) -> None:
    """For pipelines that round to bf16/fp16 more than once (partials, then the merge): the worst error against the
    float64 expected may be at most twice that of `baseline`, the same pipeline computed exactly and rounded at the
    same points (a same-precision computation, docs/design.md §7)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    base = (baseline.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= 2 * base + 1e-6, f"{what}: max error {err:.3g} exceeds 2x the same-precision baseline's {base:.3g}"


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & (a == b)  # -inf LSE of empty rows on both sides
    return torch.where(same_inf, torch.zeros_like(a), (a - b).abs()).max().item()


def assert_native(out: torch.Tensor, lse: torch.Tensor, exact, native, what: str) -> None:
    """precision="native": (out, lse) against the float64 exact (out, lse), bounded by the same-precision `native`
    reference's errors (docs/design.md §7). NaN never passes."""
    assert out.shape == exact[0].shape and lse.shape == exact[1].shape, f"{what}: shapes {out.shape}, {lse.shape}"
    assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}, expected float32"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN in the result"
    assert_native_bound(out, lse, exact, native, what)


def assert_native_bound(out: torch.Tensor, lse: torch.Tensor, exact, native, what: str) -> None:
    """assert_native's bound alone: the worst error of out at most 2x that of the same-precision `native` reference
    (plus NATIVE_ATOL), of lse at most 2x its (plus 1e-5); callers pick the elements (the finite ones, say)."""
    err, base = _max_err(out, exact[0]), _max_err(native[0], exact[0])
    assert err <= 2 * base + NATIVE_ATOL, f"{what}: max error {err:.3g} exceeds 2x the native reference's {base:.3g}"
    lerr, lbase = _max_err(lse, exact[1]), _max_err(native[1], exact[1])
    assert lerr <= 2 * lbase + 1e-5, f"{what}: LSE max error {lerr:.3g} exceeds 2x the native reference's {lbase:.3g}"


def assert_decode(out: torch.Tensor, lse: torch.Tensor, ref_fn, args, dtype: torch.dtype, precision: str, what: str,
                  **kwargs) -> None:
    """A decode op's (out, lse) computed with `precision` against reference.`ref_fn`(*args, **kwargs): the fp32 rows
    of the table for fp32 caches and precision="fp32", assert_native's bound for "native" on 16-bit caches."""
    exact = ref_fn(*args, **kwargs)
    if precision == "fp32" or dtype == torch.float32:
        assert_matches(out, exact[0], dtype, f"{what}: out ({precision})")
        assert_lse_matches(lse, exact[1], f"{what}: lse ({precision})")
    else:
        assert_native(out, lse, exact, ref_fn(*args, round_to=dtype, **kwargs), f"{what} (native)")
