"""Draft heads in vLLM's speculators format (vllm-project/speculators, PyPI `speculators`), read into and written
from specjax's heads.

A speculators checkpoint is a directory: `config.json` names the model type (`speculators_model_type`), holds a
`speculators_config` (algorithm, proposal methods, the verifier: the target's name and architectures) and the
draft's decoder layers as a Hugging Face config (`transformer_layer_config`); `model.safetensors` (or shards listed
in `model.safetensors.index.json`) holds the weights. vLLM loads such a directory as a draft model directly.

Two model types map onto head types whose authors' layout specjax already reads (`specjax.published`), so a
checkpoint is translated into that layout and its loader makes every check (hidden size, vocabulary, layers,
tensor shapes); an export translates the published layout's files back:

- `eagle3`: the EAGLE-3 layout (`specjax.drafters.eagle3`) with `layers.0.` for `midlayer.`; config keys
  `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (the inputs of target layers: specjax's taps + 1),
  `target_hidden_size`, `norm_before_residual` as there, and the `d2t`/`t2d` maps. Only a Llama layer; the
  library's extra norms (`norm_before_fc`, `fc_norm`, `norm_output`) are refused.
- `dflash`: z-lab's DFlash layout (`specjax.drafters.dflash_zlab`), the same tensor names; `aux_hidden_state_layer_ids`
  are z-lab's `target_layer_ids` + 1 (speculators' converter's rule), `mask_token_id` and `block_size` at top level.
  Only the target's vocabulary and LM head (no reduced draft vocabulary), drafting after the anchor
  (`sample_from_anchor` false).

An export names the target `base_model` as the verifier (vLLM and the library load it beside the head) and, as the
library's own models do, writes the target's embedding with an EAGLE-3 head and none with a DFlash head.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from specjax import files, published
from specjax.drafting.protocol import target_io, target_signature
from specjax.errors import CheckpointError, HeadsError
from specjax.models.config import LlamaConfig
from specjax.models.weights import read_safetensors

VERSION = "0.9.0"  # the speculators release whose layout `export` writes and the tests load
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# keys of an authors' config.json that describe the checkpoint, not the draft's decoder layers
NOT_LAYER = (
    "architectures",
    "auto_map",
    "torch_dtype",
    "dtype",
    "draft_vocab_size",
    "eagle_aux_hidden_state_layer_ids",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "base_model_name_or_path",
)


@dataclasses.dataclass(frozen=True)
class Kind:
    """A speculators model type and the head type (`method`) whose published layout it translates to and from.

    rename: (speculators' tensor prefix, the published layout's), e.g. ("layers.0.", "midlayer.");
    config(config.json, its path) -> the published layout's config.json, refusing what the head type cannot
    represent;
    weights(tensors, weight file, target_cfg, target_params) -> the tensors the published layout holds;
    write(published config.json, tensors) -> (the model type's own config.json fields, tensors, default number of
    draft tokens);
    embedding: whether the library's model saves the target's embedding (`embed_tokens.weight`) with the head."""

    method: str
    rename: tuple[str, str]
    config: Callable
    weights: Callable
    write: Callable
    embedding: bool


def holds(path: str | Path) -> bool:
    """Whether `path` is a directory whose config.json is a speculators config (has `speculators_config`)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "speculators_config" in config


