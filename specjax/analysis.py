"""Analytical model of speculative decoding (Leviathan et al. 2023, section 3), for the experiments.

a: acceptance rate per draft token (i.i.d. model); c: cost of one draft step / one target step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


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
