"""Orbax save/restore of model parameters with their config (and tokenizer files) in one directory.

Layout of a specjax checkpoint directory:
    specjax.json   {"format": "specjax", "config": LlamaConfig fields}
    params/        Orbax StandardCheckpointer tree of the parameters
    tokenizer/     copied tokenizer files (optional)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

from specjax.models.config import LlamaConfig
from specjax.models.llama import abstract_model
from specjax.models.weights import CheckpointError

MARKER = "specjax.json"


def save_model(path: str | Path, cfg: LlamaConfig, params, tokenizer_files: list[Path] = ()) -> Path:
    """Writes config, Orbax params and tokenizer files to `path` (must not exist yet)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} already exists; choose a new destination or delete it")
    path.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", nnx.to_pure_dict(params))
    if tokenizer_files:
        (path / "tokenizer").mkdir()
        for f in tokenizer_files:
            shutil.copy2(f, path / "tokenizer" / Path(f).name)
    config = dataclasses.asdict(cfg)
    (path / MARKER).write_text(json.dumps({"format": "specjax", "config": config}, indent=1))
    return path


def read_config(path: Path) -> LlamaConfig:
    try:
        meta = json.loads((path / MARKER).read_text())
        config = meta["config"]
        if config.get("rope_llama3_scaling") is not None:
            config["rope_llama3_scaling"] = tuple(config["rope_llama3_scaling"])
        return LlamaConfig(**config)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path / MARKER} is missing or corrupt ({err}); re-run specjax.convert"
        ) from err


def restore_model(
    path: str | Path,
    dtype: str | None = None,
    sharding: Callable[[jax.ShapeDtypeStruct], jax.sharding.Sharding] | None = None,
):
    """(config, graphdef, params) from a specjax checkpoint, each array placed by `sharding(shape)`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg = read_config(path)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    graphdef, abstract = abstract_model(cfg)
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(s) if sharding else None),
        nnx.to_pure_dict(abstract),
    )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            pure = ckptr.restore(path / "params", target)
    except Exception as err:  # Orbax/tensorstore raise many types for damaged or missing files
        raise CheckpointError(
            f"cannot restore parameters from {path / 'params'} ({type(err).__name__}: "
            f"{str(err)[:300]}); the checkpoint is missing or corrupt: re-run specjax.convert"
        ) from err
    nnx.replace_by_pure_dict(abstract, pure)
    return cfg, graphdef, abstract
