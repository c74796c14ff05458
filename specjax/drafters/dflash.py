"""DFlash (Chen, Liang, Liu 2026): a block-diffusion draft that proposes a whole block in one forward pass.

Context: the target's residual streams after a few layers (shallow to deep, `layers`), concatenated and fused by
a linear layer and an RMSNorm into one feature per committed position. Draft: L decoder layers (with per-head q/k
norms, as the reference's) over the target's frozen embedding of the block [anchor, MASK x (B - 1)], the anchor
being the pending token and MASK a token of the target's vocabulary (z-lab's `mask_token_id`). In every layer
the queries are the block's; keys and values are [the context features' ; the block's], so the block sees every
committed position and itself (bidirectionally); RoPE positions continue the sequence. Block position i >= 1
gives the distribution of draft token i through the target's frozen LM head: B - 1 distributions from one pass,
each tilted, where the head has a Markov head (DSpark's), by a low-rank bias from draft token i - 1.

The context's keys and values do not depend on the block, so they live in the draft's own static cache: each
round writes the features the verification pass computed at the tokens it committed (one pass over D + 1
features), then runs the block (one pass over B tokens). Training draws anchors at random and runs every block
against the whole sequence's context under the block-causal mask (a block sees the context before its anchor
and itself), as drafting does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from specjax import heads, precision
from specjax.drafters import dflash_zlab
from specjax.drafting import registry
from specjax.drafting.protocol import KOrTree, target_io, target_signature
from specjax.drafting.trees import DynamicTree, Tree
from specjax.errors import DrafterError, HeadsError
from specjax.models.config import ATTENTION, LlamaConfig
from specjax.models.llama import Block, Linear, RMSNorm, apply_rope, init_cache, rope_angles
from specjax.sampling import Sampler
from specjax.training import divergences, losses


def paper_layers(n_target_layers: int, n_draft_layers: int) -> tuple[int, ...]:
    """z-lab's choice of tapped target layers: the middle one for one draft layer, else `n_draft_layers` evenly
    spread from layer 1 to layer L - 3 (clipped to the target's layers)."""
    if n_draft_layers == 1:
        return (n_target_layers // 2,)
    start, end = 1, n_target_layers - 3
    spread = [round(start + i * (end - start) / (n_draft_layers - 1)) for i in range(n_draft_layers)]
    return tuple(min(max(i, 0), n_target_layers - 1) for i in spread)


class DFlashLayer(Block):
    """A decoder layer of the target's shape with per-head RMSNorms on queries and keys (before RoPE), whose keys
    and values are also computed from the context features (`context`)."""

    def __init__(self, cfg: LlamaConfig, layer: int, rngs: nnx.Rngs):
        super().__init__(cfg, layer, rngs)
        dt = jnp.dtype(cfg.dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dt)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dt)

    def heads(self, qkv, cos, sin):
        b, t, _ = qkv.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.q_norm(qkv[..., : h * hd].reshape(b, t, h, hd)), cos, sin)
        k = apply_rope(self.k_norm(qkv[..., h * hd : (h + kv) * hd].reshape(b, t, kv, hd)), cos, sin)
        return q, k, qkv[..., (h + kv) * hd :].reshape(b, t, kv, hd)

    def context(self, ctx_BNH, cos, sin):
        """Keys and values [B, N, kv heads, D] of N context features (the rows of the k/v projection only)."""
        b, n, _ = ctx_BNH.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        kvp = jnp.einsum("bnd,od->bno", ctx_BNH, self.wqkv.matrix()[h * hd :])
        if self.wqkv.bias is not None:
            kvp = kvp + self.wqkv.bias[h * hd :]
        k = apply_rope(self.k_norm(kvp[..., : kv * hd].reshape(b, n, kv, hd)), cos, sin)
        return k, kvp[..., kv * hd :].reshape(b, n, kv, hd)


class MarkovBias(nnx.Module):
    """DSpark's Markov head: a low-rank bias on a block position's logits from the token before it,
    `inp[token] @ out` ([V, r] x [r, V]); `out` starts at zero (the plain head's drafts)."""

    def __init__(self, vocab: int, rank: int, dt, rngs: nnx.Rngs):
        self.inp = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab, rank), dt))
        self.out = nnx.Param(jnp.zeros((rank, vocab), dt))

    def embed(self, previous_x):
        """The tokens' rank-r embeddings [..., r]."""
        return jnp.take(self.inp[...], previous_x, axis=0)

    def __call__(self, previous_x):
        return (self.embed(previous_x) @ self.out[...]).astype(jnp.float32)


