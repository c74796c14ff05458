"""Function-preserving expansion of a trained model: a benchmark device with *synthetic cost, real distribution*.

A small trained model (stories260K) sits in the CPU's cache, so its speed says nothing about speculative decoding,
and random weights of a large shape have no meaningful acceptance. `expand` makes a model of a large, memory-bound
shape that computes exactly the small model's function (logits equal up to float rounding), so that drafters keep
their real acceptance and get a real relative cost:

- wider: the residual stream grows from D to D' dims whose extra dims stay exactly zero (every matrix that writes
  the residual has zero rows there; the embedding has zero columns). RMSNorm averages over D' dims, so its epsilon
  becomes eps * D / D' and its weight w * sqrt(D / D') on the original dims: the normalised original dims are
  unchanged.
- attention heads: head_dim grows by an integer factor r; RoPE's frequency i of the small model is frequency r * i
  of the wide head (the same float), so original head dim d goes to r * d (first half) or D'/2 + r * (d - hd/2)
  (second half), and the queries are scaled by sqrt(r) for the softmax scale. Extra query dims of an original head
  are zero; extra heads (same GQA ratio) are random, and the output projection reads none of them.
- MLP: extra hidden units are random, the down projection reads none of them.
- deeper: inserted layers are random with zero output projections (wo, w_down): full cost, no effect. The
  original layers are spread evenly (`Expansion.original_layers`); `truncated_original` builds the draft model of
  the first few original layers, skipping the inserted ones.

Trained heads expand the same way (`expand_heads`; each head type says how in its registration, as Medusa,
EAGLE and EAGLE-3 do): their drafts are unchanged and their cost is that of heads of the wide target. Rows that
the expansion makes trivial are not drafters: skipping the inserted layers (or a draft of every original layer)
is the target itself.

Default (`Expansion()`, from stories260K: D=64, 5 layers, 8 heads of 8, 4 kv heads, 172 hidden): D'=512,
32 layers, 16 heads of 32 dims, 8 kv heads, 1376 hidden: 2.90M parameters per layer, 93.1M in all, 372 MB of
float32 weights read per token (11x the 32 MiB L3 cache of the machine it was chosen on), plus 64 KiB of KV cache per
cached position (32 layers x 2 x 8 kv heads x 32 dims x 4 bytes); one layer is 1/32 of the weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from specjax import heads
from specjax.drafting import registry
from specjax.errors import ConfigError
from specjax.models.config import LlamaConfig
from specjax.models.weights import build_params


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Shape of the expanded model. Extra heads keep the original GQA ratio; head_dim a multiple of the original."""

    dim: int = 512
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 32
    hidden_dim: int = 1376
    seed: int = 0  # of the random weights of the extra heads, units and layers

    def config(self, cfg: LlamaConfig) -> LlamaConfig:
        """The expanded model's config (checked against `cfg`)."""
        problems = [
            f"{name}={new} < the model's {old}"
            for name, new, old in (
                ("dim", self.dim, cfg.dim),
                ("n_layers", self.n_layers, cfg.n_layers),
                ("n_heads", self.n_heads, cfg.n_heads),
                ("n_kv_heads", self.n_kv_heads, cfg.n_kv_heads),
                ("hidden_dim", self.hidden_dim, cfg.hidden_dim),
            )
            if new < old
        ]
        if self.head_dim % cfg.head_dim:
            problems.append(f"head_dim={self.head_dim} is not a multiple of the model's {cfg.head_dim}")
        if self.n_heads * cfg.n_kv_heads != cfg.n_heads * self.n_kv_heads:
            problems.append(
                f"n_heads / n_kv_heads = {self.n_heads}/{self.n_kv_heads} differs from the model's "
                f"{cfg.n_heads}/{cfg.n_kv_heads}"
            )
        if problems:
            raise ConfigError(f"cannot expand: {'; '.join(problems)}; choose a larger expansion")
        return cfg.replace(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            hidden_dim=self.hidden_dim,
            norm_eps=cfg.norm_eps * cfg.dim / self.dim,
        )

    def original_layers(self, n_original: int) -> tuple[int, ...]:
        """Indices of the original layers in the expanded model: spread evenly, the first at 0."""
        return tuple(i * self.n_layers // n_original for i in range(n_original))


# A small expansion for tests and smoke runs (still: extra heads, r = 2, extra units, layers inserted between
# original ones: 0, 1, 2, 4, 5 are stories260K's).
SMOKE = Expansion(dim=128, n_layers=7, n_heads=16, n_kv_heads=8, head_dim=16, hidden_dim=344)


def weight_bytes(cfg: LlamaConfig) -> int:
    """Bytes of weights one forward pass reads (the embedding table counts once: only looked-up rows are read
    from it when the head is untied, but it is the head when tied)."""
    return cfg.num_params * np.dtype(cfg.dtype).itemsize


def kv_bytes_per_position(cfg: LlamaConfig) -> int:
    """Bytes of keys and values one cached position holds (all layers)."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


def _dim_map(hd: int, hd2: int) -> np.ndarray:
    """Where original head dim d goes in the wide head: rotate-half RoPE pairs d with d + hd/2 at frequency
    d mod hd/2, and frequency i of head_dim hd is frequency r * i of head_dim r * hd."""
    r, d = hd2 // hd, np.arange(hd)
    return np.where(d < hd // 2, r * d, hd2 // 2 + r * (d - hd // 2))


class Expander:
    """Maps the small model's arrays to the expanded shape (`pad`, `norm`, `block`): what a head type's `expand`
    (`registry.TrainedHeads.expand`) builds its expanded parameters with."""

    def __init__(self, cfg: LlamaConfig, e: Expansion):
        self.cfg, self.e, self.cfg2 = cfg, e, e.config(cfg)
        self.dt = np.dtype(cfg.dtype) if cfg.dtype == "float32" else np.float32
        self.dmap = _dim_map(cfg.head_dim, e.head_dim)
        self.norm_scale = math.sqrt(cfg.dim / e.dim)

    def keeping_heads(self, cfg: LlamaConfig) -> Expander:
        """An expander of layers `cfg` (this model's width and MLP, attention heads of their own) to this expansion's
        width and MLP, their attention heads kept as they are."""
        e = dataclasses.replace(
            self.e, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim
        )
        return Expander(cfg, e)

    def random(self, rng, shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(self.dt)

    def pad(self, x, shape):
        """`x` in the leading corner of zeros of `shape`."""
        out = np.zeros(shape, self.dt)
        out[tuple(slice(0, n) for n in x.shape)] = x
        return out

    def norm(self, w):
        out = np.ones((self.e.dim,), self.dt)
        if w is not None:
            out[: self.cfg.dim] = np.asarray(w, np.float32) * self.norm_scale
        return out

    def head_rows(self, n_heads: int) -> np.ndarray:
        """Rows (or columns) of the wide projection that original heads' dims map to, `[n_heads * hd]`."""
        return (np.arange(n_heads)[:, None] * self.e.head_dim + self.dmap[None]).reshape(-1)

    def block(self, p: dict | None, rng) -> dict:
        """An expanded decoder layer: `p` an original layer's pure dict, None for an inserted one."""
        c, e = self.cfg, self.e
        d, d2, hd2, h2, kv2, f2 = c.dim, e.dim, e.head_dim, e.n_heads, e.n_kv_heads, e.hidden_dim
        q2, k2 = h2 * hd2, kv2 * hd2
        wqkv = self.random(rng, (q2 + 2 * k2, d2))
        gate_up = self.random(rng, (2 * f2, d2))
        wo, down = np.zeros((d2, q2), self.dt), np.zeros((d2, f2), self.dt)
        out = {
            "attn_norm": {"weight": self.norm(None if p is None else p["attn_norm"]["weight"])},
            "mlp_norm": {"weight": self.norm(None if p is None else p["mlp_norm"]["weight"])},
        }
        if c.qkv_bias:
            bqkv = self.random(rng, (q2 + 2 * k2,))
        if p is not None:
            q1, k1 = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            w = np.asarray(p["wqkv"]["weight"], np.float32)
            q_rows, k_rows = self.head_rows(c.n_heads), self.head_rows(c.n_kv_heads)
            wqkv[: c.n_heads * hd2] = 0  # extra dims of the original query heads see nothing
            scale = math.sqrt(hd2 / c.head_dim)  # softmax scale hd'^-1/2 instead of hd^-1/2
            wqkv[q_rows, :d] = w[:q1] * scale
            wqkv[q2 + k_rows, :d] = w[q1 : q1 + k1]
            wqkv[q2 + k2 + k_rows, :d] = w[q1 + k1 :]
            if c.qkv_bias:
                b = np.asarray(p["wqkv"]["bias"], np.float32)
                bqkv[: c.n_heads * hd2] = 0
                bqkv[q_rows], bqkv[q2 + k_rows] = b[:q1] * scale, b[q1 : q1 + k1]
                bqkv[q2 + k2 + k_rows] = b[q1 + k1 :]
            wo[:d, q_rows] = np.asarray(p["wo"]["weight"], np.float32)
            gu = np.asarray(p["w_gate_up"]["weight"], np.float32)
            gate_up[: c.hidden_dim, :d], gate_up[f2 : f2 + c.hidden_dim, :d] = (
                gu[: c.hidden_dim],
                gu[c.hidden_dim :],
            )
            down[:d, : c.hidden_dim] = np.asarray(p["w_down"]["weight"], np.float32)
        out["wqkv"] = {"weight": wqkv} | ({"bias": bqkv} if c.qkv_bias else {})
        out["wo"] = {"weight": wo}
        if c.o_bias:
            out["wo"]["bias"] = (
                self.pad(np.asarray(p["wo"]["bias"]), (d2,)) if p is not None else np.zeros(d2, self.dt)
            )
        out["w_gate_up"], out["w_down"] = {"weight": gate_up}, {"weight": down}
        return out

    def model(self, pure: dict) -> dict:
        c, e = self.cfg, self.e
        where = dict(zip(e.original_layers(c.n_layers), range(c.n_layers)))
        layers = {}
        for i in range(e.n_layers):
            rng = np.random.default_rng([e.seed, i])
            layers[i] = self.block(pure["layers"][where[i]] if i in where else None, rng)
        out = {
            "embed": {"embedding": self.pad(np.asarray(pure["embed"]["embedding"]), (c.vocab_size, e.dim))},
            "layers": layers,
            "norm": {"weight": self.norm(pure["norm"]["weight"])},
        }
        if not c.tie_embeddings:
            out["lm_head"] = {
                "weight": self.pad(np.asarray(pure["lm_head"]["weight"]), (c.vocab_size, e.dim))
            }
        return out


def _pure(params) -> dict:
    return params if isinstance(params, dict) else nnx.to_pure_dict(params)


def expand(cfg: LlamaConfig, params, expansion: Expansion = Expansion()):
    """(cfg', graphdef', params') of the expanded model: the same function as (cfg, params) at `expansion`'s cost."""
    ex = Expander(cfg, expansion)
    pure = jax.tree.map(np.asarray, _pure(params))
    return (ex.cfg2, *build_params(ex.cfg2, ex.model(pure)))


def truncated_original(cfg: LlamaConfig, expanded_params, expansion: Expansion, n_original: int, n: int):
    """(cfg, graphdef, params) of a draft model made of the expanded target's first `n` *original* layers (of
    `n_original`), its embedding, final norm and head, skipping the inserted layers between them: the small
    model's own truncated draft at the wide model's per-layer cost. `cfg` is the expanded config."""
    if not 1 <= n < n_original:
        raise ConfigError(
            f"a truncated draft takes 1..{n_original - 1} of the {n_original} original layers, got {n} "
            "(all of them is the target itself)"
        )
    pure = _pure(expanded_params)
    layers = expansion.original_layers(n_original)[:n]
    pure = {**pure, "layers": {i: pure["layers"][j] for i, j in enumerate(layers)}}
    small = cfg.replace(n_layers=n)
    return (small, *build_params(small, pure))


def expand_heads(
    meta: dict,
    head_params,
    cfg: LlamaConfig,
    expanded_cfg: LlamaConfig,
    expanded_params,
    expansion: Expansion = Expansion(),
):
    """(meta', graphdef', params') of trained heads of (cfg) for the expanded target, as their head type expands
    them (`registry.TrainedHeads.expand`, given an `Expander`): the same drafts (their extra feature dims stay
    zero), at the cost of heads of the wide target."""
    expandable = sorted(m for m in registry.head_methods() if registry.trained(m).expand is not None)
    if meta["method"] not in expandable:
        raise ConfigError(
            f"cannot expand heads of method {meta['method']!r}; expandable: {', '.join(expandable)}"
        )
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), _pure(head_params))
    expand = registry.trained(meta["method"]).expand
    new, shape = expand(meta["shape"], p, Expander(cfg, expansion), expansion, cfg)
    meta2 = heads.describe(meta["method"], shape, expanded_cfg)
    graphdef, fresh = heads.new_heads(meta2, expanded_cfg, expanded_params)
    new = jax.tree.map(lambda f, x: jax.numpy.asarray(x, f.dtype), fresh, new)
    return meta2, graphdef, new
