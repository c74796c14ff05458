"""Acceptance rules for a chain of K draft tokens, batched, static shapes, no host round trips.

Each rule returns per-row `(n_accepted[B], next_token[B])`: the first `n_accepted` draft tokens are
kept and `next_token` follows them (the target's correction at the first rejection, or the bonus
token when all K are accepted). The first rejection is found with a cumulative product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_rejection(accept_BK: jax.Array) -> jax.Array:
    """Number of leading True entries per row."""
    return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=-1), axis=-1)


def greedy_chain(draft_BK: jax.Array, target_logits_BKV: jax.Array):
    """Longest prefix where the draft equals the target's argmax, then the target's own token.

    `target_logits_BKV` has K+1 positions: position i scores the token after draft token i-1.
    """
    target = jnp.argmax(target_logits_BKV, axis=-1).astype(jnp.int32)  # [B, K+1]
    n = first_rejection(draft_BK == target[:, :-1])
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def acceptance_probs(draft_BK: jax.Array, q_BKV: jax.Array | None, p_BKV: jax.Array) -> jax.Array:
    """min(1, p_i(x_i) / q_i(x_i)) per draft position [B, K]; q=None is a point mass on the draft."""
    k = draft_BK.shape[1]
    p_x = jnp.take_along_axis(p_BKV[:, :k], draft_BK[..., None], axis=-1)[..., 0]
    if q_BKV is None:
        return jnp.minimum(p_x, 1.0)
    q_x = jnp.take_along_axis(q_BKV, draft_BK[..., None], axis=-1)[..., 0]
    return jnp.minimum(p_x / jnp.maximum(q_x, jnp.finfo(q_x.dtype).tiny), 1.0)


def residual(p_BV: jax.Array, q_BV: jax.Array) -> jax.Array:
    """norm(max(0, p - q)), the distribution to resample from after a rejection (p where it is empty)."""
    r = jnp.maximum(p_BV - q_BV, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_BV)


def speculative_sampling(key: jax.Array, draft_BK: jax.Array, q_BKV: jax.Array | None, p_BKV: jax.Array):
    """Leviathan et al. / Chen et al. rejection sampling over a chain; the output is distributed as p.

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection i,
    sample from norm(max(0, p_i - q_i)); if all K are accepted, sample the bonus token from p_K.
    `p_BKV` ([B, K+1, V]) and `q_BKV` ([B, K, V]) are the *warped* distributions; `q_BKV=None` marks
    a deterministic proposal (q is a point mass on each draft token).
    """
    b, k = draft_BK.shape
    key_accept, key_resample = jax.random.split(key)
    accept = jax.random.uniform(key_accept, (b, k)) < acceptance_probs(draft_BK, q_BKV, p_BKV)
    n = first_rejection(accept)
    q = jax.nn.one_hot(draft_BK, p_BKV.shape[-1], dtype=p_BKV.dtype) if q_BKV is None else q_BKV
    q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_K = 0: the bonus token comes from p_K
    pick = lambda probs: jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]
    resample = residual(pick(p_BKV), pick(q))
    return n, jax.random.categorical(key_resample, jnp.log(resample), axis=-1).astype(jnp.int32)
