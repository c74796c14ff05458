"""Training losses of the drafting heads, on features of the frozen target. Each returns (loss, metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.eagle import eagle_apply
from specjax.drafters.medusa import medusa_logits
from specjax.models.llama import causal_mask, forward, init_cache


def target_features(cfg, graphdef, params, tokens_BT):
    """The frozen target's features (final hidden states) `[B, T, H]` on full sequences, no gradient."""
    b, t = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, hidden, _ = forward(graphdef, params, tokens_BT, positions, init_cache(cfg, b, t), causal_mask(t))
    return jax.lax.stop_gradient(hidden.final)


def _cross_entropy(logits_xV, labels_x):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_xV), labels_x[..., None], axis=-1)[..., 0]


def _in_top(logits_xV, labels_x, k: int):
    label_logit = jnp.take_along_axis(logits_xV, labels_x[..., None], axis=-1)
    return (jnp.sum(logits_xV > label_logit, axis=-1) < k).astype(jnp.float32)


def medusa_loss(graphdef, params, feats_BTH, tokens_BT, decay: float):
    """Sum over heads i of decay^i * cross-entropy of head i at position t against token t + 2 + i (Medusa-1)."""
    logits = medusa_logits(graphdef, params, feats_BTH)  # [B, T, heads, V]
    n_heads, t = logits.shape[2], tokens_BT.shape[1]
    loss, metrics = 0.0, {}
    for i in range(n_heads):
        shift = i + 2
        head_logits, labels = logits[:, : t - shift, i], tokens_BT[:, shift:]
        ce = jnp.mean(_cross_entropy(head_logits, labels))
        loss = loss + decay**i * ce
        metrics |= {
            f"head{i}_ce": ce,
            f"head{i}_top1": jnp.mean(_in_top(head_logits, labels, 1)),
            f"head{i}_top5": jnp.mean(_in_top(head_logits, labels, 5)),
        }
    return loss, metrics | {"loss": loss}


def smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def eagle_loss(graphdef, layer_cfg, params, feats_BTH, tokens_BT, key, noise: float, ce_weight: float):
    """SmoothL1 between predicted and true feature t + 1, plus `ce_weight` x cross-entropy of the predicted
    feature's token distribution against the target's next-token distribution; inputs are the true features
    with uniform noise in [-noise/2, noise/2]. `params` as in `eagle_apply` (target embedding and head frozen)."""
    b, t, _ = feats_BTH.shape
    inputs = feats_BTH[:, :-1] + noise * (jax.random.uniform(key, feats_BTH[:, :-1].shape) - 0.5)
    positions = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    cache = init_cache(layer_cfg, b, t - 1)
    logits, predicted, _ = eagle_apply(
        graphdef, params, tokens_BT[:, 1:], inputs, positions, cache, causal_mask(t - 1)
    )
    true = feats_BTH[:, 1:]
    feature_loss = jnp.mean(smooth_l1(predicted, true))
    target_logits = jnp.einsum("btd,vd->btv", true, jax.lax.stop_gradient(params["unembed"]))
    target_probs = jax.nn.softmax(target_logits.astype(jnp.float32))
    ce = jnp.mean(-jnp.sum(target_probs * jax.nn.log_softmax(logits), axis=-1))
    top1 = jnp.mean((jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32))
    loss = feature_loss + ce_weight * ce
    return loss, {"loss": loss, "feature_loss": feature_loss, "ce": ce, "top1": top1}
