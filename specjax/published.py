"""Trained heads in the layouts their authors publish (a `config.json` beside a safetensors or torch file), read
into and written from specjax's own heads.

This module owns what every such layout shares: reading the tensor files, finding which registered layout a file
holds, the checks and conversions of a Llama decoder layer and of a draft vocabulary (`d2t`/`t2d`), and the
atomic export. Each head type describes its own layout where it registers (`registry.Published`: EAGLE-3 in
`specjax.drafters.eagle3`, EAGLE-1/2 in `specjax.drafters.eagle`, Medusa-1 in `specjax.drafters.medusa`, z-lab's
DFlash in `specjax.drafters.dflash_zlab`), so nothing here names a method.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from specjax import files
from specjax.drafting import registry
from specjax.drafting.protocol import target_io, target_signature
from specjax.errors import HeadsError
from specjax.models.config import LlamaConfig
from specjax.models.weights import CheckpointError

MARK = "specjax_export.json"  # marks a directory written by `export_published` (one a later export may replace)


def layouts() -> dict[str, registry.Published]:
    """The published layout of each trained head type that has one (`registry.TrainedHeads.published`)."""
    found = {m: registry.trained(m).published for m in registry.head_methods()}
    return {m: layout for m, layout in found.items() if layout is not None}


def kind_of(tensors: dict) -> str | None:
    """Which registered published layout the tensor names belong to (its method), or None."""
    return next((m for m, layout in layouts().items() if layout.owns(tensors)), None)


def _read_dir(path: Path, method: str) -> tuple[dict, dict, Path]:
    """(config.json, tensors, weight file) of a published head directory, checked to hold `method` heads."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass the directory of a published {method} head")
    every = layouts()
    names = dict.fromkeys(
        every[method].weights + sum((w.weights for w in every.values()), ())
    )  # its own first
    found = [path / n for n in names if (path / n).is_file()]
    if not found:
        raise CheckpointError(
            f"{path} holds none of {' / '.join(every[method].weights)}; download the head's weights there"
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
            f"{found[0]} holds no published head tensors ({', '.join(w.tensors for w in every.values())}); "
            f"pass the directory of a published {method} head"
        )
    if kind != method:
        raise CheckpointError(f"{found[0]} holds {kind} heads, not {method} heads; pass method={kind!r}")
    return config, tensors, found[0]


def load_published(path: str | Path, method: str, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of a published `method` head (e.g. "eagle3", "eagle" for EAGLE-1/2, "medusa") for
    the target, as `specjax.heads.load_heads` returns them (either this or vLLM's speculators format:
    `specjax.heads.load_external`)."""
    path = Path(path).absolute()
    if method not in layouts():
        raise HeadsError(f"unknown published head method {method!r}; use one of {sorted(layouts())}")
    config, tensors, where = _read_dir(path, method)
    return layouts()[method].load(config, tensors, where, target_cfg, target_params)


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


def getter(tensors: dict, where: Path):
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


def fill(fresh, pure):
    """`pure` (numpy) in the structure and dtypes of the fresh head parameters `fresh`."""
    return jax.tree.map(lambda f, a: jax.device_put(np.asarray(a, f.dtype)), fresh, pure)


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


def check(where: Path, what: str, theirs, ours, fix: str = "use a head trained for this target") -> None:
    if theirs is not None and theirs != ours:
        raise CheckpointError(f"{where} is a head for {what} {theirs}, the target has {ours}: {fix}")


def check_embedding(t: dict, where: Path, cfg: LlamaConfig, target_params) -> None:
    """The reference drafts with the target's embedding; a file carrying a copy of another one is refused."""
    if "embed_tokens.weight" in t:
        theirs = t["embed_tokens.weight"].astype(np.float32)
        ours = np.asarray(target_io(cfg, target_params)["embed"], np.float32)
        if theirs.shape != ours.shape or np.abs(theirs - ours).max() > 1e-2 * np.abs(ours).max():
            raise CheckpointError(
                f"{where} carries an embed_tokens.weight unlike the target's embedding; specjax drafts with the "
                "target's embedding: use a head trained for this target"
            )


def layer_from(t: dict, where: Path, cfg: LlamaConfig, prefix: str, width: int, fresh: dict) -> dict:
    """A decoder layer's projections (attention input `width` wide), post-attention norm and attention biases
    from the tensors under `prefix` (`fresh`: the layer's fresh parameters, which say which biases it has)."""
    get, a, dim = getter(t, where), prefix + "self_attn.", cfg.dim
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


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / MARK).read_text()).get("format") == "specjax-published-export"
    except (OSError, ValueError, AttributeError):
        return False


def layer_tensors(layer: dict, prefix: str, cfg: LlamaConfig) -> dict:
    """The published tensors of a decoder layer (inverse of `layer_from`), attention biases included if it has any."""
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


def layer_config_json(cfg: LlamaConfig, architecture: str, bias: bool, dtype) -> dict:
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


def export_published(
    meta: dict, params, dest: str | Path, target_cfg: LlamaConfig, base_model: str | None = None
):
    """Writes specjax `meta`/`params` heads to `dest` in their method's published layout (its first weight file
    + `config.json`; `base_model`: the target's name, for layouts that record it, e.g. Medusa's
    `base_model_name_or_path`). Written beside `dest` and renamed into place; an existing `dest` is replaced only
    if it is empty or a previous export (files.DestinationError otherwise). Returns `dest`."""
    from safetensors.numpy import save_file

    method = meta["method"]
    exportable = sorted(m for m, layout in layouts().items() if layout.files is not None)
    if method not in exportable:
        raise HeadsError(f"{method} heads have no published layout; export {', '.join(exportable)} heads")
    if meta["target"] != target_signature(target_cfg):
        raise HeadsError(
            f"these heads were trained for target {meta['target']}, not {target_signature(target_cfg)}: "
            "pass the config of the target they were trained for"
        )
    params = jax.tree.map(np.asarray, params)
    layout = layouts()[method]
    tensors, config = layout.files(meta, params, target_cfg, base_model)
    dest = Path(dest).absolute()
    with files.atomic_dir(dest, replaceable=_is_export, what="published heads export") as tmp:
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(tmp / layout.weights[0]),
            {"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / MARK).write_text(
            json.dumps({"format": "specjax-published-export", "method": method}, indent=1)
        )
    return dest
