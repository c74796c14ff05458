"""The drafter protocol: every draft source (draft model, Medusa, EAGLE, n-grams, ...) implements it.

A drafter is a frozen, hashable object (a static argument of the compiled loop) holding its static
settings; its arrays live in `params` (weights) and `state` (its own cache, tables, ...), which the
loop carries. Each round the loop calls `propose`, verifies the draft with one target pass, and
tells the drafter what happened with `commit`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
from flax import nnx

from specjax.drafting.trees import Chain
from specjax.errors import DrafterError


class Drafter(Protocol):
    """What the speculative loop reads of a drafter: its `shape` (a `specjax.drafting.trees` Chain, Tree or
    DynamicTree: depth K, node count, cache slots one round writes) and the four methods below."""

    @property
    def shape(self): ...

    def validate(self, target_cfg) -> None:
        """Raises a clear error if this drafter cannot serve `target_cfg` (e.g. vocabulary mismatch)."""

    def init(
        self, params, tokens_BP: jax.Array, lengths_B: jax.Array, cache_size: int, feats_BPH: jax.Array
    ):
        """Drafter state after reading the (right-padded) prompts; `feats_BPH` are the target's features
        (final hidden states, what its LM head reads) at the prompt tokens."""

    def propose(self, params, state, seq_BS: jax.Array, n_tokens_B: jax.Array, key: jax.Array):
        """(`specjax.drafting.layouts.Draft`, state): a draft continuing `seq_BS[b, :n_tokens_B[b]]` (its last token
        is pending, not yet in the target's cache)."""

    def commit(self, params, state, n_accepted_B: jax.Array, n_tokens_B: jax.Array, path_BD, feats_BDH):
        """State after verification: `n_accepted_B` draft tokens were kept (nodes `path_BD`, by depth; a
        chain's node i is its token i - 1) and the sequence now has `n_tokens_B` tokens (the last pending).
        `feats_BDH[:, j]` is the target's feature at the round's pending token (j = 0), then at the
        j-th accepted draft token: the last valid one (j = n_accepted) predicted the new pending token.
        A drafter whose draft layout sets `Verification.feedback` (lookahead) receives it as the keyword
        argument `feedback`."""

    # Optional: `feature_taps`, a tuple of target layers: the features `init` and `commit` receive are then those
    # layers' outputs followed by the final features, concatenated (`specjax.models.llama.features`; EAGLE-3).
    # Optional: `reads_target_cache = True`: `propose` then also receives the target's KV cache (keyword
    # `target_cache`) and returns (draft, state, cache), the cache changed only beyond its committed length (slots
    # the verification pass overwrites); layer-skip drafting reads the target's keys/values so (`propose` below).
    # Optional: `absorb(params, sequences) -> params`, on the host between jobs: the params after learning from
    # finished sequences (token lists, prompt and output), same shapes (the suffix store); runs call it per batch.
    # Optional: `weights_key`, a class attribute: a drafter whose `graphdef` describes `params[weights_key]` (its own
    # weights beside the target's frozen arrays) rather than `params` itself (`laid_out` below).
    # Optional, for adaptive draft length (`specjax.decoding.adaptive`): `with_k(k)` -> this drafter drafting
    # chains of k tokens, able to take over the state of the drafter built for the largest K (whose `init`
    # made it); `path_BD` and `feats_BDH` then come padded to that largest K, and the round before may have
    # accepted more tokens than this round drafts (EAGLE re-reads as many as the largest K's state holds).


class KOrTree:
    """Mixin of drafters configured with `k` (a chain's length) and an optional `tree` (whose depth is k)."""

    def __post_init__(self):
        if self.tree is not None and self.k != self.tree.depth:
            raise DrafterError(f"k={self.k} must equal the tree's depth {self.tree.depth}")

    @property
    def shape(self):
        return Chain(self.k) if self.tree is None else self.tree

    def with_k(self, k: int):
        """This drafter drafting chains of `k` tokens (adaptive K: one compiled round per K)."""
        return dataclasses.replace(self, k=k, tree=None)


def propose(drafter, params, state, seq_BS, n_tokens_B, key, target_cache):
    """(draft, drafter state, target cache): `drafter.propose`, handed the target's cache if it reads it."""
    if getattr(drafter, "reads_target_cache", False):
        return drafter.propose(params, state, seq_BS, n_tokens_B, key, target_cache=target_cache)
    return (*drafter.propose(params, state, seq_BS, n_tokens_B, key), target_cache)


def laid_out(drafter, params, layout):
    """(drafter, params) with the drafter's own weights laid out by `layout(graphdef, weights) -> (graphdef,
    weights)`, the same function (`specjax.models.llama.multi_row_layout`): the module of its `graphdef`, whose
    weights are `params` or `params[drafter.weights_key]`. Drafters without a `graphdef` come back as they are."""
    graphdef = getattr(drafter, "graphdef", None)
    if graphdef is None:
        return drafter, params
    key = getattr(drafter, "weights_key", None)
    graphdef, weights = layout(graphdef, params if key is None else params[key])
    return dataclasses.replace(drafter, graphdef=graphdef), weights if key is None else params | {
        key: weights
    }


def feature_taps(drafter) -> tuple[int, ...]:
    """The target layers whose outputs the drafter reads beside the final features (none: final features only)."""
    return tuple(getattr(drafter, "feature_taps", ()))


def target_io(target_cfg, target_params) -> dict:
    """The target's embedding and LM head, `{"embed": [V, H], "unembed": [V, H]}`: the frozen inputs of
    drafting heads."""
    pure = target_params if isinstance(target_params, dict) else nnx.to_pure_dict(target_params)
    embed = pure["embed"]["embedding"]
    return {"embed": embed, "unembed": embed if target_cfg.tie_embeddings else pure["lm_head"]["weight"]}


def target_signature(cfg) -> dict:
    """What a trained head depends on in its target: heads for a target with another signature are refused."""
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_dim": cfg.hidden_dim,
    }
