"""Conversion of any model `specjax.models.loading` reads into a specjax checkpoint (`specjax.models.store`),
recording its source, and `converted`: the one conversion of a training target, made once under a lock and
reused while the source is unchanged (a changed source is rebuilt; a directory that is not a conversion is
refused).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from absl import logging

from specjax import files
from specjax.models.loading import DEFAULT_MODEL, load_model, resolve, tokenizer_files
from specjax.models.store import MARKER, params_digest, read_config, save_model
from specjax.models.weights import CheckpointError


def source_record(path: Path, dtype: str) -> dict:
    """What a model at `path` (a resolved model directory or llama2.c file) is, cheaply: its path, the dtype it
    is converted to, and the size and modification time of each of its files (a changed file is seen without
    reading it)."""
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
