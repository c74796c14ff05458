"""Medusa (Cai et al. 2024): extra decoding heads on the target's last feature, head i guessing the token
i + 2 positions ahead (the target's own head guesses i + 1). Drafts need no drafter forward pass beyond
the heads: a chain of top-1 guesses or the Cartesian top-k of the heads along a static tree."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads, precision, published
from specjax.drafting import registry
from specjax.drafting.layouts import Draft
from specjax.drafting.protocol import KOrTree, target_io
from specjax.drafting.trees import Tree
from specjax.errors import HeadsError
from specjax.models.config import LlamaConfig
from specjax.sampling import argmax
from specjax.training import losses


class MedusaHeads(nnx.Module):
    """`num_heads` heads of `num_layers` residual blocks `x + SiLU(W x + b)` (zero init: each head starts as the
    identity) and a vocabulary projection initialised from the target's output head `unembed_VH`."""

    def __init__(self, num_heads: int, num_layers: int, unembed_VH: jax.Array):
        vocab, dim = unembed_VH.shape
        self.w = nnx.Param(jnp.zeros((num_heads, num_layers, dim, dim), unembed_VH.dtype))  # [out, in]
        self.b = nnx.Param(jnp.zeros((num_heads, num_layers, dim), unembed_VH.dtype))
        self.proj = nnx.Param(jnp.broadcast_to(unembed_VH, (num_heads, vocab, dim)).copy())

    def __call__(self, feats_xH: jax.Array) -> jax.Array:
        """Logits `[..., num_heads, V]` (float32) from target features `[..., H]`."""
        x = jnp.broadcast_to(
            feats_xH[..., None, :], feats_xH.shape[:-1] + self.w.shape[:1] + feats_xH.shape[-1:]
        )
        for layer in range(self.w.shape[1]):
            x = x + jax.nn.silu(jnp.einsum("...ni,noi->...no", x, self.w[:, layer]) + self.b[:, layer])
        return jnp.einsum("...ni,nvi->...nv", x, self.proj[...]).astype(jnp.float32)


def init_medusa(num_heads: int, num_layers: int, unembed_VH: jax.Array):
    """(graphdef, params as a pure dict) of fresh heads."""
    graphdef, state = nnx.split(MedusaHeads(num_heads, num_layers, unembed_VH))
    return graphdef, nnx.to_pure_dict(state)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef",))
def medusa_logits(graphdef, params, feats_xH: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, params)(feats_xH)


