"""Greedy verification: keep the longest draft prefix equal to the target's argmax, then the target's token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import argmax


def first_rejection(accept_BK: jax.Array) -> jax.Array:
    """Number of leading True entries per row."""
    return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=-1), axis=-1)


@jax.jit
def greedy_chain(draft_BK: jax.Array, target_logits_BKV: jax.Array):
    """Longest prefix where the draft equals the target's argmax, then the target's own token.

    `target_logits_BKV` has K+1 positions: position i scores the token after draft token i-1.
    """
    target = argmax(target_logits_BKV)  # [B, K+1]
    n = first_rejection(draft_BK == target[:, :-1])
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


@jax.jit
def greedy_tree(layout, draft_BN: jax.Array, target_logits_BNV: jax.Array):
    """Deepest node whose every token equals the target's argmax at its parent, then the target's token.

    `layout` is a `specjax.drafting.layouts.TreeLayout`. Returns (n_accepted [B], next_token [B],
    path [B, D]: accepted node indices by depth, 0 padded)."""
    target = argmax(target_logits_BNV)  # [B, N+1]
    parent_target = jnp.take_along_axis(target, layout.parent, axis=1)
    ok = jnp.concatenate([jnp.ones_like(draft_BN[:, :1], bool), draft_BN == parent_target[:, 1:]], axis=1)
    for _ in range(layout.ancestors.shape[-1]):  # a node is kept only if its whole path matches
        ok = ok & jnp.take_along_axis(ok, layout.parent, axis=1)
    n_nodes = ok.shape[1]
    rank = layout.depth * n_nodes + (n_nodes - 1 - jnp.arange(n_nodes))  # deepest, then first
    best = jnp.argmax(jnp.where(ok, rank, -1), axis=1)
    rows = jnp.arange(draft_BN.shape[0])
    return layout.depth[rows, best], target[rows, best], layout.ancestors[rows, best]
