"""The one tolerance table for every comparison with the float64 reference (dcp_ops/reference.py).

fp32: 1e-5 relative (DESIGN.md §7). bf16: rtol 2^-8, the largest relative error of rounding the exact result to
bf16 (half its machine epsilon), so a kernel must round an accurate fp32 result once. fp16: rtol 2^-10, twice
fp16's largest rounding error (its machine epsilon). Each adds a small atol for results near 0. Every
same-precision computation rounds at least once, so both are at least as strict as "within 2x of a same-precision
torch computation". LSE is fp32 arithmetic in every case: 1e-5 absolute.
"""
import torch

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2.0 ** -8, atol=1e-3),
    torch.float16: dict(rtol=2.0 ** -10, atol=1e-4),
}
LSE_TOL = dict(rtol=1e-6, atol=1e-5)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """actual (any dtype) against the float64 expected, with the table's bounds for `dtype`; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=False, msg=lambda m: f"{what}: {m}",
                               **TOL[dtype])


def assert_lse_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32, f"{what}: lse dtype {actual.dtype}, expected float32"
    torch.testing.assert_close(actual.double(), expected.double(), msg=lambda m: f"{what}: {m}", **LSE_TOL)


def assert_within_baseline(actual: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor, what: str) -> None:
    """For pipelines that round to bf16/fp16 more than once (partials, then the merge): the worst error against the
    float64 expected may be at most twice that of `baseline`, the same pipeline computed exactly and rounded at the
    same points (a same-precision computation, DESIGN.md §7)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    base = (baseline.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= 2 * base + 1e-6, f"{what}: max error {err:.3g} exceeds 2x the same-precision baseline's {base:.3g}"
