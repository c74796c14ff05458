"""Drafting heads in the layouts their authors publish, loaded into and exported from specjax's own heads.

EAGLE-3 (SafeAILab/EAGLE `eagle/model/cnets.py`, SpecForge, vLLM `llama_eagle3.py`): `config.json` (a one-layer
Llama config plus `draft_vocab_size`, optionally `eagle_aux_hidden_state_layer_ids`) and `model.safetensors` or
`pytorch_model.bin` holding `fc.weight` [H, 3H], `midlayer.self_attn.{q,k,v}_proj.weight` [*, 2H] (input:
concat(input_layernorm(embedding), hidden_norm(feature))), `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`norm.weight`, `lm_head.weight` [N, H], `d2t` [N] (target id = draft id + d2t[draft id]) and `t2d` [V] (bool).
Layer id j in `eagle_aux_hidden_state_layer_ids` is the input of target layer j, i.e. specjax's tap j - 1; without
it the reference takes the inputs of layers 2, L/2, L-3 (`specjax.drafters.eagle3.paper_layers`).

Medusa-1 (FasterDecoding/Medusa `medusa/model/medusa_model.py`): `config.json` with `medusa_num_heads` and
`medusa_num_layers`, and `medusa_lm_head.safetensors` or `medusa_lm_head.pt`: head i is residual blocks
`{i}.{j}.linear.{weight,bias}` (x + SiLU(W x + b)) then `{i}.{num_layers}.weight` [V, H].

EAGLE-1/2 (SafeAILab/EAGLE `eagle/model/cnets1.py`, vLLM `llama_eagle.py`): `config.json` (a one-layer Llama
config) and `pytorch_model.bin` or `model.safetensors` holding `fc.weight` [H, 2H] (input: concat(embedding,
feature)) and `fc.bias` (absent: zero), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight` and `layers.0.post_attention_layernorm.weight`: layer 0 has no
input_layernorm (its attention reads the fc output as it is), so these load into specjax EAGLE heads of shape
`{"input_norm": false}`; specjax's own EAGLE heads (which normalise) cannot be exported to this layout. HASS's
variant (`add_para_norm`) is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import files, heads
from specjax.drafters.base import target_io
from specjax.drafters.eagle import layer_config
from specjax.drafters.eagle3 import paper_layers
from specjax.errors import HeadsError
from specjax.models.config import ConfigError, LlamaConfig
from specjax.models.weights import CheckpointError

WEIGHTS = {
    "eagle3": ("model.safetensors", "pytorch_model.bin"),
    "medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
    "eagle": ("model.safetensors", "pytorch_model.bin"),
}
MARK = "specjax_export.json"  # marks a directory written by `export_published` (one a later export may replace)
EAGLE12 = (
    "the published EAGLE-1/2 layout has no input_layernorm in its decoder layer (SafeAILab/EAGLE cnets1.py), while "
    "this head normalises its layer's input, so the layout cannot hold it; export it as specjax heads "
    "(heads.export) or train an EAGLE-3 head"
)


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file, or of a `.bin`/`.pt` file through `torch.load(weights_only=True)`."""
    path = Path(path)
    if path.suffix == ".safetensors":
        import ml_dtypes  # noqa: F401  (lets numpy, and so safetensors, read bfloat16)
        from safetensors.numpy import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises several types on damaged files
            raise CheckpointError(f"{path} is corrupt or truncated ({err}); download it again") from err
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"reading {path} needs torch: install torch, or convert the file to safetensors"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{path} cannot be loaded as plain tensors ({type(err).__name__}); convert it to safetensors"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    to_np = lambda v: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
    return {k: to_np(v) for k, v in state.items() if torch.is_tensor(v)}


def kind_of(tensors: dict) -> str | None:
    """Which published head the tensor names belong to: "eagle3", "medusa", "eagle" (EAGLE-1/2) or None."""
    if any(k.startswith("midlayer.") for k in tensors):
        return "eagle3"
    if any(re.fullmatch(r"\d+\.\d+\.(linear\.)?weight", k) for k in tensors):
        return "medusa"
    fc = tensors.get("fc.weight")
    if fc is not None and fc.ndim == 2 and fc.shape[1] == 2 * fc.shape[0]:
        return "eagle"
    return None


