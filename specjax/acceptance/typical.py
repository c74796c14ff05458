"""Typical acceptance (Medusa-2, Cai et al. 2024), `TypicalLossy`: LOSSY, opt-in, labelled in its name.

A draft token x after a kept prefix is accepted when the target's (warped) probability of it exceeds
min(epsilon, delta * exp(-H(p))), H the entropy of the target's distribution there; the first failure ends the
prefix (cumulative product). The next token is the target's argmax at the end of the kept prefix, as in Medusa
(its first token of a round is the greedy token, unconditionally accepted), whether a draft token was rejected
there or all were accepted. The output is therefore NOT distributed as the target's: no sampled token ever
comes from the target, only draft tokens the target finds typical and the target's argmax. Its distance from
exact sampling is measured by `first_token_law` (exact, per round) and in `tests/test_verification.py`
(exact enumeration on small vocabularies).

Greedy samplers: p is a point mass on the argmax, so only argmax tokens pass and the output is greedy
decoding's; such samplers use greedy matching directly. Thresholds that only argmax tokens can pass (a threshold
of at least 1/2: epsilon >= 1/2 and delta >= V/2, since exp(-H) >= 1/V) give greedy decoding's tokens at any
temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.acceptance.base import register
from specjax.acceptance.greedy import first_rejection, greedy_chain, greedy_tree
from specjax.errors import SamplingError
from specjax.sampling import argmax


def entropy(p_xV: jax.Array) -> jax.Array:
    """Shannon entropy in nats over the last axis (0 log 0 = 0)."""
    return -jnp.sum(jnp.where(p_xV > 0, p_xV * jnp.log(jnp.where(p_xV > 0, p_xV, 1.0)), 0.0), axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class TypicalLossy:
    """Lossy typical acceptance; `epsilon` (hard threshold) and `delta` (entropy-scaled threshold) default to
    Medusa's `posterior_threshold=0.09` and `posterior_alpha=0.3`."""

    name = "typical_lossy"
    lossless = False
    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self):
        if not (self.epsilon >= 0 and self.delta >= 0):
            raise SamplingError(
                f"typical acceptance needs epsilon >= 0 and delta >= 0, got {self.epsilon}, {self.delta}"
            )

    def threshold(self, p_xV: jax.Array) -> jax.Array:
        """min(epsilon, delta * exp(-H(p))) per distribution [...]."""
        return jnp.minimum(self.epsilon, self.delta * jnp.exp(-entropy(p_xV)))

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        del key, q_BKV  # deterministic given the draft; the draft distribution plays no part
        if sampler.greedy:
            return greedy_chain(draft_BK, logits_BKV)
        p = sampler.probs(logits_BKV)
        k = draft_BK.shape[1]
        p_x = jnp.take_along_axis(p[:, :k], draft_BK[..., None], axis=-1)[..., 0]
        n = first_rejection(p_x > self.threshold(p[:, :k]))
        return n, jnp.take_along_axis(argmax(logits_BKV), n[:, None], axis=1)[:, 0]

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement: bool):
        """The deepest node whose path passes the test at every step (first in sibling order among equals, as
        Medusa picks the first longest candidate), then the target's argmax there."""
        del key, q_BNV, without_replacement
        if sampler.greedy:
            return greedy_tree(layout, draft_BN, logits_BNV)
        p = sampler.probs(logits_BNV)  # [B, N + 1, V]
        rows = jnp.arange(draft_BN.shape[0])[:, None]
        tokens = jnp.pad(draft_BN, ((0, 0), (1, 0)))
        p_x = p[rows, layout.parent, tokens]  # each node's token under its parent's distribution
        ok = p_x > self.threshold(p)[rows, layout.parent]
        ok = ok.at[:, 0].set(True)
        for _ in range(layout.ancestors.shape[-1]):  # a node is kept only if its whole path passes
            ok = ok & jnp.take_along_axis(ok, layout.parent, axis=1)
        n_nodes = ok.shape[1]
        rank = layout.depth * n_nodes + (n_nodes - 1 - jnp.arange(n_nodes))  # deepest, then first
        best = jnp.argmax(jnp.where(ok, rank, -1), axis=1)
        rows = rows[:, 0]
        return layout.depth[rows, best], argmax(logits_BNV)[rows, best], layout.ancestors[rows, best]

    def first_token_law(self, sampler, q_BV: jax.Array, logits_BV: jax.Array) -> jax.Array:
        """The exact distribution [B, V] of a round's first emitted token when the first draft token is drawn
        from `q_BV` (a point mass for a deterministic draft) and the target's logits there are `logits_BV`:
        the draft token if it passes, else the target's argmax. Its total-variation distance from
        `sampler.probs(logits_BV)` is this rule's per-round error (0 for a lossless rule)."""
        if sampler.greedy:
            return sampler.probs(logits_BV)
        p = sampler.probs(logits_BV)
        passed = q_BV * (p > self.threshold(p)[:, None])
        top = jax.nn.one_hot(argmax(logits_BV), p.shape[-1], dtype=p.dtype)
        return passed + (1.0 - jnp.sum(passed, axis=-1, keepdims=True)) * top
