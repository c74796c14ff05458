"""Decoder configuration: one frozen dataclass for every supported family, parsed from Hugging Face or llama2.c.

The Llama fields describe the common decoder; the family fields after `dtype` switch on what Qwen3, Gemma 2/3,
Mixtral, Qwen3-MoE, gpt-oss and Phi-3 add to it (all off: a Llama). A model's identity (`specjax.models.store`)
leaves out the family fields that are off, so a Llama's identity does not change as families are added.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.errors import ConfigError
from specjax.hf_import import import_transformers

# Hugging Face model types specjax loads ("gemma3": the text model of Gemma 3's multimodal checkpoints)
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "gemma3", "gpt_oss", "phi3",
)  # fmt: skip
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
ROUTERS = ("softmax_topk", "softmax_topk_norm", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a decoder of a supported family (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Mixtral, Qwen3-MoE,
    gpt-oss, Phi-3)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    bos_id: int = 1
    eos_id: int = 2
    dtype: str = "float32"
    # --- family fields (off: a Llama) ---
    family: str = "llama"  # the Hugging Face model_type it was read from
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each query and key head before RoPE
    norm_plus_one: bool = False  # Gemma: norms scale by (1 + weight), in float32
    activation: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP as well as before
    embed_scale: bool = False  # Gemma: embeddings times sqrt(dim)
    attn_scale: float | None = None  # query scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    sliding_window: int | None = (
        None  # a sliding layer's query sees the keys less than this many positions back
    )
    layer_types: tuple[str, ...] = ()  # "full" / "sliding" per layer; (): every layer full
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (None: rope_theta)
    rope_linear_factor: float = 1.0  # linear RoPE scaling (positions / factor) of the full layers
    # YaRN: (factor, beta_fast, beta_slow, original_max_position_embeddings, truncate, attention_factor)
    rope_yarn: tuple[float, float, float, int, bool, float] | None = None
    attn_sinks: bool = False  # gpt-oss: one learned logit per head joins every softmax
    n_experts: int = 0  # mixture of experts: routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    expert_dim: int = 0  # an expert's hidden size
    router: str = "softmax_topk_norm"  # see ROUTERS; Mixtral and Qwen3-MoE (norm_topk_prob) renormalise
    expert_bias: bool = False  # gpt-oss: biases on the router and the experts
    swiglu_clamp: tuple[float, float] | None = None  # gpt-oss's gate: (alpha, limit)

    def __post_init__(self):
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("rope_llama3_scaling", "layer_types", "rope_yarn", "swiglu_clamp"):  # JSON gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ConfigError(
                f"layer_types names {len(self.layer_types)} layers, the model has {self.n_layers}"
            )
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding layers but sliding_window is not set")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ConfigError(
                f"experts_per_token={self.experts_per_token} must be in [1, n_experts={self.n_experts}]"
            )
        if self.router not in ROUTERS:
            raise ConfigError(f"router {self.router!r} is not one of {ROUTERS}")

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def family_fields(self) -> dict:
        """The family fields that are on (differ from a Llama's)."""
        return {k: getattr(self, k) for k, off in FAMILY_DEFAULTS.items() if getattr(self, k) != off}

    def identity_record(self) -> dict:
        """Every field, less the family fields that are off (what provenance records hash: a Llama's identity
        is the one it had before the families were added)."""
        return {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in FAMILY_DEFAULTS or v != FAMILY_DEFAULTS[k]
        }

    def head_layers(self, n_layers: int, attention=None) -> LlamaConfig:
        """`n_layers` plain Llama layers of this model's shape and RoPE (what trained heads are made of, whatever
        the target's family), with attention heads `attention` = (n_heads, n_kv_heads, head_dim) where given."""
        own = {} if attention is None else dict(zip(ATTENTION, attention))
        return self.replace(
            n_layers=n_layers, **{k: v for k, v in FAMILY_DEFAULTS.items() if k not in HEAD_KEEPS}, **own
        )

    def select_layers(self, layers) -> LlamaConfig:
        """The model made of these of its layers, in this order (each keeps its attention type; an index past the
        last layer repeats the pattern)."""
        types = tuple(self.layer_types[i % self.n_layers] for i in layers) if self.layer_types else ()
        return self.replace(n_layers=len(layers), layer_types=types)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every earlier position)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else None

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies [head_dim / 2] (float32) of the full layers, or with `local` of the sliding
        ones (Gemma 3 gives them their own base and no scaling)."""
        d = self.head_dim
        theta = self.local_rope_theta if local and self.local_rope_theta else self.rope_theta
        inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if local and self.local_rope_theta:
            return inv.astype(np.float32)
        if self.rope_llama3_scaling is not None:
            factor, low, high, old_ctx = self.rope_llama3_scaling
            wavelen = 2 * math.pi / inv
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        if self.rope_yarn is not None:
            inv = yarn_inv_freq(theta, d, *self.rope_yarn[:5])
        return (inv / self.rope_linear_factor).astype(np.float32)

    def rope_scale(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1 otherwise)."""
        return 1.0 if self.rope_yarn is None else float(self.rope_yarn[5])

    def mlp_params(self) -> tuple[int, int]:
        """(parameters, of them active per token) of one layer's MLP (with its router)."""
        if not self.n_experts:
            return 3 * self.dim * self.hidden_dim, 3 * self.dim * self.hidden_dim
        expert = 3 * self.dim * self.expert_dim
        router = self.n_experts * self.dim
        return self.n_experts * expert + router, self.experts_per_token * expert + router

    @property
    def num_params(self) -> int:
        return self._params(self.mlp_params()[0])

    @property
    def active_params(self) -> int:
        """Parameters a token's pass reads (a mixture of experts reads only its routed experts)."""
        return self._params(self.mlp_params()[1])

    def _params(self, mlp: int) -> int:
        d, h, kv, hd = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * (h + 2 * kv) * hd + h * hd * d
        norms = (4 if self.sandwich_norms else 2) * d + (2 * hd if self.qk_norm else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * (attn + mlp + norms) + d + head

    @classmethod
    def from_hf(cls, hf: dict, dtype: str = "float32") -> LlamaConfig:
        """Parses a Hugging Face `config.json` dict; refuses what the decoder cannot run exactly."""
        return parse_hf(hf, dtype)

    def to_hf(self) -> dict:
        """The equivalent Hugging Face config dict of a Llama, Qwen2 or Qwen3 (for reference models in tests and
        distilled drafts)."""
        if self.family_fields().keys() - {"family", "qk_norm"}:
            raise ConfigError(
                f"to_hf writes Llama, Qwen2 and Qwen3 configs; this is a {self.family} config"
            )
        model_type = (
            "qwen3" if self.qk_norm else "qwen2" if (self.qkv_bias and not self.o_bias) else "llama"
        )
        hf = dict(
            model_type=model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.dim,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            intermediate_size=self.hidden_dim,
            head_dim=self.head_dim,
            rms_norm_eps=self.norm_eps,
            max_position_embeddings=self.max_seq_len,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            hidden_act="silu",
        )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3_scaling is not None:
            f, lo, hi, old = self.rope_llama3_scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": f,
                "low_freq_factor": lo,
                "high_freq_factor": hi,
                "original_max_position_embeddings": old,
            }
        hf["rope_parameters"] = rope
        if hf["model_type"] != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        return hf