def _refuse(where: Path, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{where} {what}, which specjax's heads cannot represent; {fix}")


def _layer(config: dict, where: Path) -> dict:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(
            f"{where} has no transformer_layer_config (the draft's layers); the file is incomplete, download it again"
        )
    return layer


def _eagle3_config(config: dict, where: Path) -> dict:
    layer = _layer(config, where)
    kind = layer.get("model_type", "qwen3")  # the library's default layer config is Qwen3's
    if kind != "llama":
        raise _refuse(
            where,
            f"has a {kind} draft layer (transformer_layer_config.model_type)",
            "use a head with a llama draft layer",
        )
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if config.get(flag):
            raise _refuse(where, f"sets {flag}=true (an extra norm)", f"use a head trained without {flag}")
    keys = (
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
        "target_hidden_size",
        "norm_before_residual",
    )
    return {**layer, **{k: config.get(k) for k in keys}}


def _write_eagle3(hf: dict, t: dict) -> tuple[dict, dict, int]:
    if hf["draft_vocab_size"] == hf["vocab_size"]:  # the library keeps no maps for the whole vocabulary
        t = {k: v for k, v in t.items() if k not in ("d2t", "t2d")}
    own = {
        "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": hf["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"],
        "target_hidden_size": None,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
    }
    return own, t, 3  # the library converter's default number of draft tokens


def _unembed_matches(weight, cfg: LlamaConfig, target_params) -> bool:
    ours = np.asarray(target_io(cfg, target_params)["unembed"], np.float32)
    theirs = np.asarray(weight, np.float32)
    return theirs.shape == ours.shape and np.abs(theirs - ours).max() <= 1e-2 * np.abs(ours).max()


def _dflash_config(config: dict, where: Path) -> dict:
    layer = _layer(config, where)
    if config.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise _refuse(
            where,
            f"has a {config.get('draft_vocab_size')}-token draft vocabulary",
            "specjax's DFlash head drafts over the target's whole vocabulary: use a head with draft_vocab_size = "
            "the target's vocab_size",
        )
    if config.get("sample_from_anchor"):
        raise _refuse(
            where,
            "sets sample_from_anchor=true",
            "use a head that drafts after the anchor (the bonus token)",
        )
    width = config.get("target_hidden_size")
    if width not in (None, layer.get("hidden_size")):
        raise _refuse(
            where,
            f"reads a target {width} wide with layers {layer.get('hidden_size')} wide",
            "use a head whose layers are as wide as its target",
        )
    ids = config.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(
            f"{where} has aux_hidden_state_layer_ids={ids!r}, not the target layers the head reads; set them to "
            "the ids it was trained with"
        )
    dflash = {"mask_token_id": config.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids]}
    return {**layer, "block_size": config.get("block_size"), "dflash_config": dflash}


def _dflash_weights(t: dict, where: Path, cfg: LlamaConfig, target_params) -> dict:
    """The draft's tensors without the LM head the library may save beside it (it must be the target's)."""
    if "d2t" in t:
        raise _refuse(
            where, "holds a draft vocabulary map (d2t)", "use a head over the target's whole vocabulary"
        )
    if "lm_head.weight" in t and not _unembed_matches(t["lm_head.weight"], cfg, target_params):
        raise _refuse(
            where,
            "carries an lm_head unlike the target's",
            "specjax's DFlash head drafts with the target's LM head",
        )
    return {k: v for k, v in t.items() if k not in ("lm_head.weight", "t2d")}


def _write_dflash(hf: dict, t: dict) -> tuple[dict, dict, int]:
    dflash = hf["dflash_config"]
    own = {
        "architectures": ["DFlashDraftModel"],
        "draft_vocab_size": hf["vocab_size"],
        "block_size": hf["block_size"],
        "aux_hidden_state_layer_ids": [int(j) + 1 for j in dflash["target_layer_ids"]],
        "mask_token_id": dflash["mask_token_id"],
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
    }
    return own, t, hf["block_size"] - 1  # a block drafts the tokens after its anchor


KINDS = {
    "eagle3": Kind(
        "eagle3", ("layers.0.", "midlayer."), _eagle3_config, lambda t, *_: t, _write_eagle3, embedding=True
    ),
    "dflash": Kind(
        "dflash", ("layers.", "layers."), _dflash_config, _dflash_weights, _write_dflash, embedding=False
    ),
}


def _renamed(t: dict, old: str, new: str) -> dict:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in t.items()}


def _read_weights(path: Path) -> tuple[dict, Path]:
    """(tensors, the file named in errors) of a speculators directory: model.safetensors or its shards."""
    tensors = dict(read_safetensors(path).items())
    return tensors, path / (INDEX if (path / INDEX).is_file() else WEIGHTS)


def read_config(path: Path) -> tuple[dict, Kind]:
    """(config.json, its Kind) of a speculators directory; an unknown model type is a CheckpointError."""
    where = path / "config.json"
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{where} is missing or corrupt ({err}); download it again") from err
    kind = config.get("speculators_model_type") if isinstance(config, dict) else None
    if kind is None:
        raise CheckpointError(
            f"{where} names no speculators_model_type; the file is incomplete, download it again"
        )
    if kind not in KINDS:
        raise CheckpointError(
            f"{where} is a speculators {kind!r} model, which specjax does not read (it reads {', '.join(KINDS)}); "
            f"pass a speculators {' or '.join(KINDS)} checkpoint"
        )
    return config, KINDS[kind]


def published_config(path: str | Path) -> tuple[str, dict]:
    """(the head method, its published layout's config.json) of the speculators checkpoint in `path`, read without
    its weights or a target (what a pair check compares)."""
    path = Path(path).absolute()
    config, kind = read_config(path)
    return kind.method, kind.config(config, path / "config.json")


