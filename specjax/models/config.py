"""Llama-family model configuration: one frozen dataclass, parsed from Hugging Face or llama2.c headers."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral-style, Qwen2-style)."""

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

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim / 2] (float32), Llama-3 scaling applied if configured."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_llama3_scaling is not None:
            factor, low, high, old_ctx = self.rope_llama3_scaling
            wavelen = 2 * math.pi / inv
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)

    @property
    def num_params(self) -> int:
        d, h, kv, hd = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * (h + 2 * kv) * hd + h * hd * d
        mlp = 3 * d * self.hidden_dim
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * (attn + mlp + 2 * d) + d + head

    @classmethod
    def from_hf(cls, hf: dict, dtype: str = "float32") -> LlamaConfig:
        """Parses a Hugging Face `config.json` dict; refuses what the decoder cannot run exactly."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; specjax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if model_type == "mistral" or (model_type == "qwen2" and hf.get("use_sliding_window")):
            window = hf.get("sliding_window")
            if window is not None and window < max_pos:
                raise ConfigError(
                    f"this {model_type} config needs sliding-window attention (sliding_window={window} < "
                    f"max_position_embeddings={max_pos}), which specjax does not implement; set "
                    "sliding_window to null if the model was trained with full attention"
                )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"hidden_act {hf['hidden_act']!r} is not supported; Llama-family models use 'silu'"
            )
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported by the specjax Llama decoder")
        rope = dict(hf.get("rope_parameters") or {})
        rope_scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        llama3 = None
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind != "llama3":
                raise ConfigError(
                    f"rope scaling {kind!r} is not supported; supported: none (default) and 'llama3'"
                )
            llama3 = (
                float(rope_scaling["factor"]),
                float(rope_scaling["low_freq_factor"]),
                float(rope_scaling["high_freq_factor"]),
                int(rope_scaling["original_max_position_embeddings"]),
            )
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id", 2)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=int(hf["num_attention_heads"]),
            n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            hidden_dim=int(hf["intermediate_size"]),
            head_dim=hf.get("head_dim"),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_llama3_scaling=llama3,
            max_seq_len=max_pos,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            bos_id=int(hf.get("bos_token_id") or 1),
            eos_id=int(eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 2)),
            dtype=dtype,
        )

    def to_hf(self) -> dict:
        """The equivalent Hugging Face `LlamaConfig`/`Qwen2Config` dict (for reference models in tests)."""
        hf = dict(
            model_type="qwen2" if (self.qkv_bias and not self.o_bias) else "llama",
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
        if hf["model_type"] == "llama":
            hf["attention_bias"] = self.qkv_bias
        return hf
