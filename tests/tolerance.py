"""Float tolerances for the tests, derived from the dtype, the depth of the computation and the size of the values
compared; never tuned to one machine.

The same function computed in another order (another CPU's vector width, another backend's reduction tree, a
padded or re-laid-out matrix product) differs by rounding. Each rounding stage on the longest path from the inputs
to a value (a matrix product, a normalisation, a softmax, a residual add) adds a relative error of a few units of
the dtype's rounding, eps = finfo(dtype).eps, relative to the size of the values it combined. After `depth` stages:

    |actual - expected| <= rtol * |expected| + atol,   rtol = UNITS * eps * depth,   atol = rtol * scale

where scale is the magnitude of the values compared (by default max |expected|): an element near zero that comes
from cancelling values of size `scale` carries their absolute error, not a relative one, so the absolute part is
never below what the dtype resolves at that magnitude. The rule does not widen for reduced-precision matrix
products (TF32): float32 runs at full precision on every backend.

Statistical checks (sampling frequencies, chi-square) keep their statistical bounds; exact things (token ids,
greedy equality, bit-identical resumes) stay exact.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

UNITS = 4  # rounding units per stage: a fused or reordered operation rounds a few times, not once
LAYER_DEPTH = (
    10  # a decoder layer: 2 norms, 7 matrix products (q/k/v/scores/values/out, MLP), softmax, 2 adds
)


def forward_depth(n_layers: int) -> int:
    """Rounding stages of a decoder forward: `n_layers` layers, the embedding, final norm and LM head."""
    return LAYER_DEPTH * n_layers + 2


def eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def tolerance(dtype, depth: int = 1, magnitude: float = 1.0, units: int = UNITS) -> tuple[float, float]:
    """(rtol, atol) for values of this `magnitude` after `depth` rounding stages in `dtype`."""
    rtol = units * eps(dtype) * depth
    return rtol, rtol * magnitude


def _bounds(actual, expected, dtype, depth, magnitude, units):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if magnitude is None:  # the finite values' (infinities must match exactly); all zeros: exactly zero
        magnitude = float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0))
    rtol, atol = tolerance(dtype, depth, magnitude, units)
    return actual, expected, rtol, atol


def _used(actual, expected, rtol, atol) -> float:
    """The largest |actual - expected| as a multiple of the tolerance at that element (0 where both are exact)."""
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities
        err = np.where(actual == expected, 0.0, np.abs(actual - expected))
    bound = rtol * np.abs(expected) + atol
    return float(
        np.max(np.where(err > 0, err / np.maximum(bound, np.finfo(np.float64).tiny), 0.0), initial=0.0)
    )


def _log(actual, expected, rtol, atol):
    """With SPECJAX_TOLERANCE_LOG=file, appends the test and the fraction of its tolerance used (the margin on
    this machine)."""
    if path := os.environ.get("SPECJAX_TOLERANCE_LOG"):
        used = _used(actual, expected, rtol, atol)
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{used:.4f}\trtol={rtol:.3g}\tatol={atol:.3g}\n")


def assert_close(
    actual, expected, *, dtype, depth: int = 1, magnitude=None, units: int = UNITS, err_msg=""
):
    """`actual` equals `expected` to `depth` stages of `dtype` rounding at their magnitude (see the module)."""
    actual, expected, rtol, atol = _bounds(actual, expected, dtype, depth, magnitude, units)
    _log(actual, expected, rtol, atol)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def assert_far(actual, expected, *, dtype, depth: int = 1, magnitude=None, units: int = UNITS, factor=10):
    """A negative control: somewhere `actual` misses `expected` by more than `factor` times the tolerance that
    assert_close allows, so the positive check with the same settings would catch it with room to spare."""
    actual, expected, rtol, atol = _bounds(actual, expected, dtype, depth, magnitude, units)
    worst = _used(actual, expected, rtol, atol)
    assert worst > factor, f"the control differs by only {worst:.3g} x the tolerance (wanted > {factor})"


def approx(expected, *, dtype, depth: int = 1, magnitude=None, units: int = UNITS):
    """pytest.approx with this module's tolerance, for scalars (magnitude: |expected| unless stated)."""
    scale = magnitude if magnitude is not None else max(abs(float(e)) for e in np.ravel(expected))
    rtol, atol = tolerance(dtype, depth, scale, units)
    return pytest.approx(expected, rel=rtol, abs=atol)
