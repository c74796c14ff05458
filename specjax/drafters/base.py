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
    tokens: jax.Array  # [B, K] int32 proposed tokens
    q_probs: jax.Array | None = None  # [B, K, V] warped draft distributions; None: deterministic proposal


class Drafter(Protocol):
    k: int  # draft tokens per round (static)

    def validate(self, target_cfg) -> None:
        """Raises a clear error if this drafter cannot serve `target_cfg` (e.g. vocabulary mismatch)."""

    def init(self, params, tokens_BP: jax.Array, lengths_B: jax.Array, cache_size: int):
        """Drafter state after reading the (right-padded) prompts."""

    def propose(self, params, state, seq_BS: jax.Array, n_tokens_B: jax.Array, key: jax.Array):
        """(Draft, state): K tokens continuing `seq_BS[b, :n_tokens_B[b]]` (its last token is pending)."""

    def commit(self, params, state, n_accepted_B: jax.Array, n_tokens_B: jax.Array):
        """State after verification: `n_accepted_B` draft tokens were kept and the sequence now has
        `n_tokens_B` tokens (the last one pending)."""
