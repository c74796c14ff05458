"""The tolerance rule of tests/tolerance.py: what it allows and what it still catches."""

import numpy as np
import pytest
from tolerance import approx, assert_close, assert_far, forward_depth, tolerance


def test_tolerance_scales_with_dtype_depth_and_magnitude():
    rtol, atol = tolerance(np.float32, depth=10, magnitude=3.0)
    assert rtol == pytest.approx(4 * 2.0**-23 * 10) and atol == pytest.approx(3 * rtol)
    assert tolerance(np.float64, 10, 3.0)[0] < rtol < tolerance("bfloat16", 10, 3.0)[0]


def test_another_cpus_rounding_passes_and_a_real_difference_fails():
    # features of stories260K's expansion (8 layers) as another CPU computed them: missed atol=1e-5 by 1.1e-5
    want, got = np.array([-2.1405151, 1.9]), np.array([-2.1405263, 1.9])
    assert_close(got, want, dtype=np.float32, depth=forward_depth(8))
    with pytest.raises(AssertionError):
        assert_close(got + 1e-3, want, dtype=np.float32, depth=forward_depth(8))
    assert_far(got + 1e-2, want, dtype=np.float32, depth=forward_depth(8))
    with pytest.raises(AssertionError, match="differs by only"):
        assert_far(got, want, dtype=np.float32, depth=forward_depth(8))
    assert approx(0.5, dtype=np.float32) == 0.5 + 1e-7 and approx(0.5, dtype=np.float32) != 0.5 + 1e-5
    assert_close(np.zeros(3), np.zeros(3), dtype=np.float32)  # all zero: exactly zero
    with pytest.raises(AssertionError):
        assert_close(np.full(3, 1e-30), np.zeros(3), dtype=np.float32)
