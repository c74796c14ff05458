"""Draft search shared by every drafter that drafts position by position (draft model, EAGLE; DFlash, whose
positions come from one block pass and, with a Markov head, depend on their parent's token): chains, static trees
and EAGLE-2-style dynamic trees, written once against a `step` function.

`step(cache, tokens_BT, positions_BT, mask_BTW, ctx) -> (logits_BTV, ctx_out, cache)` runs the drafter
on T new tokens (written after the cache's committed region, see `specjax.models.llama.forward`).
`ctx` is per-token context besides the token itself, a pytree of `[B, T, ...]` arrays or None: for
EAGLE the feature predicted at the token's parent, for a draft model nothing. A search starts from
the root's logits and ctx (the drafter's output at the pending token) and `pos0_B`, the position of
depth-1 draft tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafting.layouts import ChainLayout, Draft, TreeLayout
from specjax.models.llama import causal_mask
from specjax.sampling import argmax, inverse_cdf

take = lambda ctx, idx_BN: jax.tree.map(
    lambda c: jnp.take_along_axis(  # ctx rows idx along axis 1
        c, idx_BN.reshape(idx_BN.shape + (1,) * (c.ndim - 2)), axis=1
    ),
    ctx,
)


def chain(step, sampler, k: int, root_logits_BV, root_ctx, pos0_B, cache, key):
    """K tokens, each drawn by `sampler` from the drafter's output at the previous one (a `lax.scan`: unrolled,
    the round measured slower on XLA CPU). The K uniforms per row come from one PRNG call."""

    def draw(u_B, logits_BV):  # (token, its warped distribution q, or None when greedy)
        if sampler.greedy:
            return argmax(logits_BV), None
        q = sampler.probs(logits_BV)
        return inverse_cdf(q, u_B), q

    def one(carry, u_B):  # feed the last token, draw the next
        token, ctx, i, cache = carry
        logits, ctx, cache = step(cache, token[:, None], (pos0_B + i)[:, None], causal_mask(1), ctx)
        nxt, q = draw(u_B, logits[:, 0])
        return (nxt, ctx, i + 1, cache.advance(1)), (nxt, q)

    u = None if sampler.greedy else jax.random.uniform(key, (k, root_logits_BV.shape[0]))
    first, q0 = draw(None if u is None else u[0], root_logits_BV)
    ctx = jax.tree.map(lambda c: c[:, None], root_ctx)
    (_, _, _, cache), (rest, rest_q) = jax.lax.scan(
        one, (first, ctx, 0, cache), None if u is None else u[1:], length=k - 1
    )
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    q = None if sampler.greedy else jnp.concatenate([q0[:, None], rest_q.swapaxes(0, 1)], axis=1)
    return Draft(tokens, q, ChainLayout(k)), cache


def static_tree(step, sampler, tree, root_logits_BV, root_ctx, pos0_B, cache, key):
    """Level by level: a node's children are the drafter's top-k tokens after it (sampled without
    replacement by Gumbel top-k when sampling); the nodes of a level are fed together under the tree mask."""
    arr, batch = tree.arrays, root_logits_BV.shape[0]
    tokens = jnp.zeros((batch, tree.size), jnp.int32)
    q = None if sampler.greedy else jnp.zeros((batch, tree.size, root_logits_BV.shape[-1]))
    level_logits = root_logits_BV[:, None]  # [B, nodes of the previous level, V]
    level_ctx = jax.tree.map(lambda c: c[:, None], root_ctx)
    for d, sub in zip(range(1, tree.depth + 1), jax.random.split(key, tree.depth)):
        nodes, prev = arr.levels[d], arr.levels[d - 1]
        slot = {int(n): i for i, n in enumerate(prev)}
        parent_slot = np.array([slot[int(arr.parent[n])] for n in nodes])
        scores = level_logits  # greedy: the top-k tokens, ranked
        if not sampler.greedy:  # sampled without replacement, in draw order (Gumbel top-k)
            scores = sampler.warp(level_logits) + jax.random.gumbel(sub, scores.shape)
        width = int(arr.rank[nodes].max()) + 1
        candidates = jax.lax.top_k(scores, width)[1]  # [B, prev, width]
        tokens = tokens.at[:, nodes].set(candidates[:, parent_slot, arr.rank[nodes]].astype(jnp.int32))
        if q is not None:
            q = q.at[:, nodes].set(sampler.probs(level_logits)[:, parent_slot])
        if d < tree.depth:  # feed this level: it sees the committed cache and its ancestors
            window = int(nodes[-1])  # nodes 1..window are written after the committed region
            positions = pos0_B[:, None] - 1 + jnp.asarray(arr.depth[nodes])[None]
            ctx = jax.tree.map(lambda c: c[:, parent_slot], level_ctx)
            level_logits, level_ctx, cache = step(
                cache, tokens[:, nodes], positions, jnp.asarray(arr.mask[nodes][:, 1 : window + 1]), ctx
            )
    q = None if q is None else q[:, 1:]
    return Draft(tokens[:, 1:], q, tree.layout(batch), q is not None), cache


def dynamic_tree(step, tree, root_logits_BV, root_ctx, pos0_B, cache):
    """EAGLE-2: grow the `top_k` best frontier nodes by `top_k` children per level (scored by cumulative
    draft log-probability), then keep the best `total_tokens` candidates. Candidates are the drafter's
    deterministic top-k tokens (point-mass proposals, exact with any sampler)."""
    k, depth, n = tree.top_k, tree.depth, tree.total_tokens
    batch = root_logits_BV.shape[0]
    score, token = jax.lax.top_k(jax.nn.log_softmax(root_logits_BV), k)  # depth-1 candidates [B, k]
    cand_token, cand_score, cand_parent = [token], [score], [jnp.full((batch, k), -1)]
    frontier_id = jnp.broadcast_to(jnp.arange(k), (batch, k))
    sees = jnp.broadcast_to(jnp.eye(k, dtype=bool), (batch, k, k))
    ctx = jax.tree.map(lambda c: jnp.repeat(c[:, None], k, axis=1), root_ctx)
    for d in range(2, depth + 1):  # feed the frontier (depth d - 1), expand its children
        logits, ctx_out, cache = step(
            cache, token, jnp.broadcast_to((pos0_B + d - 2)[:, None], token.shape), sees, ctx
        )
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
        ctx = take(ctx_out, best // k)
        parent_rows = jnp.take_along_axis(sees, (best // k)[:, :, None], axis=1)  # [B, k, (d-1) k]
        sees = jnp.concatenate(
            [
                jnp.pad(sees, ((0, 0), (0, 0), (0, k))),
                jnp.concatenate(
                    [parent_rows, jnp.broadcast_to(jnp.eye(k, dtype=bool), (batch, k, k))], axis=2
                ),
            ],
            axis=1,
        )
        sees = sees[:, -k:]  # rows of the new frontier over all fed nodes
    cand_token, cand_parent = jnp.concatenate(cand_token, 1), jnp.concatenate(cand_parent, 1)
    cand_depth = jnp.concatenate(
        [jnp.full((batch, c.shape[1]), d + 1) for d, c in enumerate(cand_score)], 1
    )
    cand_score = jnp.concatenate(cand_score, 1) - 1e-6 * cand_depth  # a parent always outranks its children
    chosen = jnp.sort(jax.lax.top_k(cand_score, n)[1], axis=1)  # ids ascending: parents before children
    node_of = (
        jnp.zeros_like(cand_token).at[jnp.arange(batch)[:, None], chosen].set(jnp.arange(1, n + 1)[None])
    )
    parent = jnp.take_along_axis(cand_parent, chosen, axis=1)
    parent_node = jnp.where(parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(parent, 0), axis=1))
    layout = TreeLayout.from_parents(jnp.pad(parent_node, ((0, 0), (1, 0))), depth, k)
    return Draft(jnp.take_along_axis(cand_token, chosen, axis=1).astype(jnp.int32), None, layout), cache
