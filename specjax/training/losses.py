"""What every head's training loss shares: the frozen target's features and per-token loss terms. Each head's
loss lives in its drafter module (registered as `TrainedHeads.loss`) and returns (loss, metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decoding.prefill import prefill


def target_features(cfg, graphdef, params, tokens_BT):
    """The frozen target's features (final hidden states) `[B, T, H]` on full sequences, no gradient."""
    b, t = tokens_BT.shape
    return jax.lax.stop_gradient(prefill(cfg, graphdef, params, tokens_BT, jnp.full((b,), t), t)[2])


def cross_entropy(logits_xV, labels_x):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_xV), labels_x[..., None], axis=-1)[..., 0]


def in_top(logits_xV, labels_x, k: int):
    label_logit = jnp.take_along_axis(logits_xV, labels_x[..., None], axis=-1)
    return (jnp.sum(logits_xV > label_logit, axis=-1) < k).astype(jnp.float32)


def smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)