class DFlashHead(nnx.Module):
    def __init__(
        self,
        draft_cfg: LlamaConfig,
        n_taps: int,
        confidence: bool,
        rngs: nnx.Rngs,
        masks=None,
        markov: int = 0,
    ):
        dt, dim = jnp.dtype(draft_cfg.dtype), draft_cfg.dim
        # learned MASK embeddings [B - 1, H], one per block position (None: the target's embedding of mask_token)
        self.masks = None if masks is None else nnx.Param(jnp.asarray(masks, dt))
        self.fc = Linear(n_taps * dim, dim, False, dt, rngs)
        self.hidden_norm = RMSNorm(dim, draft_cfg.norm_eps, dt)
        self.layers = nnx.List([DFlashLayer(draft_cfg, i, rngs) for i in range(draft_cfg.n_layers)])
        self.norm = RMSNorm(dim, draft_cfg.norm_eps, dt)
        # DSpark's confidence head: logits of each block position's acceptance given all before it, greedy and
        # sampled (T = 1), from its features and the Markov head's embedding of the token before it (if any)
        self.confidence = Linear(dim + markov, 2, True, dt, rngs) if confidence else None
        # rank of the Markov head (`MarkovBias`; 0: none): drafted tokens then depend on the one before them
        self.markov = MarkovBias(draft_cfg.vocab_size, markov, dt, rngs) if markov else None
        self.inv_freq = tuple(float(f) for f in draft_cfg.inv_freq())

    def embed(self, embed_VH, tokens_BxT):
        """The block's inputs [..., T, H]: the tokens' embeddings, with block positions >= 1 given the learned MASK
        embeddings where the head has them."""
        x = jnp.take(embed_VH, tokens_BxT, axis=0)
        if self.masks is None:
            return x
        t = tokens_BxT.shape[-1]
        masks = jnp.broadcast_to(self.masks[...][: t - 1], (*x.shape[:-2], t - 1, x.shape[-1]))
        return jnp.concatenate([x[..., :1, :], masks.astype(x.dtype)], -2)

    def context(self, taps_BNF):
        """The fused context features [B, N, H] from the target's tapped layers [B, N, n_taps * H]."""
        return self.hidden_norm(self.fc(taps_BNF))

    def extend(self, taps_BNF, positions_BN, cache):
        """The cache with every layer's context keys/values of N positions written after its committed length
        (not committed: the caller sets the length)."""
        ctx = self.context(taps_BNF)
        cos, sin = rope_angles(self.inv_freq, positions_BN, cache.size)
        for layer in self.layers:
            k, v = layer.context(ctx, cos, sin)
            cache = cache.write(layer.layer, k.swapaxes(1, 2), v.swapaxes(1, 2))
        return cache

    def __call__(self, embeds_BTH, positions_BT, cache):
        """The block's final features [B, T, H]: it sees the committed context and the whole block."""
        b, t, _ = embeds_BTH.shape
        cos, sin = rope_angles(self.inv_freq, positions_BT, cache.size)
        visible = cache.visible(jnp.ones((b, t, t), bool))
        x = embeds_BTH
        for layer in self.layers:
            x, cache = layer(x, cos, sin, cache, visible, 0)
        return self.norm(x)

    def acceptance(self, x, previous_x):
        """The confidence head's logits [..., 2] of each position's acceptance from its final features `x` and the
        token before it (which only a Markov head reads; its embedding detached: this head's loss leaves the draft
        alone)."""
        if self.markov is not None:
            embedding = jax.lax.stop_gradient(self.markov.embed(previous_x))
            x = jnp.concatenate([x, embedding.astype(x.dtype)], -1)
        return self.confidence(x).astype(jnp.float32)

    def bias(self, previous_x):
        """The Markov head's logit bias [..., V] for positions after the tokens `previous_x` (0 without one)."""
        return 0.0 if self.markov is None else self.markov(previous_x)

    def blocks(self, embeds_BNTH, positions_BNT, taps_BSF, anchors_BN):
        """Training: the final features [B, N, T, H] of N blocks over one sequence's S context positions, block n
        seeing the context before its anchor and itself (what drafting at that anchor sees). Each block attends
        to the context and to its own T positions only: O(N T (S + T)), not the O(N T (S + N T)) of one masked
        pass over all blocks."""
        b, n, t, dim = embeds_BNTH.shape
        s = taps_BSF.shape[1]
        ctx = self.context(taps_BSF)
        ctx_cos, ctx_sin = rope_angles(self.inv_freq, jnp.broadcast_to(jnp.arange(s), (b, s)), s + t)
        cos, sin = rope_angles(self.inv_freq, positions_BNT.reshape(b, n * t), s + t)
        sees_ctx = jnp.arange(s)[None, None] < anchors_BN[:, :, None]  # [B, N, S]
        split = lambda a: a.reshape(b, n, t, *a.shape[2:])  # [B, NT, ...] -> [B, N, T, ...]
        x = embeds_BNTH.reshape(b, n * t, dim)
        for layer in self.layers:
            q, k, v = layer.heads(layer.wqkv(layer.attn_norm(x)), cos, sin)
            k_ctx, v_ctx = layer.context(ctx, ctx_cos, ctx_sin)
            attn = attend_blocks(split(q), k_ctx, v_ctx, sees_ctx, split(k), split(v))
            x = layer.residual(x, attn.reshape(b, n * t, -1))
        return self.norm(x).reshape(b, n, t, dim)


