"""DFlash heads as z-lab publishes them (the `dflash` package's `DFlashDraftModel`, PyPI dflash 0.1.0), read into and
written from specjax's DFlash heads (`specjax.drafters.dflash`).

The layout: `config.json`, a Qwen3 config of the draft (`hidden_size`, `num_hidden_layers` = draft layers,
`num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`, `rope_theta`,
`vocab_size`, `num_target_layers`) whose `dflash_config` (or, failing that, top level) holds `target_layer_ids`,
`block_size` and `mask_token_id`; and `model.safetensors` holding `fc.weight` [H, n_taps * H], `hidden_norm.weight`,
`norm.weight` and for each draft layer i `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.self_attn.{q_norm,k_norm}.weight` [head_dim], `layers.{i}.mlp.{gate,up,down}_proj.weight` and
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`. There is no embedding and no LM head: the draft uses
the target's, as specjax's does; MASK is the target's embedding of `mask_token_id`.

Target layer id j reads transformers' `hidden_states[j + 1]`, the output of target layer j: specjax's tap j, except
for the last layer, whose entry transformers replaces by the final normed features (which specjax's taps, residual
streams, do not hold): heads tapping the target's last layer are refused both ways.

What the reference can do and specjax's head cannot represent is refused with the key and the fix: an input
embedding scale, an output multiplier, logit soft-capping, causal or sliding-window draft layers, and the DFlash2
variant (dynamic convolutions, candidate selector). A confidence head (DSpark's, specjax's own addition) is not
exported: it reads the draft detached, so the exported head drafts the same distributions. A Markov head (DSpark's),
which changes the drafts, has no place in the layout: such a head's export is refused.

This module does not import `specjax.drafters.dflash` (which registers these functions): fresh heads come from the
registry (`specjax.heads.describe` / `new_heads`). The draft's attention heads (`num_attention_heads`,
`num_key_value_heads`, `head_dim`) may differ from the target's: they are the shape's `attention` then.
"""

from __future__ import annotations

import re
from pathlib import Path

from specjax import heads, published
from specjax.drafters.eagle import check_published_layer
from specjax.errors import HeadsError
from specjax.models.config import LlamaConfig
from specjax.models.weights import CheckpointError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CANNOT = "specjax's DFlash head cannot represent"


def owns(t: dict) -> bool:
    """A z-lab DFlash file: the fused context's norm at top level and per-head query norms in its layers."""
    return "hidden_norm.weight" in t and any(
        re.fullmatch(r"layers\.\d+\.self_attn\.q_norm\.weight", k) for k in t
    )


def value(hf: dict, name: str, default=None):
    """A draft setting as the reference reads it (`_draft_value`): `dflash_config`'s, else the top level's."""
    return (hf.get("dflash_config") or {}).get(name, hf.get(name, default))


