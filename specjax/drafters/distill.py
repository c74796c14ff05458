"""Trained draft models distilled from the target (DistillSpec, Zhou et al. 2024): a small Llama of the target's
family and vocabulary, initialised from scratch or from chosen target layers, trained to match the target's
warped next-token distribution under a chosen divergence, on a fixed corpus, the target's own samples or
sequences the draft samples itself (on-policy, `config.data.on_policy_fraction`), scored by the target.

It registers as the trained method `distill` (`train_heads.py --config=configs/draft.py`); it drafts like
`draft_model` (`run_decode.py --drafter=distill --heads=WORKDIR`), and `export_model` writes it as a Hugging Face
model directory for `--drafter=draft_model --draft_model=PATH`."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from specjax import heads, precision
from specjax.decoding.autoregressive import generate_compiled
from specjax.decoding.jobs import GenerateSpec
from specjax.drafters.draft_model import DraftModel
from specjax.drafting import registry
from specjax.drafting.protocol import target_io
from specjax.errors import HeadsError
from specjax.models.config import LlamaConfig
from specjax.models.llama import init_params, sequence_logits
from specjax.sampling import Sampler
from specjax.training import divergences, losses
from specjax.training.config import TrainingConfigError

SHAPE = ("n_layers", "dim", "n_heads", "n_kv_heads", "hidden_dim")
LOSSES = (
    *divergences.DIVERGENCES,
    "next_token",
)  # next_token: plain cross-entropy on the data (a baseline)


@dataclasses.dataclass(frozen=True)
class DistillTraining:
    """`config.heads` of a draft-model distillation run."""

    n_layers: int = 2
    dim: int = 64
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden_dim: int = 172
    vocab_size: int = 0  # 0: the target's (a draft must share the target's vocabulary)
    init: str = "layers:0,4"  # "scratch", or "layers:I,J,..." (the target's layers I, J, ... in this order)
    divergence: str = "forward_kl"  # forward_kl, reverse_kl, jsd, tvd, or next_token (plain cross-entropy)
    jsd_beta: float = 0.5  # jsd: the target's weight in the mixture
    temperature: float = 1.0  # the distributions are compared at this temperature
    RULES: ClassVar = {
        **{k: (lambda v: v >= 1, "must be >= 1") for k in SHAPE},
        "vocab_size": (lambda v: v >= 0, "must be >= 0 (0 = the target's)"),
        "init": (
            lambda v: v == "scratch" or re.fullmatch(r"layers:\d+(,\d+)*", v) is not None,
            "must be 'scratch' or 'layers:I,J,...' (target layer indices)",
        ),
        "divergence": (lambda v: v in LOSSES, f"must be one of {LOSSES}"),
        "jsd_beta": (lambda v: 0 < v < 1, "must be in (0, 1)"),
        "temperature": (lambda v: v > 0, "must be > 0"),
    }


def draft_config(shape: dict, target_cfg: LlamaConfig) -> LlamaConfig:
    """The draft's architecture: the target's family, vocabulary and context with the shape's sizes."""
    small = target_cfg.select_layers(range(shape["n_layers"]))  # the target's first layers' attention types
    return small.replace(**{k: shape[k] for k in SHAPE}, head_dim=shape["dim"] // shape["n_heads"])


def sizes(h) -> dict:
    """The draft's Llama sizes (SHAPE) from `config.heads` or the `DistillTraining` settings."""
    return {k: getattr(h, k) for k in SHAPE}


def init_layers(spec: str, target_cfg: LlamaConfig) -> tuple[int, ...] | None:
    """The target layers an `init` string copies (None: from scratch); a one-line error for layers the target
    lacks."""
    if spec == "scratch":
        return None
    layers = tuple(int(i) for i in spec.split(":", 1)[1].split(","))
    lacking = [i for i in layers if i >= target_cfg.n_layers]
    if lacking:
        raise TrainingConfigError(
            f"config heads.init={spec!r} names layers {lacking} that the target lacks (it has layers "
            f"0..{target_cfg.n_layers - 1}); name existing layers or pass --config.heads.init=scratch"
        )
    return layers


def check(h, target_cfg: LlamaConfig) -> None:
    """Refuses a draft that cannot be made for this target (before anything is written); warns when the draft
    costs as much as the target or more."""
    if h.vocab_size and h.vocab_size != target_cfg.vocab_size:
        raise TrainingConfigError(
            f"config heads.vocab_size={h.vocab_size} differs from the target's vocabulary of "
            f"{target_cfg.vocab_size}; a draft must share the target's tokenizer: pass --config.heads.vocab_size=0"
        )
    if h.dim % h.n_heads or (h.dim // h.n_heads) % 2 or h.n_heads % h.n_kv_heads:
        raise TrainingConfigError(
            f"config heads dim={h.dim}, n_heads={h.n_heads}, n_kv_heads={h.n_kv_heads} make no Llama (dim must "
            "divide into n_heads even head sizes, n_heads into n_kv_heads groups); change them"
        )
    layers = init_layers(h.init, target_cfg)
    if layers is not None:
        if len(layers) != h.n_layers:
            raise TrainingConfigError(
                f"config heads.init={h.init!r} copies {len(layers)} layers into a draft of {h.n_layers}; "
                f"name {h.n_layers} layers or set --config.heads.n_layers={len(layers)}"
            )
        ours = {k: v for k, v in sizes(h).items() if k != "n_layers"}
        theirs = {k: getattr(target_cfg, k) for k in ours}
        if ours != theirs:
            raise TrainingConfigError(
                f"config heads.init={h.init!r} copies target layers, but the draft's sizes {ours} differ from the "
                f"target's {theirs}; a draft of other widths cannot copy them: pass --config.heads.init=scratch"
            )
    draft = draft_config(sizes(h), target_cfg)
    if draft.num_params >= target_cfg.num_params or h.n_layers > target_cfg.n_layers:
        logging.warning(
            "the draft (%d layers, %d parameters) is as large as the target (%d layers, %d parameters) or "
            "larger: each drafted token costs about %.2f target passes, so speculative decoding with it "
            "cannot be faster than decoding the target alone",
            h.n_layers,
            draft.num_params,
            target_cfg.n_layers,
            target_cfg.num_params,
            draft.num_params / target_cfg.num_params,
        )


def init(shape: dict, target_cfg: LlamaConfig, target_params, seed: int):
    """(graphdef, params as a pure dict) of a fresh draft: random, or the target's embedding, final norm, head
    and the layers `shape["init"]` names."""
    cfg = draft_config(shape, target_cfg)
    graphdef, state = init_params(cfg, seed)
    params = nnx.to_pure_dict(state)
    layers = init_layers(shape["init"], target_cfg)
    if layers is not None:
        source = target_params if isinstance(target_params, dict) else nnx.to_pure_dict(target_params)
        copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
        params = {k: copy(v) for k, v in source.items() if k != "layers"}
        params["layers"] = {i: copy(source["layers"][j]) for i, j in enumerate(layers)}
    return graphdef, params


def drafter_params(shape, params, target_cfg, target_params) -> dict:
    """The draft's parameters beside the target's LM head (which the loss turns target features into logits
    with)."""
    return {"draft": params, "target_head": target_io(target_cfg, target_params)["unembed"]}


@dataclasses.dataclass(frozen=True)
class DistilledDraft(DraftModel):
    """A `DraftModel` whose params come as `drafter_params` gives them."""

    def init(self, params, *args, **kwargs):
        return super().init(params["draft"], *args, **kwargs)

    def propose(self, params, *args, **kwargs):
        return super().propose(params["draft"], *args, **kwargs)

    def commit(self, params, *args, **kwargs):
        return super().commit(params["draft"], *args, **kwargs)


@precision.follows_params
def distill_loss(graphdef, target_cfg, params, feats_BTH, tokens_BT, loss_mask_BT, h):
    """The configured divergence between target and draft at every position whose predicted token has loss
    mask 1, plus the acceptance rates they imply (alpha_T1 = mean(1 - TVD) at T=1, alpha_T0 = argmax match)."""
    cfg = draft_config(sizes(h), target_cfg)
    t = tokens_BT.shape[1]
    target = jnp.einsum("btd,vd->btv", feats_BTH[..., -target_cfg.dim :], params["target_head"])
    draft = sequence_logits(cfg, graphdef, params["draft"], tokens_BT)
    weights = losses.predicted_mask(loss_mask_BT, 1, t)
    if h.divergence == "next_token":
        terms = losses.cross_entropy(draft[:, :-1], tokens_BT[:, 1:])
        loss = losses.masked_mean(terms, weights[:, :-1])
    else:
        terms = divergences.divergence(h.divergence, target, draft, h.temperature, h.jsd_beta)
        loss = losses.masked_mean(terms, weights)
    alpha_t1, alpha_t0 = divergences.acceptance(target, draft)
    return loss, {
        "loss": loss,
        "alpha_T1": losses.masked_mean(alpha_t1, weights),
        "alpha_T0": losses.masked_mean(alpha_t0, weights),
    }


def on_policy(graphdef, target_cfg, params, tokens_BT, loss_mask_BT, key, config):
    """The batch with its first `round(on_policy_fraction * B)` rows replaced by the draft's own continuations
    (sampled at data.temperature with the batched decoder) of their first `data.seq_len // 8` tokens; the
    target scores them in the loss. Those first tokens keep their mask (a conversation's user turn stays out of
    the loss); tokens after a row's end of sequence are masked out."""
    d = config.data
    b, t = tokens_BT.shape
    n = int(round(d.on_policy_fraction * b))
    if n == 0:
        return tokens_BT, loss_mask_BT
    cfg = draft_config(sizes(config.heads), target_cfg)
    prompt = max(1, t // 8)
    spec = GenerateSpec(
        t - prompt,
        Sampler(float(d.temperature)),
        cache_size=t,
        eos_id=cfg.eos_id,
        matmul_precision=config.matmul_precision,
    )
    draft = jax.lax.stop_gradient(params["draft"])
    out = generate_compiled(cfg, graphdef, draft, tokens_BT[:n, :prompt], jnp.full((n,), prompt), key, spec)
    sampled = jnp.concatenate([tokens_BT[:n, :prompt], out.tokens], axis=1)
    at = jnp.arange(t)[None]
    valid = jnp.where(at < prompt, loss_mask_BT[:n] > 0, at < prompt + out.lengths[:, None])
    mask = (valid & (at >= 1)).astype(loss_mask_BT.dtype)
    return tokens_BT.at[:n].set(sampled), loss_mask_BT.at[:n].set(mask)


def export_model(workdir: str | Path, dest: str | Path, target_dir: str | Path) -> Path:
    """Writes the latest draft of a `distill` training run as a Hugging Face model directory (config.json,
    model.safetensors, the target's tokenizer) at `dest`, which `load_model`, `--draft_model` and transformers
    read. `target_dir`: the target the draft was trained against (a specjax checkpoint or anything load_model
    takes). Written beside `dest` and renamed into place; an existing `dest` is replaced only if it is a
    previous export."""
    from safetensors.numpy import save_file

    from specjax import files
    from specjax.models.loading import load_model, tokenizer_files

    target = load_model(str(target_dir))
    meta, _, params = heads.load_heads(workdir, target.cfg, target.params)
    if meta["method"] != "distill":
        raise HeadsError(
            f"{workdir} holds {meta['method']} heads, not a distilled draft; pass a distill run"
        )
    cfg = draft_config(meta["shape"], target.cfg)
    tensors = hf_tensors(cfg, jax.tree.map(np.asarray, params))
    hf = cfg.to_hf() | {"architectures": ["LlamaForCausalLM"], "torch_dtype": cfg.dtype}
    record = {
        "format": "specjax-draft-export",
        "workdir": str(Path(workdir).absolute()),
        "shape": meta["shape"],
    }
    tok = target.path / "tokenizer" if (target.path / "tokenizer").is_dir() else target.path
    with files.atomic_dir(dest, replaceable=_is_export, what="draft export") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=1))
        (tmp / "specjax_draft.json").write_text(json.dumps(record, indent=1))
        for f in tokenizer_files(tok):
            (tmp / f.name).write_bytes(f.read_bytes())
    return Path(dest)


def _is_export(path: Path) -> bool:
    return (path / "specjax_draft.json").is_file()


def hf_tensors(cfg: LlamaConfig, pure: dict) -> dict[str, np.ndarray]:
    """Hugging Face Llama tensor names of specjax parameters (the inverse of `weights.params_from_hf`)."""
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.hidden_dim
    out = {
        "model.embed_tokens.weight": pure["embed"]["embedding"],
        "model.norm.weight": pure["norm"]["weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = pure["lm_head"]["weight"]
    for i in range(cfg.n_layers):
        layer, p = pure["layers"][i], f"model.layers.{i}."
        wq, wk, wv = np.split(layer["wqkv"]["weight"], [q, q + kv])
        gate, up = np.split(layer["w_gate_up"]["weight"], [f])
        out |= {
            p + "input_layernorm.weight": layer["attn_norm"]["weight"],
            p + "self_attn.q_proj.weight": wq,
            p + "self_attn.k_proj.weight": wk,
            p + "self_attn.v_proj.weight": wv,
            p + "self_attn.o_proj.weight": layer["wo"]["weight"],
            p + "post_attention_layernorm.weight": layer["mlp_norm"]["weight"],
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer["w_down"]["weight"],
        }
        if cfg.qkv_bias:
            out |= dict(
                zip(
                    (p + f"self_attn.{n}_proj.bias" for n in "qkv"),
                    np.split(layer["wqkv"]["bias"], [q, q + kv]),
                )
            )
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = layer["wo"]["bias"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def build(target, settings: heads.HeadsSettings, k: int, tree, sampler):
    """(drafter, params) for `run_decode.py --drafter=distill`: `--heads` is a distill training run or an
    exported draft model directory (default: the committed stories260K draft, `heads/stories260K_distill`)."""
    from specjax.models.loading import load_model

    path = heads.resolve_heads(settings.heads or str(heads.COMMITTED / "stories260K_distill"))
    if (path / heads.META).exists():
        return heads.heads_builder("distill")(target, settings, k, tree, sampler)
    draft = load_model(str(path), target.cfg.dtype)
    drafter = DistilledDraft(draft.cfg, draft.graphdef, k, sampler, tree)
    drafter.validate(target.cfg)
    return drafter, {"draft": draft.params}


def example(target, k: int, tree, sampler):
    """A random one-layer draft of the tiny target's widths (verify_exactness)."""
    cfg = target.cfg
    shape = {k_: getattr(cfg, k_) for k_ in SHAPE} | {"n_layers": 1, "init": "scratch"}
    graphdef, params = init(shape, cfg, target.params, 1)
    draft = DistilledDraft(draft_config(shape, cfg), graphdef, k, sampler, tree)
    return draft, drafter_params(shape, params, cfg, target.params)


TRAINED = registry.TrainedHeads(
    settings=DistillTraining,
    init=init,
    drafter_params=drafter_params,
    drafter=lambda shape, graphdef, cfg, k, sampler, tree: DistilledDraft(
        draft_config(shape, cfg), graphdef, k, sampler, tree
    ),
    loss=lambda graphdef, cfg, params, feats, tokens, mask, key, h: distill_loss(
        graphdef, cfg, params, feats, tokens, mask, h
    ),
    shape_of=lambda h, cfg, tokens: sizes(h) | {"init": h.init},
    check=check,
    resample=on_policy,
)
HELP = {
    "heads": "A distill training run (--workdir) or an exported draft model directory (default: "
    "heads/stories260K_distill)."
}
registry.register(registry.Entry("distill", heads.HeadsSettings, build, HELP, TRAINED, example))
