"""specjax's own trained heads on disk and the builder that turns heads into a drafter.

A work directory holds `heads.json` (method, head shape, the target it was trained for) and Orbax checkpoints
under `checkpoints/` written by `specjax.training.trainer`; `export` copies its latest step without optimiser
state. `load_heads(workdir, target)` restores the latest head parameters for a target and refuses heads trained
for another one; the builder that `register` installs reads either that or a head in its authors' layout
(`specjax.published`). What each head type is (its initialiser, loss, drafter, expansion, published layout) is
registered with its drafter (`specjax.drafting.registry.TrainedHeads`); nothing here names a method.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax import files, published, speculators_format
from specjax.drafting import registry
from specjax.drafting.protocol import target_signature
from specjax.errors import HeadsError
from specjax.models.config import LlamaConfig
from specjax.models.store import restore_step
from specjax.models.weights import CheckpointError

META = "heads.json"
COMMITTED = Path(__file__).resolve().parents[1] / "heads"  # the trained stories260K heads


def describe(method: str, shape: dict, target_cfg: LlamaConfig) -> dict:
    registry.trained(method)  # an unknown method is an error naming the known ones
    return {"method": method, "shape": dict(shape), "target": target_signature(target_cfg)}


def new_heads(meta: dict, target_cfg: LlamaConfig, target_params, seed: int = 0):
    """(graphdef, trainable params as a pure dict) of fresh heads described by `meta`."""
    return registry.trained(meta["method"]).init(meta["shape"], target_cfg, target_params, seed)


def drafter_params(meta: dict, params, target_cfg: LlamaConfig, target_params):
    """What the drafter's functions take (e.g. EAGLE reads the target's embedding and LM head beside its
    own parameters)."""
    return registry.trained(meta["method"]).drafter_params(meta["shape"], params, target_cfg, target_params)


def make_drafter(meta: dict, graphdef, target_cfg: LlamaConfig, k: int, sampler, tree=None):
    return registry.trained(meta["method"]).drafter(meta["shape"], graphdef, target_cfg, k, sampler, tree)


@dataclasses.dataclass(frozen=True)
class HeadsSettings:
    heads: str | None = None
    HELP = {
        "heads": "Trained heads: the --workdir of a train_heads.py run or an export of one, or a head published "
        "by the EAGLE-3 / Medusa / DFlash (z-lab) authors or in vLLM's speculators format (a directory or a Hugging "
        "Face hub id; default: heads/stories260K_<drafter>)."
    }


def resolve_heads(source: str) -> Path:
    """A local directory for `--heads`: a path, or a Hugging Face hub id (org/name) downloaded into the hub's
    cache (config and weights only)."""
    path = Path(source)
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", source) or source.startswith("."):
        return path
    import huggingface_hub as hub

    try:
        patterns = ["*.json", "*.safetensors", "*.bin", "*.pt"]
        return Path(hub.snapshot_download(source, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repository, ...
        raise CheckpointError(
            f"heads {source!r} are not a local directory and could not be downloaded from the Hugging Face hub "
            f"({type(err).__name__}); pass a local directory of heads"
        ) from err


def load_external(path, method: str, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of `method` heads written elsewhere: in vLLM's speculators format
    (`specjax.speculators_format`) or in their authors' layout (`specjax.published`)."""
    if speculators_format.holds(Path(path)):
        return speculators_format.load(Path(path), method, target_cfg, target_params)
    return published.load_published(path, method, target_cfg, target_params)


def heads_builder(method: str):
    """The registry builder of a trained-head drafter: loads `settings.heads` (default: the committed
    stories260K heads; a directory with config.json and no heads.json is read as a published head,
    `specjax.published`, or a speculators checkpoint, `specjax.speculators_format`) for the target and checks they
    are `method` heads."""

    def build(target, settings: HeadsSettings, k: int, tree, sampler):
        workdir = resolve_heads(settings.heads or str(COMMITTED / f"stories260K_{method}"))
        if (workdir / "config.json").is_file() and not (workdir / META).exists():
            loaded = load_external(workdir, method, target.cfg, target.params)
        else:
            loaded = load_heads(workdir, target.cfg, target.params)
        meta, graphdef, params = loaded
        if meta["method"] != method:
            raise HeadsError(
                f"{workdir} holds {meta['method']} heads, not {method}; pass --drafter={meta['method']} "
                f"or the heads of a {method} run"
            )
        drafter = make_drafter(meta, graphdef, target.cfg, k, sampler, tree)
        options = {
            f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "heads"
        }
        drafter = dataclasses.replace(drafter, **options)  # a head type's own settings are drafter fields
        return drafter, drafter_params(meta, params, target.cfg, target.params)

    return build


