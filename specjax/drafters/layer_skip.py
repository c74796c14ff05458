"""Layer-skip self-speculation (Draft & Verify, SWIFT, LayerSkip): the draft is the target itself run through a
subset of its layers (the first k, or any skip set), then its final norm and LM head. No training.

The draft is a `DraftModel` whose layer i is the target's layer `layers[i]`.

What is shared with the target:
- every parameter array: the draft's params are the target's own arrays (embedding, the kept blocks, final
  norm, head), not copies; no parameter memory is added;
- the KV cache: the draft keeps none of its own. Its layer i attends to the target's cached keys/values of
  layer `layers[i]` for the committed tokens and writes its own for the pending token and the draft into the
  target's cache beyond the committed length, where the verification pass overwrites them. For a layer with
  no skipped layer before it (every layer of a first-k set) the cached keys/values are exactly those the
  draft would compute itself (same inputs, same weights); after a skipped layer they are the target's, not
  the skip model's (as in Draft & Verify and SWIFT): a different draft distribution, verified exactly all the
  same, at no cache memory and one token fed per round.

`layers="auto"` searches the set on a few calibration prompts (`search_layers`): per size, the set whose greedy
predictions agree most with the target's (all subsets of a size when they are few, else backward elimination),
then the size with the best expected speedup (`specjax.analysis`) at the measured cost of a draft step; it
prints what it chose.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.analysis import expected_speedup, optimal_k
from specjax.decoding import GenerateSpec, generate
from specjax.decoding.jobs import pad_prompts
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafting import registry
from specjax.errors import LayerSkipError
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward, init_cache

CALIBRATION_TEXTS = (
    "Once upon a time",
    "The little dog",
    "One day, a girl named",
    "The sun was hot and the",
)


def _listed_layers(layers: str) -> list[int]:
    """The layers `layers` lists ("0-3", "0,1,2,5", "0-2,5"), in the order given; syntax errors only."""
    if not isinstance(layers, str):
        raise LayerSkipError(
            f"layer_skip layers must be a string like '0-3' or '0,1,2,5', got {layers!r}; "
            "pass e.g. layers='0-2' for the first 3 layers"
        )
    if not layers.strip():
        raise LayerSkipError(
            f"layer_skip layers={layers!r} selects no layer; list the layers the draft runs, "
            "e.g. --layers=0-1 or --layers=0,2, or search them with --layers=auto"
        )
    listed = []
    for part in layers.split(","):
        ends = part.strip().split("-")
        if len(ends) > 2 or not all(e.strip().isdigit() for e in ends):
            raise LayerSkipError(
                f"layer_skip layers={layers!r}: {part.strip()!r} is not a layer or a range; "
                "write layers like 0-3 or 0,1,2,5"
            )
        first, last = int(ends[0]), int(ends[-1])
        if last < first:
            raise LayerSkipError(
                f"layer_skip layers={layers!r}: the range {part.strip()!r} runs backwards; write {last}-{first}"
            )
        listed += range(first, last + 1)
    twice = sorted({i for i in listed if listed.count(i) > 1})
    if twice:
        raise LayerSkipError(
            f"layer_skip layers={layers!r} lists layer {twice[0]} twice; list each layer once"
        )
    return listed


def _check_depth(n_layers: int) -> None:
    if n_layers < 2:
        raise LayerSkipError(
            f"the target has {n_layers} layer: layer-skip drafting needs at least 2; use another drafter "
            "(e.g. --drafter=ngram)"
        )


def parse_layers(layers: str, n_layers: int) -> tuple[int, ...]:
    """The sorted layer indices `layers` names for an `n_layers`-layer target; a clear error if the set is
    empty, malformed, repeats a layer, leaves the target or keeps every layer."""
    _check_depth(n_layers)
    listed = _listed_layers(layers)
    if max(listed) >= n_layers:
        raise LayerSkipError(
            f"layer_skip layers={layers!r}: layer {max(listed)} is out of range for a {n_layers}-layer "
            f"target; use layers 0..{n_layers - 1}"
        )
    if len(listed) == n_layers:
        raise LayerSkipError(
            f"layer_skip layers={layers!r} keeps all {n_layers} layers, so the draft would be the target "
            "itself; skip at least one layer"
        )
    return tuple(sorted(listed))


def format_layers(layers: tuple[int, ...]) -> str:
    """The shortest `layers` string for a sorted set: (0, 1, 2, 5) -> '0-2,5'."""
    runs = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def skip_model(cfg: LlamaConfig, params, layers: tuple[int, ...]):
    """(cfg, graphdef, params) of the target run through `layers` only: its layer i is the target's layer
    `layers[i]`; every parameter array is the target's own (no copy)."""
    return truncated_target(cfg, params, len(layers), layers)


