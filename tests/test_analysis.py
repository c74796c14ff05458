"""The analytical model agrees with a direct simulation of i.i.d. acceptances."""

import numpy as np
import pytest
from tolerance import approx

from specjax.analysis import expected_speedup, expected_tokens_per_round, optimal_k


@pytest.mark.parametrize("a, k", [(0.0, 3), (0.6, 4), (0.9, 8), (1.0, 5)])
def test_expected_tokens_per_round_matches_simulation(a, k):
    rng = np.random.default_rng(0)
    accept = rng.random((200_000, k)) < a
    tokens = np.cumprod(accept, axis=1).sum(1) + 1
    # the simulated mean is within 5 standard errors (exact where every round is alike)
    standard_error = tokens.std() / np.sqrt(len(tokens))
    assert expected_tokens_per_round(a, k) == pytest.approx(tokens.mean(), abs=5 * standard_error)


def test_speedup_and_optimal_k():
    # float64, a closed form against a sum of 5 powers
    assert expected_speedup(0.8, 4, 0.0) == approx(sum(0.8**i for i in range(5)), dtype=np.float64, depth=5)
    assert expected_speedup(0.5, 3, 1.0) < 1  # a draft as slow as the target cannot pay
    for a, c in [(0.6, 0.05), (0.8, 0.1), (0.95, 0.02)]:
        k = optimal_k(a, c)
        best = expected_speedup(a, k, c)
        assert all(expected_speedup(a, j, c) <= best for j in range(1, 65))
        assert best > expected_speedup(a, k + 1, c) and (k == 1 or best > expected_speedup(a, k - 1, c))
