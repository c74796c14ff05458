"""Analytical model of speculative decoding (Leviathan et al. 2023, section 3), for the experiments.

a: acceptance rate per draft token (i.i.d. model); c: cost of one draft step / one target step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import UsageError


def expected_tokens_per_round(a: float, k: int) -> float:
    """E[tokens per round] = (1 - a^(K+1)) / (1 - a) (K + 1 when a = 1)."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def tokens_per_round_distributions(alpha_K):
    """[K, K + 2] P(a round drafting k tokens emits j tokens (accepted drafts + 1)), k = 1..K by row, j = 0..K + 1,
    position i accepted with probability alpha[i] given all before it were. Traceable."""
    k_max = alpha_K.shape[0]
    # P(at least i accepted), i = 0..K
    reach = jnp.concatenate([jnp.ones(1, alpha_K.dtype), jnp.cumprod(alpha_K)])
    j = jnp.arange(k_max + 2)[None]
    k = jnp.arange(1, k_max + 1)[:, None]
    at = lambda i: reach[jnp.clip(i, 0, k_max)]
    # j <= k tokens: j - 1 accepted and the next rejected; k + 1: all k accepted
    return jnp.where(j == 0, 0.0, jnp.where(j <= k, at(j - 1) - at(j), jnp.where(j == k + 1, at(k), 0.0)))


def expected_rounds_to_finish(tokens_J, remaining_B, points: int = 64):
    """E[rounds until every row has emitted its `remaining_B` tokens] (rows with none left count no more) when each
    round emits j tokens per row with probability `tokens_J[j]`, rows independent. Traceable: adaptive K scores
    each K by it inside the loop.

    Where no row has more than two rounds of the most tokens a round emits left, it is exact (the distribution of
    each row's tokens after r rounds, cut at that window: `rounds_cdf`'s recursion). Elsewhere each row's rounds are
    approximately normal (renewal theory: mean (m + overshoot) / mean, the last round's expected overshoot past m
    being (E[X^2] - mean) / (2 mean) on the integers; variance m var / mean^3), at least one while it has tokens left
    and at most m (a round emits at least one token); the expected maximum is integrated over `points` (static).
    The approximation averages over m and is up to half a round off where the rounds are nearly certain, which near
    a row's end decides between a long and a short draft."""
    window = 2 * (tokens_J.shape[0] - 1)
    exact = _rounds_near_the_end(tokens_J, remaining_B, window)
    return jnp.where(jnp.max(remaining_B) <= window, exact, _renewal_rounds(tokens_J, remaining_B, points))


def _rounds_near_the_end(tokens_J, remaining_B, window: int):
    """E[rounds until every row has its tokens], exact for rows with at most `window` tokens left: sum over r of
    P(some row is not done after r rounds), from the distribution of r rounds' tokens cut at `window`."""
    s = jnp.arange(window + 1)
    gap = s[None] - s[:, None]  # tokens a round moves the count from s to s'
    step = jnp.where(
        (gap >= 0) & (gap < tokens_J.shape[0]), tokens_J[jnp.clip(gap, 0, tokens_J.shape[0] - 1)], 0
    )
    # reaching the window absorbs: a count past it is done for every row the window describes
    step = step.at[:, window].set(1.0 - step[:, :window].sum(1))
    start = (s == 0).astype(tokens_J.dtype)
    after = lambda d, _: (jnp.matmul(d, step, precision=jax.lax.Precision.HIGHEST), d)  # float32 everywhere
    _, counts_RS = jax.lax.scan(after, start, length=window)  # rows r = 0..window - 1: r rounds' counts
    done_RM = jnp.cumsum(counts_RS[:, ::-1], 1)[:, ::-1]  # P(at least m tokens after r rounds)
    m = jnp.clip(remaining_B, 0, window).astype(jnp.int32)
    return jnp.sum(1.0 - jnp.prod(done_RM[:, m], axis=1))


def _renewal_rounds(tokens_J, remaining_B, points: int):
    """`expected_rounds_to_finish`'s normal approximation."""
    j = jnp.arange(tokens_J.shape[0], dtype=tokens_J.dtype)
    mean = jnp.dot(j, tokens_J)
    var = jnp.maximum(jnp.dot(j**2, tokens_J) - mean**2, 0.0)
    m = remaining_B.astype(jnp.float32)
    live = m > 0
    nu = (m + (var + mean**2 - mean) / (2 * mean)) / mean
    tau = jnp.sqrt(m * var / mean**3) + 1e-3  # > 0: a certain round count is a steep step
    top = jnp.max(jnp.where(live, nu + 6 * tau, 1.0)) + 1.0
    x = jnp.linspace(1.0, top, points)[:, None]
    normal = jax.scipy.stats.norm.cdf((x - nu[None]) / tau[None])
    done_by = jnp.where(live[None] & (x < m[None]), normal, 1.0)
    after_first = jnp.trapezoid(1.0 - jnp.prod(done_by, axis=1), x[:, 0])
    return jnp.where(live.any(), 1.0 + after_first, 0.0)


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


def expected_batch_rounds(tokens_per_round_rows, n) -> float:
    """E[rounds until every row of a batch has emitted its n tokens (one n for every row, or one per row)] = sum over
    r of P(some row needs more than r), rows independent, each with its own distribution of tokens per round
    (`rounds_cdf`)."""
    ns = [max(int(m), 0) for m in np.broadcast_to(n, (len(tokens_per_round_rows),))]
    top = max(ns, default=0)
    pad = lambda cdf: np.pad(cdf, (0, top + 1 - len(cdf)), constant_values=1.0)
    cdfs = np.stack([pad(rounds_cdf(p, m)) for p, m in zip(tokens_per_round_rows, ns)])
    return float(np.sum(1.0 - np.prod(cdfs, axis=0)))


def refill_schedule(rounds_N, slots: int) -> tuple[float, np.ndarray]:
    """(the loop's rounds, [N] the round that makes each request's last token) when `slots` slots take the requests
    in order (`specjax.decoding.refill`): the first `slots` start together, request i then needs rounds_N[i] rounds
    after its prefill's token (fractional: an expectation), and the slot that frees first (the lower one on a tie)
    takes the next request at once; a request that needs no round still holds its slot for one. Exact for integer
    rounds: the loop's own schedule."""
    free = np.zeros(min(slots, len(rounds_N)))  # when each slot can take its next request
    ends = np.zeros(len(rounds_N))
    for i, r in enumerate(rounds_N):
        b = int(np.argmin(free))
        ends[i] = free[b] + r
        free[b] += max(r, 1)
    return float(ends.max(initial=0.0)), ends


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
