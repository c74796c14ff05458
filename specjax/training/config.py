"""The training configuration every `configs/*.py` file starts from (ml_collections, locked: a key that is not
defined here is an error, not a silent no-op), and `validate`, which refuses bad values before anything is
loaded or compiled."""

from __future__ import annotations

import dataclasses
import difflib
import math
import runpy
from pathlib import Path

import ml_collections

from specjax import cli, precision
from specjax.errors import TrainingConfigError


def _head_settings(method: str) -> type:
    from specjax.drafting import registry

    if method not in registry.head_methods():
        raise TrainingConfigError(
            f"method {method!r} trains no heads; choose one of {registry.head_methods()}"
        )
    return registry.trained(method).settings


def _resamples(method: str) -> bool:
    from specjax.drafting import registry

    return method in registry.head_methods() and registry.trained(method).resample is not None


def base_config(method: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = method  # a drafter with trained heads: specjax.drafting.registry.head_methods()
    # The frozen target: anything run_decode.py --model takes (a model name, a Hugging Face directory, a llama2.c
    # file, a hub id) or a specjax (Orbax) checkpoint. Anything but a checkpoint is converted once into one at
    # target_checkpoint ("" = checkpoints/NAME), recorded with its source and reused while the source is unchanged.
    c.target = "stories260K"
    c.target_checkpoint = ""
    c.seed = 0
    # matrix products of the target and the heads, forward and backward (specjax.precision): "dtype" runs float32
    # weights at full float32 precision on every backend; "default", "high", "highest" choose otherwise
    c.matmul_precision = "dtype"

    c.data = ml_collections.ConfigDict()
    c.data.source = (
        "self_distill"  # or a .txt / .jsonl file (a jsonl of conversations: `messages` or ShareGPT)
    )
    c.data.num_samples = 2048  # self-distillation: documents sampled from the target
    c.data.sample_len = 256  # ... of at most this many tokens after BOS (regeneration: per assistant turn)
    c.data.temperature = 1.0  # ... at this temperature (and regeneration's)
    # self-distillation: as many documents again at this temperature, their rows interleaved with the others' (< 0:
    # none)
    c.data.mix_temperature = -1.0
    c.data.chat_template = ""  # conversations: a Jinja chat template file ("" = the target tokenizer's own)
    c.data.regenerate = (
        ""  # conversations: the jsonl the target's rewrite of every assistant turn goes to ("" = none)
    )
    c.data.cache = (
        "checkpoints/stories260K_corpus.npy"  # packed tokens, built once ("" = rebuild every run)
    )
    c.data.seq_len = 128
    c.data.features = (
        "online"  # "online": the target runs inside the train step; "store": precomputed on disk
    )
    c.data.store = ""  # feature-store folder for features = "store"
    c.data.on_policy_fraction = (
        0.0  # rows of each batch the heads sample themselves (methods that can: distill)
    )
    c.data.heldout = 0  # corpus rows kept out of training and evaluated at every log step (0: none)

    c.heads = ml_collections.ConfigDict(dataclasses.asdict(_head_settings(method)()))

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.lr = 1e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.final_lr_fraction = 0.1  # cosine decay to lr x this
    c.optimizer.weight_decay = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.clip_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 2000
    c.train.batch_size = 32  # global: split over the mesh's data axis
    c.train.log_every = 50
    c.train.checkpoint_every = 500
    c.train.keep_checkpoints = 3  # at least 1
    c.train.allow_config_change = False  # resume a workdir whose recorded config.json differs (knowingly)
    # heads (a workdir or an export) that a new run starts from, with a fresh optimiser ("": random weights)
    c.train.init_from = ""

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # devices on the data axis (-1: all that the model axis leaves)
    c.mesh.model = 1  # devices sharding the frozen target's parameters
    return c


def variant(c: ml_collections.ConfigDict, name: str = "") -> ml_collections.ConfigDict:
    """`c` as the config-file variant `name` (`--config=FILE:NAME`): '' is the full run, 'smoke' is `smoke(c)`;
    any other name is an error (it would otherwise run the full config without a word)."""
    if name not in VARIANTS:
        raise TrainingConfigError(
            f"unknown config variant {name!r}; use one of {sorted(v for v in VARIANTS if v)} after the file "
            "name (e.g. --config=configs/eagle.py:smoke) or none for the full run"
        )
    return VARIANTS[name](c)


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks a config to a run of seconds: a small self-distilled corpus (not cached), a few steps."""
    c.data.num_samples = 64
    c.data.sample_len = 64
    c.data.seq_len = 32
    c.data.cache = ""
    c.optimizer.warmup_steps = 2
    c.train.steps = 30
    c.train.batch_size = 8
    c.train.log_every = 10
    c.train.checkpoint_every = 10
    return c


VARIANTS = {"": lambda c: c, "smoke": smoke}

# Keys that change how a run is carried out, not what it trains: a resumed run may change them freely.
OPERATIONAL = frozenset(
    {
        "target",  # compared by the target's identity instead (the same weights may move)
        "target_checkpoint",
        "data.cache",
        "data.features",
        "data.store",
        "train.log_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.allow_config_change",
        "mesh.data",
        "mesh.model",
    }
)


def flatten(c) -> dict:
    """{"data.seq_len": 128, ...} of a ConfigDict (or nested dict)."""
    out = {}
    for k, v in c.items() if isinstance(c, dict) else c.to_dict().items():
        if isinstance(v, (dict, ml_collections.ConfigDict)):
            out.update({f"{k}.{kk}": vv for kk, vv in flatten(v).items()})
        else:
            out[k] = v
    return out


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises TrainingConfigError for the first setting that cannot work (before anything is loaded)."""
    from specjax.drafting.registry import head_methods

    flat = flatten(c)

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            raise TrainingConfigError(f"config {key}={flat[key]!r} {rule}; pass a valid --config.{key}=...")

    for key, value in flat.items():
        if isinstance(value, float):
            need(math.isfinite(value), key, "is not a finite number")
    need(c.method in head_methods(), "method", f"is not one of {head_methods()}")
    need(isinstance(c.target, str) and bool(c.target.strip()), "target", "must name a model or checkpoint")
    need(c.seed >= 0, "seed", "must be >= 0")
    need(c.matmul_precision in precision.CHOICES, "matmul_precision", f"is not one of {precision.CHOICES}")
    d, h, o, t = c.data, c.heads, c.optimizer, c.train
    if d.source != "self_distill":
        need(
            Path(d.source).is_file(),
            "data.source",
            "is neither 'self_distill' nor an existing .txt/.jsonl file",
        )
    need(d.num_samples >= 1, "data.num_samples", "must be >= 1")
    need(d.sample_len >= 1, "data.sample_len", "must be >= 1")
    need(d.temperature >= 0, "data.temperature", "must be >= 0 (0 = greedy)")
    if d.source == "self_distill":  # every document starts at BOS: greedy, all would be one
        for key, value in (
            ("data.temperature", d.temperature),
            ("data.mix_temperature", d.mix_temperature),
        ):
            need(
                not 0 <= value < cli.GREEDY_BELOW,
                key,
                "samples greedily, and every self-distilled document would be the same one; set it > 0",
            )
    need(
        d.mix_temperature < 0 or d.source == "self_distill",
        "data.mix_temperature",
        "mixes only self-distilled documents, not data.source's (set it to -1)",
    )
    need(d.seq_len >= 2, "data.seq_len", "must be >= 2 (a head learns from a token and what follows it)")
    need(not (d.cache and Path(d.cache).is_dir()), "data.cache", "is a directory, not a .npy file path")
    need(
        not d.chat_template or Path(d.chat_template).is_file(),
        "data.chat_template",
        "is not an existing Jinja template file",
    )
    need(
        not (d.regenerate and Path(d.regenerate).is_dir()),
        "data.regenerate",
        "is a directory, not a .jsonl path",
    )
    need(d.features in ("online", "store"), "data.features", "must be 'online' or 'store'")
    need(
        d.features != "store" or bool(d.store),
        "data.store",
        "is empty but data.features='store' needs a folder",
    )
    need(0 <= d.on_policy_fraction <= 1, "data.on_policy_fraction", "must be in [0, 1]")
    if d.on_policy_fraction > 0:
        need(
            _resamples(c.method),
            "data.on_policy_fraction",
            f"needs a method that samples its own data, not {c.method}",
        )
        need(d.features == "online", "data.on_policy_fraction", "needs data.features='online' (new tokens)")
    need(d.heldout >= 0, "data.heldout", "must be >= 0")
    settings = _head_settings(c.method)
    fields = sorted(f.name for f in dataclasses.fields(settings))
    if sorted(h.keys()) != fields:
        raise TrainingConfigError(
            f"config heads keys {sorted(h.keys())} are not the {c.method} settings {fields}; "
            f"start the config from base_config({c.method!r}) (see configs/{c.method}.py)"
        )
    for key, (ok, rule) in settings.RULES.items():
        need(ok(h[key]), f"heads.{key}", rule)
    need(o.lr > 0, "optimizer.lr", "must be > 0")
    need(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    need(0 <= o.final_lr_fraction <= 1, "optimizer.final_lr_fraction", "must be in [0, 1]")
    need(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    need(0 <= o.b1 < 1, "optimizer.b1", "must be in [0, 1)")
    need(0 <= o.b2 < 1, "optimizer.b2", "must be in [0, 1)")
    need(o.clip_norm > 0, "optimizer.clip_norm", "must be > 0")
    need(t.steps >= 1, "train.steps", "must be >= 1")
    need(
        not t.init_from or (Path(t.init_from) / "heads.json").is_file(),
        "train.init_from",
        "names no heads folder (one holding heads.json: a train_heads.py workdir or an export of one)",
    )
    need(t.batch_size >= 1, "train.batch_size", "must be >= 1")
    need(t.log_every >= 1, "train.log_every", "must be >= 1")
    need(t.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
    need(
        t.keep_checkpoints >= 1,
        "train.keep_checkpoints",
        "must be >= 1 (fewer would delete every checkpoint)",
    )
    need(c.mesh.data == -1 or c.mesh.data >= 1, "mesh.data", "must be -1 (all devices) or >= 1")
    need(c.mesh.model >= 1, "mesh.model", "must be >= 1")


def check_command_line(argv: list[str], flag: str = "config") -> None:
    """Refuses, before absl parses `argv`, what it would report as a traceback or not at all: a --config file
    that does not exist or does not load, an unknown variant (FILE:NAME), and a --config.KEY override naming no
    key of that config (with the nearest key, or the list of keys)."""
    spec, overrides, args = None, [], iter(argv[1:])
    for arg in args:
        if arg == "--":
            break
        if arg.startswith(f"--{flag}="):
            spec = arg.split("=", 1)[1]
        elif arg == f"--{flag}":
            spec = next(args, None)
        elif arg.startswith(f"--{flag}."):
            overrides.append(arg[len(flag) + 3 :].split("=", 1)[0])
    if spec is None:
        return  # absl says that --config is required
    path, *name = spec.split(":", 1)
    if not Path(path).is_file():
        raise TrainingConfigError(
            f"config file {path} does not exist; pass --config=configs/medusa.py or configs/eagle.py "
            "(add :smoke for a run of seconds)"
        )
    try:
        config = runpy.run_path(path)["get_config"](*name)
    except TrainingConfigError:
        raise
    except Exception as err:  # the file is Python: anything can go wrong in it
        raise TrainingConfigError(
            f"cannot load the config file {path} ({type(err).__name__}: {err}); it must define get_config() "
            "like configs/medusa.py"
        ) from err
    keys = sorted(flatten(config))
    for key in overrides:
        if key not in keys:
            near = difflib.get_close_matches(key, keys, 1)
            raise TrainingConfigError(
                f"unknown config key {key!r} (--{flag}.{key}); "
                + (f"did you mean {near[0]!r}?" if near else f"the keys are {', '.join(keys)}")
            )