def attend_blocks(q_BNTHD, k_BSKD, v_BSKD, sees_BNS, k_BNTKD, v_BNTKD):
    """Grouped-query attention [B, N, T, heads * D] of N blocks of T queries, each over the S context keys it
    sees (`sees_BNS`) and its own block's T keys (all visible): one softmax over both."""
    b, n, t, h, d = q_BNTHD.shape
    kv = k_BSKD.shape[2]
    q = q_BNTHD.reshape(b, n, t, kv, h // kv, d) * d**-0.5
    f32 = dict(preferred_element_type=jnp.float32)
    on_ctx = jnp.einsum("bntkgd,bskd->bnkgts", q, k_BSKD, **f32)
    on_ctx = jnp.where(sees_BNS[:, :, None, None, None], on_ctx, jnp.finfo(jnp.float32).min)
    on_block = jnp.einsum("bntkgd,bnukd->bnkgtu", q, k_BNTKD, **f32)
    probs = jax.nn.softmax(jnp.concatenate([on_ctx, on_block], -1), axis=-1).astype(v_BSKD.dtype)
    out = jnp.einsum("bnkgts,bskd->bntkgd", probs[..., : k_BSKD.shape[1]], v_BSKD)
    out = out + jnp.einsum("bnkgtu,bnukd->bntkgd", probs[..., k_BSKD.shape[1] :], v_BNTKD)
    return out.reshape(b, n, t, h * d)


def draft_config(target_cfg: LlamaConfig, shape: dict) -> LlamaConfig:
    """The draft's decoder layers (heads.json's `shape`): `n_layers` layers of the target's width and MLP, with the
    target's attention heads or the shape's own `attention` (n_heads, n_kv_heads, head_dim)."""
    return target_cfg.head_layers(shape["n_layers"], shape.get("attention"))


def init_dflash(
    draft_cfg: LlamaConfig,
    n_taps: int,
    confidence: bool = False,
    seed: int = 0,
    masks=None,
    markov: int = 0,
):
    """(graphdef, params as a pure dict) of a fresh head; `masks` [B - 1, H]: learned MASK embeddings' start;
    `markov`: the Markov head's rank (0: none)."""
    head = DFlashHead(draft_cfg, n_taps, confidence, nnx.Rngs(seed), masks, markov)
    graphdef, state = nnx.split(head)
    return graphdef, nnx.to_pure_dict(state)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef",))
def dflash_extend(graphdef, params, taps_BNF, positions_BN, cache):
    """The draft cache with N context positions' keys/values written after its committed length."""
    return nnx.merge(graphdef, params["head"]).extend(taps_BNF, positions_BN, cache)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef",))
def dflash_block(graphdef, params, tokens_BT, positions_BT, cache):
    """(logits [B, T, V] float32, final features [B, T, H]) of the block `tokens_BT` over the committed context;
    position i >= 1 is the distribution of draft token i (without the Markov head's bias, which depends on draft
    token i - 1). `params` = {"head", "embed", "unembed"}."""
    head = nnx.merge(graphdef, params["head"])
    x = head(head.embed(params["embed"], tokens_BT), positions_BT, cache)
    logits = jnp.einsum("btd,vd->btv", x, params["unembed"]).astype(jnp.float32)
    return logits, x


@struct.dataclass
class DFlashState:
    # the draft layers' context keys/values; committed: every position before the pending token
    cache: object
    # [B, D + 1, F] the target's tapped features at the last round's pending and accepted tokens
    taps: jax.Array


@dataclasses.dataclass(frozen=True)
class DFlash(KOrTree):
    """Drafter: a block (the pending token and masks) drafted in one pass, of the head's trained size or k + 1
    tokens where k is longer, whose first k positions are the draft; chains sampled from the per-position
    distributions, static trees from their top-k, or dynamic trees (EAGLE-2's search over them), each
    position tilted by a Markov head's bias from its parent's token where the head has one."""

    weights_key: ClassVar[str] = "head"  # its params: the head's weights beside the target's frozen arrays
    draft_cfg: LlamaConfig
    graphdef: object
    k: int
    sampler: Sampler = Sampler()
    tree: Tree | DynamicTree | None = None
    feature_taps: tuple[int, ...] = ()
    mask_token: int = 0
    has_confidence: bool = False  # the head has a confidence head
    confidence: bool = True  # size each chain's verified prefix with it (where the head has one)
    verify_cost: float = 0.1  # the cost of verifying one more token, relative to a round's fixed cost
    max_k: int = 0  # the longest draft the head has MASK embeddings for (learned masks: B - 1; 0: any)
    # the block the head was trained on: a shorter one would change what each position attends to (masks attend to
    # each other), and drafted worse (the TVD head's first 7 positions: tau -7% at T = 0 and -4% at T = 1 from a
    # block of 8 instead of its 16)
    block_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.max_k and self.k > self.max_k:
            raise DrafterError(
                f"k={self.k} is longer than this DFlash head's block of {self.max_k + 1} (it learned one MASK "
                f"embedding per block position): draft k <= {self.max_k} or train a head with a larger block_size"
            )

    @property
    def block(self) -> int:
        """The tokens of a draft pass: the pending one and its masks."""
        return max(self.k + 1, self.block_size)

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        """The verified prefix lengths a confidence-sized chain chooses from (one compiled round each)."""
        if not (self.has_confidence and self.confidence) or self.tree is not None:
            return ()
        return tuple(sorted({max(1, (self.k + 1) // 4), max(1, (self.k + 1) // 2), self.k}))

    def validate(self, target_cfg: LlamaConfig) -> None:
        mine = self.draft_cfg
        # the draft's attention heads may be its own (a shape's "attention")
        own = target_cfg.replace(**{k: getattr(mine, k) for k in ATTENTION})
        if target_signature(mine) != target_signature(own) or max(self.feature_taps) >= target_cfg.n_layers:
            raise HeadsError(
                f"this DFlash head was built for a target of vocabulary {mine.vocab_size}, width {mine.dim} and "
                f"at least {max(self.feature_taps) + 1} layers, not vocabulary {target_cfg.vocab_size}, width "
                f"{target_cfg.dim} and {target_cfg.n_layers} layers (or another MLP width): train a head for "
                "this target"
            )
        if not 0 <= self.mask_token < target_cfg.vocab_size:
            raise HeadsError(
                f"this DFlash head's mask token {self.mask_token} is outside the target's vocabulary of "
                f"{target_cfg.vocab_size}: train a head for this target"
            )

    @property
    def taps_width(self) -> int:
        """The width of the tapped layers' features (the final features follow them in the loop's)."""
        return len(self.feature_taps) * self.draft_cfg.dim

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH):
        batch, width = tokens_BP.shape
        positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
        cache = init_cache(self.draft_cfg, batch, cache_size + self.block)  # room for a block at the end
        cache = dflash_extend(self.graphdef, params, feats_BPH[..., : self.taps_width], positions, cache)
        taps = jnp.zeros((batch, self.shape.depth + 1, self.taps_width), feats_BPH.dtype)
        return DFlashState(cache.with_length(lengths_B), taps)

    def propose(self, params, state: DFlashState, seq_BS, n_tokens_B, key):
        # the last round's committed tokens join the context: every position before the pending token
        w = state.taps.shape[1]
        positions = state.cache.length[:, None] + jnp.arange(w)[None]
        cache = dflash_extend(self.graphdef, params, state.taps, positions, state.cache)
        cache = cache.with_length(n_tokens_B - 1)
        pending = jnp.take_along_axis(seq_BS, (n_tokens_B - 1)[:, None], axis=1)
        masks = jnp.full((pending.shape[0], self.block - 1), self.mask_token)
        positions = (n_tokens_B - 1)[:, None] + jnp.arange(self.block)[None]
        tokens = jnp.concatenate([pending, masks], 1).astype(jnp.int32)
        logits, x = dflash_block(self.graphdef, params, tokens, positions, cache)
        logits, x = logits[:, 1 : self.k + 1], x[:, : self.k + 1]
        head = nnx.merge(self.graphdef, params["head"])

        def step(cache_, tokens_BT, positions_BT, mask_BTW, ctx):  # a node's children: the next position's
            depth = positions_BT - n_tokens_B[:, None] + 1
            index = jnp.minimum(depth, self.k - 1)[..., None]
            return jnp.take_along_axis(logits, index, axis=1) + head.bias(tokens_BT), ctx, cache_

        first = logits[:, 0] + head.bias(pending[:, 0])
        draft, _ = self.shape.search(step, self.sampler, first, None, n_tokens_B, cache, key)
        if self.verify_lengths:
            # the confidence reads the block's greedy path (its greedy draft), a function of the context alone: a
            # length chosen from the sampled tokens would verify a token more often where the head trusts it, and
            # sampled output would lean towards such tokens
            greedy = (
                draft
                if self.sampler.greedy
                else self.shape.search(step, Sampler(), first, None, n_tokens_B, cache, key)[0]
            )
            previous = jnp.concatenate([pending, greedy.tokens[:, :-1]], 1)
            confidence = head.acceptance(x[:, 1:], previous)
            draft = draft.replace(lengths=self.verify_lengths, scores=self.gains(confidence))
        return draft, DFlashState(cache, state.taps)

    def gains(self, confidence_BK2):
        """[B, len(verify_lengths)] each row's expected tokens per round over the round's cost when the first m
        tokens are verified, (1 + sum over i <= m of P(positions 1..i accepted)) / (1 + verify_cost x m): the round
        verifies the length of the best mean over the live rows."""
        c = jax.nn.sigmoid(confidence_BK2[..., 0 if self.sampler.greedy else 1])
        expected = 1 + jnp.cumsum(jnp.cumprod(c, axis=1), axis=1)  # [B, K]: verifying m tokens, at m - 1
        m = jnp.asarray(self.verify_lengths)
        return expected[:, m - 1] / (1 + self.verify_cost * m)

    def commit(self, params, state: DFlashState, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state.replace(taps=feats_BDH[..., : self.taps_width])


def choose_anchors(key, loss_mask_BT, n_blocks: int):
    """(anchors [B, N], valid [B, N]): N distinct positions a in [1, T - 2] per row whose token a + 1 has loss
    mask 1, drawn uniformly (Gumbel top-N); a row with fewer such positions pads with invalid ones."""
    b, t = loss_mask_BT.shape
    a = jnp.arange(t)
    ok = (a >= 1) & (a <= t - 2) & (jnp.roll(loss_mask_BT, -1, axis=1) > 0)
    scores = jnp.where(ok, jax.random.gumbel(key, (b, t)), -jnp.inf)
    top, anchors = jax.lax.top_k(scores, n_blocks)
    return anchors, top > -jnp.inf


@precision.follows_params
@functools.partial(
    jax.jit, static_argnames=("graphdef", "dim", "n_blocks", "block_size", "decay", "divergence")
)
def dflash_loss(
    graphdef,
    dim: int,
    params,
    feats_BTF,
    tokens_BT,
    loss_mask_BT,
    key,
    n_blocks: int,
    block_size: int,
    decay: float,
    divergence: str,
    mask_token: int,
    confidence_weight: float,
):
    """Random anchors (`choose_anchors`), each the block [token a, MASK x (B - 1)] at positions a .. a + B - 1
    over the context before a; block position i predicts token a + i, whose loss mask must be 1. The loss is the
    mean over those terms, weighted exp(-(i - 1) / decay), of `divergence` between the target's distribution of
    token a + i and the block's ("cross_entropy": against the data's token a + i). A confidence head adds
    `confidence_weight` x its binary cross-entropy (unweighted by position) against each position's acceptance:
    greedy, the argmaxes agree; sampled, 1 - TVD(p, q) (`divergences.acceptance`); it reads the draft's features
    detached, so it does not change the draft. A Markov head's bias at position i follows the data's token
    a + i - 1 (the anchor at i = 1).
    `feats_BTF`: the tapped layers' outputs then the final features."""
    b, t, width = feats_BTF.shape
    taps, final = feats_BTF[..., : width - dim], feats_BTF[..., width - dim :]
    anchors, valid = choose_anchors(key, loss_mask_BT, n_blocks)
    offsets = jnp.arange(block_size)
    positions = anchors[:, :, None] + offsets  # [B, N, T_block]
    block = jnp.where(offsets == 0, jnp.take_along_axis(tokens_BT, anchors, 1)[:, :, None], mask_token)
    head = nnx.merge(graphdef, params["head"])
    x = head.blocks(head.embed(params["embed"], block), positions, taps, anchors)[:, :, 1:]
    logits = jnp.einsum("bnid,vd->bniv", x, params["unembed"]).astype(jnp.float32)
    # token a + i; its target distribution is at a + i - 1
    predicted = jnp.minimum(positions[:, :, 1:], t - 1)
    at = lambda a_BT, idx=predicted: jax.vmap(lambda row, i: row[i])(a_BT, idx)
    previous = at(tokens_BT, predicted - 1)  # the data's token a + i - 1
    logits = logits + head.bias(previous)
    unembed = jax.lax.stop_gradient(params["unembed"])
    target_logits = at(jnp.einsum("btd,vd->btv", final, unembed).astype(jnp.float32), predicted - 1)
    i = offsets[1:]
    weight = valid[:, :, None] & (positions[:, :, 1:] <= t - 1) & (at(loss_mask_BT) > 0)
    weight = weight * jnp.exp(-(i - 1) / decay)
    if divergence == "cross_entropy":
        terms = losses.cross_entropy(logits, at(tokens_BT))
    else:
        terms = divergences.divergence(divergence, target_logits, logits)
    loss = jnp.sum(terms * weight) / jnp.maximum(jnp.sum(weight), 1e-9)
    hit = jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)
    counted = weight > 0
    metrics = {}
    if head.confidence is not None:
        sampled, _ = divergences.acceptance(target_logits, jax.lax.stop_gradient(logits))
        labels = jnp.stack([hit.astype(jnp.float32), sampled], -1)
        # its loss leaves the draft alone
        scores = head.acceptance(jax.lax.stop_gradient(x), previous)
        bce = jnp.sum(optax.sigmoid_binary_cross_entropy(scores, labels), -1)
        metrics["confidence_bce"] = losses.masked_mean(bce, counted.astype(jnp.float32))
        loss = loss + confidence_weight * metrics["confidence_bce"]
    metrics |= {
        "loss": loss,
        "top1": jnp.sum(hit & counted) / jnp.maximum(jnp.sum(counted), 1),
        "tau_greedy": greedy_tokens_per_round(hit, counted),
    }
    return loss, metrics


def greedy_tokens_per_round(hit_BNI, counted_BNI):
    """Greedy tokens per round at the blocks whose first position is counted, bonus included: a block's positions
    are accepted while every one before agrees with the target's argmax; a position the loss mask leaves out
    (unknown agreement) ends the run."""
    run = jnp.cumprod(hit_BNI & counted_BNI, axis=-1)
    return 1 + jnp.sum(run) / jnp.maximum(jnp.sum(counted_BNI[..., 0]), 1)


@dataclasses.dataclass(frozen=True)
class DFlashTraining:
    """`config.heads` of a DFlash training run."""

    layers: tuple = ()  # target layers whose outputs form the context; () = z-lab's rule (`paper_layers`)
    n_layers: int = 1  # draft decoder layers
    # the draft's attention heads (0: the target's): a target with tiny heads (stories260K's head_dim 8) drafts
    # better with fewer, wider ones
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    block_size: int = 8  # B: the anchor and B - 1 masks (decoding drafts k = B - 1 by default)
    blocks: int = 8  # anchors drawn per training sequence
    decay: float = 4.0  # block position i's loss weighs exp(-(i - 1) / decay) (the paper's 4 for B = 8)
    # against the target's distribution; or "cross_entropy" on the data's tokens
    divergence: str = "forward_kl"
    mask_token: int = 0  # the target token whose embedding is MASK (stories260K's <unk>)
    confidence: bool = False  # train a confidence head (DSpark) beside the draft
    # MASK as a learned embedding per block position, started at the target's embedding of mask_token (False: that
    # embedding everywhere, as z-lab's heads, whose layout has no place for learned ones)
    learned_masks: bool = False
    # rank of DSpark's Markov head (0: none): a low-rank bias on each position's logits from the token before it,
    # so a drafted token depends on the one drafted before it (parallel drafting's blind spot)
    markov: int = 0
    confidence_weight: float = 1.0  # its loss's weight
    RULES: ClassVar = {
        "layers": (lambda v: all(isinstance(i, int) and i >= 0 for i in v), "must be layer indices >= 0"),
        "n_layers": (lambda v: 1 <= v <= 5, "must be 1..5"),
        "n_heads": (lambda v: v >= 0, "must be >= 0 (0 = the target's)"),
        "n_kv_heads": (lambda v: v >= 0, "must be >= 0 (0 = the target's)"),
        "head_dim": (lambda v: v >= 0 and v % 2 == 0, "must be even and >= 0 (0 = the target's)"),
        "block_size": (lambda v: v >= 2, "must be >= 2"),
        "blocks": (lambda v: v >= 1, "must be >= 1"),
        "decay": (lambda v: v > 0, "must be > 0"),
        "divergence": (
            lambda v: v in ("cross_entropy", *divergences.DIVERGENCES),
            f"must be cross_entropy or one of {divergences.DIVERGENCES}",
        ),
        "mask_token": (lambda v: v >= 0, "must be a token id >= 0"),
        "confidence_weight": (lambda v: v >= 0, "must be >= 0"),
        "markov": (lambda v: v >= 0, "must be >= 0 (0 = no Markov head)"),
    }


def head_shape(h: DFlashTraining, target_cfg: LlamaConfig, tokens) -> dict:
    """The head's shape in heads.json: its context layers, draft layers, block size, mask token, its own attention
    heads (absent: the target's), whether it has a confidence head and learned masks, and its Markov head's rank
    (each absent: none)."""
    layers = list(h.layers) or list(paper_layers(target_cfg.n_layers, h.n_layers))
    if max(layers) >= target_cfg.n_layers or h.mask_token >= target_cfg.vocab_size:
        raise HeadsError(
            f"config heads.layers={layers} or heads.mask_token={h.mask_token} is outside the target's "
            f"{target_cfg.n_layers} layers or {target_cfg.vocab_size} tokens; choose ones it has"
        )
    shape = dict(layers=layers, n_layers=h.n_layers, block_size=h.block_size, mask_token=h.mask_token)
    own = (h.n_heads, h.n_kv_heads, h.head_dim)
    if any(own):
        attention = [v or getattr(target_cfg, k) for k, v in zip(ATTENTION, own)]
        if attention[0] % attention[1]:
            raise HeadsError(
                f"config heads.n_heads={attention[0]} is not a multiple of heads.n_kv_heads={attention[1]} (0 takes "
                "the target's): choose n_heads as a multiple of n_kv_heads"
            )
        if attention != [getattr(target_cfg, k) for k in ATTENTION]:
            shape["attention"] = attention
    return (
        shape
        | ({"confidence": True} if h.confidence else {})
        | ({"learned_masks": True} if h.learned_masks else {})
        | ({"markov": h.markov} if h.markov else {})
    )


def init_head(shape: dict, cfg: LlamaConfig, target_params, seed: int):
    """(graphdef, params) of a fresh head of `shape` (heads.json's) for the target."""
    masks = None
    if shape.get("learned_masks"):
        mask = np.asarray(target_io(cfg, target_params)["embed"][shape["mask_token"]])
        masks = np.repeat(mask[None], shape["block_size"] - 1, 0)
    return init_dflash(
        draft_config(cfg, shape),
        len(shape["layers"]),
        shape.get("confidence", False),
        seed,
        masks,
        shape.get("markov", 0),
    )


def make_drafter(shape, graphdef, cfg, k, sampler, tree) -> DFlash:
    draft_cfg = draft_config(cfg, shape)
    layers, confidence = tuple(shape["layers"]), shape.get("confidence", False)
    block = shape["block_size"]
    max_k = block - 1 if shape.get("learned_masks") else 0
    mask = shape["mask_token"]
    return DFlash(
        draft_cfg, graphdef, k, sampler, tree, layers, mask, confidence, max_k=max_k, block_size=block
    )


def drafter_params(shape, params, cfg, target_params) -> dict:
    return {"head": params, **target_io(cfg, target_params)}


def tiny_example(target, k, tree, sampler):
    """(drafter, params) of a fresh two-layer head on verify_exactness's tiny target, with a Markov head whose bias
    is moved off zero (each draft token then depends on the one before it)."""
    cfg = target.cfg
    shape = head_shape(DFlashTraining(n_layers=2, markov=4), cfg, None)
    graphdef, params = init_head(shape, cfg, target.params, 1)
    params["markov"]["out"] = 20 * jax.random.normal(jax.random.key(2), params["markov"]["out"].shape)
    return make_drafter(shape, graphdef, cfg, k, sampler, tree), drafter_params(
        shape, params, cfg, target.params
    )


def expand_heads(shape: dict, p: dict, ex, expansion, cfg: LlamaConfig) -> tuple[dict, dict]:
    """The head for the expanded target (`specjax.expand`): fc fuses the tapped layers' original dims; each
    layer as the expander builds a target layer, with the q/k rows rescaled for the per-head norms (their mean runs
    over the wide head and their epsilon is the wide config's) and the extra dims of original key heads zeroed. A
    draft with its own attention heads keeps them (only its width and MLP grow)."""
    where = expansion.original_layers(cfg.n_layers)  # the target's layers in the expanded target
    if "attention" in shape:
        cfg = draft_config(cfg, shape)
        ex = ex.keeping_heads(cfg)
        expansion = ex.e
    d, d2, hd, hd2 = cfg.dim, expansion.dim, cfg.head_dim, expansion.head_dim
    n_taps = p["fc"]["weight"].shape[1] // d
    fc = np.zeros((d2, n_taps * d2), ex.dt)
    for i in range(n_taps):
        fc[:d, i * d2 : i * d2 + d] = p["fc"]["weight"][:, i * d : (i + 1) * d]
    scale = np.sqrt(hd2 / hd)  # the softmax scale the expander folds into the query rows
    c = np.sqrt(ex.cfg2.norm_eps / cfg.norm_eps * hd2 / hd)  # rows x c: the norm's output grows by `scale`
    q2, k2 = expansion.n_heads * hd2, expansion.n_kv_heads * hd2
    q_rows, k_rows = ex.head_rows(cfg.n_heads), ex.head_rows(cfg.n_kv_heads)
    layers = {}
    for i, layer in p["layers"].items():
        new = ex.block(layer, np.random.default_rng([expansion.seed, 10**6 + int(i)]))
        w = new["wqkv"]["weight"]
        w[q_rows] *= c / scale
        unused = (np.arange(k2) < cfg.n_kv_heads * hd2) & ~np.isin(np.arange(k2), k_rows)
        w[q2 : q2 + k2][unused] = (
            0  # extra dims of original key heads: the key norm's mean must not see them
        )
        w[q2 + k_rows] *= c
        if "bias" in new["wqkv"]:
            b = new["wqkv"]["bias"]
            b[q_rows] *= c / scale
            b[q2 : q2 + k2][unused] = 0
            b[q2 + k_rows] *= c
        q_norm, k_norm = np.ones(hd2, ex.dt), np.ones(hd2, ex.dt)
        q_norm[ex.dmap] = layer["q_norm"]["weight"]
        k_norm[ex.dmap] = np.asarray(layer["k_norm"]["weight"]) / scale
        layers[i] = new | {"q_norm": {"weight": q_norm}, "k_norm": {"weight": k_norm}}
    new = {
        "fc": {"weight": fc},
        "hidden_norm": {"weight": ex.norm(p["hidden_norm"]["weight"])},
        "layers": layers,
        "norm": {"weight": ex.norm(p["norm"]["weight"])},
    }
    if "masks" in p:  # embeddings, padded as the target's are
        new["masks"] = ex.pad(np.asarray(p["masks"]), (p["masks"].shape[0], d2))
    if "markov" in p:  # from token to logits: the vocabulary does not grow
        new["markov"] = p["markov"]
    if "confidence" in p:
        # reads the final features (zero columns for their extra dims), then any Markov embedding
        w = np.asarray(p["confidence"]["weight"])
        wide = np.concatenate([ex.pad(w[:, :d], (w.shape[0], d2)), w[:, d:]], 1)
        new["confidence"] = {"weight": wide, "bias": p["confidence"]["bias"]}
    return new, {**shape, "layers": [where[i] for i in shape["layers"]]}


@dataclasses.dataclass(frozen=True)
class DFlashSettings(heads.HeadsSettings):
    confidence: bool = True
    verify_cost: float = 0.1
    HELP = heads.HeadsSettings.HELP | {
        "confidence": "With a head that has a confidence head: verify only the prefix of the block it expects to "
        "pay (one of about K/4, K/2 and K tokens, chosen each round).",
        "verify_cost": "The cost of verifying one more token relative to a round's fixed cost, for that choice.",
    }


heads.register(
    "dflash",
    registry.TrainedHeads(
        settings=DFlashTraining,
        init=init_head,
        drafter_params=drafter_params,
        drafter=make_drafter,
        loss=lambda graphdef, cfg, params, feats, tokens, mask, key, h: dflash_loss(
            graphdef,
            cfg.dim,
            params,
            feats,
            tokens,
            mask,
            key,
            h.blocks,
            h.block_size,
            h.decay,
            h.divergence,
            h.mask_token,
            h.confidence_weight,
        ),
        shape_of=head_shape,
        feature_taps=lambda shape, cfg: tuple(shape["layers"]),
        expand=expand_heads,
        published=registry.Published(
            weights=("model.safetensors", "pytorch_model.bin"),
            tensors="fc + hidden_norm + layers.*.self_attn.q_norm",
            owns=dflash_zlab.owns,
            load=dflash_zlab.load_published_heads,
            files=dflash_zlab.published_files,
        ),
    ),
    example=tiny_example,
    settings=DFlashSettings,
)
