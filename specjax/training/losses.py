"""What every head's training loss shares: the frozen target's features and per-token loss terms. Each head's
loss lives in its drafter module (registered as `TrainedHeads.loss`) and returns (loss, metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decoding.prefill import prefill


def target_features(cfg, graphdef, params, tokens_BT, taps: tuple[int, ...] = ()):
    """The frozen target's features on full sequences, no gradient: final hidden states `[B, T, H]`, or with
    `taps` those layers' outputs then the final hidden states (`specjax.models.llama.features`)."""
    b, t = tokens_BT.shape
    full = prefill(cfg, graphdef, params, tokens_BT, jnp.full((b,), t), t, taps)[2]
    return jax.lax.stop_gradient(full)


def predicted_mask(loss_mask_BT, shift: int, length: int):
    """The weights `[B, length]` of the loss terms at positions m < length that predict token m + shift: that
    token's loss mask (a term predicting past the row's end takes the row's last token's)."""
    last = loss_mask_BT.shape[1] - 1
    return loss_mask_BT[:, jnp.minimum(jnp.arange(length) + shift, last)].astype(jnp.float32)


def masked_mean(x, weights):
    """The mean of `x` over the terms with weight 1 (0 when no term has weight)."""
    weights = jnp.broadcast_to(weights, x.shape)
    return jnp.sum(x * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def cross_entropy(logits_xV, labels_x):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_xV), labels_x[..., None], axis=-1)[..., 0]


def in_top(logits_xV, labels_x, k: int):
    label_logit = jnp.take_along_axis(logits_xV, labels_x[..., None], axis=-1)
    return (jnp.sum(logits_xV > label_logit, axis=-1) < k).astype(jnp.float32)


def smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)
