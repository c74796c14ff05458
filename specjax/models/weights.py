"""Weight conversion into specjax's parameter tree from Hugging Face safetensors and llama2.c files."""

from __future__ import annotations

import json
import struct as pystruct
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import CheckpointError
from specjax.models.config import LlamaConfig
from specjax.models.llama import abstract_model


def build_params(cfg: LlamaConfig, pure: dict):
    """(graphdef, params) from a nested dict of numpy arrays, checking every name and shape."""
    graphdef, abstract = abstract_model(cfg)
    expected = {path: var.get_value() for path, var in nnx.to_flat_state(abstract)}
    given = dict(_flatten(pure))
    missing = sorted(set(expected) - set(given), key=str)
    extra = sorted(set(given) - set(expected), key=str)
    if missing or extra:
        raise CheckpointError(
            f"parameter names do not match the config: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    leaves = {}
    for path, spec in expected.items():
        if tuple(given[path].shape) != tuple(spec.shape):
            raise CheckpointError(
                f"parameter {'/'.join(map(str, path))} has shape {given[path].shape}, "
                f"the config needs {spec.shape}"
            )
        leaves[path] = jnp.asarray(given[path], dtype=spec.dtype)
    params = nnx.from_flat_state({p: v.replace(leaves[p]) for p, v in nnx.to_flat_state(abstract)})
    return graphdef, params


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _layer(norm1, q, k, v, o, norm2, gate, up, down, qkv_bias=None, o_bias=None):
    """One block from [out, in] matrices (PyTorch layout, which specjax keeps), q/k/v and gate/up fused."""
    layer = {
        "attn_norm": {"weight": norm1},
        "wqkv": {"weight": np.concatenate([q, k, v], axis=0)},
        "wo": {"weight": o},
        "mlp_norm": {"weight": norm2},
        "w_gate_up": {"weight": np.concatenate([gate, up], axis=0)},
        "w_down": {"weight": down},
    }
    if qkv_bias is not None:
        layer["wqkv"]["bias"] = np.concatenate(qkv_bias)
    if o_bias is not None:
        layer["wo"]["bias"] = o_bias
    return layer


def _assemble(cfg: LlamaConfig, embed, layers, norm, lm_head):
    pure = {"embed": {"embedding": embed}, "layers": dict(enumerate(layers)), "norm": {"weight": norm}}
    if not cfg.tie_embeddings:
        pure["lm_head"] = {"weight": lm_head}
    return pure


# --- Hugging Face safetensors ------------------------------------------------------------------


class SafetensorsFiles(Mapping):
    """The tensors of `model.safetensors` or of the shards a `model.safetensors.index.json` names, read one at a
    time when asked for (`files[name]` -> numpy): loading never holds the whole model on the host. Every file's
    header is checked when this is made."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as err:
                raise CheckpointError(f"{index} is corrupt ({err}); download it again") from err
        elif (model_dir / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {model_dir}; "
                "download the model's weights in safetensors format"
            )
        self._where, self._handles = {}, {}
        for name in files:
            path = model_dir / name
            if not path.exists():
                raise CheckpointError(f"{path}, listed in {index.name}, is missing; download it again")
            try:
                self._handles[path] = handle = safe_open(str(path), framework="numpy")
            except Exception as err:  # safetensors raises several types on damaged files
                raise _corrupt(path, err) from err
            self._where |= dict.fromkeys(handle.keys(), path)

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._where[name]
        try:
            return self._handles[path].get_tensor(name)
        except Exception as err:
            raise _corrupt(path, err) from err

    def __contains__(self, name) -> bool:  # without reading the tensor (Mapping's default would)
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _corrupt(path: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"weight file {path} is corrupt or truncated ({err}); download it again")


def read_safetensors(model_dir: Path) -> SafetensorsFiles:
    """The tensors of a Hugging Face model directory (`SafetensorsFiles`: read one at a time)."""
    return SafetensorsFiles(model_dir)


def params_from_hf(cfg: LlamaConfig, tensors: Mapping[str, np.ndarray], put: Callable | None = None):
    """(graphdef, params) from a Hugging Face checkpoint's tensor names (every supported family), converted a layer
    at a time: `put(path, array in the config's dtype)` places each parameter (default: on the default device; on a
    mesh, `specjax.sharding.leaf_placer`), so the host holds one layer's tensors at a time."""
    put = put or (lambda path, x: jax.device_put(x))  # jnp.asarray would compile a copy per shape
    prefix = next((p for p in MODEL_PREFIXES if p + "embed_tokens.weight" in tensors), "model.")

    def tensor(name, shape):
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the safetensors checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, but config.json implies {shape}; "
                "the weights and config.json do not belong together: download them again"
            )
        return np.asarray(tensors[name], dtype=np.float32)

    def get(name, shape):  # inside the decoder
        return tensor(prefix + name, shape)

    def placed(path: tuple, tree: dict) -> dict:
        return {
            key: placed(path + (key,), value)
            if isinstance(value, dict)
            else put(path + (key,), np.asarray(value, dtype=jnp.dtype(cfg.dtype)))
            for key, value in tree.items()
        }

    layers = []
    for i in range(cfg.n_layers):
        layer = placed(("layers", i), hf_layer(cfg, get, f"layers.{i}.", lambda n: prefix + n in tensors))
        layers.append(jax.block_until_ready(layer))  # copied before the next is read: one layer on the host
    d, v = cfg.dim, cfg.vocab_size
    lm_head = None if cfg.tie_embeddings else tensor("lm_head.weight", (v, d))
    embed, norm = get("embed_tokens.weight", (v, d)), get("norm.weight", (d,))
    rest = placed((), _assemble(cfg, embed, [], norm, lm_head))
    return build_params(cfg, rest | {"layers": dict(enumerate(layers))})