def reference_layers(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The reference's target layers without `target_layer_ids` (`build_target_layer_ids`, unclipped)."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def _refuse(where: Path, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{where} {what}, which {CANNOT}; use a head with {fix}")


def _check_options(hf: dict, t: dict, where: Path, n_layers: int) -> None:
    """Refuses the reference's options that specjax's head cannot represent (one line each: the key, the fix)."""
    config = where.parent / "config.json"
    dflash2 = [k for k in DFLASH2 if value(hf, k) is not None]
    dflash2 += [
        k for k in t if k.startswith("candidate_selector.") or re.search(r"\.(attention|mlp)_conv\.", k)
    ]
    if dflash2 or "DFlash2DraftModel" in (hf.get("architectures") or []):
        named = ", ".join(dflash2[:3]) or "DFlash2DraftModel"
        raise _refuse(
            where,
            f"is a DFlash2 head ({named}: dynamic convolutions, a candidate selector)",
            "DFlash (DFlashDraftModel) layers",
        )
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    for key in ("input_embedding_scale", "output_multiplier"):
        scale = value(hf, key)
        if scale is not None and not (number(scale) and scale == 1):
            raise _refuse(config, f"sets {key}={scale}", f"{key} 1.0 or none")
    softcap = value(hf, "final_logit_softcapping")
    if softcap is not None and not (number(softcap) and softcap <= 0):  # the reference caps where > 0
        raise _refuse(config, f"sets final_logit_softcapping={softcap}", "no final_logit_softcapping")
    if hf.get("is_causal"):
        raise _refuse(
            config, "sets is_causal=true (causal draft blocks)", "bidirectional blocks (no is_causal)"
        )
    window = hf.get("max_window_layers")
    types = hf.get("layer_types") or [
        "sliding_attention"
        if hf.get("use_sliding_window")
        and hf.get("sliding_window") is not None
        and i >= (window if number(window) else 28)  # Qwen3Config's default
        else "full_attention"
        for i in range(n_layers)
    ]
    if any(kind != "full_attention" for kind in types):
        raise _refuse(
            config,
            f"has layer_types {sorted(set(types))} (sliding-window draft layers)",
            "full_attention layers",
        )


def _taps(hf: dict, where: Path, cfg: LlamaConfig, n_layers: int, n_taps: int) -> list[int]:
    ids = value(hf, "target_layer_ids")
    if ids is None:
        ids = reference_layers(cfg.n_layers, n_layers)  # num_target_layers, checked
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or len(ids) != n_taps:
        raise CheckpointError(
            f"{where} fuses target layers {ids} with an fc for {n_taps} of them; the file or its config.json is "
            "corrupt, download them again"
        )
    last = cfg.n_layers - 1
    if not all(0 <= i < last for i in ids):
        raise CheckpointError(
            f"{where} reads target layers {ids}; specjax taps the outputs of layers 0..{last - 1} of this "
            f"{cfg.n_layers}-layer target (the reference's id {last} is the final normed features, which specjax's "
            "taps do not hold): use a head for this target tapping those layers"
        )
    return ids


def _own_attention(hf: dict, where: Path, cfg: LlamaConfig) -> list[int] | None:
    """The draft's attention heads [n_heads, n_kv_heads, head_dim] where they are not the target's (else None)."""
    n = hf.get("num_attention_heads", cfg.n_heads)
    kv = hf.get("num_key_value_heads") or n
    hd = hf.get("head_dim") or (cfg.dim // n if isinstance(n, int) and n > 0 else None)
    if not all(isinstance(v, int) and v > 0 for v in (n, kv, hd)):
        raise CheckpointError(
            f"{where.parent / 'config.json'} has {n!r} attention heads, {kv!r} key/value heads of dim {hd!r}, not "
            "positive numbers; download it again"
        )
    return None if [n, kv, hd] == [cfg.n_heads, cfg.n_kv_heads, cfg.head_dim] else [n, kv, hd]


def load_published_heads(hf: dict, t: dict, where: Path, cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of z-lab's DFlash head (`config.json` dict `hf`, tensors `t` from file `where`)."""
    dim = cfg.dim
    n_layers = hf.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        raise CheckpointError(
            f"{where.parent / 'config.json'} has num_hidden_layers={n_layers!r}, not a number of draft layers; "
            "download it again"
        )
    _check_options(hf, t, where, n_layers)
    if "fc.weight" not in t or t["fc.weight"].ndim != 2:
        raise CheckpointError(f"{where} has no fc.weight matrix: the file is incomplete; download it again")
    published.check(where, "hidden size", t["fc.weight"].shape[0], dim)
    published.check(where, "hidden size", hf.get("hidden_size"), dim)
    published.check(where, "a vocabulary of", hf.get("vocab_size"), cfg.vocab_size)
    published.check(where, "target layers (num_target_layers)", hf.get("num_target_layers"), cfg.n_layers)
    attention = _own_attention(hf, where, cfg)
    published.check_embedding(t, where, cfg, target_params)
    if t["fc.weight"].shape[1] % dim:
        raise CheckpointError(
            f"{where} has fc.weight of shape {tuple(t['fc.weight'].shape)}, not [H, n x H] for this target's H = "
            f"{dim}: use a head trained for this target"
        )
    n_taps = t["fc.weight"].shape[1] // dim
    layers = _taps(hf, where, cfg, n_layers, n_taps)
    mask = value(hf, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < cfg.vocab_size:
        raise CheckpointError(
            f"{where.parent / 'config.json'} has mask_token_id={mask!r}, not a token of this target's "
            f"{cfg.vocab_size}; set it to the id of the MASK token the head was trained with"
        )
    block_size = value(hf, "block_size", 16)
    if not isinstance(block_size, int) or block_size < 2:
        raise CheckpointError(
            f"{where.parent / 'config.json'} has block_size={block_size!r}; a DFlash block is an anchor and at "
            "least one MASK: download it again"
        )
    shape = {"layers": layers, "n_layers": n_layers, "block_size": block_size, "mask_token": mask}
    shape |= {"attention": attention} if attention else {}
    draft = cfg.head_layers(n_layers, attention)
    check_published_layer({**hf, "model_type": "llama"}, where, draft)
    meta = heads.describe("dflash", shape, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)

    get = published.getter(t, where)
    known = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight"}
    pure_layers = {}
    for i in range(n_layers):
        prefix = f"layers.{i}."
        layer = published.layer_from(t, where, draft, prefix, dim, fresh["layers"][i])
        layer["attn_norm"] = {"weight": get(prefix + "input_layernorm.weight", (dim,))}
        for norm in ("q_norm", "k_norm"):
            layer[norm] = {"weight": get(f"{prefix}self_attn.{norm}.weight", (draft.head_dim,))}
        pure_layers[i] = layer
        known |= set(_layer_names(prefix))
    unknown = sorted(set(t) - known)
    if unknown:
        raise CheckpointError(
            f"{where} has tensors that a {n_layers}-layer z-lab DFlash head has not ({', '.join(unknown[:3])}"
            f"{', ...' if len(unknown) > 3 else ''}), another variant's, which {CANNOT}; pass the directory of a "
            "z-lab DFlash head"
        )
    pure = {
        "fc": {"weight": get("fc.weight", (dim, n_taps * dim))},
        "hidden_norm": {"weight": get("hidden_norm.weight", (dim,))},
        "layers": pure_layers,
        "norm": {"weight": get("norm.weight", (dim,))},
    }
    return meta, graphdef, published.fill(fresh, pure)


def _layer_names(prefix: str) -> list[str]:
    """The tensor names a draft layer may have (its attention biases included)."""
    a = prefix + "self_attn."
    names = [a + f"{p}_proj.weight" for p in "qkvo"] + [a + "q_norm.weight", a + "k_norm.weight"]
    names += [prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
    return names + [a + f"{p}_proj.bias" for p in "qkvo"]


def _layer_tensors(layer: dict, prefix: str, cfg: LlamaConfig) -> dict:
    a = prefix + "self_attn."
    return {
        **published.layer_tensors(layer, prefix, cfg),
        prefix + "input_layernorm.weight": layer["attn_norm"]["weight"],
        a + "q_norm.weight": layer["q_norm"]["weight"],
        a + "k_norm.weight": layer["k_norm"]["weight"],
    }


def published_files(meta: dict, p, cfg: LlamaConfig, base_model: str | None = None) -> tuple[dict, dict]:
    """(tensors, config.json) of specjax's DFlash head `p` (numpy) in z-lab's layout (without a confidence head)."""
    shape = meta["shape"]
    draft = cfg.head_layers(shape["n_layers"], shape.get("attention"))
    if shape.get("learned_masks"):
        raise HeadsError(
            "this DFlash head learned a MASK embedding per block position; z-lab's layout has one MASK, the target's "
            "embedding of mask_token_id, and cannot hold them: export it as specjax heads (python -m specjax.heads "
            "export WORKDIR DEST) or train a head with heads.learned_masks=False"
        )
    if shape.get("markov"):
        raise HeadsError(
            "this DFlash head has a Markov head (a bias from the previous drafted token), which z-lab's layout cannot "
            "hold: export it as specjax heads (python -m specjax.heads export WORKDIR DEST) or train a head with "
            "heads.markov=0"
        )
    if max(shape["layers"]) >= cfg.n_layers - 1:
        raise HeadsError(
            f"this DFlash head taps target layers {shape['layers']}, among them the last ({cfg.n_layers - 1}), "
            "whose z-lab id reads the target's final normed features, not the layer's output that specjax taps: "
            "z-lab's layout cannot hold it; export it as specjax heads (python -m specjax.heads export WORKDIR "
            "DEST) or train a head tapping earlier layers"
        )
    n_layers = shape["n_layers"]
    t = {
        "fc.weight": p["fc"]["weight"],
        "hidden_norm.weight": p["hidden_norm"]["weight"],
        "norm.weight": p["norm"]["weight"],
    }
    for i in range(n_layers):
        t |= _layer_tensors(p["layers"][i], f"layers.{i}.", draft)
    bias = "layers.0.self_attn.o_proj.bias" in t
    config = published.layer_config_json(draft, ARCHITECTURE, bias, t["fc.weight"].dtype)
    config |= {
        "model_type": "qwen3",
        "num_hidden_layers": n_layers,
        "layer_types": ["full_attention"] * n_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_target_layers": cfg.n_layers,
        "block_size": shape["block_size"],
        "dflash_config": {
            "mask_token_id": shape["mask_token"],
            "target_layer_ids": [int(j) for j in shape["layers"]],
        },
    }
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    return t, config