_FIELDS = dataclasses.fields(LlamaConfig)
FAMILY_DEFAULTS = {f.name: f.default for f in _FIELDS[[f.name for f in _FIELDS].index("family") :]}
HEAD_KEEPS = ("rope_linear_factor", "rope_yarn")  # a head keeps the target's (full layers') RoPE
ATTENTION = ("n_heads", "n_kv_heads", "head_dim")  # the fields `head_layers`' `attention` sets


def yarn_inv_freq(theta, dim, factor, beta_fast, beta_slow, original_max, truncate) -> np.ndarray:
    """YaRN's inverse frequencies (float64): interpolated below the correction range, extrapolated above it."""

    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    return (1 / (factor * pos)) * (1 - extrapolate) + (1 / pos) * extrapolate


def normalized_hf(hf: dict) -> dict:
    """`hf` as transformers' own config class completes it (its defaults, `layer_types`, `rope_parameters` from
    older keys), the text model's config for Gemma 3's multimodal checkpoints."""
    transformers = import_transformers()
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on unusual but valid configs are not ours to print
    try:
        hf_cfg = transformers.AutoConfig.for_model(**hf)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ConfigError(
            f"config.json does not parse as a {hf.get('model_type')} config ({err}); fix or re-download it"
        ) from err
    finally:
        transformers.logging.set_verbosity(level)
    return hf_cfg.text_config.to_dict() if hf.get("model_type") == "gemma3" else hf_cfg.to_dict()