@dataclasses.dataclass(frozen=True)
class Medusa(KOrTree):
    """Drafter: its state is the target's feature at the token before the pending one (which the target's head
    turned into the pending token). Candidates are the heads' top-k tokens: deterministic proposals."""

    graphdef: object
    num_heads: int
    vocab_size: int
    dim: int
    k: int
    tree: Tree | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.shape.dynamic:
            raise HeadsError(
                "Medusa drafts static trees only (its candidates do not depend on their parents); "
                "use a preset or explicit paths, or EAGLE for dynamic trees"
            )
        if not 1 <= self.k <= self.num_heads:
            raise HeadsError(
                f"Medusa with {self.num_heads} heads drafts 1..{self.num_heads} tokens deep; got "
                f"k={self.k}: lower k, use a shallower tree, or train more heads"
            )

    def validate(self, target_cfg: LlamaConfig) -> None:
        if (self.vocab_size, self.dim) != (target_cfg.vocab_size, target_cfg.dim):
            raise HeadsError(
                f"Medusa heads for vocabulary {self.vocab_size} and width {self.dim} cannot serve a "
                f"target with vocabulary {target_cfg.vocab_size} and width {target_cfg.dim}: "
                "train heads for this target"
            )

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH):
        return jnp.take_along_axis(feats_BPH, (lengths_B - 1)[:, None, None], axis=1)[:, 0]

    def propose(self, params, feat_BH, seq_BS, n_tokens_B, key):
        logits = medusa_logits(self.graphdef, params, feat_BH)[:, : self.k]  # [B, k, V]
        layout = self.shape.layout(feat_BH.shape[0])
        if self.tree is None:
            return Draft(argmax(logits), None, layout), feat_BH
        arr = self.tree.arrays
        candidates = jax.lax.top_k(logits, int(arr.rank.max()) + 1)[1]  # [B, k, width]
        tokens = candidates[:, arr.depth[1:] - 1, arr.rank[1:]].astype(jnp.int32)
        return Draft(tokens, None, layout), feat_BH

    def commit(self, params, feat_BH, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return jnp.take_along_axis(feats_BDH, n_accepted_B[:, None, None], axis=1)[:, 0]


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef", "decay"))
def medusa_loss(graphdef, params, feats_BTH, tokens_BT, loss_mask_BT, decay: float):
    """Sum over heads i of decay^i * cross-entropy of head i at position t against token t + 2 + i (Medusa-1),
    over the tokens whose loss mask is 1."""
    logits = medusa_logits(graphdef, params, feats_BTH)  # [B, T, heads, V]
    n_heads, t = logits.shape[2], tokens_BT.shape[1]
    loss, metrics = 0.0, {}
    for i in range(n_heads):
        shift = i + 2
        head_logits, labels = logits[:, : t - shift, i], tokens_BT[:, shift:]
        weights = losses.predicted_mask(loss_mask_BT, shift, t - shift)
        ce = losses.masked_mean(losses.cross_entropy(head_logits, labels), weights)
        loss = loss + decay**i * ce
        metrics |= {
            f"head{i}_ce": ce,
            f"head{i}_top1": losses.masked_mean(losses.in_top(head_logits, labels, 1), weights),
            f"head{i}_top5": losses.masked_mean(losses.in_top(head_logits, labels, 5), weights),
        }
    return loss, metrics | {"loss": loss}


@dataclasses.dataclass(frozen=True)
class MedusaTraining:
    """`config.heads` of a Medusa training run."""

    num_heads: int = 4  # heads, head i predicts the token i + 2 ahead
    num_layers: int = 1  # residual blocks per head
    decay: float = 0.8  # head i's loss weight is decay^i (1 = uniform)
    RULES: ClassVar = {
        "num_heads": (lambda v: v >= 1, "must be >= 1"),
        "num_layers": (lambda v: v >= 1, "must be >= 1"),
        "decay": (lambda v: v > 0, "must be > 0"),
    }


# --- Medusa-1 as FasterDecoding/Medusa publishes it (`medusa/model/medusa_model.py`): `config.json` with
# `medusa_num_heads` and `medusa_num_layers`, and `medusa_lm_head.safetensors` or `medusa_lm_head.pt`: head i is
# residual blocks `{i}.{j}.linear.{weight,bias}` (x + SiLU(W x + b)) then `{i}.{num_layers}.weight` [V, H].


def load_published_heads(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    blocks = {tuple(map(int, k.split(".")[:2])) for k in t if re.fullmatch(r"\d+\.\d+\.linear\.weight", k)}
    n_heads = int(hf.get("medusa_num_heads") or 1 + max(i for i, _ in blocks | {(0, 0)}))
    n_layers = int(hf.get("medusa_num_layers", 1 + max((j for _, j in blocks), default=-1)))
    if "0.0.linear.weight" in t:
        published.check(where, "hidden size", t["0.0.linear.weight"].shape[0], cfg.dim)
    published.check(where, "hidden size", hf.get("hidden_size"), cfg.dim)
    published.check(where, "a vocabulary of", hf.get("vocab_size"), cfg.vocab_size)
    if f"0.{n_layers}.weight" in t:
        published.check(
            where, "a vocabulary (output rows) of", t[f"0.{n_layers}.weight"].shape[0], cfg.vocab_size
        )
    meta = heads.describe("medusa", {"num_heads": n_heads, "num_layers": n_layers}, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)
    get, d = published.getter(t, where), cfg.dim
    w = [[get(f"{i}.{j}.linear.weight", (d, d)) for j in range(n_layers)] for i in range(n_heads)]
    b = [[get(f"{i}.{j}.linear.bias", (d,)) for j in range(n_layers)] for i in range(n_heads)]
    proj = [get(f"{i}.{n_layers}.weight", (cfg.vocab_size, d)) for i in range(n_heads)]
    pure = {
        "w": np.asarray(w, np.float32).reshape(n_heads, n_layers, d, d),
        "b": np.asarray(b, np.float32).reshape(n_heads, n_layers, d),
        "proj": np.stack(proj),
    }
    return meta, graphdef, published.fill(fresh, pure)


def published_files(meta: dict, p, cfg: LlamaConfig, base_model: str | None = None) -> tuple[dict, dict]:
    w, b, proj = (np.asarray(p[k]) for k in ("w", "b", "proj"))
    n_heads, n_layers = w.shape[:2]
    t = {}
    for i in range(n_heads):
        for j in range(n_layers):
            t[f"{i}.{j}.linear.weight"], t[f"{i}.{j}.linear.bias"] = w[i, j], b[i, j]
        t[f"{i}.{n_layers}.weight"] = proj[i]
    config = {
        "medusa_num_heads": int(n_heads),
        "medusa_num_layers": int(n_layers),
        "hidden_size": cfg.dim,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": str(proj.dtype),
    }
    if base_model:
        config["base_model_name_or_path"] = base_model
    return t, config


def expand_heads(shape: dict, p: dict, ex, expansion, cfg: LlamaConfig) -> tuple[dict, dict]:
    """The heads for the expanded target (`specjax.expand`): residual blocks and projection zero-padded."""
    nh, nl = p["w"].shape[:2]
    d2 = expansion.dim
    new = {
        "w": ex.pad(p["w"], (nh, nl, d2, d2)),
        "b": ex.pad(p["b"], (nh, nl, d2)),
        "proj": ex.pad(p["proj"], (nh, cfg.vocab_size, d2)),
    }
    return new, shape


heads.register(
    "medusa",
    registry.TrainedHeads(
        settings=MedusaTraining,
        init=lambda shape, cfg, target_params, seed: init_medusa(
            shape["num_heads"], shape["num_layers"], target_io(cfg, target_params)["unembed"]
        ),
        drafter_params=lambda shape, params, cfg, target_params: params,
        drafter=lambda shape, graphdef, cfg, k, sampler, tree: Medusa(
            graphdef, shape["num_heads"], cfg.vocab_size, cfg.dim, k, tree
        ),
        loss=lambda graphdef, cfg, params, feats, tokens, mask, key, h: medusa_loss(
            graphdef, params, feats, tokens, mask, h.decay
        ),
        shape_of=lambda h, cfg, tokens: {"num_heads": h.num_heads, "num_layers": h.num_layers},
        expand=expand_heads,
        published=registry.Published(
            weights=("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
            tensors="{i}.{j}.linear.*",
            owns=lambda t: any(re.fullmatch(r"\d+\.\d+\.(linear\.)?weight", k) for k in t),
            load=load_published_heads,
            files=published_files,
        ),
    ),
)
