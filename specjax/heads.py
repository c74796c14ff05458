"""Trained drafting heads on disk: a work directory holds `heads.json` (method, head shape, the target it was
trained for) and Orbax checkpoints under `checkpoints/` written by `specjax.training.trainer`.

`load_heads(workdir, target)` restores the latest head parameters for a target and refuses heads trained
for another one; `make_drafter` turns them into a drafter for the speculative loop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.drafters.eagle import Eagle, init_eagle, layer_config, target_io
from specjax.drafters.medusa import Medusa, init_medusa
from specjax.models.config import LlamaConfig
from specjax.models.weights import CheckpointError

META = "heads.json"
METHODS = ("medusa", "eagle")


def target_signature(cfg: LlamaConfig) -> dict:
    """What a head depends on: heads for targets with a different signature are refused."""
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_dim": cfg.hidden_dim,
    }


def describe(method: str, shape: dict, target_cfg: LlamaConfig) -> dict:
    if method not in METHODS:
        raise ValueError(f"unknown head method {method!r}; choose one of {METHODS}")
    return {"method": method, "shape": dict(shape), "target": target_signature(target_cfg)}


def new_heads(meta: dict, target_cfg: LlamaConfig, target_params, seed: int = 0):
    """(graphdef, trainable params as a pure dict) of fresh heads described by `meta`."""
    if meta["method"] == "medusa":
        unembed = target_io(target_cfg, target_params)["unembed"]
        return init_medusa(meta["shape"]["num_heads"], meta["shape"]["num_layers"], unembed)
    return init_eagle(target_cfg, seed)


def drafter_params(meta: dict, params, target_cfg: LlamaConfig, target_params):
    """What the drafter's functions take: EAGLE reads the target's embedding and LM head beside its own."""
    return (
        params if meta["method"] == "medusa" else {"head": params, **target_io(target_cfg, target_params)}
    )


def make_drafter(meta: dict, graphdef, target_cfg: LlamaConfig, k: int, sampler, tree=None):
    if meta["method"] == "medusa":
        return Medusa(graphdef, meta["shape"]["num_heads"], target_cfg.vocab_size, target_cfg.dim, k, tree)
    return Eagle(layer_config(target_cfg), graphdef, k, sampler, tree)


def write_meta(workdir: Path, meta: dict) -> None:
    path = Path(workdir) / META
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            raise ValueError(
                f"{workdir} already holds heads {old}, not {meta}: use a new --workdir to train "
                "different heads"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))


def load_heads(workdir: str | Path, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of the latest checkpoint in `workdir`, checked against the target."""
    import orbax.checkpoint as ocp

    workdir = Path(workdir).absolute()
    try:
        meta = json.loads((workdir / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{workdir / META} is missing or corrupt ({err}): pass the --workdir of a train_heads.py run"
        ) from err
    if meta["target"] != target_signature(target_cfg):
        diff = {
            k: (v, target_signature(target_cfg)[k])
            for k, v in meta["target"].items()
            if target_signature(target_cfg).get(k) != v
        }
        raise ValueError(
            f"the heads in {workdir} were trained for another target: (heads, this target) differ "
            f"in {diff}; train heads for this target"
        )
    graphdef, fresh = new_heads(meta, target_cfg, target_params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fresh)
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"{workdir / 'checkpoints'} holds no finished checkpoint: train first")
        try:
            restored = manager.restore(
                step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
            )
        except Exception as err:  # Orbax/tensorstore raise many types for damaged or missing files
            raise CheckpointError(
                f"cannot restore head parameters of step {step} from {workdir / 'checkpoints'} "
                f"({type(err).__name__}: {str(err)[:300]}); the checkpoint is corrupt: "
                "delete that step to fall back to an earlier one, or retrain"
            ) from err
    params = restored["params"]
    return meta, graphdef, jax.tree.map(jnp.asarray, params)


def export(workdir: str | Path, dest: str | Path) -> Path:
    """Copies the latest head parameters (no optimiser state) and `heads.json` of a training run to `dest`:
    a small directory that `load_heads` reads like the run itself."""
    import orbax.checkpoint as ocp

    workdir, dest = Path(workdir).absolute(), Path(dest).absolute()
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"{workdir / 'checkpoints'} holds no finished checkpoint: train first")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(
        workdir / "checkpoints" / str(step),
        dest / "checkpoints" / str(step),
        ignore=shutil.ignore_patterns("opt_state"),
    )
    shutil.copy2(workdir / META, dest / META)
    return dest
