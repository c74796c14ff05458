"""EAGLE-3 (Li et al. 2025): a one-layer head over a fusion of the target's low, middle and high layers.

The target's residual streams after three layers (`feature_taps`) are concatenated and fused by a linear layer
into one feature; the head's decoder layer attends from concat(norm(embedding of token i + 1), norm(feature i))
and keeps the feature as its residual stream; its own norm and LM head give the next token over a draft
vocabulary (the N most frequent tokens of its training data, or the whole target vocabulary). While drafting it
feeds its own output features back in place of the fused target features, as EAGLE-1/2 do; training unrolls it
the same way ("training-time test") with the loss on the token distribution at every unrolled step.

Draft tokens are mapped back to target ids (`draft_ids`, the d2t map); a target token outside the draft
vocabulary gets q = 0, so sampled drafts stay exact under the acceptance rule.

A parallel head (head shape `"parallel": true`, P-EAGLE / PARD style) drafts K tokens in one pass: after the slot
of the pending token, which reads (its embedding, the target's feature before it) as above and gives depth 1, come
K - 1 slots reading two learned vectors, a MASK embedding and a MASK feature, at the positions that follow; slot j
(causal, over the head's committed cache) gives the distribution of depth j + 1 whatever was drafted before it, so
a chain samples each depth from its own distribution (trees take each depth's top-k). Training runs the same
slots at every anchor, against the target's distributions of the tokens they stand for.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads, precision, published
from specjax.drafters.eagle import Eagle, EagleState, check_published_layer, layer_config
from specjax.drafting import registry
from specjax.drafting.protocol import target_io
from specjax.errors import HeadsError, TrainingConfigError
from specjax.models.config import LlamaConfig
from specjax.models.llama import Block, Linear, RMSNorm, causal_mask, rope_angles
from specjax.models.weights import CheckpointError
from specjax.training import losses


def paper_layers(n_layers: int) -> tuple[int, int, int]:
    """The paper's low, middle and high layers: the inputs of layers 2, L/2 and L-3 (the outputs of layers 1,
    L/2 - 1 and L - 4), clipped to the model's layers."""
    return tuple(min(max(i, 0), n_layers - 1) for i in (1, n_layers // 2 - 1, n_layers - 4))


def frequent_tokens(tokens: np.ndarray, n: int, vocab_size: int) -> list[int]:
    """The `n` most frequent token ids of `tokens` (ties: the lower id), in increasing order."""
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)
    return sorted(int(i) for i in np.argsort(-counts, kind="stable")[:n])


class FusedInputBlock(Block):
    """EAGLE-3's decoder layer: attention reads concat(norm(token embedding), norm(feature)) [2H]; the residual
    stream is the feature; the rest is a decoder layer of the target's architecture."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        super().__init__(cfg, 0, rngs)
        dt = jnp.dtype(cfg.dtype)
        n_qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = Linear(2 * cfg.dim, n_qkv, cfg.qkv_bias, dt, rngs)
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)

    def __call__(self, embeds_BTH, x_BTH, cos, sin, cache, visible_BTS, offset: int):
        qkv = self.wqkv(jnp.concatenate([self.embed_norm(embeds_BTH), self.attn_norm(x_BTH)], axis=-1))
        return self.finish(x_BTH, qkv, cos, sin, cache, visible_BTS, offset)


class Eagle3Head(nnx.Module):
    def __init__(
        self, layer_cfg: LlamaConfig, n_taps: int, n_draft: int, rngs: nnx.Rngs, parallel: bool = False
    ):
        dt, dim = jnp.dtype(layer_cfg.dtype), layer_cfg.dim
        self.fc = Linear(n_taps * dim, dim, False, dt, rngs)
        self.layer = FusedInputBlock(layer_cfg, rngs)
        self.norm = RMSNorm(dim, layer_cfg.norm_eps, dt)
        self.lm_head = Linear(dim, n_draft, False, dt, rngs)
        # a parallel head's draft slots read these in place of (token embedding, feature)
        vector = lambda: nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (dim,), dt))
        self.mask_embed = vector() if parallel else None
        self.mask_feature = vector() if parallel else None
        self.inv_freq = tuple(float(f) for f in layer_cfg.inv_freq())

    def masked(self, embeds_BTH, feats_BTH, masked_BT):
        """The inputs with a parallel head's MASK embedding and MASK feature where `masked_BT`."""
        m = masked_BT[..., None]
        return (
            jnp.where(m, self.mask_embed[...], embeds_BTH),
            jnp.where(m, self.mask_feature[...], feats_BTH),
        )

    def fuse(self, taps_BTF):
        """The head's input feature [B, T, H] from the target's tapped layers [B, T, n_taps * H]."""
        return self.fc(taps_BTF)

    def unrolled(self, embeds_JBTH, feats_BTH):
        """Training-time test: draft-vocabulary logits [J, B, T, N] of J unrolled steps. Step j at anchor i sits
        at position i + j and reads embeds_JBTH[j, :, i] and the output feature of step j - 1 at anchor i (step 0:
        `feats_BTH`); it attends to step 0's keys at anchors <= i and to its own keys at steps 1..j, as drafting
        does (the prefix read with target features, then the draft chain). Only those scores are computed: T x T
        for step 0's keys and T x j for the chain, not T x JT. A parallel head's steps j >= 1 read its MASK
        embedding and feature instead (its draft slots: `embeds_JBTH[1:]` are not read)."""
        block, (b, t, _) = self.layer, feats_BTH.shape
        kv, hd = block.n_kv_heads, block.head_dim
        g = block.n_heads // kv
        causal = jnp.tril(jnp.ones((t, t), bool))
        x, chain, logits = feats_BTH, [], []
        for j, embeds in enumerate(embeds_JBTH):
            if j and self.mask_embed is not None:
                embeds, x = self.masked(embeds, x, jnp.ones((b, t), bool))
            positions = jnp.broadcast_to(jnp.arange(t) + j, (b, t))
            cos, sin = rope_angles(self.inv_freq, positions, t + len(embeds_JBTH))
            qkv = block.wqkv(jnp.concatenate([block.embed_norm(embeds), block.attn_norm(x)], axis=-1))
            q, k, v = block.heads(qkv, cos, sin)
            q = q.reshape(b, t, kv, g, hd) * hd**-0.5
            if j == 0:
                k0, v0 = k, v
            else:
                chain.append((k, v))
            scores = jnp.einsum("btkgd,bskd->bkgts", q, k0, preferred_element_type=jnp.float32)
            scores = [jnp.where(causal, scores, jnp.finfo(jnp.float32).min)]
            # the chain: one key per query (elementwise products: XLA CPU runs these tiny batched dots slowly)
            scores += [
                jnp.sum(q * kc[:, :, :, None], -1).transpose(0, 2, 3, 1)[..., None] for kc, _ in chain
            ]
            probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(v0.dtype)
            attn = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
            for s, (_, vc) in enumerate(chain):
                attn = attn + probs[..., t + s].transpose(0, 3, 1, 2)[..., None] * vc[:, :, :, None]
            x = block.residual(x, attn.reshape(b, t, -1))
            logits.append(self.lm_head(self.norm(x)).astype(jnp.float32))
        return jnp.stack(logits)

    def __call__(self, embeds_BTH, feats_BTH, positions_BT, cache, mask_BTW):
        """(draft-vocabulary logits [B, T, N] float32, output features [B, T, H], cache)."""
        b, t, _ = embeds_BTH.shape
        mask_BTW = jnp.broadcast_to(mask_BTW, (b, t, mask_BTW.shape[-1]))
        cos, sin = rope_angles(self.inv_freq, positions_BT, cache.size)
        visible = cache.visible(mask_BTW)
        x, cache = self.layer(embeds_BTH, feats_BTH, cos, sin, cache, visible, mask_BTW.shape[-1] - t)
        return self.lm_head(self.norm(x)).astype(jnp.float32), x, cache


def init_eagle3(
    target_cfg: LlamaConfig, n_taps: int, draft_ids, target_params, seed: int = 0, parallel: bool = False
):
    """(graphdef, params as a pure dict) of a fresh head; its LM head starts as the target's rows of the draft
    vocabulary."""
    head = Eagle3Head(layer_config(target_cfg), n_taps, len(draft_ids), nnx.Rngs(seed), parallel)
    unembed = target_io(target_cfg, target_params)["unembed"]
    head.lm_head.weight.set_value(
        jnp.asarray(unembed)[jnp.asarray(draft_ids)].astype(head.lm_head.weight.dtype)
    )
    graphdef, state = nnx.split(head)
    return graphdef, nnx.to_pure_dict(state)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef",))
def eagle3_apply(graphdef, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW, masked_BT=None):
    """(draft-vocabulary logits [B, T, N], output features [B, T, H], cache) for inputs (token i + 1, feature i),
    the features already fused (`Eagle3Head.fuse`) or the head's own; where `masked_BT`, a parallel head's MASK
    inputs instead. `params` = {"head", "embed", "unembed", "draft_ids"}."""
    head = nnx.merge(graphdef, params["head"])
    embeds = jnp.take(params["embed"], tokens_BT, axis=0)
    if masked_BT is not None:
        embeds, feats_BTH = head.masked(embeds, feats_BTH, masked_BT)
    return head(embeds, feats_BTH, positions_BT, cache, mask_BTW)


def to_target_vocab(draft_logits, draft_ids, vocab_size: int):
    """Draft-vocabulary logits [..., N] as target-vocabulary logits [..., V]: -inf (q = 0) outside it."""
    full = jnp.full((*draft_logits.shape[:-1], vocab_size), -jnp.inf, draft_logits.dtype)
    return full.at[..., draft_ids].set(draft_logits)


@dataclasses.dataclass(frozen=True)
class Eagle3(Eagle):
    """Drafter: EAGLE's chains, static trees and dynamic trees over an EAGLE-3 head; reads the target's
    `feature_taps` layers. A parallel head drafts all depths' distributions in one pass (`propose`)."""

    feature_taps: tuple[int, ...] = ()
    parallel: bool = False  # the head has MASK slots: one pass per round

    def validate(self, target_cfg: LlamaConfig) -> None:
        super().validate(target_cfg)
        if not self.feature_taps or max(self.feature_taps) >= target_cfg.n_layers:
            raise HeadsError(
                f"this EAGLE-3 head fuses layers {list(self.feature_taps)} but the target has "
                f"{target_cfg.n_layers} layers: train a head for this target"
            )

    @precision.follows_params
    def fuse(self, params, target_feats):
        n = len(self.feature_taps) * self.layer_cfg.dim  # the tapped layers; the final features follow
        return nnx.merge(self.graphdef, params["head"]).fuse(target_feats[..., :n])

    def apply(self, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW, masked_BT=None):
        logits, feats, cache = eagle3_apply(
            self.graphdef, params, tokens_BT, feats_BTH, positions_BT, cache, mask_BTW, masked_BT
        )
        return to_target_vocab(logits, params["draft_ids"], self.layer_cfg.vocab_size), feats, cache

    def propose(self, params, state: EagleState, seq_BS, n_tokens_B, key):
        if not self.parallel:
            return super().propose(params, state, seq_BS, n_tokens_B, key)
        # One pass from the committed slots: the last round re-read with true features up to the pending token's
        # slot `root` (depth 1), then K - 1 MASK slots (depths 2..K), slot i at position committed + i, causal; the
        # slots after the last MASK are padding (their positions clipped to the cache, their writes dropped).
        w, k = state.feats.shape[1], self.k
        root = (n_tokens_B - 2 - state.committed)[:, None]
        slots = jnp.arange(w + k - 1)[None]
        positions = jnp.minimum(state.committed[:, None] + slots, state.cache.size - 1)
        tokens = jnp.take_along_axis(seq_BS, jnp.minimum(positions + 1, seq_BS.shape[1] - 1), axis=1)
        feats = jnp.pad(self.fuse(params, state.feats), ((0, 0), (0, k - 1), (0, 0)))
        cache = state.cache.with_length(state.committed)
        logits, _, cache = self.apply(
            params, tokens, feats, positions, cache, causal_mask(w + k - 1), slots > root
        )
        depth_logits = jnp.take_along_axis(logits, (root + jnp.arange(k))[..., None], axis=1)  # [B, K, V]

        def step(cache_, tokens_BT, positions_BT, mask_BTW, ctx):  # a node's children: the next depth's
            depth = jnp.minimum(positions_BT - n_tokens_B[:, None] + 2, k - 1)  # (0-based) distribution
            return jnp.take_along_axis(depth_logits, depth[..., None], axis=1), ctx, cache_

        draft, _ = self.shape.search(
            step, self.sampler, depth_logits[:, 0], None, n_tokens_B - 1, cache, key
        )
        return draft, EagleState(cache.with_length(n_tokens_B - 1), state.feats, n_tokens_B - 1)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef", "unroll"))
def eagle3_unrolled(graphdef, params, taps_BTF, tokens_BT, unroll: int):
    """Draft-vocabulary logits [unroll, B, T - 1, N] of the training-time test (`Eagle3Head.unrolled`): step j
    at anchor i reads token i + j + 1 (a parallel head: MASK at j >= 1) and predicts token i + j + 2; `taps_BTF`:
    the tapped layers' outputs."""
    t = tokens_BT.shape[1]
    head = nnx.merge(graphdef, params["head"])
    anchors = jnp.arange(t - 1)
    embeds = [
        jnp.take(params["embed"], tokens_BT[:, jnp.minimum(anchors + j + 1, t - 1)], axis=0)
        for j in range(unroll)
    ]
    return head.unrolled(jnp.stack(embeds), head.fuse(taps_BTF[:, :-1]))


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef", "layer_cfg", "unroll", "step_weight"))
def eagle3_loss(
    graphdef, layer_cfg, params, feats_BTF, tokens_BT, loss_mask_BT, unroll: int, step_weight: float
):
    """Training-time test: the head is run `unroll` steps (`Eagle3Head.unrolled`), step 0 on the fused target
    features, each later step on its own output features of the step before; at step j anchor i sits at
    position i + j, reads token i + j + 1 and predicts token i + j + 2. The loss is step_weight^j x the
    cross-entropy of its draft distribution against the target's distribution restricted to the draft vocabulary,
    over anchors that exist, whose predicted token has loss mask 1 and whose target top token lies in the draft
    vocabulary (as the paper does). A parallel head's steps j >= 1 are its MASK slots (`Eagle3Head.unrolled`):
    the same positions, attention and targets, depth j + 1 of a draft from anchor i.
    `feats_BTF`: the tapped layers' outputs then the final features (`specjax.models.llama.features`)."""
    b, t, width = feats_BTF.shape
    n, dim, vocab = t - 1, layer_cfg.dim, params["embed"].shape[0]
    taps, final = feats_BTF[..., : width - dim], feats_BTF[..., width - dim :]
    ids = params["draft_ids"]
    target_logits = jnp.einsum("btd,vd->btv", final[:, 1:], jax.lax.stop_gradient(params["unembed"]))
    target_logits = target_logits.astype(jnp.float32)  # index m: the distribution of token m + 2
    in_vocab = jnp.zeros((vocab,), bool).at[ids].set(True)[jnp.argmax(target_logits, -1)]
    trained = in_vocab & (losses.predicted_mask(loss_mask_BT, 2, n) > 0)
    target_probs = jax.nn.softmax(target_logits[..., ids], axis=-1)
    target_top = jnp.argmax(target_probs, -1)
    anchors = jnp.arange(n)
    logits_J = eagle3_unrolled(graphdef, params, taps, tokens_BT, unroll)
    total, metrics = 0.0, {}
    for j, logits in enumerate(logits_J):
        shifted = lambda a: jnp.roll(a, -j, axis=1)  # index i -> i + j (the wrapped tail is masked out)
        weight = ((anchors < n - j)[None] & shifted(trained)).astype(jnp.float32)
        ce = -jnp.sum(shifted(target_probs) * jax.nn.log_softmax(logits), axis=-1)
        ce = jnp.sum(ce * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        hit = (jnp.argmax(logits, -1) == shifted(target_top)).astype(jnp.float32)
        total = total + step_weight**j * ce
        metrics |= {f"ce_{j}": ce, f"top1_{j}": jnp.sum(hit * weight) / jnp.maximum(jnp.sum(weight), 1.0)}
    return total, {"loss": total, **metrics}


@dataclasses.dataclass(frozen=True)
class Eagle3Training:
    """`config.heads` of an EAGLE-3 training run."""

    layers: tuple = ()  # target layers whose outputs are fused (low, middle, high); () = `paper_layers`
    draft_vocab: int = 0  # the N most frequent training tokens form the draft vocabulary; 0 = the target's
    unroll: int = 7  # training-time test: steps the head runs on its own features (the paper's 7)
    step_weight: float = 0.8  # the loss of unrolled step j weighs step_weight^j (the paper's 0.8)
    # P-EAGLE / PARD: the head drafts a chain in one pass, depths 2..unroll from learned MASK slots (draft K <= unroll)
    parallel: bool = False
    RULES: ClassVar = {
        "layers": (lambda v: all(isinstance(i, int) and i >= 0 for i in v), "must be layer indices >= 0"),
        "draft_vocab": (lambda v: v >= 0, "must be >= 0 (0 = the target's vocabulary)"),
        "unroll": (lambda v: v >= 1, "must be >= 1"),
        "step_weight": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
        "parallel": (lambda v: isinstance(v, bool), "must be True or False"),
    }


def check_training(h: Eagle3Training, target_cfg: LlamaConfig) -> None:
    if h.parallel and h.unroll < 2:
        raise TrainingConfigError(
            f"config heads.unroll={h.unroll} trains none of a parallel head's MASK slots; pass "
            "--config.heads.unroll=K, the chain length it will draft (>= 2)"
        )


def head_shape(h: Eagle3Training, target_cfg: LlamaConfig, tokens) -> dict:
    """The head's shape in heads.json: its fused layers, draft vocabulary (None: the target's) and, for a parallel
    head only, `"parallel": True` (absent: sequential, as every head written before it)."""
    layers = list(h.layers) or list(paper_layers(target_cfg.n_layers))
    if max(layers) >= target_cfg.n_layers:
        raise HeadsError(
            f"config heads.layers={layers} names a layer the {target_cfg.n_layers}-layer target does not "
            f"have; use indices below {target_cfg.n_layers}"
        )
    ids = None
    if 0 < h.draft_vocab < target_cfg.vocab_size:
        if tokens is None:
            raise HeadsError("a reduced draft vocabulary is chosen from training tokens; none were given")
        ids = frequent_tokens(tokens, h.draft_vocab, target_cfg.vocab_size)
    return {"layers": layers, "draft_ids": ids} | ({"parallel": True} if h.parallel else {})


def draft_ids(shape: dict, target_cfg: LlamaConfig) -> list[int]:
    return shape["draft_ids"] or list(range(target_cfg.vocab_size))


def make_drafter(shape, graphdef, cfg, k, sampler, tree) -> Eagle3:
    parallel = shape.get("parallel", False)
    return Eagle3(layer_config(cfg), graphdef, k, sampler, tree, tuple(shape["layers"]), parallel)


def drafter_params(shape, params, cfg, target_params) -> dict:
    ids = jnp.asarray(draft_ids(shape, cfg), jnp.int32)
    return {"head": params, **target_io(cfg, target_params), "draft_ids": ids}


def tiny_example(target, k, tree, sampler):
    """(drafter, params) of a fresh head for verify_exactness's tiny target, its LM head redrawn small: a copy of
    that target's deliberately peaked head would draft tokens the target never accepts, leaving the check no
    rejections to see."""
    cfg = target.cfg
    shape = head_shape(Eagle3Training(), cfg, None)
    graphdef, params = init_eagle3(cfg, len(shape["layers"]), draft_ids(shape, cfg), target.params)
    w = params["lm_head"]["weight"]
    params["lm_head"]["weight"] = 0.25 * jax.random.normal(jax.random.key(1), w.shape, w.dtype)
    return make_drafter(shape, graphdef, cfg, k, sampler, tree), drafter_params(
        shape, params, cfg, target.params
    )


# --- EAGLE-3 as SafeAILab/EAGLE (`eagle/model/cnets.py`), SpecForge and vLLM (`llama_eagle3.py`) publish it:
# `config.json` (a one-layer Llama config plus `draft_vocab_size`, optionally `eagle_aux_hidden_state_layer_ids`) and
# `model.safetensors` or `pytorch_model.bin` holding `fc.weight` [H, 3H], `midlayer.self_attn.{q,k,v}_proj.weight`
# [*, 2H] (input: concat(input_layernorm(embedding), hidden_norm(feature))), `midlayer.self_attn.o_proj.weight`,
# `midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
# `norm.weight`, `lm_head.weight` [N, H], `d2t` [N] (target id = draft id + d2t[draft id]) and `t2d` [V] (bool).
# Layer id j in `eagle_aux_hidden_state_layer_ids` is the input of target layer j, i.e. specjax's tap j - 1; without
# it the reference takes the inputs of layers 2, L/2, L-3 (`paper_layers`).


def load_published_heads(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    dim, vocab = cfg.dim, cfg.vocab_size
    if "fc.weight" not in t:
        raise CheckpointError(
            f"{where} has no fc.weight (a head reading no fused target layers); specjax's EAGLE-3 head fuses them"
        )
    published.check(where, "hidden size", t["fc.weight"].shape[0], dim)
    published.check(where, "hidden size", hf.get("hidden_size"), dim)
    published.check(where, "target hidden size", hf.get("target_hidden_size"), dim)
    published.check(where, "a vocabulary of", hf.get("vocab_size"), vocab)
    if "t2d" in t:
        published.check(where, "a vocabulary (t2d) of", len(t["t2d"]), vocab)
    n_draft = t["lm_head.weight"].shape[0] if "lm_head.weight" in t else None
    if n_draft is None or n_draft > vocab:
        raise CheckpointError(
            f"{where} has lm_head rows {n_draft} for a {vocab}-token target: use a head trained for this target"
        )
    published.check(where, "draft vocabulary (draft_vocab_size)", hf.get("draft_vocab_size"), n_draft)
    if hf.get("num_hidden_layers", 1) != 1 or hf.get("norm_before_residual"):
        raise CheckpointError(
            f"{where} has {hf.get('num_hidden_layers')} decoder layers or norm_before_residual=true; specjax's "
            "EAGLE-3 head is one layer keeping the un-normalised feature as its residual"
        )
    check_published_layer(hf, where, cfg)
    published.check_embedding(t, where, cfg, target_params)

    n_taps = t["fc.weight"].shape[1] // dim
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids:
        if len(ids) != n_taps or not all(1 <= int(j) <= cfg.n_layers for j in ids):
            raise CheckpointError(
                f"{where} fuses target layer inputs {list(ids)} with an fc for {n_taps} of them; specjax taps the "
                f"outputs of layers 0..{cfg.n_layers - 1} (ids 1..{cfg.n_layers}): use a head for this target"
            )
        layers = [int(j) - 1 for j in ids]
    else:
        layers = list(paper_layers(cfg.n_layers))
        published.check(where, "fused layers (fc inputs / hidden size)", n_taps, len(layers))

    if "d2t" in t:
        draft_ids = published.draft_ids_of(t["d2t"], t.get("t2d"), vocab, where)
    elif n_draft == vocab:
        draft_ids = np.arange(vocab)
    else:
        raise CheckpointError(
            f"{where} has a {n_draft}-token draft vocabulary but no d2t; download it again"
        )
    full = n_draft == vocab and np.array_equal(draft_ids, np.arange(vocab))
    meta = heads.describe(
        "eagle3", {"layers": layers, "draft_ids": None if full else draft_ids.tolist()}, cfg
    )
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)

    get = published.getter(t, where)
    layer = published.layer_from(t, where, cfg, "midlayer.", 2 * dim, fresh["layer"])
    layer["attn_norm"] = {"weight": get("midlayer.hidden_norm.weight", (dim,))}
    layer["embed_norm"] = {"weight": get("midlayer.input_layernorm.weight", (dim,))}
    pure = {
        "fc": {"weight": get("fc.weight", (dim, n_taps * dim))},
        "layer": layer,
        "norm": {"weight": get("norm.weight", (dim,))},
        "lm_head": {"weight": get("lm_head.weight", (n_draft, dim))},
    }
    return meta, graphdef, published.fill(fresh, pure)


def published_files(meta: dict, p, cfg: LlamaConfig, base_model: str | None = None) -> tuple[dict, dict]:
    shape, layer = meta["shape"], p["layer"]  # numpy arrays
    if shape.get("parallel"):
        raise HeadsError(
            "a parallel EAGLE-3 head (MASK slots) has no published EAGLE-3 layout; export it as specjax heads "
            "(python -m specjax.heads export WORKDIR DEST)"
        )
    ids = shape["draft_ids"] if shape["draft_ids"] is not None else range(cfg.vocab_size)
    d2t, t2d = published.d2t_t2d(ids, cfg.vocab_size)
    t = {
        "fc.weight": p["fc"]["weight"],
        **published.layer_tensors(layer, "midlayer.", cfg),
        "midlayer.input_layernorm.weight": layer["embed_norm"]["weight"],
        "midlayer.hidden_norm.weight": layer["attn_norm"]["weight"],
        "norm.weight": p["norm"]["weight"],
        "lm_head.weight": p["lm_head"]["weight"],
        "d2t": d2t,
        "t2d": t2d,
    }
    bias = "midlayer.self_attn.o_proj.bias" in t
    config = published.layer_config_json(cfg, "LlamaForCausalLMEagle3", bias, t["fc.weight"].dtype)
    config["draft_vocab_size"] = len(d2t)
    config["eagle_aux_hidden_state_layer_ids"] = [int(j) + 1 for j in shape["layers"]]
    return t, config


def expand_heads(shape: dict, p: dict, ex, expansion, cfg: LlamaConfig) -> tuple[dict, dict]:
    """The head for the expanded target (`specjax.expand`): fc fuses the tapped layers; the layer reads
    [embedding, feature]; a tap reads the residual after the same original layer."""
    d, d2 = cfg.dim, expansion.dim
    n_taps = p["fc"]["weight"].shape[1] // d
    fc = np.zeros((d2, n_taps * d2), ex.dt)
    for i in range(n_taps):
        fc[:d, i * d2 : i * d2 + d] = p["fc"]["weight"][:, i * d : (i + 1) * d]
    halves = [  # the q/k/v columns reading the embedding, then those reading the feature
        ex.block({**p["layer"], "wqkv": {"weight": w}}, np.random.default_rng([expansion.seed, 10**6]))
        for w in np.split(p["layer"]["wqkv"]["weight"], 2, axis=1)
    ]
    layer = halves[1] | {
        "wqkv": {"weight": np.concatenate([h["wqkv"]["weight"] for h in halves], axis=1)},
        "embed_norm": {"weight": ex.norm(p["layer"]["embed_norm"]["weight"])},
    }
    new = {
        "fc": {"weight": fc},
        "layer": layer,
        "norm": {"weight": ex.norm(p["norm"]["weight"])},
        "lm_head": {"weight": ex.pad(p["lm_head"]["weight"], (p["lm_head"]["weight"].shape[0], d2))},
    }
    # a parallel head's MASK inputs: zero in the extra dims, as the embeddings and features are
    if "mask_embed" in p:
        new |= {name: ex.pad(p[name], (d2,)) for name in ("mask_embed", "mask_feature")}
    where = expansion.original_layers(cfg.n_layers)
    return new, {**shape, "layers": [where[i] for i in shape["layers"]]}


heads.register(
    "eagle3",
    registry.TrainedHeads(
        settings=Eagle3Training,
        init=lambda shape, cfg, target_params, seed: init_eagle3(
            cfg,
            len(shape["layers"]),
            draft_ids(shape, cfg),
            target_params,
            seed,
            shape.get("parallel", False),
        ),
        drafter_params=drafter_params,
        drafter=make_drafter,
        loss=lambda graphdef, cfg, params, feats, tokens, mask, key, h: eagle3_loss(
            graphdef, layer_config(cfg), params, feats, tokens, mask, h.unroll, h.step_weight
        ),
        shape_of=head_shape,
        check=check_training,
        feature_taps=lambda shape, cfg: tuple(shape["layers"]),
        expand=expand_heads,
        published=registry.Published(
            weights=("model.safetensors", "pytorch_model.bin"),
            tensors="midlayer.*",
            owns=lambda t: any(k.startswith("midlayer.") for k in t),
            load=load_published_heads,
            files=published_files,
        ),
    ),
    example=tiny_example,
)
