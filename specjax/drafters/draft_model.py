"""A separate (smaller) Llama-family model that drafts K tokens autoregressively with its own KV cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import Draft
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward, init_cache
from specjax.models.weights import build_params
from specjax.sampling import Sampler
from specjax.trees import Tree


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Drafts with `sampler` (pass the target's, so p and q are warped alike); greedy drafts are
    deterministic proposals (`q_probs=None`)."""

    cfg: LlamaConfig
    graphdef: object
    k: int
    sampler: Sampler = Sampler()
    tree: Tree | None = None  # propose this static tree (top-k children per node) instead of a chain

    def __post_init__(self):
        if self.tree is not None and self.k != self.tree.depth:
            raise ValueError(f"k={self.k} must equal the tree's depth {self.tree.depth}")

    def validate(self, target_cfg: LlamaConfig) -> None:
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"draft model vocabulary ({self.cfg.vocab_size}) differs from the target's "
                             f"({target_cfg.vocab_size}): the drafter must share the target's tokenizer")

    def init(self, params, tokens_BP, lengths_B, cache_size: int):
        batch, width = tokens_BP.shape
        positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
        _, _, cache = forward(self.graphdef, params, tokens_BP, positions, init_cache(self.cfg, batch, cache_size),
                              causal_mask(width))
        return cache.with_length(lengths_B)

    def propose(self, params, cache, seq_BS, n_tokens_B, key):
        # The cache holds every token before the pending one, except after a fully accepted round,
        # when the last draft token was never fed: then re-read the last two tokens in one step.
        pending = n_tokens_B - 1
        stale = jnp.any(jnp.minimum(cache.length, pending) < pending)

        def feed(t):
            start = n_tokens_B - t
            positions = start[:, None] + jnp.arange(t)[None]
            tokens = jnp.take_along_axis(seq_BS, positions, axis=1)
            logits, _, new = forward(self.graphdef, params, tokens, positions, cache.with_length(start), causal_mask(t))
            return logits[:, -1], new.with_length(n_tokens_B)

        logits, cache = jax.lax.cond(stale, lambda: feed(2), lambda: feed(1))
        if self.tree is not None:
            return self._propose_tree(params, cache, logits, n_tokens_B, key)
        keys = jax.random.split(key, self.k)
        first = self.sampler.sample(keys[0], logits)

        def step(carry, key):  # one more draft token: feed the last one, sample the next
            token, cache = carry
            logits, _, cache = forward(self.graphdef, params, token[:, None], cache.length[:, None], cache,
                                       causal_mask(1))
            nxt = self.sampler.sample(key, logits[:, 0])
            return (nxt, cache.advance(1)), (nxt, None if self.sampler.greedy else logits[:, 0])

        (_, cache), (rest, rest_logits) = jax.lax.scan(step, (first, cache), keys[1:])
        tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
        if self.sampler.greedy:
            return Draft(tokens), cache
        scores = jnp.concatenate([logits[:, None], rest_logits.swapaxes(0, 1)], axis=1)
        return Draft(tokens, self.sampler.probs(scores)), cache

    def _propose_tree(self, params, cache, root_logits_BV, n_tokens_B, key):
        """Level by level: each node's children are its top-k draft tokens (sampled without replacement
        by Gumbel top-k when sampling); the nodes of a level are fed together under the tree mask."""
        arr, batch = self.tree.arrays, root_logits_BV.shape[0]
        tokens = jnp.zeros((batch, self.tree.size), jnp.int32)
        q = None if self.sampler.greedy else jnp.zeros((batch, self.tree.size, root_logits_BV.shape[-1]))
        level_logits = root_logits_BV[:, None]  # [B, nodes of the previous level, V]
        for d, sub in zip(range(1, self.tree.depth + 1), jax.random.split(key, self.tree.depth)):
            nodes, prev = arr.levels[d], arr.levels[d - 1]
            slot = {int(n): i for i, n in enumerate(prev)}
            parent_slot = np.array([slot[int(arr.parent[n])] for n in nodes])
            scores = self.sampler.warp(level_logits)
            if not self.sampler.greedy:
                scores = scores + jax.random.gumbel(sub, scores.shape)
            width = int(arr.rank[nodes].max()) + 1
            candidates = jax.lax.top_k(scores, width)[1]  # [B, prev, width]
            tokens = tokens.at[:, nodes].set(candidates[:, parent_slot, arr.rank[nodes]].astype(jnp.int32))
            if q is not None:
                q = q.at[:, nodes].set(self.sampler.probs(level_logits)[:, parent_slot])
            if d < self.tree.depth:  # feed this level: it sees the committed cache and its ancestors
                window = int(nodes[-1])  # nodes 1..window are written after the committed root
                positions = n_tokens_B[:, None] - 1 + jnp.asarray(arr.depth[nodes])[None]
                level_logits, _, cache = forward(self.graphdef, params, tokens[:, nodes], positions, cache,
                                                 jnp.asarray(arr.mask[nodes][:, 1: window + 1]))
        q = None if q is None else q[:, 1:]
        return Draft(tokens[:, 1:], q, self.tree, without_replacement=q is not None), cache

    def commit(self, params, cache, n_accepted_B, n_tokens_B, path_BD):
        if path_BD is None:
            return cache  # a chain: `propose` keeps what is still valid of the sequence it is given
        # keep the accepted path (nodes at the last depth were never fed: they stay stale)
        return cache.compact(path_BD - 1, jnp.minimum(n_accepted_B, self.tree.depth - 1))


def truncated_target(cfg: LlamaConfig, params, n_layers: int):
    """(cfg, graphdef, params) of the target's first `n_layers` blocks with its embedding, final norm and
    head: a draft model that needs no training."""
    if not 1 <= n_layers <= cfg.n_layers:
        raise ValueError(f"a truncated draft needs 1..{cfg.n_layers} layers, got {n_layers}")
    pure = nnx.to_pure_dict(params)
    pure["layers"] = {i: pure["layers"][i] for i in range(n_layers)}
    small = cfg.replace(n_layers=n_layers)
    return (small, *build_params(small, pure))
