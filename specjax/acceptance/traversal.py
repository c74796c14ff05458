"""Traversal verification (Weng et al., "Traversal Verification for Speculative Tree Decoding", 2025): the tree
rule of `block.Block` (registered as "block" and, under the paper's name, "traversal").

Token-wise tree sampling walks down from the root and drops a whole subtree with its root. Traversal
verification walks the tree depth first and decides bottom-up, leaf to root, on whole paths, as block
verification does on a chain (to which it reduces; at depth 1 it is recursive rejection sampling over siblings).

Every node on the walk's current path carries a path weight w, the target's distribution P over its children
and the draft distribution Q they were drawn from (initially p and q there; the root has w = 1). Entering child
x gives it w_x = min(1, w P(x) / Q(x)) with its own P = p and Q = q. A node whose children are all decided (a
leaf at once) is accepted with probability w: the walk ends there, and the next token is drawn from its P. If it
is rejected, its parent absorbs the rejection, with Z = sum max(w P - Q, 0):

    P <- norm(max(w P - Q, 0)),   w <- Z / (Z + 1 - w) (1 when the denominator is 0),   and, for siblings drawn
    without replacement, x is removed from Q (renormalised),

and the walk moves on to the parent's next child. Why it is exact: by induction over subtrees, the walk below a
node with weight w (whatever its children's draft distributions) accepts that node or a descendant with
probability w, and then emits continuations distributed as the target's; a rejected child x leaves the parent
exactly the residual mass max(w P - Q, 0), out of the rejection probability 1 - w + Z, which the updated
(w, P) ask of the next child. Deterministic candidates (`q=None`) are point masses, Q = one_hot(x), each
sibling its own. A candidate its Q gives probability 0 (e.g. beyond the support under top-k) is skipped.
`tests/test_verification.py` checks exactness by exact enumeration.

On device: a `lax.while_loop` of at most 2N + 1 steps (until every row has accepted a node) over a per-row stack
(depth D + 1) of (node, w, P, Q, next child); each step descends into the next child or decides the node on top.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import inverse_cdf


def _normalise(x_BV: jax.Array) -> jax.Array:
    total = jnp.sum(x_BV, axis=-1, keepdims=True)
    return x_BV / jnp.where(total > 0, total, 1.0)


def absorb(w_B: jax.Array, P_BV: jax.Array, Q_BV: jax.Array):
    """A node's (w, P) after a child drawn from Q was rejected: (Z / (Z + 1 - w), norm(max(w P - Q, 0))) with
    Z = sum max(w P - Q, 0); (1, P) when there is no residual."""
    excess = jnp.maximum(w_B[:, None] * P_BV - Q_BV, 0.0)
    z = jnp.sum(excess, axis=-1)
    denom = z + 1.0 - w_B
    w = jnp.where(denom > 0, z / jnp.where(denom > 0, denom, 1.0), 1.0)
    return w, jnp.where((z > 0)[:, None], _normalise(excess), P_BV)


def traversal_outcome(t_BE, layout, draft_BN, q_BNV, p_BNV, without_replacement: bool):
    """The deterministic part of traversal verification given thresholds `t_BE` [B, N + 1]: the e-th node
    decided in a row is accepted iff t[e] < its weight (uniforms: sampling; -1 / 2: a forced pass / failure,
    for enumeration). Returns (n_accepted [B], the next token's distribution [B, V], path [B, D], the probability
    of these decisions under uniform thresholds [B], the number of decisions taken [B]: thresholds after them
    were not read)."""
    b, n_nodes, vocab = p_BNV.shape
    depth, width = layout.ancestors.shape[-1], layout.children.shape[-1]
    rows = jnp.arange(b)
    tokens = jnp.pad(draft_BN, ((0, 0), (1, 0)))
    sampled = q_BNV is not None

    def q_below(node):  # the distribution the children of `node` were drawn from (shared by siblings)
        first = layout.children[rows, node, 0]
        return q_BNV[rows, jnp.maximum(first - 1, 0)]

    f32 = p_BNV.dtype
    stack = dict(
        node=jnp.zeros((b, depth + 1), jnp.int32),
        w=jnp.ones((b, depth + 1), f32),
        P=jnp.zeros((b, depth + 1, vocab), f32).at[:, 0].set(p_BNV[:, 0]),
        c=jnp.zeros((b, depth + 1), jnp.int32),
    )
    if sampled:
        stack["Q"] = jnp.zeros((b, depth + 1, vocab), f32).at[:, 0].set(q_below(jnp.zeros((b,), jnp.int32)))
    state = dict(
        stack=stack,
        d=jnp.zeros((b,), jnp.int32),
        e=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        result=jnp.zeros((b,), jnp.int32),
        result_P=p_BNV[:, 0],
        prob=jnp.ones((b,), f32),
    )

    def step(s):
        st, d = s["stack"], s["d"]
        node, w, P, c = st["node"][rows, d], st["w"][rows, d], st["P"][rows, d], st["c"][rows, d]
        child = jnp.where(c < width, layout.children[rows, node, jnp.minimum(c, width - 1)], -1)
        x = tokens[rows, jnp.maximum(child, 0)]
        Q = st["Q"][rows, d] if sampled else jax.nn.one_hot(x, vocab, dtype=f32)
        q_x = jnp.take_along_axis(Q, x[:, None], axis=1)[:, 0]
        p_x = jnp.take_along_axis(P, x[:, None], axis=1)[:, 0]
        active = ~s["done"]
        skip = active & (child >= 0) & (q_x <= 0)  # could not have been drawn: not a candidate
        descend = active & (child >= 0) & (q_x > 0)
        decide = active & (child < 0)

        # descend into `child`
        w_child = jnp.minimum(w * p_x / jnp.where(q_x > 0, q_x, 1.0), 1.0)
        up = jnp.minimum(d + 1, depth)
        child_at = jnp.maximum(child, 0)
        new = dict(
            node=jnp.where(descend, child_at, st["node"][rows, up]),
            w=jnp.where(descend, w_child, st["w"][rows, up]),
            P=jnp.where(descend[:, None], p_BNV[rows, child_at], st["P"][rows, up]),
            c=jnp.where(descend, 0, st["c"][rows, up]),
        )
        if sampled:
            new["Q"] = jnp.where(descend[:, None], q_below(child_at), st["Q"][rows, up])
        st = {k: st[k].at[rows, up].set(new[k]) for k in st}

        # decide the node on top: accept with probability w, else its parent absorbs the rejection
        t = jnp.take_along_axis(t_BE, jnp.minimum(s["e"], t_BE.shape[1] - 1)[:, None], axis=1)[:, 0]
        passed = (t < w) | (d == 0)  # the root's weight is 1
        prob = jnp.where(decide & (d > 0), jnp.where(passed, w, 1.0 - w), 1.0)
        accept = decide & passed
        reject = decide & ~passed
        down = jnp.maximum(d - 1, 0)
        w_par, P_par = st["w"][rows, down], st["P"][rows, down]
        x_self = tokens[rows, node]
        Q_par = st["Q"][rows, down] if sampled else jax.nn.one_hot(x_self, vocab, dtype=f32)
        w_new, P_new = absorb(w_par, P_par, Q_par)
        parent = dict(w=w_new, P=P_new, c=st["c"][rows, down] + 1)
        if sampled and without_replacement:
            parent["Q"] = _normalise(Q_par * (1.0 - jax.nn.one_hot(x_self, vocab, dtype=f32)))
        updates = {
            k: st[k]
            .at[rows, down]
            .set(jnp.where(reject.reshape((b,) + (1,) * (v.ndim - 1)), v, st[k][rows, down]))
            for k, v in parent.items()
        }
        st = st | updates
        # a skipped child: move on to the next one
        st["c"] = st["c"].at[rows, d].add(skip.astype(jnp.int32))
        return dict(
            stack=st,
            d=jnp.where(descend, d + 1, jnp.where(reject, d - 1, d)),
            e=s["e"] + decide.astype(jnp.int32),
            done=s["done"] | accept,
            result=jnp.where(accept, node, s["result"]),
            result_P=jnp.where(accept[:, None], P, s["result_P"]),
            prob=s["prob"] * prob,
        )

    # every node is entered once and decided at most once (a skipped candidate costs one step): 2N + 1 steps
    state["i"] = jnp.int32(0)
    more = lambda s: (s["i"] < 2 * n_nodes + 1) & ~jnp.all(s["done"])
    s = jax.lax.while_loop(more, lambda s: step(s) | {"i": s["i"] + 1}, state)
    best = s["result"]
    return layout.depth[rows, best], s["result_P"], layout.ancestors[rows, best], s["prob"], s["e"]


def traversal_verification(key, layout, draft_BN, q_BNV, p_BNV, without_replacement: bool = False):
    """(n_accepted [B], next_token [B], path [B, D]) by traversal verification; `p_BNV` [B, N + 1, V] and
    `q_BNV` [B, N, V] (None: deterministic candidates) are warped distributions. One PRNG call."""
    b, n_nodes = p_BNV.shape[:2]
    u = jax.random.uniform(key, (b, n_nodes + 1))
    n, probs, path, _, _ = traversal_outcome(
        u[:, :n_nodes], layout, draft_BN, q_BNV, p_BNV, without_replacement
    )
    return n, inverse_cdf(probs, u[:, n_nodes]), path
