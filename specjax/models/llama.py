"""Llama-family decoder in Flax NNX with explicit positions, a new-token mask and a static KV cache.

`forward(graphdef, params, tokens_BT, positions_BT, cache, mask_BTW)` is the pure function every
decoding loop calls; the NNX module only defines parameters and the computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import kernels, precision
from specjax.cache import KVCache
from specjax.models.config import LlamaConfig


@struct.dataclass
class Hidden:
    final: jax.Array  # [B, T, dim] after the final norm (the feature the LM head reads)
    taps: tuple[jax.Array, ...] = ()  # residual stream after each requested layer, in the order requested


def features(hidden: Hidden, taps: tuple[int, ...] = ()) -> jax.Array:
    """What a drafter reads of the target at each token: the final features [B, T, dim] (what the LM head
    reads), or with `taps` the residual streams after those layers then the final features, concatenated
    [B, T, (len(taps) + 1) * dim] (EAGLE-3 fuses a low, a middle and a high layer)."""
    return jnp.concatenate([*hidden.taps, hidden.final], axis=-1) if taps else hidden.final


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; `plus_one` (Gemma) scales by 1 + weight in float32 (its weights start at 0)."""

    def __init__(self, dim: int, eps: float, dtype, plus_one: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if plus_one else jnp.ones((dim,), dtype))
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


class Linear(nnx.Module):
    """`x @ W.T + b` with W stored [out, in] (PyTorch's layout: faster matrix-vector products on XLA CPU)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (n_out, n_in), dtype))
        self.bias = nnx.Param(jnp.zeros((n_out,), dtype)) if bias else None

    def matrix(self):
        """W [out, in] as the product reads it (`specjax.models.quantize.QLinear` dequantises its ints here)."""
        return self.weight[...]

    def __call__(self, x):
        w, rows, cpu = self.matrix(), int(np.prod(x.shape[:-1])), jax.default_backend() == "cpu"
        flat = x.reshape(rows, x.shape[-1])
        if cpu and rows <= GEMV_ROWS:
            y = jnp.concatenate([blocked_product(w, row[None]) for row in flat])
        elif cpu and rows <= BLOCKED_ROWS:
            y = blocked_product(w, flat)
        else:
            y = jnp.einsum("ri,oi->ro", flat, w)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias[...]


def blocked_product(w_OI, x_RI):
    """`x @ w.T` [R, O] for XLA CPU: a batched product over ROW_BLOCKS row blocks of w (when its rows divide),
    which XLA runs on several threads, where it runs a matrix-vector or small matrix product on one."""
    blocks = ROW_BLOCKS if w_OI.shape[0] % ROW_BLOCKS == 0 else 1
    w_KOI = w_OI.reshape(blocks, -1, w_OI.shape[1])
    y_KOR = jnp.einsum("koi,kri->kor", w_KOI, jnp.broadcast_to(x_RI, (blocks, *x_RI.shape)))
    return y_KOR.reshape(-1, x_RI.shape[0]).T


class InOutLinear(Linear):
    """A `Linear` whose weight is stored [in, out]: XLA CPU's product of 2 to 16 rows reads it about once (16 rows:
    1.6 one-row products), where it reads an [out, in] weight about three times; one row is slower (`in_out_layout`)."""

    def __init__(self, linear: Linear):
        self.weight = nnx.Param(linear.weight[...].T)
        self.bias = linear.bias

    def matrix(self):
        return self.weight[...].T

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


class PackedLinear(Linear):
    """A float32 `Linear` whose weight is packed for specjax's CPU kernel (`specjax.kernels`), which reads it once
    for any number of rows (passes of the expanded stories260K by layout: `docs/benchmarks.md`)."""

    def __init__(self, linear: Linear):
        self.n_out = linear.weight.shape[0]
        self.weight = nnx.Param(kernels.pack(linear.weight[...]))
        self.bias = linear.bias

    def matrix(self):
        w = self.weight[...]
        return w.transpose(0, 2, 1).reshape(-1, w.shape[1])[: self.n_out]

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # as a float32 `Linear` promotes its inputs
        y = kernels.packed_matmul(flat, self.weight[...], self.n_out).reshape(*x.shape[:-1], self.n_out)
        return y if self.bias is None else y + self.bias[...]


def replace_linears(graphdef, params, make):
    """(graphdef, params) of the model with every plain `Linear` replaced by `make(linear)`; the leaves it keeps
    are the same arrays as in `params`, not copies."""
    model = nnx.merge(graphdef, params, copy=True)
    for path, node in list(nnx.iter_graph(model)):
        if type(node) is Linear:
            parent = model
            for key in path[:-1]:
                parent = parent[key] if isinstance(key, int) else getattr(parent, key)
            if isinstance(path[-1], int):
                parent[path[-1]] = make(node)
            else:
                setattr(parent, path[-1], make(node))
    return nnx.split(model)


def in_out_layout(graphdef, params):
    """The model with its linear layers stored [in, out] (`InOutLinear`), the same function: for passes of several
    rows on XLA CPU (a verify pass of 8 tokens of the expanded stories260K: 1.6 one-token passes instead of 1.9)."""
    return replace_linears(graphdef, params, InOutLinear)


def multi_row_layout(graphdef, params):
    """The model laid out for passes of several rows on XLA CPU, the same function: float32 linear layers packed for
    specjax's CPU kernel where it is built and the backend is the CPU (`specjax.kernels`), the others stored
    [in, out] (`in_out_layout`)."""
    packed = jax.default_backend() == "cpu" and kernels.available()
    return replace_linears(
        graphdef,
        params,
        lambda linear: (
            PackedLinear if packed and linear.weight[...].dtype == jnp.float32 else InOutLinear
        )(linear),
    )


def uses_multi_row_layout(several_rows: bool) -> bool:
    """Whether decoding lays the model out with `multi_row_layout`: on the CPU for passes of several rows, and for
    one row too where specjax's kernels are built (their product streams a packed matrix once, one row included:
    0.81 of XLA's one-row pass of the expanded stories260K on a Zen 4 EPYC, `docs/benchmarks.md`)."""
    return jax.default_backend() == "cpu" and (several_rows or kernels.available())


