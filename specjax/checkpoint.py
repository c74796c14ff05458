"""Orbax save/restore of model parameters with their config (and tokenizer files) in one directory.

Layout of a specjax checkpoint directory:
    specjax.json   {"format": "specjax", "config": LlamaConfig fields, "params_sha256": digest of the arrays,
                    "source": what it was converted from (`source_record`), when written by `convert`}
    params/        Orbax StandardCheckpointer tree of the parameters
    tokenizer/     copied tokenizer files (optional)

The directory is written under a temporary name beside the destination and renamed into place when complete,
so an interrupted save leaves no half-written checkpoint; an existing destination is never overwritten, except
a conversion whose recorded source has changed (`converted`: it is rebuilt, under a lock).
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
from absl import logging
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
    record = json.dumps({"config": dataclasses.asdict(cfg), "params": digest}, sort_keys=True, default=str)
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


def source_record(path: Path, dtype: str) -> dict:
    """What a model at `path` (a resolved model directory or llama2.c file) is, cheaply: its path, the dtype it
    is converted to, and the size and modification time of each of its files (a changed file is seen without
    reading it)."""
    from specjax.models.loading import tokenizer_files

    found = [path, *tokenizer_files(path)] if path.is_file() else sorted(path.rglob("*"))
    stats = {str(f): [f.stat().st_size, f.stat().st_mtime_ns] for f in found if f.is_file()}
    return {"path": str(path), "dtype": dtype, "files": stats}


def recorded_source(path: Path) -> dict | None:
    """The `source` recorded in the checkpoint at `path` (None: none, or not a specjax checkpoint)."""
    try:
        source = json.loads((Path(path) / MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, dict) else None


def convert(source: str, dest: str | Path, dtype: str = "float32", replaceable=None) -> tuple[Path, object]:
    """Converts the model `source` (anything `load_model` takes) into a specjax checkpoint at `dest`, recording
    its source; returns (dest, the loaded model)."""
    from specjax.models.loading import load_model, tokenizer_files

    model = load_model(source, dtype)
    record = source_record(model.path, dtype)
    out = save_model(dest, model.cfg, model.params, tokenizer_files(model.path), record, replaceable)
    return out, model


@contextlib.contextmanager
def _conversion_lock(dest: Path):
    """Holds `.NAME.lock` beside `dest` (waiting for another process converting into `dest` to finish)."""
    import fcntl

    lock = dest.parent / f".{dest.name}.lock"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")  # noqa: SIM115 (closed below)
    except OSError as err:
        raise files.DestinationError(
            f"cannot write the target checkpoint beside {dest} ({err.strerror or err}); choose a writable "
            "target_checkpoint"
        ) from err
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def converted(target: str, dest: str | Path = "", dtype: str = "float32") -> Path:
    """A specjax checkpoint of `target`: `target` itself if it is one, else its conversion at `dest` (default
    `checkpoints/NAME`), made once under a lock and reused while its recorded source (`source_record`) matches;
    a conversion of a changed source is rebuilt. A directory at `dest` that is not a conversion is refused."""
    from specjax.models.loading import DEFAULT_MODEL, resolve

    local = Path(target).expanduser()
    if (local / MARKER).exists():
        return local.absolute()
    hub_id = target.count("/") == 1 and not target.startswith((".", "/", "~"))
    if not local.exists() and not hub_id and target != DEFAULT_MODEL:
        raise CheckpointError(
            f"target checkpoint {local.absolute()} not found (no such file or directory); set target to a model "
            f"name ({DEFAULT_MODEL}), a Hugging Face directory, a llama2.c file or a checkpoint written by "
            "`python -m specjax.convert SRC DST`"
        )
    path = resolve(target)
    if (path / MARKER).exists():
        return path
    dest = Path(dest or Path("checkpoints") / (path.stem if path.is_file() else path.name)).absolute()
    record = source_record(path, dtype)
    with _conversion_lock(dest):
        if recorded_source(dest) == record or _adopted(dest, path, record):
            return dest
        if dest.is_file() or (dest.is_dir() and any(dest.iterdir()) and recorded_source(dest) is None):
            raise files.DestinationError(
                f"{dest} already exists and is not a conversion of a target by specjax (it records no "
                f"source); set target={dest} to train on it as it is, or choose another target_checkpoint"
            )
        logging.warning(
            "converting the target %s into %s (once; reused while the source is unchanged)", path, dest
        )
        convert(str(path), dest, dtype, replaceable=lambda p: recorded_source(p) is not None)
    return dest


def _adopted(dest: Path, source: Path, record: dict) -> bool:
    """Whether `dest` is a checkpoint written before sources were recorded (by `specjax.convert`) that holds
    exactly the weights of `source`; if so its source is recorded now, so it is reused from then on."""
    from specjax.models.loading import load_model

    try:
        meta = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or "source" in meta or "params_sha256" not in meta:
        return False
    model = load_model(str(source), record["dtype"])
    if meta["params_sha256"] != params_digest(model.params) or read_config(dest) != model.cfg:
        return False
    files.write_text(
        dest / MARKER, json.dumps({**meta, "source": record}, indent=1), replaceable=lambda p: True
    )
    logging.info("%s holds the weights of %s: recorded it as its source", dest, source)
    return True


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
        with quiet_failed_reads(), ocp.StandardCheckpointer() as ckptr:
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