@dataclasses.dataclass(frozen=True)
class LayerSkip(DraftModel):
    """A `DraftModel` over the target's `layers`, reading and writing the target's KV cache (no state)."""

    layers: tuple[int, ...] = ()
    reads_target_cache: ClassVar[bool] = True

    def validate(self, target_cfg: LlamaConfig) -> None:
        super().validate(target_cfg)
        parse_layers(format_layers(self.layers), target_cfg.n_layers)

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        return ()

    def propose(self, params, state, seq_BS, n_tokens_B, key, target_cache):
        # The target's cache holds every token but the pending one: feed it, then draft.
        view = target_cache.replace(
            k=tuple(target_cache.k[i] for i in self.layers), v=tuple(target_cache.v[i] for i in self.layers)
        )
        logits, view = self._feed(params, view, seq_BS, n_tokens_B, 1)
        draft, view = self.shape.search(
            self._step(params), self.sampler, logits, None, n_tokens_B, view, key
        )
        k, v = list(target_cache.k), list(target_cache.v)
        for i, layer in enumerate(self.layers):
            k[layer], v[layer] = view.k[i], view.v[i]
        return draft, state, target_cache.replace(k=tuple(k), v=tuple(v))

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state


def layer_skip_drafter(cfg: LlamaConfig, params, layers: tuple[int, ...], k: int, sampler, tree=None):
    """(LayerSkip, its params: the target's arrays) drafting with the target's `layers`."""
    small, graphdef, draft_params = skip_model(cfg, params, layers)
    return LayerSkip(small, graphdef, k, sampler, tree, layers), draft_params


# --- searching the skip set -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    layers: tuple[int, ...]
    agreement: float  # teacher-forced greedy agreement with the target (the acceptance rate a)
    cost: float  # c: draft step / target step
    speedup: float  # expected_speedup(agreement, k, cost)
    best_k: int  # optimal_k(agreement, cost)


