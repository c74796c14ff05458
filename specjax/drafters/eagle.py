"""EAGLE (Li et al. 2024, EAGLE-1/2): a one-layer autoregressive head over the target's features.

At position i it reads concat(embedding(token i + 1), feature i) -> linear 2H -> H -> one decoder layer of the
target's architecture -> predicted feature i + 1, which the target's frozen LM head turns into a token.
While drafting it feeds its own predicted features; after verification it re-reads the accepted tokens
with the target's true features. Embedding and LM head are the target's (frozen, not stored with the head).
specjax's heads normalise the layer's input; the heads the EAGLE authors publish do not (their layer 0 skips its
input_layernorm): the head shape `{"input_norm": false}` holds those (`specjax.published`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import heads, precision, published
from specjax.drafting import registry
from specjax.drafting.protocol import KOrTree, target_io
from specjax.drafting.trees import DynamicTree, Tree
from specjax.errors import HeadsError
from specjax.models.config import ConfigError, LlamaConfig
from specjax.models.llama import Block, Linear, causal_mask, init_cache, rope_angles
from specjax.models.weights import CheckpointError
from specjax.sampling import Sampler
from specjax.training import losses


class RawInputBlock(Block):
    """A decoder layer whose attention reads its input without the input norm (the published EAGLE-1/2 layer)."""

    def __init__(self, cfg: LlamaConfig, layer: int, rngs: nnx.Rngs):
        super().__init__(cfg, layer, rngs)
        del self.attn_norm

    def __call__(self, x_BTH, cos, sin, cache, visible_BTS, offset: int):
        return self.finish(x_BTH, self.wqkv(x_BTH), cos, sin, cache, visible_BTS, offset)


class EagleHead(nnx.Module):
    def __init__(self, layer_cfg: LlamaConfig, rngs: nnx.Rngs, input_norm: bool = True):
        self.fc = Linear(2 * layer_cfg.dim, layer_cfg.dim, True, jnp.dtype(layer_cfg.dtype), rngs)
        self.layer = (Block if input_norm else RawInputBlock)(layer_cfg, 0, rngs)
        self.inv_freq = tuple(float(f) for f in layer_cfg.inv_freq())

    def __call__(self, embeds_BTH, feats_BTH, positions_BT, cache, mask_BTW):
        """(predicted features [B, T, H], cache) for inputs (embedding of token i + 1, feature i)."""
        b, t, _ = embeds_BTH.shape
        mask_BTW = jnp.broadcast_to(mask_BTW, (b, t, mask_BTW.shape[-1]))
        cos, sin = rope_angles(self.inv_freq, positions_BT, cache.size)
        x = self.fc(jnp.concatenate([embeds_BTH, feats_BTH.astype(embeds_BTH.dtype)], axis=-1))
        return self.layer(x, cos, sin, cache, cache.visible(mask_BTW), mask_BTW.shape[-1] - t)


def layer_config(target_cfg: LlamaConfig) -> LlamaConfig:
    """The head's decoder layer: one layer of the target's architecture."""
    return target_cfg.head_layers(1)


def init_eagle(target_cfg: LlamaConfig, seed: int = 0, input_norm: bool = True):
    """(graphdef, params as a pure dict) of a fresh head (`input_norm=False`: the published EAGLE-1/2 layer)."""
    graphdef, state = nnx.split(EagleHead(layer_config(target_cfg), nnx.Rngs(seed), input_norm))
    return graphdef, nnx.to_pure_dict(state)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef",))
def eagle_apply(graphdef, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW):
    """(logits [B, T, V] float32, predicted features [B, T, H], cache). `params` = {"head": the head's
    params, "embed": the target's embedding [V, H], "unembed": the target's LM head [V, H]}."""
    embeds = jnp.take(params["embed"], tokens_BT, axis=0)
    feats, cache = nnx.merge(graphdef, params["head"])(embeds, feats_BTH, positions_BT, cache, mask_BTW)
    logits = jnp.einsum("btd,vd->btv", feats, params["unembed"]).astype(jnp.float32)
    return logits, feats, cache


@struct.dataclass
class EagleState:
    cache: object  # the head's KV cache; committed slots were read with the target's true features
    feats: (
        jax.Array
    )  # [B, K + 1, F] the target's features at the last round's tokens, from slot `committed`
    committed: jax.Array  # [B] committed cache slots


@dataclasses.dataclass(frozen=True)
class Eagle(KOrTree):
    """Drafter: chains (sampled with `sampler`, pass the target's), static trees, or dynamic trees (EAGLE-2)."""

    layer_cfg: LlamaConfig
    graphdef: object
    k: int
    sampler: Sampler = Sampler()
    tree: Tree | DynamicTree | None = None
    weights_key: ClassVar[str] = "head"  # its params: the head's weights beside the target's frozen arrays

    def validate(self, target_cfg: LlamaConfig) -> None:
        mine = self.layer_cfg
        if layer_config(target_cfg).replace(dtype=mine.dtype, max_seq_len=mine.max_seq_len) != mine:
            raise HeadsError(
                f"this EAGLE head was built for a target with vocabulary {self.layer_cfg.vocab_size} "
                f"and width {self.layer_cfg.dim}, not vocabulary {target_cfg.vocab_size} and width "
                f"{target_cfg.dim} (or another layer shape): train a head for this target"
            )

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH):
        batch, width = tokens_BP.shape
        positions = jnp.broadcast_to(jnp.arange(width - 1), (batch, width - 1))
        cache = init_cache(self.layer_cfg, batch, cache_size)
        _, _, cache = self.apply(
            params,
            tokens_BP[:, 1:],
            self.fuse(params, feats_BPH[:, :-1]),
            positions,
            cache,
            causal_mask(width - 1),
        )  # slot i: (token i + 1, feature i)
        last = jnp.take_along_axis(feats_BPH, (lengths_B - 1)[:, None, None], axis=1)
        feats = jnp.zeros((batch, self.k + 1, feats_BPH.shape[-1]), feats_BPH.dtype).at[:, :1].set(last)
        return EagleState(cache.with_length(lengths_B - 1), feats, lengths_B - 1)

    def fuse(self, params, target_feats):
        """The head's input features from the target's (EAGLE-1/2: the target's final features as they are)."""
        return target_feats

    def apply(self, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW):
        """(logits over the target vocabulary [B, T, V], predicted features [B, T, H], cache)."""
        return eagle_apply(self.graphdef, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW)

    def _step(self, params):
        def step(cache, tokens_BT, positions_BT, mask_BTW, feats_BTH):
            return self.apply(params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW)

        return step

    def reread(self, params, state: EagleState, seq_BS):
        """(logits, features, cache) of the last round re-read with the target's true features: slots committed ..
        n_tokens - 2 hold (token i + 1, feature i). The last round accepted at most K_max tokens: the state is the
        largest K's (adaptive K may draft fewer)."""
        w = state.feats.shape[1]
        positions = state.committed[:, None] + jnp.arange(w)[None]
        tokens = jnp.take_along_axis(seq_BS, jnp.minimum(positions + 1, seq_BS.shape[1] - 1), axis=1)
        return self.apply(
            params,
            tokens,
            self.fuse(params, state.feats[:, :w]),
            positions,
            state.cache.with_length(state.committed),
            causal_mask(w),
        )

    def catch_up(self, params, state: EagleState, seq_BS, n_tokens_B) -> EagleState:
        """The state `propose` leaves, without drafting: for a round whose draft comes from elsewhere."""
        _, _, cache = self.reread(params, state, seq_BS)
        return EagleState(cache.with_length(n_tokens_B - 1), state.feats, n_tokens_B - 1)

    def propose(self, params, state: EagleState, seq_BS, n_tokens_B, key):
        logits, feats, cache = self.reread(params, state, seq_BS)
        # the slot that predicts after the pending token
        root = (n_tokens_B - 2 - state.committed)[:, None, None]
        root_logits = jnp.take_along_axis(logits, root, axis=1)[:, 0]
        root_feat = jnp.take_along_axis(feats, root, axis=1)[:, 0]
        cache = cache.with_length(n_tokens_B - 1)
        draft, cache = self.shape.search(
            self._step(params), self.sampler, root_logits, root_feat, n_tokens_B - 1, cache, key
        )
        return draft, EagleState(cache, state.feats, n_tokens_B - 1)

    def commit(self, params, state: EagleState, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state.replace(feats=feats_BDH)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef", "layer_cfg", "noise", "ce_weight"))
def eagle_loss(
    graphdef, layer_cfg, params, feats_BTH, tokens_BT, loss_mask_BT, key, noise: float, ce_weight: float
):
    """SmoothL1 between predicted and true feature t + 1, plus `ce_weight` x cross-entropy of the predicted
    feature's token distribution against the target's next-token distribution (the one of token t + 2), over
    the positions whose token t + 2 has loss mask 1; inputs are the true features with uniform noise in
    [-noise/2, noise/2]. `params` as in `eagle_apply` (target embedding and head frozen)."""
    b, t, _ = feats_BTH.shape
    inputs = feats_BTH[:, :-1] + noise * (jax.random.uniform(key, feats_BTH[:, :-1].shape) - 0.5)
    positions = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    cache = init_cache(layer_cfg, b, t - 1)
    logits, predicted, _ = eagle_apply(
        graphdef, params, tokens_BT[:, 1:], inputs, positions, cache, causal_mask(t - 1)
    )
    true = feats_BTH[:, 1:]
    weights = losses.predicted_mask(loss_mask_BT, 2, t - 1)
    feature_loss = losses.masked_mean(jnp.mean(losses.smooth_l1(predicted, true), axis=-1), weights)
    target_logits = jnp.einsum("btd,vd->btv", true, jax.lax.stop_gradient(params["unembed"]))
    target_probs = jax.nn.softmax(target_logits.astype(jnp.float32))
    ce = losses.masked_mean(-jnp.sum(target_probs * jax.nn.log_softmax(logits), axis=-1), weights)
    hit = (jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    top1 = losses.masked_mean(hit, weights)
    loss = feature_loss + ce_weight * ce
    return loss, {"loss": loss, "feature_loss": feature_loss, "ce": ce, "top1": top1}


@dataclasses.dataclass(frozen=True)
class EagleTraining:
    """`config.heads` of an EAGLE training run."""

    noise: float = 0.2  # width of the uniform noise added to the input features
    ce_weight: float = 0.1  # weight of the cross-entropy beside the SmoothL1 feature loss
    RULES: ClassVar = {
        "noise": (lambda v: v >= 0, "must be >= 0"),
        "ce_weight": (lambda v: v >= 0, "must be >= 0"),
    }


# --- EAGLE-1/2 as SafeAILab/EAGLE publishes it (`eagle/model/cnets1.py`, vLLM `llama_eagle.py`): `config.json` (a
# one-layer Llama config) and `pytorch_model.bin` or `model.safetensors` holding `fc.weight` [H, 2H] (input:
# concat(embedding, feature)) and `fc.bias` (absent: zero), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
# `layers.0.mlp.{gate,up,down}_proj.weight` and `layers.0.post_attention_layernorm.weight`: layer 0 has no
# input_layernorm (its attention reads the fc output as it is), so these load into heads of shape
# `{"input_norm": false}`; specjax's own EAGLE heads (which normalise) cannot be exported to this layout. HASS's
# variant (`add_para_norm`) is refused.

EAGLE12 = (
    "the published EAGLE-1/2 layout has no input_layernorm in its decoder layer (SafeAILab/EAGLE cnets1.py), while "
    "this head normalises its layer's input, so the layout cannot hold it; export it as specjax heads "
    "(heads.export) or train an EAGLE-3 head"
)


def check_published_layer(hf: dict, where: Path, cfg: LlamaConfig) -> None:
    """A published head's one-layer Llama config must match a layer of the target."""
    try:
        theirs = LlamaConfig.from_hf({"model_type": "llama", **hf, "vocab_size": cfg.vocab_size})
    except (ConfigError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{where.parent / 'config.json'} cannot be read as a Llama layer ({err})"
        ) from err
    ours = layer_config(cfg)
    for name in ("n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps"):
        published.check(where, name, getattr(theirs, name), getattr(ours, name))
    if not np.array_equal(theirs.inv_freq(), ours.inv_freq()):
        raise CheckpointError(
            f"{where} is a head for RoPE theta {theirs.rope_theta} / scaling {theirs.rope_llama3_scaling}, the "
            f"target has {ours.rope_theta} / {ours.rope_llama3_scaling}: use a head trained for this target"
        )


def load_published_heads(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    dim = cfg.dim
    published.check(where, "hidden size", t["fc.weight"].shape[0], dim)
    published.check(where, "hidden size", hf.get("hidden_size"), dim)
    published.check(where, "a vocabulary of", hf.get("vocab_size"), cfg.vocab_size)
    if hf.get("num_hidden_layers", 1) != 1 or hf.get("add_para_norm"):
        raise CheckpointError(
            f"{where} has {hf.get('num_hidden_layers')} decoder layers or HASS's extra norms (add_para_norm); "
            "specjax's EAGLE head is one decoder layer reading fc(concat(embedding, feature))"
        )
    if "layers.0.input_layernorm.weight" in t:
        raise CheckpointError(
            f"{where} has a layers.0.input_layernorm, which the published EAGLE-1/2 layer does not: it is another "
            "layout; pass the directory of a SafeAILab/EAGLE head"
        )
    check_published_layer(hf, where, cfg)
    published.check_embedding(t, where, cfg, target_params)
    meta = heads.describe("eagle", {"input_norm": False}, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)
    get = published.getter(t, where)
    bias = get("fc.bias", (dim,)) if "fc.bias" in t else np.zeros(dim, np.float32)
    pure = {
        "fc": {"weight": get("fc.weight", (dim, 2 * dim)), "bias": bias},
        "layer": published.layer_from(t, where, cfg, "layers.0.", dim, fresh["layer"]),
    }
    return meta, graphdef, published.fill(fresh, pure)


def published_files(meta: dict, p, cfg: LlamaConfig, base_model: str | None = None) -> tuple[dict, dict]:
    if meta["shape"].get("input_norm", True):
        raise HeadsError(f"this EAGLE head cannot be exported to the published layout: {EAGLE12}")
    t = {
        "fc.weight": p["fc"]["weight"],
        "fc.bias": p["fc"]["bias"],
        **published.layer_tensors(p["layer"], "layers.0.", cfg),
    }
    bias = "layers.0.self_attn.o_proj.bias" in t
    return t, published.layer_config_json(cfg, "LlamaForCausalLM", bias, t["fc.weight"].dtype)


def expand_heads(shape: dict, p: dict, ex, expansion, cfg: LlamaConfig) -> tuple[dict, dict]:
    """The head for the expanded target (`specjax.expand`): fc reads concat(embedding, feature) 2D -> D,
    then one target-shaped layer."""
    d, d2 = cfg.dim, expansion.dim
    fc = np.zeros((d2, 2 * d2), ex.dt)
    fc[:d, :d], fc[:d, d2 : d2 + d] = p["fc"]["weight"][:, :d], p["fc"]["weight"][:, d:]
    layer = ex.block(p["layer"], np.random.default_rng([expansion.seed, 10**6]))
    return {"fc": {"weight": fc, "bias": ex.pad(p["fc"]["bias"], (d2,))}, "layer": layer}, shape


heads.register(
    "eagle",
    registry.TrainedHeads(
        settings=EagleTraining,
        init=lambda shape, cfg, target_params, seed: init_eagle(cfg, seed, shape.get("input_norm", True)),
        drafter_params=lambda shape, params, cfg, target_params: {
            "head": params,
            **target_io(cfg, target_params),
        },
        drafter=lambda shape, graphdef, cfg, k, sampler, tree: Eagle(
            layer_config(cfg), graphdef, k, sampler, tree
        ),
        loss=lambda graphdef, cfg, params, feats, tokens, mask, key, h: eagle_loss(
            graphdef, layer_config(cfg), params, feats, tokens, mask, key, h.noise, h.ce_weight
        ),
        shape_of=lambda h, cfg, tokens: {},
        expand=expand_heads,
        published=registry.Published(
            weights=("model.safetensors", "pytorch_model.bin"),
            tensors="fc + layers.0.*",
            owns=lambda t: (
                "fc.weight" in t
                and t["fc.weight"].ndim == 2
                and t["fc.weight"].shape[1] == 2 * t["fc.weight"].shape[0]
                and not any(k.startswith("midlayer.") for k in t)
                and "hidden_norm.weight" not in t  # a DFlash head fusing two layers (dflash_zlab)
            ),
            load=load_published_heads,
            files=published_files,
        ),
    ),
)
