"""The drafter registry: every draft source registers its name, settings, builder and (for trained heads)
its initialiser, loss, expansion and published layout, and `run_decode.py`, `specjax.heads`, `specjax.published`,
`specjax.expand`, the trainer and the benchmarks look it up: none of them names a method.

Adding a drafter is one module that calls `register` at import; built-in modules are imported on first
lookup (`BUILTIN`), any other module by importing it before the lookup (a test, a plugin).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from specjax.errors import DrafterError

BUILTIN = (
    "draft_model",
    "medusa",
    "eagle",
    "eagle3",
    "dflash",
    "ngram",
    "suffix",
    "hybrid",
    "layer_skip",
    "lookahead",
    "retrieval",
    "quantized",
    "distill",
)


@dataclasses.dataclass(frozen=True)
class Published:
    """A trained head type's layout as its authors publish it (read and written by `specjax.published`).

    weights: the weight file names it is read from, the first the one an export writes;
    tensors: what its tensor names look like (for the error when a file matches no layout);
    owns(tensors) -> whether a file's tensor names are this layout's (no two layouts own the same file);
    load(config.json dict, tensors, file, target_cfg, target_params) -> (meta, graphdef, params), as
    `specjax.heads.load_heads` returns them;
    files(meta, numpy params, target_cfg, base_model or None) -> (tensors, config.json dict); None: not exported."""

    weights: tuple[str, ...]
    tensors: str
    owns: Callable
    load: Callable
    files: Callable | None = None


@dataclasses.dataclass(frozen=True)
class TrainedHeads:
    """How a trained head type is made, trained and turned into a drafter (`specjax.heads`, the trainer).

    init(shape: dict, target_cfg, target_params, seed) -> (graphdef, params as a pure dict);
    drafter_params(shape, params, target_cfg, target_params) -> what the drafter's functions take;
    drafter(shape: dict, graphdef, target_cfg, k, sampler, tree) -> Drafter;
    loss(graphdef, target_cfg, drafter_params, feats_BTF, tokens_BT, loss_mask_BT, key, config.heads) ->
    (loss, metrics), averaged over the terms that predict a token whose loss mask is 1 (`losses.predicted_mask`);
    shape_of(config.heads, target_cfg, tokens or None) -> the head shape recorded in heads.json (the tokens the
    heads are trained to predict, where there are any, e.g. choose a reduced draft vocabulary);
    feature_taps(shape, target_cfg) -> the target layers whose outputs the loss's features hold before the
    final features (`specjax.models.llama.features`; none: the final features only);
    expand(shape, numpy params, expander, expansion, target_cfg) -> (params, shape) of the same heads for a
    function-preserving expansion of the target (`specjax.expand.expand_heads`; None: not expandable);
    published: its authors' layout (`Published`; None: it has none);
    settings: the dataclass that `config.heads` of a training config is made from (its fields and defaults)
    and checked against (its `RULES`: field -> (predicate, what a valid value is));
    check(config.heads, target_cfg): raises TrainingConfigError for heads this target cannot have, before the
    trainer writes anything (default: none);
    resample(graphdef, target_cfg, drafter_params, tokens_BT, loss_mask_BT, key, config) -> (tokens, loss_mask):
    the training batch as the heads want it, made inside the train step before the target's features (e.g.
    sequences sampled by the heads themselves; default: none, and `config.data.on_policy_fraction` must be 0)."""

    settings: type
    init: Callable
    drafter_params: Callable
    drafter: Callable
    loss: Callable
    shape_of: Callable
    feature_taps: Callable = lambda shape, target_cfg: ()
    expand: Callable | None = None
    published: Published | None = None
    check: Callable = lambda h, target_cfg: None
    resample: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered drafter. `settings` is a dataclass whose fields are the drafter's own options (the
    flags of `run_decode.py`, with their defaults and help in `help`); `build(target, settings, k, tree,
    sampler)` returns (drafter, drafter params) for a loaded target (`specjax.models.loading.LoadedModel`)."""

    name: str
    settings: type
    build: Callable
    help: dict = dataclasses.field(default_factory=dict)
    heads: TrainedHeads | None = None
    example: Callable | None = None  # (target, k, tree, sampler) -> (drafter, params) on a tiny random
    # target without a tokenizer, for exactness checks; default: `build` with default settings


DRAFTERS: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
    DRAFTERS[entry.name] = entry
    return entry


def _load_builtins() -> None:
    for module in BUILTIN:
        importlib.import_module(f"specjax.drafters.{module}")


def names() -> list[str]:
    _load_builtins()
    return sorted(DRAFTERS)


def get(name: str) -> Entry:
    """The registered drafter `name`; an unknown name is an error listing the known ones."""
    _load_builtins()
    if name not in DRAFTERS:
        raise DrafterError(f"unknown drafter {name!r}; choose one of {sorted(DRAFTERS)}")
    return DRAFTERS[name]


def head_methods() -> list[str]:
    """The drafters that train heads (`train_heads.py --config.method=...`)."""
    _load_builtins()
    return sorted(n for n, e in DRAFTERS.items() if e.heads is not None)


def trained(name: str) -> TrainedHeads:
    """The trained-head description of drafter `name`; an error if it trains no heads."""
    if name not in head_methods():
        raise DrafterError(f"{name!r} is not a drafter with trained heads; choose one of {head_methods()}")
    return DRAFTERS[name].heads
