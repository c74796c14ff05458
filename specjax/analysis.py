"""Analytical model of speculative decoding (Leviathan et al. 2023, section 3), for the experiments.

a: acceptance rate per draft token (i.i.d. model); c: cost of one draft step / one target step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.errors import UsageError


def expected_tokens_per_round(a: float, k: int) -> float:
    """E[tokens per round] = (1 - a^(K+1)) / (1 - a) (K + 1 when a = 1)."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def expected_tokens_by_position(alpha_K):
    """[K] E[tokens per round] drafting k = 1..K tokens, when draft position i is accepted with probability
    alpha[i] given all before it were: 1 + sum_{j<k} prod_{i<=j} alpha[i] (the formula above when alpha is
    constant). Traceable: the adaptive-K loop calls it on device."""
    return 1.0 + jnp.cumsum(jnp.cumprod(alpha_K))


def expected_speedup(a: float, k: int, c: float) -> float:
    """Expected wall-time improvement over AR: (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    return expected_tokens_per_round(a, k) / (k * c + 1)


def optimal_k(a: float, c: float, k_max: int = 64) -> int:
    """The K in 1..k_max maximising the expected speedup (Theorem 3.8's optimisation, by enumeration)."""
    ks = np.arange(1, k_max + 1)
    return int(ks[np.argmax([expected_speedup(a, int(k), c) for k in ks])])


# --- a batch: it runs until its slowest row has its tokens ---------------------------------------------------


def rounds_cdf(tokens_per_round, n: int) -> np.ndarray:
    """[n + 1] P(a row has emitted n tokens within r rounds), r = 0..n, when each round emits j tokens with
    probability `tokens_per_round[j]` (j = 1..K + 1; index 0 unused), independently across rounds: the distribution
    of the sum of r rounds, cut at n, one round at a time."""
    p = np.asarray(tokens_per_round, np.float64)
    p = p / p.sum()
    if p[0] > 0:
        raise UsageError(
            "a round emits at least one token: tokens_per_round[0] must be 0 (build it with `tokens_per_round`)"
        )
    if n <= 0:
        return np.ones(1)  # nothing to emit: done before any round
    below = np.zeros(n)  # P(r rounds emitted s tokens), s < n
    below[0] = 1.0
    cdf = np.zeros(n + 1)
    for r in range(1, n + 1):
        nxt = np.zeros(n)
        for j in range(1, len(p)):
            if p[j] > 0 and j < n:
                nxt[j:] += p[j] * below[: n - j]
        below = nxt
        cdf[r] = 1.0 - below.sum()
    return cdf


def expected_batch_rounds(tokens_per_round_rows, n: int) -> float:
    """E[rounds until every row of a batch has emitted n tokens] = sum over r of P(some row needs more than r), rows
    independent, each with its own distribution of tokens per round (`rounds_cdf`)."""
    cdfs = np.stack([rounds_cdf(p, n) for p in tokens_per_round_rows])
    return float(np.sum(1.0 - np.prod(cdfs, axis=0)))


def tokens_per_round(accepted_hist) -> np.ndarray:
    """[K + 2] the distribution of tokens a round emits (accepted drafts + 1) from a histogram of row-rounds by
    draft tokens accepted (`SpecStats.accepted_hist`)."""
    hist = np.asarray(accepted_hist, np.float64)
    return np.concatenate([[0.0], hist / hist.sum()])


def batch_speedup(tokens_per_round_rows, n: int, round_cost: float) -> float:
    """Expected decoding speedup over AR of a batch whose rows each emit n tokens after the first: AR takes n steps;
    speculation takes `expected_batch_rounds` rounds, each costing `round_cost` AR steps at that batch (draft
    calls x c + v, both measured at the batch's size)."""
    return n / (expected_batch_rounds(tokens_per_round_rows, n) * round_cost)