@dataclasses.dataclass(frozen=True)
class LayerSearch:
    chosen: Candidate
    candidates: tuple[Candidate, ...]  # the best set of each size, most layers first
    k: int
    tokens: int  # calibration tokens scored

    def format(self) -> str:
        lines = [
            f"layer_skip search over {self.tokens} calibration tokens: a = greedy agreement with the target, "
            f"c = draft step / target step (measured), expected speedup at K={self.k}",
            "",
            "| layers | a | c | expected speedup | best K |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {format_layers(c.layers)} | {c.agreement:.3f} | {c.cost:.3f} | {c.speedup:.3f} | {c.best_k} |"
            for c in self.candidates
        ]
        return "\n".join(lines + ["", f"layer_skip chose --layers={format_layers(self.chosen.layers)}"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _greedy_predictions(cfg, graphdef, params, tokens_BT, positions_BT):
    cache = init_cache(cfg, *tokens_BT.shape)
    logits, _, _ = forward(
        graphdef, params, tokens_BT, positions_BT, cache, causal_mask(tokens_BT.shape[1])
    )
    return jnp.argmax(logits, axis=-1)


_step = jax.jit(forward, static_argnums=0)


def step_seconds(
    cfg: LlamaConfig, graphdef, params, batch: int, cache_size: int, repeats: int = 7
) -> float:
    """Median wall time of one decoding step (one token per row on a cache of `cache_size` slots)."""
    tokens, cache = jnp.ones((batch, 1), jnp.int32), init_cache(cfg, batch, cache_size)
    run = lambda: jax.block_until_ready(_step(graphdef, params, tokens, tokens, cache, causal_mask(1)))
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measured_cost(
    cfg: LlamaConfig, graphdef, params, batch: int, cache_size: int
) -> Callable[[int], float]:
    """c(m) = (m-layer draft step) / (target step), linear in m between the measured 1-layer and full steps."""
    t_one = step_seconds(*skip_model(cfg, params, (0,)), batch, cache_size)
    t_full = step_seconds(cfg, graphdef, params, batch, cache_size)
    per_layer = (t_full - t_one) / (cfg.n_layers - 1)
    return lambda m: max(t_one + (m - 1) * per_layer, 1e-9) / t_full


def search_layers(
    cfg: LlamaConfig,
    graphdef,
    params,
    prompts: list[list[int]],
    k: int,
    new_tokens: int = 64,
    cost: Callable[[int], float] | None = None,
    exhaustive: int = 64,
) -> LayerSearch:
    """Searches the skip set on `prompts` continued greedily by the target for `new_tokens`. For each size m
    from n - 1 down to 1 it keeps the m-layer set whose greedy predictions agree most with the target's
    (teacher-forced): among all m-subsets when there are at most `exhaustive` of them, else among the previous
    size's best set less one layer (backward elimination). Of these it chooses the one with the best expected
    speedup at `k` draft tokens, `cost(m)` being an m-layer draft step / a target step (default:
    `measured_cost`)."""
    n = cfg.n_layers
    _check_depth(n)
    continuations = np.asarray(
        generate(cfg, graphdef, params, prompts, GenerateSpec(new_tokens, eos_id=None)).tokens
    )
    tokens, lengths = pad_prompts([p + c.tolist() for p, c in zip(prompts, continuations)])
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    starts = np.array([len(p) - 1 for p in prompts])[:, None]  # from the last prompt token on
    scored = (positions >= starts) & (positions < lengths[:, None])
    target = np.asarray(_greedy_predictions(cfg, graphdef, params, tokens, positions))

    def agreement(layers):
        small, small_graphdef, small_params = skip_model(cfg, params, layers)
        draft = np.asarray(_greedy_predictions(small, small_graphdef, small_params, tokens, positions))
        return float(np.mean((draft == target)[scored]))

    cost = cost or measured_cost(cfg, graphdef, params, len(prompts), tokens.shape[1])
    keep, found = tuple(range(n)), []
    for size in range(n - 1, 0, -1):
        if math.comb(n, size) <= exhaustive:
            pool = itertools.combinations(range(n), size)
        else:
            pool = (tuple(x for x in keep if x != drop) for drop in keep)
        a, keep = max((agreement(s), s) for s in pool)
        c = cost(size)
        found.append(Candidate(keep, a, c, expected_speedup(a, k, c), optimal_k(a, c)))
    return LayerSearch(max(found, key=lambda x: x.speedup), tuple(found), k, int(scored.sum()))


def calibration_prompts(target) -> list[list[int]]:
    """A few short openings in the target's tokenizer; BOS + one token each without a tokenizer."""
    if target.tokenizer is None:
        return [[target.cfg.bos_id, t] for t in range(min(4, target.cfg.vocab_size))]
    return [target.tokenizer.encode(t) for t in CALIBRATION_TEXTS]


# --- registration -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerSkipSettings:
    layers: str | None = None  # None: the first half of the target's layers; "auto": search them
    HELP = {
        "layers": "layer_skip: the target's layers the draft runs, e.g. 0-3 or 0,1,2,5; 'auto' searches them "
        "on a few calibration prompts (default: the first half).",
    }

    def __post_init__(self):
        if self.layers not in (None, "auto"):
            _listed_layers(self.layers)


def build(target, settings: LayerSkipSettings, k: int, tree, sampler):
    """(LayerSkip, the target's arrays it reads) for `settings.layers`; with 'auto', the searched set."""
    n = target.cfg.n_layers
    if settings.layers == "auto":
        search = search_layers(target.cfg, target.graphdef, target.params, calibration_prompts(target), k)
        print(search.format())
        layers = search.chosen.layers
    else:
        layers = parse_layers(settings.layers or f"0-{max(n // 2, 1) - 1}", n)
    return layer_skip_drafter(target.cfg, target.params, layers, k, sampler, tree)


registry.register(registry.Entry("layer_skip", LayerSkipSettings, build, help=LayerSkipSettings.HELP))
