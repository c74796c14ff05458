"""The analytical model agrees with a direct simulation of i.i.d. acceptances, and the batch model with a simulation
of batches that run until their slowest row ends."""

import jax
import numpy as np
import pytest
from tolerance import approx

from specjax.analysis import (
    batch_speedup,
    expected_batch_rounds,
    expected_rounds_to_finish,
    expected_speedup,
    expected_tokens_per_round,
    optimal_k,
    rounds_cdf,
    tokens_per_round,
    tokens_per_round_distributions,
)
from specjax.errors import UsageError


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


def simulated_rounds(p, n: int, rows: int, trials: int, rng) -> np.ndarray:
    """[trials, rows] rounds each row needed to emit n tokens, rounds drawing j tokens with probability p[j]."""
    draws = rng.choice(
        len(p), size=(trials, rows, n), p=np.asarray(p) / np.sum(p)
    )  # n rounds always suffice
    return np.argmax(np.cumsum(draws, axis=2) >= n, axis=2) + 1


def test_rounds_until_a_row_ends_match_simulation():
    rng = np.random.default_rng(0)
    p = tokens_per_round([30, 20, 10, 5, 35])  # accepted 0..4 of K = 4
    n = 23
    rounds = simulated_rounds(p, n, 1, 100_000, rng)[:, 0]
    cdf = rounds_cdf(p, n)
    for r in (3, 5, 8, 12):
        empirical = np.mean(rounds <= r)
        assert cdf[r] == pytest.approx(
            empirical, abs=5 * np.sqrt(cdf[r] * (1 - cdf[r]) / len(rounds)) + 1e-9
        )
    assert cdf[0] == 0 and cdf[n] == 1 and np.all(np.diff(cdf) >= 0)
    assert (
        rounds_cdf(p, 0).tolist() == [1.0] and expected_batch_rounds([p, p], 0) == 0
    )  # one token: no round
    with pytest.raises(UsageError, match="a round emits at least one token"):
        rounds_cdf([0.5, 0.5], n)


def test_a_batch_runs_until_its_slowest_row_ends():
    rng = np.random.default_rng(1)
    fast, slow = tokens_per_round([10, 10, 10, 70]), tokens_per_round([60, 30, 5, 5])
    rows, n = [fast] * 5 + [slow] * 3, 31
    sim = np.concatenate(
        [simulated_rounds(fast, n, 5, 20_000, rng), simulated_rounds(slow, n, 3, 20_000, rng)], axis=1
    ).max(1)
    expected = expected_batch_rounds(rows, n)
    assert expected == pytest.approx(sim.mean(), abs=5 * sim.std() / np.sqrt(len(sim)))
    # the negative control: the fast rows' mean rounds (n / tau, the one-row model) miss the batch's by far
    one_row = n / np.dot(np.arange(len(fast)), fast)
    assert expected > 1.3 * one_row
    # one n per row (rows of a batch with different token budgets)
    sim = np.concatenate(
        [simulated_rounds(fast, n, 5, 20_000, rng), simulated_rounds(slow, 9, 3, 20_000, rng)], axis=1
    ).max(1)
    ragged = expected_batch_rounds(rows, [n] * 5 + [9] * 3)
    assert ragged == pytest.approx(sim.mean(), abs=5 * sim.std() / np.sqrt(len(sim))) and ragged < expected
    # rounds that always emit j tokens: ceil(n / j) whatever the batch
    assert expected_batch_rounds([tokens_per_round([0, 0, 1])] * 4, 10) == pytest.approx(4.0, abs=1e-12)
    assert batch_speedup([tokens_per_round([0, 0, 1])], 10, 1.25) == pytest.approx(
        10 / (4 * 1.25), abs=1e-12
    )


def exact_tokens_per_round(alpha):
    """[K + 2] P(a round drafting len(alpha) tokens emits j tokens), j = 0..K + 1, position i accepted with
    probability alpha[i] given all before it were."""
    k = len(alpha)
    reach = np.cumprod([1.0, *alpha])  # P(at least j accepted), j = 0..K
    return np.concatenate([[0.0], reach[:k] - reach[1:], reach[k:]])


# one program per alpha: every batch below padded to 16 rows with rows that have nothing left (they count no more)
ROUNDS = jax.jit(expected_rounds_to_finish)


@pytest.mark.parametrize(
    "alpha", [[0.8, 0.7, 0.6, 0.5], [0.95] * 8, [0.3, 0.3], [0.9, 0.9, 0.9], [1.0] * 7]
)
def test_round_distributions_and_the_rounds_a_batch_waits_for(alpha):
    """Adaptive K's on-device batch model: the distribution of a round's tokens is exact for every K; the expected
    rounds until every row has its tokens is exact where no row has more than two rounds of K + 1 tokens left, and
    within 5% of the exact batch model (a renewal approximation) for batches up to 16 whose rows have at least
    4 (K + 1) tokens left. (Where every draft is accepted the rounds are ceil(m / (K + 1)), and the approximation, an
    average over m, is up to half a round off: the reason for the exact window.)"""
    k_max = len(alpha)
    got_KJ = np.asarray(tokens_per_round_distributions(np.asarray(alpha, np.float32)))
    for k in range(1, k_max + 1):
        want = np.pad(exact_tokens_per_round(alpha[:k]), (0, k_max - k))
        assert got_KJ[k - 1] == approx(want, dtype=np.float32, depth=k_max + 1)
    p, tokens_J = exact_tokens_per_round(alpha), got_KJ[-1]
    u = k_max + 1  # the most tokens a round emits
    near_end = ([1, 1, 0], [u], [u + 1, 2, 0, 2 * u], [2 * u] * 16, [3, 2 * u - 1], [0, 0])
    far = ([4 * u], [8 * u] * 8, [16 * u] * 16, [4 * u, 6 * u, 8 * u, 10 * u])
    for left in near_end + far:
        rows = [m for m in left if m > 0]
        cdfs = [np.pad(rounds_cdf(p, m), (0, max(rows) - m), constant_values=1.0) for m in rows]
        exact = float(np.sum(1 - np.prod(cdfs, axis=0))) if rows else 0.0
        got = float(ROUNDS(tokens_J, np.pad(left, (0, 16 - len(left)))))
        if left in near_end:  # a sum over 2 u rounds of products over the rows of sums over 2 u counts
            assert got == approx(exact, dtype=np.float32, depth=4 * u + len(left), magnitude=2 * u), left
        else:  # where every draft is accepted, the half round the approximation averages over
            assert got == pytest.approx(exact, rel=0.05, abs=0.5 * (min(alpha) == 1)), (left, got, exact)