def load(path: str | Path, method: str, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of the speculators checkpoint in `path` as specjax `method` heads for the target,
    as `specjax.heads.load_heads` returns them."""
    path = Path(path).absolute()
    config, kind = read_config(path)
    if kind.method != method:
        raise HeadsError(
            f"{path} is a speculators {config['speculators_model_type']} checkpoint, not {method} heads; pass "
            f"--drafter={kind.method}"
        )
    hf = kind.config(config, path / "config.json")
    tensors, where = _read_weights(path)
    tensors = kind.weights(tensors, where, target_cfg, target_params)
    theirs, ours = kind.rename
    layout = published.layouts()[method]
    try:
        return layout.load(hf, _renamed(tensors, theirs, ours), where, target_cfg, target_params)
    except CheckpointError as err:  # its messages name the layout's tensors: name the file's instead
        raise type(err)(str(err).replace(ours, theirs)) from err


def _rope_parameters(hf: dict) -> dict:
    """`rope_theta` and `rope_scaling` of an authors' config.json as transformers 5's `rope_parameters`."""
    scaling = hf.get("rope_scaling") or {"rope_type": "default"}
    return {**scaling, "rope_theta": hf["rope_theta"]}


def layer_config(hf: dict) -> dict:
    """The `transformer_layer_config` of an authors' config.json: its decoder-layer keys."""
    layer = {k: v for k, v in hf.items() if k not in NOT_LAYER and k not in ("rope_theta", "rope_scaling")}
    return layer | {"rope_parameters": _rope_parameters(hf), "tie_word_embeddings": False}


def _verifier(base_model: str | None) -> dict:
    """speculators' verifier entry: the target's name or path and, from a local config.json, its architectures."""
    try:
        architectures = json.loads((Path(base_model) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, TypeError, AttributeError):
        architectures = None
    return {"name_or_path": base_model, "architectures": architectures or []}


def speculators_files(
    meta: dict, params, target_cfg: LlamaConfig, target_params, base_model=None, draft_tokens=None
):
    """(tensors, config.json) of specjax heads (numpy `params`) in the speculators format (`draft_tokens`: the
    proposal's number of draft tokens, default the model type's)."""
    named = {k.method: (name, k) for name, k in KINDS.items()}
    if meta["method"] not in named:
        raise HeadsError(
            f"{meta['method']} heads have no speculators format; export {', '.join(named)} heads"
        )
    model_type, kind = named[meta["method"]]
    tensors, hf = published.layouts()[kind.method].files(meta, params, target_cfg, base_model)
    own, tensors, default_tokens = kind.write(hf, tensors)
    if kind.embedding:
        embed = target_io(target_cfg, target_params)["embed"]
        tensors["embed_tokens.weight"] = np.asarray(embed, tensors["fc.weight"].dtype)
    proposal = {"proposal_type": "greedy", "speculative_tokens": draft_tokens or default_tokens}
    config = {
        **own,
        "speculators_model_type": model_type,
        "speculators_version": VERSION,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [proposal],
            "default_proposal_method": "greedy",
            "verifier": _verifier(base_model),
        },
        "transformer_layer_config": layer_config(hf),
        "dtype": hf.get("torch_dtype"),
        "tie_word_embeddings": False,
    }
    theirs, ours = kind.rename
    return _renamed(tensors, ours, theirs), config


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / published.MARK).read_text()).get("format") == "specjax-speculators-export"
    except (OSError, ValueError, AttributeError):
        return False


def export(
    meta: dict,
    params,
    dest: str | Path,
    target_cfg: LlamaConfig,
    target_params,
    base_model: str | None = None,
    draft_tokens: int | None = None,
) -> Path:
    """Writes specjax `meta`/`params` heads (e.g. `specjax.heads.load_heads` of a training run) to `dest` as a
    speculators checkpoint for the target `base_model` (its Hugging Face id or path: the verifier that vLLM and the
    library load beside it). Written beside `dest` and renamed into place; an existing `dest` is replaced only if
    it is empty or a previous export (files.DestinationError otherwise). Returns `dest`."""
    from safetensors.numpy import save_file

    if meta["target"] != target_signature(target_cfg):
        raise HeadsError(
            f"these heads were trained for target {meta['target']}, not {target_signature(target_cfg)}: "
            "pass the config of the target they were trained for"
        )
    params = jax.tree.map(np.asarray, params)
    tensors, config = speculators_files(meta, params, target_cfg, target_params, base_model, draft_tokens)
    dest = Path(dest).absolute()
    with files.atomic_dir(dest, replaceable=_is_export, what="speculators export") as tmp:
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / WEIGHTS), {"format": "pt"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        mark = {"format": "specjax-speculators-export", "method": meta["method"]}
        (tmp / published.MARK).write_text(json.dumps(mark, indent=1))
    return dest
