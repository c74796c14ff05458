"""The drafter protocol: every draft source (draft model, Medusa, EAGLE, n-grams, ...) implements it.

A drafter is a frozen, hashable object (a static argument of the compiled loop) holding its static
settings; its arrays live in `params` (weights) and `state` (its own cache, tables, ...), which the
loop carries. Each round the loop calls `propose`, verifies the draft with one target pass, and
tells the drafter what happened with `commit`.
"""

from __future__ import annotations

from typing import Protocol

import jax
from flax import struct


@struct.dataclass
class Draft:
    """A chain (`layout=None`: token i follows token i-1) or a tree (`tokens[:, j - 1]` is node j of `layout`)."""

    tokens: jax.Array  # [B, K] (chain) or [B, N] (tree nodes) int32
    q_probs: jax.Array | None = (
        None  # [B, K|N, V] warped distribution each token was drawn from; None: deterministic
    )
    layout: object = None  # specjax.trees.TreeLayout for a tree
    without_replacement: bool = struct.field(
        pytree_node=False, default=False
    )  # siblings drawn without replacement


class Drafter(Protocol):
    k: int  # most draft tokens one round can accept: chain length or tree depth (static)
    tree: object  # the tree it proposes (`specjax.trees.Tree` or `DynamicTree`), or None for a chain

    def validate(self, target_cfg) -> None:
        """Raises a clear error if this drafter cannot serve `target_cfg` (e.g. vocabulary mismatch)."""

    def init(
        self, params, tokens_BP: jax.Array, lengths_B: jax.Array, cache_size: int, feats_BPH: jax.Array
    ):
        """Drafter state after reading the (right-padded) prompts; `feats_BPH` are the target's features
        (final hidden states, what its LM head reads) at the prompt tokens."""

    def propose(self, params, state, seq_BS: jax.Array, n_tokens_B: jax.Array, key: jax.Array):
        """(Draft, state): K tokens continuing `seq_BS[b, :n_tokens_B[b]]` (its last token is pending)."""

    def commit(
        self,
        params,
        state,
        n_accepted_B: jax.Array,
        n_tokens_B: jax.Array,
        path_BD: jax.Array | None,
        feats_BDH: jax.Array,
    ):
        """State after verification: `n_accepted_B` draft tokens were kept (tree nodes `path_BD`, by depth;
        None for a chain) and the sequence now has `n_tokens_B` tokens (the last one pending).
        `feats_BDH[:, j]` is the target's feature at the round's pending token (j = 0), then at the
        j-th accepted draft token: the last valid one (j = n_accepted) predicted the new pending token."""
