"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025), `Block`.

Token-wise rejection sampling decides each draft token on its own ratio p_i(x_i) / q_i(x_i); block verification
decides on the whole prefix. With p_0 = 1 and p_i = min(1, p_{i-1} p_i(x_i) / q_i(x_i)) (a path's acceptance
weight: a token the target likes more than the draft makes up for an earlier one it liked less), the residual
mass Z_{i+1} = sum_x max(p_i p_i(x) - q_i(x), 0) at the position after x_i, and

    h_i = Z_{i+1} / (Z_{i+1} + 1 - p_i)  (i < K; 1 when the denominator is 0),    h_K = p_K,

draw eta_i ~ U(0, 1) and keep tau = max{i : eta_i < h_i} (0 if none) draft tokens; the next token comes from
the target's p_K if tau = K, else from norm(max(p_tau p_tau(.) - q_tau(.), 0)). (Here p_i(.) and q_i(.) are the
target's and the drafter's warped distributions after i draft tokens; p_i without argument is the path weight.)
The output is distributed exactly as the target's (Theorem 1 of the paper; `tests/test_verification.py` checks it
by exact enumeration), and the expected number of accepted tokens is at least token-wise's (Theorem 2).

Deterministic drafts (`q_BKV=None`) are point masses, q_i = one_hot(x_i); for them block verification accepts as
much as token-wise verification in expectation (which already accepts a prefix with its target probability),
and gains only on sampled drafts. Greedy samplers keep the longest prefix equal to the target's argmax, as
token-wise verification does. Trees use traversal verification (`traversal.py`, Weng et al. 2025), which decides
whole paths bottom-up and reduces to block verification on a chain; the same rule is registered as "traversal".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.acceptance.base import register
from specjax.acceptance.rejection import TokenWise
from specjax.acceptance.traversal import traversal_verification
from specjax.sampling import inverse_cdf


def draft_probs(draft_BK: jax.Array, q_BKV: jax.Array | None, vocab: int, dtype) -> jax.Array:
    """The drafter's distributions [B, K, V]; a deterministic draft (None) is a point mass on each token."""
    return jax.nn.one_hot(draft_BK, vocab, dtype=dtype) if q_BKV is None else q_BKV


@jax.jit
def block_weights(draft_BK: jax.Array, q_BKV: jax.Array | None, p_BKV: jax.Array):
    """(h [B, K]: h_1..h_K, the probability of passing test i; path [B, K + 1]: p_0..p_K, the path weights)."""
    k = draft_BK.shape[1]
    q = draft_probs(draft_BK, q_BKV, p_BKV.shape[-1], p_BKV.dtype)
    p_x = jnp.take_along_axis(p_BKV[:, :k], draft_BK[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft_BK[..., None], axis=-1)[..., 0]
    ratio = p_x / jnp.maximum(q_x, jnp.finfo(q_x.dtype).tiny)
    path = [jnp.ones_like(ratio[:, 0])]
    for i in range(k):  # K is static and small: a clamped running product
        path.append(jnp.minimum(path[-1] * ratio[:, i], 1.0))
    path = jnp.stack(path, axis=1)  # [B, K + 1]
    mass = jnp.sum(jnp.maximum(path[:, 1:k, None] * p_BKV[:, 1:k] - q[:, 1:k], 0.0), axis=-1)  # Z_2..Z_K
    denom = mass + 1.0 - path[:, 1:k]
    h = jnp.where(denom > 0, mass / jnp.where(denom > 0, denom, 1.0), 1.0)
    return jnp.concatenate([h, path[:, k:]], axis=1), path


def block_residual(weight_B: jax.Array, p_BV: jax.Array, q_BV: jax.Array) -> jax.Array:
    """norm(max(weight p - q, 0)): the next token's distribution after tau accepted tokens (p where it is
    empty, which has probability 0)."""
    r = jnp.maximum(weight_B[:, None] * p_BV - q_BV, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_BV)


def block_outcome(eta_BK: jax.Array, draft_BK: jax.Array, q_BKV: jax.Array | None, p_BKV: jax.Array):
    """(tau [B], the next token's distribution [B, V]) for given uniforms `eta_BK`: the deterministic part of
    block verification, separate so that tests can enumerate it."""
    k = draft_BK.shape[1]
    # nothing drafted (adaptive K's K = 0 round, a plain round): no test, the next token from the target's p
    if k == 0:
        return jnp.zeros(draft_BK.shape[0], jnp.int32), p_BKV[:, 0]
    h, path = block_weights(draft_BK, q_BKV, p_BKV)
    tau = jnp.max(jnp.where(eta_BK < h, jnp.arange(1, k + 1), 0), axis=1).astype(jnp.int32)
    q = draft_probs(draft_BK, q_BKV, p_BKV.shape[-1], p_BKV.dtype)
    q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_K = 0: all accepted -> the target's p_K
    pick = lambda a: jnp.take_along_axis(a, tau.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]
    return tau, block_residual(pick(path), pick(p_BKV), pick(q))


def block_verification(key: jax.Array, draft_BK: jax.Array, q_BKV: jax.Array | None, p_BKV: jax.Array):
    """(n_accepted [B], next_token [B]) by block verification; `p_BKV` [B, K + 1, V] and `q_BKV` [B, K, V] are
    warped distributions (`q_BKV=None`: a deterministic draft). One PRNG call: K tests, then the draw."""
    b, k = draft_BK.shape
    u = jax.random.uniform(key, (b, k + 1))
    tau, probs = block_outcome(u[:, :k], draft_BK, q_BKV, p_BKV)
    return tau, inverse_cdf(probs, u[:, k])


@register
@dataclasses.dataclass(frozen=True)
class Block(TokenWise):
    """Lossless block verification for chains (Sun et al. 2025), traversal verification for trees (Weng et al.
    2025); greedy matching for greedy samplers."""

    name = "block"
    lossless = True
    sample_chain = staticmethod(block_verification)
    sample_tree = staticmethod(traversal_verification)


@register
@dataclasses.dataclass(frozen=True)
class Traversal(Block):
    """The same rule as "block" under the name of its tree paper: traversal verification (Weng et al. 2025) for
    trees, block verification (to which it reduces) for chains."""

    name = "traversal"
