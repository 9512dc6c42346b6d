"""The canary's comparison: a provider's output on the warm-up input against the CPU's, within a
tolerance per dtype (docs/adapters.md, "Correctness canary"). ``session.canary`` runs both."""

from __future__ import annotations

from typing import Any

import numpy as np

from ortq.errors import CanaryMismatch


def _tolerance(dtype: np.dtype[Any]) -> tuple[float, float] | None:
    """(rtol, atol relative to the output's scale) for comparing a GPU's output with the CPU's;
    None for exact comparison. Loose enough for TF32 and fused kernels, tight enough that an
    all-zero or garbage output fails."""
    if dtype == np.float16:
        return 5e-2, 1e-2
    if dtype == np.float32:
        return 1e-2, 1e-3
    if dtype == np.float64:
        return 1e-6, 1e-8
    return None


def compare_with_cpu(got: dict[str, np.ndarray], reference: dict[str, np.ndarray], provider: str) -> float:
    """Raise CanaryMismatch unless every output matches the CPU's within its dtype's tolerance;
    returns the largest absolute difference."""
    worst = 0.0
    for name, expected in reference.items():
        actual = np.asarray(got[name])
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise CanaryMismatch(
                f"output {name!r}: {actual.dtype}{list(actual.shape)} on {provider}, "
                f"{expected.dtype}{list(expected.shape)} on the CPU"
            )
        if expected.size:
            difference = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
            worst = max(worst, float(np.nanmax(difference)) if not np.isnan(difference).all() else 0.0)
        tolerance = _tolerance(expected.dtype)
        if tolerance is None:
            ok = bool(np.array_equal(actual, expected))
        else:
            rtol, atol = tolerance
            scale = max(1.0, float(np.nanmax(np.abs(expected)))) if expected.size else 1.0
            ok = bool(np.allclose(actual, expected, rtol=rtol, atol=atol * scale, equal_nan=True))
        if not ok:
            raise CanaryMismatch(
                f"output {name!r} on {provider} differs from the CPU's on the warm-up input "
                f"(max abs difference {worst:.3g}); refusing to serve wrong answers. "
                "Check the GPU driver; --skip-canary turns this check off"
            )
    return worst
