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
from specjax.trees import DynamicTree, Tree, TreeLayout


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Drafts with `sampler` (pass the target's, so p and q are warped alike); greedy drafts are
    deterministic proposals (`q_probs=None`)."""

    cfg: LlamaConfig
    graphdef: object
    k: int
    sampler: Sampler = Sampler()
    tree: Tree | DynamicTree | None = None  # propose this tree (top-k children per node) instead of a chain

    def __post_init__(self):
        if self.tree is not None and self.k != self.tree.depth:
            raise ValueError(f"k={self.k} must equal the tree's depth {self.tree.depth}")

    @property
    def slack(self) -> int:
        """Cache slots written past the sequence in one round (by this drafter or the target's verification)."""
        if self.tree is None:
            return self.k + 1
        if isinstance(self.tree, DynamicTree):
            return max(self.tree.size, (self.tree.depth - 1) * self.tree.top_k + 1, self.tree.depth + 1)
        return self.tree.size

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
        if isinstance(self.tree, DynamicTree):
            return self._propose_dynamic(params, cache, seq_BS, n_tokens_B)
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
            scores = level_logits  # greedy: the top-k tokens, ranked
            if not self.sampler.greedy:  # sampled without replacement, in draw order (Gumbel top-k)
                scores = self.sampler.warp(level_logits) + jax.random.gumbel(sub, scores.shape)
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
        return Draft(tokens[:, 1:], q, TreeLayout.from_tree(self.tree, batch), q is not None), cache

    def _propose_dynamic(self, params, cache, seq_BS, n_tokens_B):
        """EAGLE-2-style: grow the `top_k` best frontier nodes by `top_k` children per level (cumulative
        draft log-probability), then keep the best `total_tokens` candidates. Candidates are the draft's
        deterministic top-k tokens (point-mass proposals, exact with any sampler)."""
        k, depth, n = self.tree.top_k, self.tree.depth, self.tree.total_tokens
        batch = seq_BS.shape[0]
        # Re-read the last depth + 1 tokens: covers the accepted path the cache has not seen (commit keeps nothing).
        start = jnp.maximum(n_tokens_B - (depth + 1), 0)
        positions = start[:, None] + jnp.arange(depth + 1)[None]
        window = jnp.take_along_axis(seq_BS, positions, axis=1)
        logits, _, cache = forward(self.graphdef, params, window, positions, cache.with_length(start),
                                   causal_mask(depth + 1))
        root = jnp.take_along_axis(logits, (n_tokens_B - 1 - start)[:, None, None], axis=1)[:, 0]
        cache = cache.with_length(n_tokens_B)

        score, token = jax.lax.top_k(jax.nn.log_softmax(root), k)  # depth-1 candidates [B, k]
        cand_token, cand_score, cand_parent = [token], [score], [jnp.full((batch, k), -1)]
        frontier_id, sees = jnp.broadcast_to(jnp.arange(k), (batch, k)), jnp.broadcast_to(jnp.eye(k, dtype=bool),
                                                                                           (batch, k, k))
        for d in range(2, depth + 1):  # feed the frontier (depth d - 1), expand its children
            logits, _, cache = forward(self.graphdef, params, token, (n_tokens_B[:, None] - 2 + d) + 0 * token,
                                       cache, sees)
            child_score, child_token = jax.lax.top_k(jax.nn.log_softmax(logits), k)  # [B, k, k]
            child_score = (score[:, :, None] + child_score).reshape(batch, k * k)
            child_token = child_token.reshape(batch, k * k)
            base = sum(c.shape[1] for c in cand_token)
            cand_token.append(child_token)
            cand_score.append(child_score)
            cand_parent.append(jnp.repeat(frontier_id, k, axis=1))
            score, best = jax.lax.top_k(child_score, k)  # the next frontier
            token = jnp.take_along_axis(child_token, best, axis=1)
            frontier_id = base + best
            parent_rows = jnp.take_along_axis(sees, (best // k)[:, :, None], axis=1)  # [B, k, (d-1) k]
            sees = jnp.concatenate([jnp.pad(sees, ((0, 0), (0, 0), (0, k))),
                                    jnp.concatenate([parent_rows, jnp.broadcast_to(jnp.eye(k, dtype=bool),
                                                                                   (batch, k, k))], axis=2)], axis=1)
            sees = sees[:, -k:]  # rows of the new frontier over all fed nodes
        cand_token, cand_parent = jnp.concatenate(cand_token, 1), jnp.concatenate(cand_parent, 1)
        cand_depth = jnp.concatenate([jnp.full((batch, c.shape[1]), d + 1) for d, c in enumerate(cand_score)], 1)
        cand_score = jnp.concatenate(cand_score, 1) - 1e-6 * cand_depth  # a parent always outranks its children
        chosen = jnp.sort(jax.lax.top_k(cand_score, n)[1], axis=1)  # ids ascending: parents before children
        node_of = jnp.zeros_like(cand_token).at[jnp.arange(batch)[:, None], chosen].set(jnp.arange(1, n + 1)[None])
        parent = jnp.take_along_axis(cand_parent, chosen, axis=1)
        parent_node = jnp.where(parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(parent, 0), axis=1))
        layout = TreeLayout.from_parents(jnp.pad(parent_node, ((0, 0), (1, 0))), depth, k)
        return Draft(jnp.take_along_axis(cand_token, chosen, axis=1).astype(jnp.int32), None, layout), cache

    def commit(self, params, cache, n_accepted_B, n_tokens_B, path_BD):
        if isinstance(self.tree, DynamicTree):
            return cache  # `propose` re-reads the accepted path
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
