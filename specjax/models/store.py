"""specjax's own checkpoint layout: a model's config, Orbax parameters and tokenizer files in one directory, and
the identity (config + weight digest) that provenance records name a target by.

Layout of a specjax checkpoint directory:
    specjax.json   {"format": "specjax", "config": LlamaConfig fields, "params_sha256": digest of the arrays,
                    "source": what it was converted from (`specjax.models.conversion.source_record`)}
    params/        Orbax StandardCheckpointer tree of the parameters
    tokenizer/     copied tokenizer files (optional)

The directory is written under a temporary name beside the destination and renamed into place when complete,
so an interrupted save leaves no half-written checkpoint; an existing destination is never overwritten (unless
`replaceable` says so). `restore_step` is the one guarded restore of a step of an Orbax CheckpointManager (heads,
trainer state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from specjax import files
from specjax.models.config import LlamaConfig
from specjax.models.llama import abstract_model
from specjax.models.weights import CheckpointError

MARKER = "specjax.json"


def params_digest(params) -> str:
    """sha256 over the parameter arrays (names, dtypes, shapes and bytes): the same weights give the same digest
    however they were saved."""
    pure = params if isinstance(params, dict) else nnx.to_pure_dict(params)
    leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
    h = hashlib.sha256()
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def model_identity(cfg: LlamaConfig, digest: str) -> str:
    """What a target is, for provenance records: its config and the digest of its weights."""
    record = json.dumps({"config": cfg.identity_record(), "params": digest}, sort_keys=True, default=str)
    return hashlib.sha256(record.encode()).hexdigest()[:20]


def identity(path: str | Path, cfg: LlamaConfig, params) -> str:
    """`model_identity` of the checkpoint at `path` restored as (`cfg`, `params`): the digest recorded at save
    time, or computed from `params` for a checkpoint written before digests were recorded."""
    try:
        digest = json.loads((Path(path) / MARKER).read_text()).get("params_sha256")
    except (OSError, ValueError, AttributeError):
        digest = None
    if digest is None or read_config(Path(path).absolute()) != cfg:
        digest = params_digest(params)
    return model_identity(cfg, digest)


def save_model(
    path: str | Path,
    cfg: LlamaConfig,
    params,
    tokenizer_files: list[Path] = (),
    source: dict | None = None,
    replaceable: Callable[[Path], bool] | None = None,
) -> Path:
    """Writes config, Orbax params and tokenizer files to `path` (which must not exist, be an empty directory,
    or satisfy `replaceable`) through a temporary directory beside it, renamed into place when complete;
    `source` (`source_record`) records what the parameters were converted from."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    pure = nnx.to_pure_dict(params)
    with files.atomic_dir(path, replaceable, what="checkpoint") as tmp:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", pure)
        if tokenizer_files:
            (tmp / "tokenizer").mkdir()
            for f in tokenizer_files:
                shutil.copy2(f, tmp / "tokenizer" / Path(f).name)
        meta = {
            "format": "specjax",
            "config": dataclasses.asdict(cfg),
            "params_sha256": params_digest(pure),
        }
        if source is not None:
            meta["source"] = source
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))
    return path


def read_config(path: Path) -> LlamaConfig:
    try:
        meta = json.loads((path / MARKER).read_text())
        config = meta["config"]
        return LlamaConfig(**config)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path / MARKER} is missing or corrupt ({err}); re-run specjax.convert"
        ) from err


def restore_model(
    path: str | Path,
    dtype: str | None = None,
    shardings: Callable | None = None,
):
    """(config, graphdef, params) from a specjax checkpoint, each array restored straight onto its place in
    `shardings(abstract params as a pure dict)` (a tree of `jax.sharding.Sharding`; e.g.
    `specjax.sharding.llama_shardings`), with no full copy on one device first."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg = read_config(path)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    graphdef, abstract = abstract_model(cfg)
    pure = nnx.to_pure_dict(abstract)
    places = shardings(pure) if shardings else jax.tree.map(lambda _: None, pure)
    target = jax.tree.map(lambda s, at: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at), pure, places)
    try:
        with ocp.StandardCheckpointer() as ckptr, quiet_failed_reads():
            pure = ckptr.restore(path / "params", target)
    except Exception as err:  # Orbax/tensorstore raise many types for damaged or missing files
        raise CheckpointError(
            f"cannot restore parameters from {path / 'params'} ({type(err).__name__}: "
            f"{str(err)[:300]}); the checkpoint is missing or corrupt: re-run specjax.convert"
        ) from err
    nnx.replace_by_pure_dict(abstract, pure)
    return cfg, graphdef, abstract


def restore_step(manager, step: int, failure: str, remedy: str, **items):
    """Restores the named `items` (orbax restore args) of `step` from an orbax CheckpointManager; a damaged
    checkpoint raises CheckpointError "cannot {failure} ...; the checkpoint is corrupt: {remedy}"."""
    import orbax.checkpoint as ocp

    try:
        with quiet_failed_reads():
            return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # Orbax/tensorstore raise many types for damaged or missing files
        raise CheckpointError(
            f"cannot {failure} ({type(err).__name__}: {str(err)[:300]}); the checkpoint is corrupt: {remedy}"
        ) from err


def _read_aftermath(unraisable) -> bool:
    """Whether an unraisable exception is the aftermath of a failed Orbax read (see `quiet_failed_reads`)."""
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
        unraisable.exc_value
    ):
        return True
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    return any("orbax" in f.filename or "tensorstore" in f.filename for f in frames) or "orbax" in repr(
        unraisable.object
    )


@contextlib.contextmanager
def quiet_failed_reads():
    """Reads of a damaged checkpoint fail in Orbax's background coroutines, which outlive the failed restore and
    report to `sys.unraisablehook` ('Event loop is closed', 'Encountered error while reading array index') before
    or after the one-line error that names the checkpoint; after a failed restore they stay quiet for the rest
    of the process (other unraisable exceptions are reported as before)."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _read_aftermath(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    yield  # an exception here leaves the hook in place
    sys.unraisablehook = previous