# XLA CPU runs a plain matrix-vector product, and a matrix product of a few rows, on one thread, but the entries
# of a batched product on several. Up to GEMV_ROWS rows (batch x tokens) a linear layer is fastest as one
# blocked matrix-vector product per row (a second one re-reads the layer's matrix from L3, where YNNPACK's GEMM
# of a few rows costs about two), up to BLOCKED_ROWS as one blocked matrix product, beyond as one plain product.
GEMV_ROWS = 4
BLOCKED_ROWS = 32
ROW_BLOCKS = 2


def gated(gate, up, cfg: LlamaConfig):
    """The MLP's gated activation: SwiGLU, Gemma's GeGLU (tanh GELU), or gpt-oss's clamped SwiGLU."""
    if cfg.swiglu_clamp is not None:
        alpha, limit = cfg.swiglu_clamp
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)
    act = jax.nn.silu if cfg.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    return act(gate) * up


class MLP(nnx.Module):
    """A gated MLP: gate and up fused in one matrix ([gate; up] rows), then down."""

    def __init__(self, cfg: LlamaConfig, hidden: int, bias: bool, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.w_gate_up = Linear(cfg.dim, 2 * hidden, bias, dt, rngs)
        self.w_down = Linear(hidden, cfg.dim, bias, dt, rngs)

    def __call__(self, x, cfg: LlamaConfig):
        gate, up = jnp.split(self.w_gate_up(x), 2, axis=-1)
        return self.w_down(gated(gate, up, cfg))


class Experts(nnx.Module):
    """Routed experts: a router picks `experts_per_token` of `n_experts` MLPs per token and mixes their outputs.

    Each expert is its own module (its own arrays), and a token's pass runs only its experts' matrices, one
    `lax.switch` over the experts per (token, pick) in a loop: it reads the routed experts' weights and nothing
    else (no gather copies them). Where the picks outnumber the experts, every expert runs on every token,
    weighted by the routing (zero for the unrouted), reading each expert once.
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.router = Linear(cfg.dim, cfg.n_experts, cfg.expert_bias, jnp.dtype(cfg.dtype), rngs)
        self.experts = nnx.List(
            [MLP(cfg, cfg.expert_dim, cfg.expert_bias, rngs) for _ in range(cfg.n_experts)]
        )

    def route(self, rows_RH, cfg: LlamaConfig):
        """(weights [R, k] in the rows' dtype, expert indices [R, k]) of each row's picks."""
        logits = self.router(rows_RH).astype(jnp.float32)
        k = cfg.experts_per_token
        if cfg.router == "topk_softmax":
            top, idx = jax.lax.top_k(logits, k)
            return jax.nn.softmax(top, axis=-1).astype(rows_RH.dtype), idx
        top, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if cfg.router == "softmax_topk_norm":
            top = top / top.sum(-1, keepdims=True)
        return top.astype(rows_RH.dtype), idx

    def __call__(self, x_BTH, cfg: LlamaConfig):
        rows = x_BTH.reshape(-1, x_BTH.shape[-1])
        weights, idx = self.route(rows, cfg)
        r, k = idx.shape
        if r * k >= len(self.experts):
            dense = (
                jnp.zeros((r, len(self.experts)), rows.dtype).at[jnp.arange(r)[:, None], idx].add(weights)
            )
            out = sum(dense[:, e, None] * expert(rows, cfg) for e, expert in enumerate(self.experts))
            return out.reshape(x_BTH.shape)
        branches = [functools.partial(lambda m, x: m(x, cfg), m) for m in self.experts]

        def pick(i, out):
            row, slot = i // k, i % k
            y = jax.lax.switch(idx[row, slot], branches, rows[row][None])[0]
            return out.at[row].add(weights[row, slot] * y)

        return jax.lax.fori_loop(0, r * k, pick, jnp.zeros_like(rows)).reshape(x_BTH.shape)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE; x [B, T, heads, D], cos/sin [B, T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@functools.cache
def rope_table(inv_freq: tuple[float, ...], size: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [size, D/2] of the rotary angles at positions 0..size-1 (float32 angles, as in transformers),
    times `scale`."""
    angles = np.arange(size, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None]
    return tuple(
        (f(angles, dtype=np.float64) * np.float32(scale)).astype(np.float32) for f in (np.cos, np.sin)
    )


def rope_angles(inv_freq: tuple[float, ...], positions_BT, size: int, scale: float = 1.0):
    """(cos, sin) [B, T, D/2] at `positions_BT` (< `size`, else NaN), looked up in `rope_table` (times `scale`, YaRN's
    attention factor): XLA CPU evaluates cos/sin inside every layer's RoPE fusion, which cost a 9-token decoding
    pass of stories260K 7-11%."""
    return tuple(
        jnp.take(jnp.asarray(t), positions_BT, axis=0, mode="fill", fill_value=jnp.nan)
        for t in rope_table(inv_freq, size, scale)
    )


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        hd = cfg.head_dim
        norm = lambda dim: RMSNorm(dim, cfg.norm_eps, dt, cfg.norm_plus_one)
        self.cfg, self.layer, self.window = cfg, layer, cfg.window(layer)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = norm(cfg.dim)
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.qkv_bias, dt, rngs)
        self.wo = Linear(cfg.n_heads * hd, cfg.dim, cfg.o_bias, dt, rngs)
        self.mlp_norm = norm(cfg.dim)
        if cfg.n_experts:
            self.moe = Experts(cfg, rngs)
        else:
            self.w_gate_up = Linear(cfg.dim, 2 * cfg.hidden_dim, False, dt, rngs)
            self.w_down = Linear(cfg.hidden_dim, cfg.dim, False, dt, rngs)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(hd), norm(hd)
        if cfg.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(cfg.dim), norm(cfg.dim)
        if cfg.attn_sinks:
            self.sinks = nnx.Param(jnp.zeros((cfg.n_heads,), dt))

    def __call__(self, x_BTH, cos, sin, cache: KVCache, visible_BTS, offset: int):
        return self.finish(x_BTH, self.wqkv(self.attn_norm(x_BTH)), cos, sin, cache, visible_BTS, offset)

    def heads(self, qkv, cos, sin):
        """(queries [B, T, heads, D], keys and values [B, T, kv heads, D]) from the q/k/v projection, with RoPE
        (after the per-head norms of Qwen3 and Gemma 3)."""
        b, t, _ = qkv.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k = (
            qkv[..., : h * hd].reshape(b, t, h, hd),
            qkv[..., h * hd : (h + kv) * hd].reshape(b, t, kv, hd),
        )
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return (
            apply_rope(q, cos, sin),
            apply_rope(k, cos, sin),
            qkv[..., (h + kv) * hd :].reshape(b, t, kv, hd),
        )

    def residual(self, x_BTH, attn_BTA):
        """The block after attention: output projection and MLP on the residual stream."""
        cfg, out = self.cfg, self.wo(attn_BTA)
        x_BTH = x_BTH + (self.post_attn_norm(out) if cfg.sandwich_norms else out)
        x = self.mlp_norm(x_BTH)
        if cfg.n_experts:
            out = self.moe(x, cfg)
        else:
            gate, up = jnp.split(self.w_gate_up(x), 2, axis=-1)
            out = self.w_down(gated(gate, up, cfg))
        return x_BTH + (self.post_mlp_norm(out) if cfg.sandwich_norms else out)

    def finish(self, x_BTH, qkv, cos, sin, cache: KVCache, visible_BTS, offset: int):
        """The block after its q/k/v projection: attention (writing this layer's keys/values), output
        projection and MLP on the residual stream `x_BTH`."""
        b, t, _ = x_BTH.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.heads(qkv, cos, sin)
        cache = cache.write(self.layer, k.swapaxes(1, 2), v.swapaxes(1, 2), offset)
        k_all, v_all = cache.k[self.layer], cache.v[self.layer]  # [B*kv, S, hd], [B*kv, hd, S]
        g = (
            h // kv
        )  # query heads per kv head; (row, kv head) is the matmuls' batch axis, (group, token) their rows
        q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * t, hd)
        if self.on_cpu_kernel(k_all):
            attn = kernels.decode_attention(q, k_all, v_all, visible_BTS, self.scale)
        else:
            scores = jnp.einsum("xqd,xsd->xqs", q, k_all, preferred_element_type=jnp.float32)
            probs = self.attention(scores.reshape(b, kv, g, t, -1), visible_BTS)
            probs = probs.astype(v_all.dtype).reshape(b * kv, g * t, -1)
            attn = jnp.einsum("xqs,xds->xqd", probs, v_all)
        attn = attn.reshape(b, kv, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)
        return self.residual(x_BTH, attn), cache

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.cfg.attn_scale is None else self.cfg.attn_scale

    def on_cpu_kernel(self, k_all) -> bool:
        """Whether attention runs on specjax's CPU kernel (`kernels.decode_attention`): a float32 cache on XLA CPU
        where the kernels are built, without Gemma 2's soft cap or gpt-oss's sinks."""
        cfg = self.cfg
        plain = not (cfg.attn_softcap or cfg.attn_sinks) and k_all.dtype == jnp.float32
        return plain and jax.default_backend() == "cpu" and kernels.available()

    def attention(self, scores, visible_BTS):
        """Attention weights [B, kv, g, T, S] (float32) from the raw scores: scaled, soft-capped (Gemma 2),
        masked, and normalised with each head's sink logit in the denominator (gpt-oss)."""
        cfg = self.cfg
        scores = scores * self.scale
        if cfg.attn_softcap:
            scores = cfg.attn_softcap * jnp.tanh(scores / cfg.attn_softcap)
        scores = jnp.where(visible_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
        if not cfg.attn_sinks:
            return jax.nn.softmax(scores, axis=-1)
        sink = self.sinks[...].astype(jnp.float32).reshape(1, self.n_kv_heads, -1, 1, 1)
        top = jnp.maximum(scores.max(-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        return e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))


class Llama(nnx.Module):
    """Decoder-only transformer: embed -> blocks -> norm -> LM head (tied or untied), for every supported family
    (`LlamaConfig`'s family fields say what a layer adds)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.dim,
            dtype=dt,
            param_dtype=dt,
            rngs=rngs,
            embedding_init=nnx.initializers.normal(0.02),
        )
        self.layers = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dt, cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, False, dt, rngs)
        self.cfg = cfg  # static, not a parameter
        self.inv_freq = tuple(float(f) for f in cfg.inv_freq())
        self.local_inv_freq = tuple(float(f) for f in cfg.inv_freq(local=True))

    def __call__(self, tokens_BT, positions_BT, cache: KVCache, mask_BTW, taps: tuple[int, ...] = ()):
        cfg, (b, t) = self.cfg, tokens_BT.shape
        mask_BTW = jnp.broadcast_to(mask_BTW, (b, t, mask_BTW.shape[-1]))
        rope = {False: rope_angles(self.inv_freq, positions_BT, cache.size, cfg.rope_scale())}
        if self.local_inv_freq != self.inv_freq:
            rope[True] = rope_angles(self.local_inv_freq, positions_BT, cache.size)
        visible = {None: cache.visible(mask_BTW)}
        if cfg.sliding_window:
            recent = cache.recent(positions_BT, mask_BTW.shape[-1], cfg.sliding_window)
            visible[cfg.sliding_window] = visible[None] & recent
        x = self.embed(tokens_BT)
        if cfg.embed_scale:
            x = x * jnp.asarray(cfg.dim**0.5, x.dtype)
        tapped = {}
        for i, block in enumerate(self.layers):
            cos, sin = rope[block.window is not None and len(rope) > 1]  # sliding layers' own RoPE, if any
            x, cache = block(x, cos, sin, cache, visible[block.window], mask_BTW.shape[-1] - t)
            if i in taps:
                tapped[i] = x
        final = self.norm(x)
        head = self.embed.embedding[...] if self.lm_head is None else self.lm_head.matrix()  # [V, dim]
        logits = jnp.einsum("btd,vd->btv", final, head).astype(jnp.float32)
        if cfg.final_softcap:
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
        return logits, Hidden(final, tuple(tapped[i] for i in taps)), cache


@precision.follows_params
@functools.partial(jax.jit, static_argnums=(0, 6))
def forward(
    graphdef, params, tokens_BT, positions_BT, cache: KVCache, mask_BTW, taps: tuple[int, ...] = ()
):
    """Pure forward: `(logits[B,T,V] float32, Hidden, cache with the T new keys/values written)`.

    Every token sees the committed cache. `mask_BTW` ([T, W] or [B, T, W], bool, W >= T) says which
    slots of the uncommitted window `[length, length + W)` each new token sees; the new tokens are
    written at its last T slots (W = T: a plain block of new tokens; W > T: a tree drafted level by
    level). The committed length is unchanged: commit with `cache.advance`, keep a subset with
    `cache.compact`. One compiled program per shape (`graphdef` and `taps` static): called on its own, it does
    not compile each operation separately; inside a compiled job it is inlined.
    """
    return nnx.merge(graphdef, params)(tokens_BT, positions_BT, cache, mask_BTW, taps)


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))


def sequence_logits(cfg: LlamaConfig, graphdef, params, tokens_BT):
    """The model's logits `[B, T, V]` at every position of full sequences (one pass, a fresh cache)."""
    b, t = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return forward(graphdef, params, tokens_BT, positions, init_cache(cfg, b, t), causal_mask(t))[0]


def abstract_model(cfg: LlamaConfig):
    """(graphdef, abstract params) without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))))


def init_params(cfg: LlamaConfig, seed: int = 0):
    """(graphdef, random params): for tests and random-weight benchmark shapes."""
    return abstract_model(cfg)[0], _random_params(cfg, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=0)
def _random_params(cfg: LlamaConfig, key):
    """The initialisation as one compiled program per config (run eagerly, each initializer compiles its own)."""
    return nnx.state(Llama(cfg, nnx.Rngs(key)))


def init_cache(cfg: LlamaConfig, batch: int, size: int) -> KVCache:
    return KVCache.init(cfg.n_layers, batch, size, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
