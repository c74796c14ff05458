"""A round's draft on device and its layout: how the target verifies it and how the outcome is committed.

`Draft.layout` is a `ChainLayout` (token i follows token i - 1) or a `TreeLayout` (token j - 1 is node j,
node 0 the pending token). Both answer the same questions, so the speculative loop never asks which it has:
the positions and attention mask of the verification pass, which acceptance-rule entry point applies, and
how the accepted tokens are committed to the target's cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.llama import causal_mask


@struct.dataclass
class Draft:
    tokens: jax.Array  # [B, K] (chain) or [B, N] (tree nodes 1..N) int32
    q_probs: (
        jax.Array | None
    )  # [B, K|N, V] warped distribution each token was drawn from; None: deterministic
    layout: ChainLayout | TreeLayout
    without_replacement: bool = struct.field(pytree_node=False, default=False)  # tree siblings drawn so
    # a chain whose verified prefix is chosen on device: `scores` [B, len(lengths)] rates each static length for
    # each row, and the round verifies the length the live rows rate best together (`best_length`)
    lengths: tuple[int, ...] = struct.field(pytree_node=False, default=())
    scores: jax.Array | None = None

    def prefix(self, k: int) -> Draft:
        """The chain's first k tokens as a draft of its own."""
        q = None if self.q_probs is None else self.q_probs[:, :k]
        return Draft(self.tokens[:, :k], q, ChainLayout(k))


def best_length(scores_BM, live_B) -> jax.Array:
    """[] index of the length whose scores summed over the live rows are highest (the first on ties): rows that have
    ended, whose drafts are never verified, do not size the round."""
    return jnp.argmax(jnp.sum(jnp.where(live_B[:, None], scores_BM, 0.0), axis=0))


@struct.dataclass
class Verification:
    """The outcome of one verification pass, per row."""

    n_accepted: jax.Array  # [B] draft tokens kept
    next_token: jax.Array  # [B] the target's token after them (correction or bonus)
    accepted_tokens: jax.Array  # [B, D] the kept draft tokens first (D = draft depth)
    path: jax.Array  # [B, D] the kept draft nodes by depth (a chain's node i is token i - 1), 0 padded
    features: jax.Array  # [B, D + 1, H] target features at the pending token, then along `path`
    feedback: object = (
        None  # what a drafter's own layout tells its `commit` (lookahead: the window's argmax)
    )


@struct.dataclass
class ChainLayout:
    k: int = struct.field(pytree_node=False)

    @property
    def mask(self) -> jax.Array:
        return causal_mask(self.k + 1)

    def positions(self, length_B: jax.Array) -> jax.Array:
        return length_B[:, None] + jnp.arange(self.k + 1)[None]

    def accept(self, rule, key, sampler, draft: Draft, logits_BTV, feats_BTH) -> Verification:
        n, nxt = rule.chain(key, sampler, draft.tokens, draft.q_probs, logits_BTV)
        path = jnp.broadcast_to(jnp.arange(1, self.k + 1), draft.tokens.shape)
        return Verification(n, nxt, draft.tokens, path, feats_BTH)

    def commit(self, cache, committed_B: jax.Array, verdict: Verification, active_B: jax.Array):
        """The cache with the pending token and the accepted draft committed (they already sit in order)."""
        return cache.with_length(jnp.where(active_B, committed_B + verdict.n_accepted + 1, committed_B))


@struct.dataclass
class TreeLayout:
    """A tree's index arrays on device, one tree per batch row (static trees broadcast, dynamic ones vary)."""

    parent: jax.Array  # [B, N+1]
    depth: jax.Array  # [B, N+1]
    ancestors: jax.Array  # [B, N+1, D] path from depth 1 to the node, 0 padded
    children: jax.Array  # [B, N+1, W] -1 padded, in the order siblings are tried
    mask: jax.Array  # [B, N+1, N+1] ancestor-or-self

    @classmethod
    def from_arrays(cls, arrays, batch: int) -> TreeLayout:
        """From a static tree's numpy `TreeArrays`, broadcast over the batch."""
        fields = (arrays.parent, arrays.depth, arrays.ancestors, arrays.children, arrays.mask)
        return cls(*(jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape) for x in fields))

    @classmethod
    def from_parents(cls, parent_BN: jax.Array, depth: int, width: int) -> TreeLayout:
        """From parent pointers (parents before children, root 0 its own parent); siblings in index order."""
        b, n = parent_BN.shape
        rows, nodes = jnp.arange(b)[:, None], jnp.arange(n)[None]
        chain = [jnp.broadcast_to(nodes, (b, n))]  # chain[d] = the ancestor d steps up
        for _ in range(depth):
            chain.append(jnp.take_along_axis(parent_BN, chain[-1], axis=1))
        node_depth = sum((c > 0).astype(jnp.int32) for c in chain[:-1])
        mask = jnp.zeros((b, n, n), bool)
        for c in chain:
            mask = mask.at[rows, nodes, c].set(True)
        # ancestors[i, d - 1] = the ancestor at depth d = chain[depth(i) - d]
        stacked = jnp.stack(chain, axis=-1)  # [B, N, depth + 1]
        up = node_depth[..., None] - jnp.arange(1, depth + 1)
        ancestors = jnp.where(up >= 0, jnp.take_along_axis(stacked, jnp.maximum(up, 0), axis=-1), 0)
        same_parent = (parent_BN[:, None, :] == parent_BN[:, :, None]) & (nodes > 0)[:, None, :]
        sibling_rank = jnp.cumsum(same_parent, axis=2)  # [B, N, N]: siblings up to and including j
        rank = jnp.take_along_axis(sibling_rank, nodes[..., None].repeat(b, 0), axis=2)[..., 0] - 1
        children = jnp.full((b, n, width), -1, jnp.int32)
        target_rank = jnp.where(nodes > 0, rank, width)  # the root is nobody's child: dropped
        nodes_BN = jnp.broadcast_to(nodes, (b, n))
        children = children.at[rows, parent_BN, target_rank].set(nodes_BN, mode="drop")
        return cls(parent_BN, node_depth, ancestors, children, mask)

    def positions(self, length_B: jax.Array) -> jax.Array:
        return length_B[:, None] + self.depth

    def accept(self, rule, key, sampler, draft: Draft, logits_BNV, feats_BNH) -> Verification:
        n, nxt, path = rule.tree(
            key, sampler, self, draft.tokens, draft.q_probs, logits_BNV, draft.without_replacement
        )
        with_root = jnp.pad(draft.tokens, ((0, 0), (1, 0)))
        feats = jnp.take_along_axis(feats_BNH, jnp.pad(path, ((0, 0), (1, 0)))[:, :, None], axis=1)
        return Verification(n, nxt, jnp.take_along_axis(with_root, path, axis=1), path, feats)

    def commit(self, cache, committed_B: jax.Array, verdict: Verification, active_B: jax.Array):
        """The cache with the root and the accepted path gathered into the committed region."""
        del committed_B  # the cache still holds it: the verification pass did not commit
        keep = jnp.pad(verdict.path, ((0, 0), (1, 0)))
        return cache.compact(keep, jnp.where(active_B, verdict.n_accepted + 1, 0))
