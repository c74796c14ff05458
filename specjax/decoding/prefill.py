"""Prefill: a model reads right-padded prompts into a fresh cache of its own."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.models.llama import causal_mask, features, forward, init_cache
from specjax.sharding import constrain_cache


def prefill(cfg, graphdef, params, tokens_BP, lengths_B, cache_size: int, taps: tuple[int, ...] = ()):
    """(logits at each row's last prompt token [B, V], cache with the prompts committed, the prompts'
    features [B, P, F] (`specjax.models.llama.features` with `taps`))."""
    batch, width = tokens_BP.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = constrain_cache(init_cache(cfg, batch, cache_size))  # split over the mesh, if there is one
    logits, hidden, cache = forward(graphdef, params, tokens_BP, positions, cache, causal_mask(width), taps)
    last = jnp.take_along_axis(logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return last, cache.with_length(lengths_B), features(hidden, taps)