def parse_hf(hf: dict, dtype: str) -> LlamaConfig:
    """The config of a Hugging Face `config.json` dict (see `LlamaConfig.from_hf`)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; specjax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [key for key in REQUIRED_HF_KEYS if hf.get(key) is None]
    # a default would be another model (Gemma 3's multimodal configs do leave the released sizes to defaults)
    if missing and model_type != "gemma3":
        raise ConfigError(
            f"config.json lacks {missing[0]!r}, which the decoder needs (a default would be a silently different "
            "model); download the model's config.json again"
        )
    hf = normalized_hf(hf)
    family = hf["model_type"]
    gemma, moe = family.startswith("gemma"), family in ("mixtral", "qwen3_moe", "gpt_oss")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ConfigError(f"hidden_act {act!r} is not supported; specjax runs {', '.join(ACTIVATIONS)}")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported by the specjax decoder")
    bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id", 2)
    scalar = hf.get("query_pre_attn_scalar")
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        hidden_dim=int(hf["intermediate_size"]),
        head_dim=hf.get("head_dim"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bias,
        o_bias=family != "qwen2" and bias,
        bos_id=int(hf.get("bos_token_id") or 1),
        eos_id=int(eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 2)),
        dtype=dtype,
        family=family,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        norm_plus_one=gemma,
        activation=ACTIVATIONS[act],
        sandwich_norms=gemma,
        embed_scale=gemma,
        attn_scale=float(scalar) ** -0.5 if gemma and scalar else None,
        attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_softcap=hf.get("final_logit_softcapping") if gemma else None,
        **_windows(hf),
        **_rope(hf),
        attn_sinks=family == "gpt_oss",
        **(_experts(hf) if moe else {}),
    )


def _windows(hf: dict) -> dict:
    """sliding_window and layer_types: transformers' per-layer types where it gives them, else (Mistral, Phi-3)
    every layer slides when a window is set."""
    window = hf.get("sliding_window")
    kinds = (
        hf.get("layer_types")
        or ["sliding_attention" if window else "full_attention"] * hf["num_hidden_layers"]
    )
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(
            f"layer type {unknown[0]!r} is not supported; specjax runs full and sliding-window attention"
        )
    types = tuple("sliding" if k == "sliding_attention" else "full" for k in kinds)
    if "sliding" not in types or window >= hf.get("max_position_embeddings", 2048):
        return {}  # a window as long as the context is full attention
    return {"sliding_window": int(window), "layer_types": types}


def _rope(hf: dict) -> dict:
    """The RoPE fields from `rope_parameters` (one dict, or one per layer type as Gemma 3's)."""
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        local, rope = (
            rope.get("sliding_attention"),
            rope.get("full_attention", rope.get("sliding_attention")),
        )
        if local is not None and local.get("rope_type", "default") != "default":
            raise ConfigError(
                f"sliding layers' rope scaling {local['rope_type']!r} is not supported; supported: none"
            )
    else:
        local = None
    if hf.get("rope_scaling"):  # an older config that transformers left as it was
        rope = {**rope, **hf["rope_scaling"]}
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ConfigError(
            "partial_rotary_factor < 1 (RoPE on part of each head) is not supported by specjax"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if local is not None:
        out["local_rope_theta"] = float(local.get("rope_theta", out["rope_theta"]))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        old = int(rope["original_max_position_embeddings"])
        out["rope_llama3_scaling"] = (*(float(rope[k]) for k in keys), old)
    elif kind == "linear":
        out["rope_linear_factor"] = float(rope["factor"])
    elif kind == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ConfigError(
                "YaRN with mscale is not supported; supported: YaRN with factor and attention_factor"
            )
        factor = float(rope["factor"])
        attention = rope.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)
        old = int(rope["original_max_position_embeddings"])
        out["rope_yarn"] = (factor, fast, slow, old, bool(rope.get("truncate", True)), float(attention))
    elif kind != "default":
        raise ConfigError(
            f"rope scaling {kind!r} is not supported; supported: none (default), 'llama3', 'linear', 'yarn'"
        )
    return out


def _experts(hf: dict) -> dict:
    """The mixture-of-experts fields of Mixtral, Qwen3-MoE and gpt-oss."""
    family = hf["model_type"]
    if family == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise ConfigError(
            "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported"
        )
    out = {
        "n_experts": int(hf.get("num_local_experts") or hf["num_experts"]),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "expert_dim": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "router": "softmax_topk_norm"
        if family == "mixtral" or hf.get("norm_topk_prob")
        else "softmax_topk",
    }
    if family == "gpt_oss":
        out |= {"router": "topk_softmax", "expert_bias": True}
        out["swiglu_clamp"] = (float(hf["swiglu_alpha"]), float(hf["swiglu_limit"]))
    return out