# where a checkpoint keeps its decoder: causal LMs under "model.", Gemma 3's multimodal ones under their text model
MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def hf_layer(cfg: LlamaConfig, get: Callable, p: str, has: Callable) -> dict:
    """Layer `p` ("layers.i.") in specjax's names from the Hugging Face names of its family."""
    d, hd = cfg.dim, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    a = p + "self_attn."
    if cfg.family == "phi3":
        qkv = get(a + "qkv_proj.weight", (q + 2 * kv, d))
    else:
        qkv = np.concatenate([get(a + f"{n}_proj.weight", (m, d)) for n, m in zip("qkv", (q, kv, kv))])
    layer = {"attn_norm": {"weight": get(p + "input_layernorm.weight", (d,))}, "wqkv": {"weight": qkv}}
    layer["wo"] = {"weight": get(a + "o_proj.weight", (d, q))}
    if cfg.qkv_bias:
        layer["wqkv"]["bias"] = np.concatenate(
            [get(a + f"{n}_proj.bias", (m,)) for n, m in zip("qkv", (q, kv, kv))]
        )
    if cfg.o_bias:
        layer["wo"]["bias"] = get(a + "o_proj.bias", (d,))
    if cfg.qk_norm:
        layer["q_norm"], layer["k_norm"] = ({"weight": get(a + f"{n}_norm.weight", (hd,))} for n in "qk")
    if cfg.attn_sinks:
        layer["sinks"] = get(a + "sinks", (cfg.n_heads,))
    if (
        cfg.sandwich_norms
    ):  # Gemma: post_attention_layernorm follows attention, pre_feedforward_layernorm leads the MLP
        layer["post_attn_norm"] = {"weight": get(p + "post_attention_layernorm.weight", (d,))}
        layer["mlp_norm"] = {"weight": get(p + "pre_feedforward_layernorm.weight", (d,))}
        layer["post_mlp_norm"] = {"weight": get(p + "post_feedforward_layernorm.weight", (d,))}
    else:
        layer["mlp_norm"] = {"weight": get(p + "post_attention_layernorm.weight", (d,))}
    if cfg.n_experts:
        layer["moe"] = hf_experts(cfg, get, p + "mlp.", has)
    else:
        layer |= hf_mlp(cfg, get, p + "mlp.", cfg.hidden_dim, "gate_proj", "up_proj", "down_proj")
    return layer


def hf_mlp(cfg: LlamaConfig, get: Callable, p: str, f: int, gate: str, up: str, down: str) -> dict:
    """A gated MLP's {w_gate_up, w_down} from separate gate and up matrices (Phi-3: one fused gate_up_proj)."""
    d = cfg.dim
    if cfg.family == "phi3":
        gate_up = get(p + "gate_up_proj.weight", (2 * f, d))
    else:
        gate_up = np.concatenate([get(p + f"{gate}.weight", (f, d)), get(p + f"{up}.weight", (f, d))])
    return {"w_gate_up": {"weight": gate_up}, "w_down": {"weight": get(p + f"{down}.weight", (d, f))}}


def hf_experts(cfg: LlamaConfig, get: Callable, p: str, has: Callable) -> dict:
    """The router and experts of a mixture-of-experts layer: Mixtral's (block_sparse_moe, w1/w3/w2), Qwen3-MoE's
    (gate_proj/up_proj/down_proj per expert) or gpt-oss's (all experts in one tensor, [in, out], gate and up
    interleaved, with biases; dequantised from MXFP4 where the checkpoint holds that)."""
    d, e, f = cfg.dim, cfg.n_experts, cfg.expert_dim
    if cfg.family == "mixtral":
        p = p.replace("mlp.", "block_sparse_moe.")
        names, router = ("w1", "w3", "w2"), {"weight": get(p + "gate.weight", (e, d))}
    elif cfg.family == "qwen3_moe":
        names, router = ("gate_proj", "up_proj", "down_proj"), {"weight": get(p + "gate.weight", (e, d))}
    else:
        router = {"weight": get(p + "router.weight", (e, d)), "bias": get(p + "router.bias", (e,))}
        x = p + "experts."
        gate_up = stacked_experts(get, has, x + "gate_up_proj", (e, 2 * f, d))
        down = stacked_experts(get, has, x + "down_proj", (e, d, f))
        gate_up_bias, down_bias = (
            get(x + "gate_up_proj_bias", (e, 2 * f)),
            get(x + "down_proj_bias", (e, d)),
        )
        experts = {
            i: {
                "w_gate_up": {
                    "weight": np.concatenate([gate_up[i, 0::2], gate_up[i, 1::2]]),
                    "bias": np.concatenate([gate_up_bias[i, 0::2], gate_up_bias[i, 1::2]]),
                },
                "w_down": {"weight": down[i], "bias": down_bias[i]},
            }
            for i in range(e)
        }
        return {"router": router, "experts": experts}
    experts = {i: hf_mlp(cfg, get, p + f"experts.{i}.", f, *names) for i in range(e)}
    return {"router": router, "experts": experts}