def register(method: str, trained: registry.TrainedHeads, example=None, settings=HeadsSettings) -> None:
    """Registers a trained-head drafter: its CLI settings are `--heads` and the fields a subclass of
    `HeadsSettings` adds (fields of its drafter, with their help in `HELP`); its builder loads the heads
    (`example`: see `registry.Entry`)."""
    entry = registry.Entry(method, settings, heads_builder(method), settings.HELP, trained, example)
    registry.register(entry)


def write_meta(workdir: Path, meta: dict) -> None:
    path = Path(workdir) / META
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            raise HeadsError(
                f"{workdir} already holds heads {old}, not {meta}: use a new --workdir to train "
                "different heads"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))


def read_meta(workdir: Path) -> dict:
    """`workdir`'s heads.json, checked: a registered head method, its shape and the target's signature (else
    HeadsError, one line)."""
    path = Path(workdir) / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HeadsError(
            f"{path} is missing or corrupt ({err}); pass the --workdir of a train_heads.py run or an export of one"
        ) from err
    fix = "restore the heads.json that train_heads.py wrote there, or pass another heads folder"
    if not isinstance(meta, dict):
        raise HeadsError(f"{path} holds a {type(meta).__name__}, not the description of heads; {fix}")
    for key, kind in (("method", str), ("shape", dict), ("target", dict)):
        if not isinstance(meta.get(key), kind):
            found = "no such entry" if key not in meta else f"{meta[key]!r}"
            raise HeadsError(f"{path} lacks a valid {key!r} entry ({found}); {fix}")
    if meta["method"] not in registry.head_methods():
        raise HeadsError(
            f"{path} names the head method {meta['method']!r}, which specjax does not know (one of "
            f"{registry.head_methods()}); {fix}"
        )
    return meta


def _check_stored_shapes(workdir: Path, params_dir: Path, fresh) -> None:
    """Refuses (HeadsError) a heads.json whose heads have other arrays than its checkpoint stores, before Orbax
    is asked to read them; a checkpoint without readable metadata is left to the restore to report."""
    try:
        tree = json.loads((params_dir / "_METADATA").read_text())["tree_metadata"]
        stored = {
            "/".join(str(k["key"]) for k in v["key_metadata"]): tuple(v["value_metadata"]["write_shape"])
            for v in tree.values()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    wanted = {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(fresh)[0]
    }
    # a run of several processes records the shape each one wrote (a chunk of the array): it must tile the array
    fits = lambda s, w: (
        s is not None and w is not None and len(s) == len(w) and all(b % a == 0 for a, b in zip(s, w))
    )
    if any(not fits(stored.get(k), wanted.get(k)) for k in {*stored, *wanted}):
        diff = sorted(
            (k, stored.get(k), wanted.get(k))
            for k in {*stored, *wanted}
            if not fits(stored.get(k), wanted.get(k))
        )
        raise HeadsError(
            f"{workdir / META} does not describe the heads its checkpoint {params_dir.parent} holds (array, "
            f"stored shape, shape heads.json implies: {diff[:3]}); restore the heads.json the run wrote, or retrain"
        )


def load_heads(workdir: str | Path, target_cfg: LlamaConfig, target_params):
    """(meta, graphdef, params) of the latest checkpoint in `workdir`, checked against the target."""
    import orbax.checkpoint as ocp

    workdir = Path(workdir).absolute()
    meta = read_meta(workdir)
    ours = target_signature(target_cfg)
    if meta["target"] != ours:
        diff = {
            k: (meta["target"].get(k), ours.get(k))
            for k in {*meta["target"], *ours}
            if meta["target"].get(k) != ours.get(k)
        }
        raise HeadsError(
            f"the heads in {workdir} were trained for another target: (heads, this target) differ "
            f"in {diff}; train heads for this target"
        )
    try:
        graphdef, fresh = new_heads(meta, target_cfg, target_params)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise HeadsError(
            f"{workdir / META} describes {meta['method']} heads of shape {meta['shape']} that cannot be built "
            f"({type(err).__name__}: {err}); restore the heads.json the run wrote, or retrain"
        ) from err
    # onto this process's default device, whatever mesh wrote the checkpoint
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), fresh)
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"{workdir / 'checkpoints'} holds no finished checkpoint: train first")
        _check_stored_shapes(workdir, workdir / "checkpoints" / str(step) / "params", fresh)
        restored = restore_step(
            manager,
            step,
            f"restore head parameters of step {step} from {workdir / 'checkpoints'}",
            "delete that step to fall back to an earlier one, or retrain",
            params=ocp.args.StandardRestore(abstract),
        )
    params = restored["params"]
    return meta, graphdef, jax.tree.map(jnp.asarray, params)


