"""The benchmarks' one harness: prompt sets by category, timing in turns with per-round ratios and medians, decode
rows declared (`Row`, `registered`) and measured against AR (`decode_rows`), the analytic prediction, the
matrix-product precision flag, and stamped writing of md/csv/png (`specjax.results`).

A benchmark declares its rows (dicts whose keys are the columns) and what is specific to it; everything it times,
predicts or writes goes through here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specjax import results
from specjax.precision import CHOICES as PRECISIONS
from specjax.precision import check as check_precision

RESULTS = Path(__file__).resolve().parents[1] / "results"

# --- prompt sets --------------------------------------------------------------------------------------------

# The 20 openings of the heads benchmarks (bench_heads, bench_eagle3).
HEAD_PROMPTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named",
    "Tom and his dog went to the",
    "Lily wanted to",
    "One day, a big bear",
    "The sun was hot and the",
    "Sam had a red ball.",
    "There was a small bird who",
    'Mom said, "',
    "Ben and Mia were best friends.",
    "The cat saw a",
    "In the park, the children",
    "A little boy found a",
    "It was a rainy day and",
    "The old tree",
    "Sue liked to play with her",
    "Once there was a fish named",
    "Max was very happy because",
    "The girl looked at the sky and",
    "At night, the moon",
]

# Free-continuation story openings shared by the drafter and verification benchmarks (10 of the 20).
STORY_OPENINGS = [HEAD_PROMPTS[i] for i in (0, 1, 2, 3, 4, 5, 7, 9, 11, 13)]

# The memory-bound benchmark's openings (8 of the 20).
MEMORY_PROMPTS = [HEAD_PROMPTS[i] for i in (0, 2, 3, 4, 5, 6, 7, 9)]

# Short stories for input-grounded prompts (bench_drafters, tables).
STORIES = [
    "Once upon a time, there was a dog named Max. Max loved to play with his red ball in the park. "
    "One day, Max lost his ball. He looked under the big tree and found it.",
    "Lily had a pretty doll. She took the doll everywhere. One day, Lily and her mom went to the store. "
    "Lily held her doll and smiled.",
    "Tom saw a little bird in the garden. The bird was sad because it could not fly. "
    "Tom gave the bird some water and the bird was happy.",
    "Sue and Ben went to the beach. They made a big sand castle. A wave came and the castle fell. "
    "Sue and Ben laughed and made a new castle.",
    "There was a cat named Kitty. Kitty liked to sleep in the sun. One day, Kitty saw a mouse. "
    "Kitty ran after the mouse, but the mouse was fast.",
    "Anna wanted to bake a cake for her mom. She put sugar and eggs in a bowl. "
    "Anna was happy when her mom ate the cake.",
    "Once upon a time, there was a little boy named Jack. Jack had a toy car. He played with the car "
    "every day. One day, the car broke and Jack was sad.",
    "Mia found a shiny rock in the garden. She showed the rock to her dad. Her dad said it was a "
    "special rock. Mia kept the rock in her box.",
    "A big bear lived in the forest. The bear was hungry. He looked for honey in a tree. "
    "The bear found the honey and ate it all.",
    "Tim and his friend Sam played with a ball. Sam kicked the ball very high. The ball went over "
    "the fence. Tim and Sam went to get the ball.",
]
# The story, then its first sentence again: the model retells it, reusing its names and phrases.
GROUNDED = [s + "\n" + s.split(". ")[0] + "." for s in STORIES]

# Prompt texts by category: free continuation, input-grounded retelling, long generation (from openings).
CATEGORIES = {"free": STORY_OPENINGS, "grounded": GROUNDED, "long": STORY_OPENINGS}


def prompts(tokenizer, texts, n: int | None = None) -> list[list[int]]:
    """The first `n` texts (all for None) as token ids."""
    return [tokenizer.encode(t) for t in texts[:n]]


# --- timing -------------------------------------------------------------------------------------------------


def interleaved_times(fns: dict, repeats: int, settle: bool = True) -> dict:
    """{name: [wall time of fn() in each of `repeats` rounds]}, the functions timed in turn after one warm-up
    each. Taking turns matters on a shared machine whose speed drifts by tens of percent over seconds: the
    times of one round saw the same drift, so a ratio computed within each round (then its median, `ratio`)
    cancels it. Bursts shorter than one call do not cancel: repeat more. `settle`: an untimed call before each
    timed one (the first call after another function's runs slower: caches, thread wake-up)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} times nothing; pass --repeats=1 or more")
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            if settle and len(fns) > 1:
                fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """{name: median wall time of fn()}, the functions timed in turn (`interleaved_times`)."""
    return {name: statistics.median(t) for name, t in interleaved_times(fns, repeats).items()}


def median_time(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs, after one untimed warm-up run."""
    return interleaved_medians({"fn": fn}, repeats)["fn"]


def ratio(num: list[float], den: list[float], less: float = 0.0) -> float:
    """Median over rounds of (num - less) / (den - less): a speedup taken within each round of
    `interleaved_times` (`less`: a fixed cost both share, e.g. prefill)."""
    return statistics.median((x - less) / (y - less) for x, y in zip(num, den))


# --- decode tables: rows declared, decoded and timed against AR ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """A drafter row of a decode table, declared: how the table names it, and how to build it for a sampler
    (`build(target, sampler) -> (drafter, params)`; None: AR). `k`: its chain length where it is a chain (the
    i.i.d. prediction of tau), else None. `spec`: what it changes in the table's GenerateSpec (an acceptance
    rule, adaptive K)."""

    method: str
    setting: str = "-"
    build: Callable | None = None
    k: int | None = None
    spec: dict = dataclasses.field(default_factory=dict, compare=False)


AR = Row("AR")


def registered(method: str, setting: str, name: str, k: int, tree=None, **settings) -> Row:
    """A row of the registered drafter `name` with `settings`, K and a tree (or its spec, as
    `specjax.drafting.trees.parse_tree` reads it; None: a chain)."""
    from specjax.drafting import registry
    from specjax.drafting.trees import parse_tree

    entry = registry.get(name)
    shape = parse_tree(tree) if isinstance(tree, str) else tree
    build = lambda target, sampler: entry.build(target, entry.settings(**settings), k, shape, sampler)
    return Row(method, setting, build, None if shape else k)


@dataclasses.dataclass
class Measured:
    """A row decoded on every prompt: seconds summed over the prompts (medians; nan untimed), AR's seconds timed
    in turns with it, each prompt's statistics (None for AR) and its new tokens (seed 0)."""

    row: Row
    seconds: float
    ar_seconds: float
    stats: list | None
    tokens: list[list[int]]

    @property
    def metrics(self) -> dict:
        """The prompts' statistics pooled (`specjax.metrics.pooled`): tau, acceptance rate, alpha, ..."""
        from specjax.metrics import pooled

        return {"tau": 1.0} if self.stats is None else pooled(self.stats)

    @property
    def speedup(self) -> float:
        return self.ar_seconds / self.seconds


def decode_rows(target, prompts, spec, rows, repeats: int, bucket: int = 8):
    """Yields a `Measured` for each of `rows` (`AR` among them or not) on the prompts, batch 1, each prompt's
    width padded to a multiple of `bucket` (one compile per width): each row timed in turns with AR on each
    prompt (`interleaved_times`; `repeats=0`: untimed, the statistics and tokens only), its compiled programs
    released before the next row is built (XLA CPU maps every program's code until it is freed)."""
    import gc

    import jax

    from specjax.decoding import compile_decode

    model = (target.cfg, target.graphdef, target.params)
    ar = {}

    def compiled(runs: dict, p, drafter=None, dparams=None, changes=None):
        width = -(-len(p) // bucket)
        if width not in runs:
            own = dataclasses.replace(spec, **(changes or {}))
            runs[width] = compile_decode(*model, [p], own, drafter, dparams, bucket)[0]
        return runs[width]

    for row in rows:
        drafter, dparams = (None, None) if row.build is None else row.build(target, spec.sampler)
        runs = ar if drafter is None else {}
        seconds = ar_seconds = 0.0 if repeats else float("nan")
        stats, tokens = [], []
        for p in prompts:
            run = compiled(runs, p, drafter, dparams, row.spec)
            out = jax.block_until_ready(run([p]))
            stats.append(getattr(out, "stats", None))
            tokens.append(np.asarray(out.tokens[0]).tolist())
            if repeats:
                fns = {"row": lambda: jax.block_until_ready(run([p]))}
                if drafter is not None:
                    base = compiled(ar, p)
                    fns["AR"] = lambda: jax.block_until_ready(base([p]))
                times = {k: statistics.median(v) for k, v in interleaved_times(fns, repeats).items()}
                seconds += times["row"]
                ar_seconds += times.get("AR", times["row"])
        measured = Measured(row, seconds, ar_seconds, None if drafter is None else stats, tokens)
        runs = run = drafter = dparams = None  # the programs freed before the next row compiles
        jax.clear_caches()
        gc.collect()
        yield measured


# --- the analytic prediction -----------------------------------------------------------------------------


def tau_iid(a: float, k: int) -> float:
    """Expected tokens per round of a chain of K drafts each accepted with probability a (Leviathan et al.)."""
    from specjax.analysis import expected_tokens_per_round

    return expected_tokens_per_round(a, k)


def predicted_speedup(tokens: float, calls: int, c: float, v: float = 1.0) -> float:
    """Tokens per round / the round's cost in one-token target passes: `calls` drafter calls of cost c and a
    verify pass of cost v (Theorem 3.8 with tokens = tau_iid(a, K), calls = K, v = 1)."""
    return tokens / (calls * c + v)


def alphas(m: dict) -> str:
    """alpha_i of pooled statistics as one table cell ('0.81 0.62 ...')."""
    return " ".join(f"{float(a):.3g}" for a in np.asarray(m["alpha"]))


# --- matrix-product precision -----------------------------------------------------------------------------


def define_precision_flag() -> None:
    """--matmul_precision, for every experiment that decodes (its value goes into GenerateSpec and the stamps)."""
    from absl import flags

    if "matmul_precision" not in flags.FLAGS:
        flags.DEFINE_enum(
            "matmul_precision",
            "dtype",
            list(PRECISIONS),
            "Matrix-product precision (specjax.precision): dtype (full for float32, the backend's default for "
            "bfloat16/float16), default, high or highest.",
            allow_override=True,  # run_decode.py's own definition may come later in the same process
        )


def precision() -> str:
    """The run's --matmul_precision ('dtype' where the flag is not defined; its default before flags are parsed, as
    in a test that imports a benchmark module)."""
    from absl import flags

    if "matmul_precision" not in flags.FLAGS:
        return "dtype"
    return (
        flags.FLAGS.matmul_precision if flags.FLAGS.is_parsed() else flags.FLAGS["matmul_precision"].default
    )


def matmul_scope(params):
    """The run's --matmul_precision around a program traced outside a GenerateSpec (a timing loop); with `dtype`
    the model's own rule applies (`specjax.precision.follows_params`)."""
    import contextlib

    from specjax import precision as policy

    choice = precision()
    return (
        contextlib.nullcontext() if choice == "dtype" else policy.scope(choice, policy.params_dtype(params))
    )


def generate_spec(*args, **kwargs):
    """`GenerateSpec(*args, **kwargs)` with the run's matrix-product precision (where GenerateSpec has it)."""
    from specjax.decoding import GenerateSpec

    kwargs.setdefault("matmul_precision", check_precision(precision()))
    return GenerateSpec(*args, **kwargs)


# --- stamped output -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Writer:
    """Writes stamped tables and figures into `folder` (one stamp per run, with the matrix-product precision)."""

    folder: Path = RESULTS
    stamp: dict | None = None
    echo: bool = True  # print each table's markdown
    matmul_precision: str | None = None  # default: the run's --matmul_precision

    def __post_init__(self):
        self.folder = Path(self.folder)
        self.stamp = (self.stamp or results.stamp()) | {
            "matmul_precision": self.matmul_precision or precision()
        }

    def table(self, name: str, rows: list[dict], title: str, notes: str = "") -> str:
        text = results.write_table(self.folder, name, rows, title, notes, self.stamp)
        if self.echo:
            print(text, flush=True)
        return text

    def figure(self, fig, name: str) -> Path:
        import matplotlib.pyplot as plt

        path = results.save_figure(fig, self.folder, name, self.stamp)
        plt.close(fig)
        return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_table(name: str, rows: list[dict], title: str, notes: str = "", folder=None) -> str:
    """Writes FOLDER/NAME.md and NAME.csv (default `RESULTS`), stamped with the run's precision; returns the
    markdown."""
    return Writer(folder or RESULTS, echo=False).table(name, rows, title, notes)