def stacked_experts(get: Callable, has: Callable, name: str, shape: tuple) -> np.ndarray:
    """gpt-oss's stacked expert matrices as [E, out, in]: dequantised from MXFP4 (`name_blocks`, `name_scales`), or
    read as stored ([E, in, out]) and transposed."""
    e, n_out, n_in = shape
    if not has(name + "_blocks"):
        return get(name, (e, n_in, n_out)).transpose(0, 2, 1)
    if n_in % 32:
        raise CheckpointError(
            f"MXFP4 tensor {name!r} packs rows of {n_in}, not a multiple of its 32-value groups"
        )
    groups = n_in // 32
    blocks = get(name + "_blocks", (e, n_out, groups, 16)).astype(np.uint8)
    return mxfp4(blocks, get(name + "_scales", (e, n_out, groups)).astype(np.uint8))


FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4(blocks_EOGB: np.ndarray, scales_EOG: np.ndarray) -> np.ndarray:
    """MXFP4 [E, out, groups, 16] bytes (two 4-bit E2M1 values each, low nibble first) and [E, out, groups] power-of-two
    scales (biased by 127) -> float32 [E, out, groups * 32]."""
    values = np.stack(
        [FP4_E2M1[blocks_EOGB & 0x0F], FP4_E2M1[blocks_EOGB >> 4]], axis=-1
    )  # [E, O, G, 16, 2]
    values = values.reshape(*blocks_EOGB.shape[:-1], -1)
    scaled = np.ldexp(values, scales_EOG.astype(np.int32)[..., None] - 127)
    return scaled.reshape(*scaled.shape[:-2], -1)


# --- llama.c legacy (version 0) -----------------------------------------------------------------

LLAMA2C_HEADER = 7 * 4


def _unpermute_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Meta's interleaved-pair RoPE rows -> rotate-half rows (as the official HF conversion does)."""
    out_dim, in_dim = w.shape
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim)
        .transpose(0, 2, 1, 3)
        .reshape(out_dim, in_dim)
    )


def read_llama2c(path: Path, dtype: str = "float32"):
    """(config, graphdef, params) from a llama2.c legacy checkpoint (`*.bin`, float32)."""
    if not path.exists():
        raise CheckpointError(f"llama2.c checkpoint {path} does not exist")
    raw = path.read_bytes()
    if len(raw) < LLAMA2C_HEADER:
        raise CheckpointError(
            f"llama2.c checkpoint {path} is truncated (only {len(raw)} bytes); download or export it again"
        )
    if raw[:4] == b"42ka":  # b'ak42' magic, little-endian
        raise CheckpointError(
            f"{path} is a versioned llama2.c export; re-export it with llama2.c's legacy_export"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = pystruct.unpack("7i", raw[:LLAMA2C_HEADER])
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads:
        raise CheckpointError(
            f"{path} does not start with a valid llama2.c header; pass a llama2.c legacy checkpoint (*.bin), a "
            "Hugging Face model directory or a specjax checkpoint"
        )
    cfg = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        hidden_dim=hidden,
        max_seq_len=seq_len,
        tie_embeddings=shared,
        dtype=dtype,
    )
    hd, kv_dim = cfg.head_dim, n_kv * cfg.head_dim
    shapes = [
        ("embed", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_real", (seq_len, hd // 2)),
        ("freq_imag", (seq_len, hd // 2)),
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    need = LLAMA2C_HEADER + 4 * sum(int(np.prod(s)) for _, s in shapes)
    if len(raw) != need:
        raise CheckpointError(
            f"llama2.c checkpoint {path} has {len(raw)} bytes, its header implies {need}: "
            "the file is truncated or corrupt; download or export it again"
        )
    flat = np.frombuffer(raw, np.float32, offset=LLAMA2C_HEADER)
    t, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        t[name] = flat[offset : offset + n].reshape(shape)
        offset += n
    layers = [
        _layer(
            t["rms_att"][i],
            _unpermute_meta(t["wq"][i], n_heads),
            _unpermute_meta(t["wk"][i], n_kv),
            t["wv"][i],
            t["wo"][i],
            t["rms_ffn"][i],
            t["w1"][i],
            t["w3"][i],
            t["w2"][i],
        )
        for i in range(n_layers)
    ]
    graphdef, params = build_params(cfg, _assemble(cfg, t["embed"], layers, t["rms_final"], t.get("wcls")))
    return cfg, graphdef, params