def _read_dir(path: Path, method: str) -> tuple[dict, dict, Path]:
    """(config.json, tensors, weight file) of a published head directory, checked to hold `method` heads."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass the directory of a published {method} head")
    names = dict.fromkeys(WEIGHTS[method] + sum(WEIGHTS.values(), ()))  # this method's files first
    found = [path / n for n in names if (path / n).is_file()]
    if not found:
        raise CheckpointError(
            f"{path} holds none of {' / '.join(WEIGHTS[method])}; download the head's weights there"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / 'config.json'} is missing or corrupt ({err}); download it again"
        ) from err
    tensors = read_tensors(found[0])
    kind = kind_of(tensors)
    if kind is None:
        raise CheckpointError(
            f"{found[0]} holds no published head tensors (midlayer.*, {{i}}.{{j}}.linear.*, fc + layers.0.*); "
            f"pass the directory of a published {method} head"
        )
    if kind != method:
        raise CheckpointError(f"{found[0]} holds {kind} heads, not {method} heads; pass method={kind!r}")
    return config, tensors, found[0]


def _getter(tensors: dict, where: Path):
    def get(name: str, shape: tuple) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(
                f"{where} has no tensor {name!r}: the file is incomplete; download it again"
            )
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {where} has shape {tuple(tensors[name].shape)}, this target needs "
                f"{tuple(shape)}: use a head trained for this target"
            )
        return np.asarray(tensors[name], np.float32)

    return get


def _fill(fresh, pure):
    """`pure` (numpy) in the structure and dtypes of the fresh head parameters `fresh`."""
    return jax.tree.map(lambda f, a: jnp.asarray(a, f.dtype), fresh, pure)


def d2t_t2d(draft_ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The published maps of a draft vocabulary (specjax's `draft_ids`: target id of each draft id): `d2t` [N]
    int64 offsets (target = draft + d2t[draft]) and `t2d` [V] bool (whether a target id is drafted)."""
    ids = np.asarray(draft_ids, np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(len(ids)), t2d


def draft_ids_of(d2t, t2d, vocab_size: int, where="the checkpoint") -> np.ndarray:
    """specjax's `draft_ids` (target id of each draft id) from published `d2t` offsets, checked against `t2d`."""
    ids = np.arange(len(d2t)) + np.asarray(d2t, np.int64)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= vocab_size or len(np.unique(ids)) != len(ids):
        raise CheckpointError(
            f"d2t of {where} maps draft ids outside the {vocab_size}-token vocabulary or twice onto one "
            "target id; the file is corrupt, download it again"
        )
    if t2d is not None and not np.array_equal(np.asarray(t2d, bool), d2t_t2d(ids, vocab_size)[1]):
        raise CheckpointError(f"d2t and t2d of {where} disagree; the file is corrupt, download it again")
    return ids


def load_published(path: str | Path, method: str, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of a published `method` head ("eagle3", "eagle" for EAGLE-1/2, "medusa") for the
    target, as `heads.load_heads` returns them."""
    path = Path(path).absolute()
    if method not in WEIGHTS:
        raise HeadsError(f"unknown published head method {method!r}; use one of {sorted(WEIGHTS)}")
    config, tensors, where = _read_dir(path, method)
    load = {"eagle3": _load_eagle3, "eagle": _load_eagle, "medusa": _load_medusa}[method]
    return load(config, tensors, where, target_cfg, target_params)


def _check(where: Path, what: str, theirs, ours, fix: str = "use a head trained for this target") -> None:
    if theirs is not None and theirs != ours:
        raise CheckpointError(f"{where} is a head for {what} {theirs}, the target has {ours}: {fix}")


def _load_eagle3(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    dim, vocab = cfg.dim, cfg.vocab_size
    if "fc.weight" not in t:
        raise CheckpointError(
            f"{where} has no fc.weight (a head reading no fused target layers); specjax's EAGLE-3 head fuses them"
        )
    _check(where, "hidden size", t["fc.weight"].shape[0], dim)
    _check(where, "hidden size", hf.get("hidden_size"), dim)
    _check(where, "target hidden size", hf.get("target_hidden_size"), dim)
    _check(where, "a vocabulary of", hf.get("vocab_size"), vocab)
    if "t2d" in t:
        _check(where, "a vocabulary (t2d) of", len(t["t2d"]), vocab)
    n_draft = t["lm_head.weight"].shape[0] if "lm_head.weight" in t else None
    if n_draft is None or n_draft > vocab:
        raise CheckpointError(
            f"{where} has lm_head rows {n_draft} for a {vocab}-token target: use a head trained for this target"
        )
    _check(where, "draft vocabulary (draft_vocab_size)", hf.get("draft_vocab_size"), n_draft)
    if hf.get("num_hidden_layers", 1) != 1 or hf.get("norm_before_residual"):
        raise CheckpointError(
            f"{where} has {hf.get('num_hidden_layers')} decoder layers or norm_before_residual=true; specjax's "
            "EAGLE-3 head is one layer keeping the un-normalised feature as its residual"
        )
    _check_layer(hf, where, cfg)
    _check_embedding(t, where, cfg, target_params)

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
        _check(where, "fused layers (fc inputs / hidden size)", n_taps, len(layers))

    if "d2t" in t:
        draft_ids = draft_ids_of(t["d2t"], t.get("t2d"), vocab, where)
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

    get = _getter(t, where)
    layer = _layer(t, where, cfg, "midlayer.", 2 * dim, fresh["layer"])
    layer["attn_norm"] = {"weight": get("midlayer.hidden_norm.weight", (dim,))}
    layer["embed_norm"] = {"weight": get("midlayer.input_layernorm.weight", (dim,))}
    pure = {
        "fc": {"weight": get("fc.weight", (dim, n_taps * dim))},
        "layer": layer,
        "norm": {"weight": get("norm.weight", (dim,))},
        "lm_head": {"weight": get("lm_head.weight", (n_draft, dim))},
    }
    return meta, graphdef, _fill(fresh, pure)


def _check_layer(hf: dict, where: Path, cfg: LlamaConfig) -> None:
    """A published head's one-layer Llama config must match a layer of the target."""
    try:
        theirs = LlamaConfig.from_hf({"model_type": "llama", **hf, "vocab_size": cfg.vocab_size})
    except (ConfigError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{where.parent / 'config.json'} cannot be read as a Llama layer ({err})"
        ) from err
    ours = layer_config(cfg)
    for name in ("n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps"):
        _check(where, name, getattr(theirs, name), getattr(ours, name))
    if not np.array_equal(theirs.inv_freq(), ours.inv_freq()):
        raise CheckpointError(
            f"{where} is a head for RoPE theta {theirs.rope_theta} / scaling {theirs.rope_llama3_scaling}, the "
            f"target has {ours.rope_theta} / {ours.rope_llama3_scaling}: use a head trained for this target"
        )


def _check_embedding(t: dict, where: Path, cfg: LlamaConfig, target_params) -> None:
    """The reference drafts with the target's embedding; a file carrying a copy of another one is refused."""
    if "embed_tokens.weight" in t:
        theirs = t["embed_tokens.weight"].astype(np.float32)
        ours = np.asarray(target_io(cfg, target_params)["embed"], np.float32)
        if theirs.shape != ours.shape or np.abs(theirs - ours).max() > 1e-2 * np.abs(ours).max():
            raise CheckpointError(
                f"{where} carries an embed_tokens.weight unlike the target's embedding; specjax drafts with the "
                "target's embedding: use a head trained for this target"
            )


def _layer(t: dict, where: Path, cfg: LlamaConfig, prefix: str, width: int, fresh: dict) -> dict:
    """A decoder layer's projections (attention input `width` wide), post-attention norm and attention biases
    from the tensors under `prefix` (`fresh`: the layer's fresh parameters, which say which biases it has)."""
    get, a, dim = _getter(t, where), prefix + "self_attn.", cfg.dim
    h, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.hidden_dim
    qkv = [get(a + f"{p}_proj.weight", (n, width)) for p, n in zip("qkv", (h, kv, kv))]
    gate_up = [get(f"{prefix}mlp.{p}_proj.weight", (f, dim)) for p in ("gate", "up")]
    layer = {
        "mlp_norm": {"weight": get(prefix + "post_attention_layernorm.weight", (dim,))},
        "wqkv": {"weight": np.concatenate(qkv)},
        "wo": {"weight": get(a + "o_proj.weight", (dim, h))},
        "w_gate_up": {"weight": np.concatenate(gate_up)},
        "w_down": {"weight": get(prefix + "mlp.down_proj.weight", (dim, f))},
    }
    biases = {"wqkv": [a + f"{p}_proj.bias" for p in "qkv"], "wo": [a + "o_proj.bias"]}
    for mod, names in biases.items():
        given = [t.get(n) for n in names]
        if "bias" in fresh[mod]:
            sizes = (h, kv, kv) if mod == "wqkv" else (dim,)
            layer[mod]["bias"] = np.concatenate(
                [
                    np.zeros(s, np.float32) if b is None else get(n, (s,))
                    for n, b, s in zip(names, given, sizes)
                ]
            )
        elif any(b is not None and np.any(b) for b in given):
            raise CheckpointError(
                f"{where} has nonzero {' / '.join(names)}, which this target's layer (no such bias) cannot hold: "
                "use a head trained for this target"
            )
    return layer


def _load_eagle(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    dim = cfg.dim
    _check(where, "hidden size", t["fc.weight"].shape[0], dim)
    _check(where, "hidden size", hf.get("hidden_size"), dim)
    _check(where, "a vocabulary of", hf.get("vocab_size"), cfg.vocab_size)
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
    _check_layer(hf, where, cfg)
    _check_embedding(t, where, cfg, target_params)
    meta = heads.describe("eagle", {"input_norm": False}, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)
    get = _getter(t, where)
    bias = get("fc.bias", (dim,)) if "fc.bias" in t else np.zeros(dim, np.float32)
    pure = {
        "fc": {"weight": get("fc.weight", (dim, 2 * dim)), "bias": bias},
        "layer": _layer(t, where, cfg, "layers.0.", dim, fresh["layer"]),
    }
    return meta, graphdef, _fill(fresh, pure)


def _load_medusa(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    blocks = {tuple(map(int, k.split(".")[:2])) for k in t if re.fullmatch(r"\d+\.\d+\.linear\.weight", k)}
    n_heads = int(hf.get("medusa_num_heads") or 1 + max(i for i, _ in blocks | {(0, 0)}))
    n_layers = int(hf.get("medusa_num_layers", 1 + max((j for _, j in blocks), default=-1)))
    if "0.0.linear.weight" in t:
        _check(where, "hidden size", t["0.0.linear.weight"].shape[0], cfg.dim)
    _check(where, "hidden size", hf.get("hidden_size"), cfg.dim)
    _check(where, "a vocabulary of", hf.get("vocab_size"), cfg.vocab_size)
    if f"0.{n_layers}.weight" in t:
        _check(where, "a vocabulary (output rows) of", t[f"0.{n_layers}.weight"].shape[0], cfg.vocab_size)
    meta = heads.describe("medusa", {"num_heads": n_heads, "num_layers": n_layers}, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)
    get, d = _getter(t, where), cfg.dim
    w = [[get(f"{i}.{j}.linear.weight", (d, d)) for j in range(n_layers)] for i in range(n_heads)]
    b = [[get(f"{i}.{j}.linear.bias", (d,)) for j in range(n_layers)] for i in range(n_heads)]
    proj = [get(f"{i}.{n_layers}.weight", (cfg.vocab_size, d)) for i in range(n_heads)]
    pure = {
        "w": np.asarray(w, np.float32).reshape(n_heads, n_layers, d, d),
        "b": np.asarray(b, np.float32).reshape(n_heads, n_layers, d),
        "proj": np.stack(proj),
    }
    return meta, graphdef, _fill(fresh, pure)


# --- export ------------------------------------------------------------------------------------------------


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / MARK).read_text()).get("format") == "specjax-published-export"
    except (OSError, ValueError, AttributeError):
        return False


def _layer_tensors(layer: dict, prefix: str, cfg: LlamaConfig) -> dict:
    """The published tensors of a decoder layer (inverse of `_layer`), attention biases included if it has any."""
    h, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    q, k, v = np.split(layer["wqkv"]["weight"], [h, h + kv])
    gate, up = np.split(layer["w_gate_up"]["weight"], 2)
    a = prefix + "self_attn."
    t = {
        a + "q_proj.weight": q,
        a + "k_proj.weight": k,
        a + "v_proj.weight": v,
        a + "o_proj.weight": layer["wo"]["weight"],
        prefix + "mlp.gate_proj.weight": gate,
        prefix + "mlp.up_proj.weight": up,
        prefix + "mlp.down_proj.weight": layer["w_down"]["weight"],
        prefix + "post_attention_layernorm.weight": layer["mlp_norm"]["weight"],
    }
    if "bias" in layer["wqkv"] or "bias" in layer["wo"]:  # attention_bias puts a bias on q, k, v and o
        zeros = lambda n: np.zeros(n, q.dtype)
        qkv_b = layer["wqkv"]["bias"] if "bias" in layer["wqkv"] else zeros(h + 2 * kv)
        for name, part in zip("qkv", np.split(qkv_b, [h, h + kv])):
            t[a + f"{name}_proj.bias"] = part
        t[a + "o_proj.bias"] = layer["wo"]["bias"] if "bias" in layer["wo"] else zeros(cfg.dim)
    return t


def _layer_config(cfg: LlamaConfig, architecture: str, bias: bool, dtype) -> dict:
    """config.json of a one-layer head for the target `cfg`."""
    rope = cfg.to_hf()["rope_parameters"]
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "max_position_embeddings": cfg.max_seq_len,
        "attention_bias": bias,
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": str(dtype),
    }


def _eagle3_files(meta: dict, p, cfg: LlamaConfig) -> tuple[dict, dict]:
    shape, layer = meta["shape"], p["layer"]  # numpy arrays
    ids = shape["draft_ids"] if shape["draft_ids"] is not None else range(cfg.vocab_size)
    d2t, t2d = d2t_t2d(ids, cfg.vocab_size)
    t = {
        "fc.weight": p["fc"]["weight"],
        **_layer_tensors(layer, "midlayer.", cfg),
        "midlayer.input_layernorm.weight": layer["embed_norm"]["weight"],
        "midlayer.hidden_norm.weight": layer["attn_norm"]["weight"],
        "norm.weight": p["norm"]["weight"],
        "lm_head.weight": p["lm_head"]["weight"],
        "d2t": d2t,
        "t2d": t2d,
    }
    bias = "midlayer.self_attn.o_proj.bias" in t
    config = _layer_config(cfg, "LlamaForCausalLMEagle3", bias, t["fc.weight"].dtype)
    config["draft_vocab_size"] = len(d2t)
    config["eagle_aux_hidden_state_layer_ids"] = [int(j) + 1 for j in shape["layers"]]
    return t, config


def _eagle_files(meta: dict, p, cfg: LlamaConfig) -> tuple[dict, dict]:
    if meta["shape"].get("input_norm", True):
        raise HeadsError(f"this EAGLE head cannot be exported to the published layout: {EAGLE12}")
    t = {
        "fc.weight": p["fc"]["weight"],
        "fc.bias": p["fc"]["bias"],
        **_layer_tensors(p["layer"], "layers.0.", cfg),
    }
    bias = "layers.0.self_attn.o_proj.bias" in t
    return t, _layer_config(cfg, "LlamaForCausalLM", bias, t["fc.weight"].dtype)


def _medusa_files(meta: dict, p, cfg: LlamaConfig) -> tuple[dict, dict]:
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
    return t, config


def export_published(
    meta: dict, params, dest: str | Path, target_cfg: LlamaConfig, base_model: str | None = None
):
    """Writes specjax `meta`/`params` heads to `dest` in the published layout: EAGLE-3 and EAGLE-1/2 (heads of
    shape `{"input_norm": false}` only) as `model.safetensors` + `config.json`, Medusa as
    `medusa_lm_head.safetensors` + `config.json` (`base_model`: the target's name for `base_model_name_or_path`).
    Written beside `dest` and renamed into place; an existing `dest` is replaced only if it is empty or a previous
    export (files.DestinationError otherwise). Returns `dest`."""
    from safetensors.numpy import save_file

    method = meta["method"]
    if method not in WEIGHTS:
        raise HeadsError(f"{method} heads have no published layout; export eagle3, eagle or medusa heads")
    if meta["target"] != heads.target_signature(target_cfg):
        raise HeadsError(
            f"these heads were trained for target {meta['target']}, not {heads.target_signature(target_cfg)}: "
            "pass the config of the target they were trained for"
        )
    params = jax.tree.map(np.asarray, params)
    files_of = {"eagle3": _eagle3_files, "eagle": _eagle_files, "medusa": _medusa_files}[method]
    tensors, config = files_of(meta, params, target_cfg)
    if base_model and method == "medusa":
        config["base_model_name_or_path"] = base_model
    weights = "medusa_lm_head.safetensors" if method == "medusa" else "model.safetensors"
    dest = Path(dest).absolute()
    with files.atomic_dir(dest, replaceable=_is_export, what="published heads export") as tmp:
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / weights), {"format": "pt"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / MARK).write_text(
            json.dumps({"format": "specjax-published-export", "method": method}, indent=1)
        )
    return dest
