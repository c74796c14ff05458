"""Token-wise speculative (rejection) sampling for chains and trees, and `TokenWise`, the default rule.

Each function returns per-row `(n_accepted[B], next_token[B])` (trees also the accepted path): the first
`n_accepted` draft tokens are kept and `next_token` follows them (the target's correction at the first
rejection, or the bonus token when all are accepted). The first rejection is found with a cumulative product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.acceptance.base import register
from specjax.acceptance.greedy import first_rejection, greedy_chain, greedy_tree
from specjax.sampling import inverse_cdf


@jax.jit
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
    u = jax.random.uniform(key, (b, k + 1))  # K acceptance tests, then the resample: one PRNG call
    accept = u[:, :k] < acceptance_probs(draft_BK, q_BKV, p_BKV)
    n = first_rejection(accept)
    q = jax.nn.one_hot(draft_BK, p_BKV.shape[-1], dtype=p_BKV.dtype) if q_BKV is None else q_BKV
    q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_K = 0: the bonus token comes from p_K
    pick = lambda probs: jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]
    return n, inverse_cdf(residual(pick(p_BKV), pick(q)), u[:, k])


# --- trees ------------------------------------------------------------------------------------------


def sibling_step(p_BV, q_BV, x_B, without_replacement: bool):
    """One candidate x of the recursive rule: (accept probability, p after a rejection, q after a rejection).

    Accept with min(1, p(x) / q(x)) (0 if q(x) = 0: x could not have been drawn); on rejection
    p <- norm(max(0, p - q)) and, for candidates drawn without replacement, q <- q with x removed and
    renormalised (SpecInfer / recursive speculative decoding)."""
    p_x = jnp.take_along_axis(p_BV, x_B[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q_BV, x_B[:, None], axis=1)[:, 0]
    accept = jnp.where(q_x > 0, jnp.minimum(p_x / jnp.where(q_x > 0, q_x, 1.0), 1.0), 0.0)
    q_next = q_BV
    if without_replacement:
        q_rest = q_BV * (1.0 - jax.nn.one_hot(x_B, q_BV.shape[-1], dtype=q_BV.dtype))
        total = jnp.sum(q_rest, axis=-1, keepdims=True)
        q_next = jnp.where(total > 0, q_rest / jnp.where(total > 0, total, 1.0), q_rest)
    return accept, residual(p_BV, q_BV), q_next


def tree_sampling(key, layout, draft_BN, q_BNV, p_BNV, without_replacement: bool = False):
    """Lossless tree verification by recursive rejection sampling; the output is distributed as p.

    From the root, the children of the current node are tried in rank order with `sibling_step`; the
    first accepted child becomes the current node; if all are rejected (or it has none), the next
    token is drawn from the current (residual) p. `q_BNV[:, j - 1]` is the draft distribution node j
    was drawn from (None: deterministic candidates, each a point mass). p_BNV has N+1 nodes (root first).
    Returns (n_accepted [B], next_token [B], path [B, D])."""
    b, vocab = draft_BN.shape[0], p_BNV.shape[-1]
    depth, width = layout.ancestors.shape[-1], layout.children.shape[-1]
    rows = jnp.arange(b)
    node_tokens = jnp.concatenate([jnp.zeros_like(draft_BN[:, :1]), draft_BN], axis=1)
    node, walking = jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
    p, path = p_BNV[:, 0], []
    u = jax.random.uniform(key, (depth * width + 1, b))  # one per sibling test, then the final draw
    for d in range(depth):
        kids = layout.children[rows, node]  # [B, W]
        q = None if q_BNV is None else q_BNV[rows, jnp.maximum(kids[:, 0] - 1, 0)]  # shared by the siblings
        moved, chosen = jnp.zeros((b,), bool), node
        for w in range(width):
            child = kids[:, w]
            x = node_tokens[rows, jnp.maximum(child, 0)]
            q_x = jax.nn.one_hot(x, vocab, dtype=p.dtype) if q is None else q
            accept, p_rejected, q_rejected = sibling_step(p, q_x, x, without_replacement and q is not None)
            possible = jnp.take_along_axis(q_x, x[:, None], axis=1)[:, 0] > 0  # else skipped: never drawn
            tried = walking & ~moved & (child >= 0) & possible
            hit = tried & (u[d * width + w] < accept)
            p = jnp.where((tried & ~hit)[:, None], p_rejected, p)
            if q is not None:
                q = jnp.where((tried & ~hit)[:, None], q_rejected, q)
            chosen, moved = jnp.where(hit, child, chosen), moved | hit
        path.append(jnp.where(moved, chosen, 0))
        p = jnp.where(moved[:, None], p_BNV[rows, chosen], p)
        node, walking = chosen, walking & moved
    n = jnp.sum(jnp.stack(path, 1) > 0, axis=1)
    return n, inverse_cdf(p, u[-1]), jnp.stack(path, axis=1)


@register
@dataclasses.dataclass(frozen=True)
class TokenWise:
    """Lossless: greedy samplers keep the longest prefix equal to the target's argmax (`greedy`); sampled
    ones use rejection sampling, token by token along a chain, recursively over siblings in a tree."""

    name = "tokenwise"
    lossless = True

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        if sampler.greedy:
            return greedy_chain(draft_BK, logits_BKV)
        return self.sample_chain(key, draft_BK, q_BKV, sampler.probs(logits_BKV))

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement: bool):
        if sampler.greedy:
            return greedy_tree(layout, draft_BN, logits_BNV)
        return self.sample_tree(
            key, layout, draft_BN, q_BNV, sampler.probs(logits_BNV), without_replacement
        )

    # The sampled rules on warped probabilities; lossless rules that differ only there override these two.
    sample_chain = staticmethod(speculative_sampling)
    sample_tree = staticmethod(tree_sampling)