EXPORT = "export.json"  # marks a directory written by `export` (and so one a later export may replace)
RUN_RECORDS = ("config.json", "metrics.jsonl")  # the training run's config and log, which an export keeps


def _is_export(path: Path) -> bool:
    """Whether `path` is a previous `export`: it holds export.json, or (exports made before the marker) exactly
    heads.json and checkpoints/STEP directories without optimiser state."""
    try:
        if (path / EXPORT).is_file():
            return json.loads((path / EXPORT).read_text()).get("format") == "specjax-heads-export"
        steps = list((path / "checkpoints").iterdir())
        return (
            {p.name for p in path.iterdir()} == {META, "checkpoints"}
            and "method" in json.loads((path / META).read_text())
            and all(s.name.isdigit() and s.is_dir() and not (s / "opt_state").exists() for s in steps)
        )
    except (OSError, ValueError, AttributeError):
        return False


def export(workdir: str | Path, dest: str | Path) -> Path:
    """Copies the latest head parameters (no optimiser state), `heads.json` and the run's config and log of a
    training run to `dest`: a small directory that `load_heads` reads like the run itself. The copy is written
    beside `dest` and renamed into place; an existing `dest` is replaced only if it is a previous export, anything
    else is refused, and so is a `dest` equal to, inside or containing the workdir (files.DestinationError)."""
    import orbax.checkpoint as ocp

    workdir, dest = Path(workdir).absolute(), Path(dest).absolute()
    if files.overlaps(workdir, dest):
        raise files.DestinationError(
            f"export destination {dest} is, lies inside or contains the workdir {workdir}; choose a "
            "destination outside the workdir"
        )
    if not (workdir / META).is_file() or not (workdir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{workdir} is not a train_heads.py workdir (no {META} and checkpoints/); pass the --workdir of "
            "a training run"
        )
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"{workdir / 'checkpoints'} holds no finished checkpoint: train first")
    with files.atomic_dir(dest, replaceable=_is_export, what="heads export") as tmp:
        shutil.copytree(
            workdir / "checkpoints" / str(step),
            tmp / "checkpoints" / str(step),
            ignore=shutil.ignore_patterns("opt_state"),
        )
        shutil.copy2(workdir / META, tmp / META)
        for log in RUN_RECORDS:  # how the heads were trained, where the run kept it
            if (workdir / log).is_file():
                shutil.copy2(workdir / log, tmp / log)
        record = {"format": "specjax-heads-export", "workdir": str(workdir), "step": step}
        (tmp / EXPORT).write_text(json.dumps(record, indent=1))
    return dest


def main(argv=None) -> int:
    """`python -m specjax.heads export WORKDIR DEST`: copies a training run's latest heads to DEST (see
    `export`). A user error ends with one line `error: ...` and exit status 1 (SPECJAX_DEBUG=1: traceback)."""
    import sys

    from specjax import cli

    parser = cli.ArgumentParser(prog="python -m specjax.heads", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    exporting = commands.add_parser(
        "export",
        help="copy the latest heads of a train_heads.py run (no optimiser state) to a new folder",
        description=export.__doc__.split("\n")[0],
    )
    exporting.add_argument("workdir", help="the --workdir of a train_heads.py run")
    exporting.add_argument("dest", help="the folder to write (new, empty, or an earlier export)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dest = export(args.workdir, args.dest)
    except cli.USER_ERRORS as err:
        if cli.debug():
            raise
        cli.fail(cli.describe(err))
    print(f"exported the heads of {Path(args.workdir).absolute()} to {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
