"""KV cache invariants: rollback forgets, compaction equals a plain decode of the kept tokens."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from tolerance import assert_close, forward_depth

from specjax.models.llama import causal_mask, forward, init_cache, init_params

GRAPHDEF, PARAMS = init_params(TINY, seed=3)
PROMPT = jnp.array([[5, 17, 3, 44, 9, 81], [7, 7, 60, 2, 11, 30]])


def run(tokens, cache, mask=None):
    t = tokens.shape[1]
    positions = cache.length[:, None] + jnp.arange(t)[None]
    return forward(GRAPHDEF, PARAMS, tokens, positions, cache, causal_mask(t) if mask is None else mask)


def layers(cache, row):
    """Keys and values of one batch row, every layer: [layers, kv_heads, S, head_dim] each."""
    heads = TINY.n_kv_heads
    rows = slice(row * heads, (row + 1) * heads)
    return (
        np.stack([np.asarray(k[rows]) for k in cache.k]),
        np.stack([np.asarray(v[rows]).swapaxes(1, 2) for v in cache.v]),
    )


def prefilled(size=24):
    _, _, cache = run(PROMPT, init_cache(TINY, 2, size))
    return cache.advance(PROMPT.shape[1])


def test_rollback_then_redecode_equals_never_written():
    clean = prefilled()
    expected, _, _ = run(jnp.array([[12], [13]]), clean)
    _, _, dirty = run(jnp.array([[90, 91, 92], [93, 94, 95]]), clean)  # speculative garbage ...
    dirty = dirty.advance(3).with_length(clean.length)  # ... committed, then rolled back
    assert not np.array_equal(
        layers(dirty, 0)[0], layers(clean, 0)[0]
    )  # the garbage is still in the buffer
    got, _, _ = run(jnp.array([[12], [13]]), dirty)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("keep", [[0, 2, 3], [1, 3, 0], [0, 1, 2]])
def test_compact_matches_plain_decode(keep):
    cache = prefilled()
    cand = jnp.array([[20, 21, 22, 23], [30, 31, 32, 33]])
    # a tree-like mask: every candidate sees the nodes listed before it in `keep` and itself
    order = {node: i for i, node in enumerate(keep)}
    mask = np.eye(4, dtype=bool)
    for node in keep:
        for earlier in keep[: order[node]]:
            mask[node, earlier] = True
    positions = cache.length[:, None] + jnp.array([order.get(i, 0) for i in range(4)])[None]
    _, _, written = forward(GRAPHDEF, PARAMS, cand, positions, cache, jnp.asarray(mask))
    n_keep = jnp.array([3, 2])  # row 1 keeps only the first two of the path
    compacted = written.compact(jnp.array([keep, keep]), n_keep)

    assert np.array_equal(np.asarray(compacted.length), np.asarray(cache.length + n_keep))
    nxt = jnp.array([[40], [41]])
    after_compact = np.asarray(run(nxt, compacted)[0])
    for row, n in enumerate([3, 2]):
        kept = np.asarray(cand)[row, keep[:n]]
        tokens = jnp.asarray(np.stack([kept if r == row else np.zeros(n, int) for r in range(2)]))
        _, _, plain = run(tokens, cache)  # this row's kept tokens decoded plainly
        plain = plain.advance(n)
        end = int(cache.length[row]) + n
        depth = forward_depth(TINY.n_layers)  # another mask and batch: the same sums in another order
        for got, want in zip(layers(compacted, row), layers(plain, row)):
            assert_close(got[:, :, :end], want[:, :, :end], dtype=jnp.float32, depth=depth)
        assert_close(
            after_compact[row], np.asarray(run(nxt, plain)[0])[row], dtype=jnp.float32, depth=depth
        )
