"""Ablations from the command line: the cross product of any `run_decode.py` flags, timed in turns against AR.

    .venv/bin/python -m experiments.sweep --grid=k:1,2,4,8 --grid=temperature:0,1 [--repeats=3] \
        [--results=results] [--name=sweep] -- --drafter=eagle --heads=heads/stories260K_eagle --prompts_file=FILE

Every flag after `--` is `run_decode.py`'s; each `--grid=FLAG:V1,V2,...` adds an axis whose values replace that
flag. Each setting is checked as run_decode checks it and compiled once per distinct program (settings that
differ only in what the program does not depend on share one); AR is compiled once per sampler and length, and
all of them run in turns (`harness.interleaved_times`), so the speedup over AR is a median of per-round ratios.
A setting that is invalid (a bad value, a flag its drafter does not read, a tree too deep for the heads) gets
a row with its one-line error and no numbers; the others still run.

Writes results/NAME.{md,csv} (one row per setting, and one AR row per sampler and length: tau, acceptance rate
a, alpha_i, tau_iid = (1 - a^(K+1)) / (1 - a) for chains, tokens/s, speedup over AR, the analytic prediction of
the speedup, same_as_ar = the fraction of prompts whose greedy tokens equal AR's) and NAME.png (speedup and tau
against the first axis, a line per value of the others). Prompts decode in batches of --batch_size with EOS
ignored (every setting emits --max_new_tokens a prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from pathlib import Path

import jax
import numpy as np
from absl import flags, logging

import run_decode as rd
from experiments import harness
from specjax import acceptance, cli, metrics
from specjax.drafting.trees import Chain

FLAGS = flags.FLAGS
OWN = ("grid", "repeats", "results", "name")
# run_decode flags that AR decoding depends on (its program and its outputs); the others are the drafter's
AR_FLAGS = (
    "model",
    "dtype",
    "quantize",
    "prompt",
    "prompts_file",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "batch_size",
    "matmul_precision",
)
NO_SWEEP = ("mesh", "compare_ar", "grid", "repeats", "results", "name")


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, values)] of --grid=FLAG:V1,V2,...; a malformed axis or a flag run_decode lacks is a UsageError."""
    axes = []
    for spec in specs:
        name, sep, values = spec.partition(":")
        name = name.strip().removeprefix("--")
        if not sep or not name or not values.strip():
            raise cli.UsageError(f"--grid={spec} is not FLAG:V1,V2,...; e.g. --grid=k:1,2,4")
        if name in NO_SWEEP or name not in FLAGS:
            raise cli.UsageError(
                f"--grid={spec}: {name!r} is not a run_decode.py flag that a sweep can vary"
            )
        if name in (a for a, _ in axes):
            raise cli.UsageError(f"--grid names {name!r} twice; give its values in one --grid")
        axes.append((name, [v.strip() for v in values.split(",")]))
    if not axes:
        raise cli.UsageError("no --grid axis; pass e.g. --grid=k:1,2,4 before `--`")
    return axes


class Setting:
    """One point of the grid: its run_decode arguments, checked; then its drafter and compiled programs."""

    def __init__(self, values: dict, args: list[str]):
        self.values, self.args, self.error = values, args, ""
        self.plan = self.ar_key = self.key = None

    def check(self):
        """Parses and checks the arguments as run_decode does, before anything is loaded."""
        FLAGS.unparse_flags()
        FLAGS(["sweep", *self.args])
        for name in ("mesh", "compare_ar"):
            if FLAGS[name].present:
                raise cli.UsageError(f"--{name} is not supported by the sweep; drop it")
        if FLAGS.max_new_tokens < 1 or FLAGS.batch_size < 1:
            bad = "max_new_tokens" if FLAGS.max_new_tokens < 1 else "batch_size"
            raise cli.UsageError(f"--{bad}={FLAGS[bad].value} must be >= 1; pass a positive --{bad}")
        self.sampler = cli.sampler(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
        self.texts = rd.read_prompts()
        self.rule = acceptance.get(FLAGS.acceptance)
        self.plan = rd.drafter_plan()
        self.quant = rd.parse_quantization(FLAGS.quantize)
        self.spec = harness.generate_spec(
            FLAGS.max_new_tokens,
            self.sampler,
            eos_id=None,
            acceptance=self.rule,
        )
        self.flags = {name: FLAGS[name].value for name in FLAGS if name in rd_flags()}
        self.ar_key = tuple((n, _hashable(self.flags.get(n))) for n in AR_FLAGS)
        self.key = tuple((n, _hashable(v)) for n, v in sorted(self.flags.items()) if n != "seed")
        self.seed, self.batch_size = FLAGS.seed, FLAGS.batch_size
        self.model_key = (FLAGS.model, FLAGS.dtype)


def rd_flags() -> set[str]:
    """The names of run_decode.py's flags (those defined in its module, drafter settings included)."""
    return (
        {f.name for f in FLAGS.get_flags_for_module(sys.modules["run_decode"])}
        | rd.drafter_flags()
        | {"matmul_precision"}
    )


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


class Runner:
    """Compiled decode functions, one per distinct program; models loaded once per (model, dtype)."""

    def __init__(self):
        self.models, self.runs = {}, {}

    def model(self, s: Setting):
        if s.model_key not in self.models:
            self.models[s.model_key] = rd.load_model(*s.model_key)
        return self.models[s.model_key]

    def build(self, s: Setting, ar: bool):
        """(run(seed) decoding the setting's prompts once and returning the outputs, new tokens, drafter, spec);
        the programs do not depend on the seed."""
        key = ("ar", tuple(kv for kv in s.ar_key if kv[0] != "seed")) if ar else ("spec", s.key)
        if key not in self.runs:
            from specjax.decoding import compile_decode
            from specjax.models.quantize import quantize_loaded

            model = self.model(s)
            drafter, dparams = (None, None) if ar else rd.make_drafter(model, s.sampler, s.plan)
            spec = dataclasses.replace(s.spec, adaptive_k=rd.policy(s.plan, drafter))
            target = quantize_loaded(model, s.quant)
            prompts = harness.prompts(model.tokenizer, s.texts)
            groups = [prompts[i : i + s.batch_size] for i in range(0, len(prompts), s.batch_size)]
            bucket = 8 * -(-max(map(len, prompts)) // 8)
            compiled = {}
            for g in groups:  # one program per batch size (the last batch may be smaller)
                if len(g) not in compiled:
                    compiled[len(g)] = compile_decode(
                        target.cfg, target.graphdef, target.params, g, spec, drafter, dparams, bucket
                    )[0]

            def run(seed):
                return [
                    jax.block_until_ready(compiled[len(g)](g, seed=seed + i)) for i, g in enumerate(groups)
                ]

            self.runs[key] = (run, len(prompts) * spec.max_new_tokens, drafter, spec)
        return self.runs[key]


def settings_of(axes, passthrough: list[str]) -> list[Setting]:
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        values = dict(zip((name for name, _ in axes), combo))
        out.append(Setting(values, passthrough + [f"--{n}={v}" for n, v in values.items()]))
    return out


def sweep(axes, passthrough: list[str], repeats: int) -> tuple[list[dict], dict]:
    """(rows, {setting index or ('ar', key): outputs}) of the grid: every valid setting and its AR, in turns."""
    runner, settings = Runner(), settings_of(axes, passthrough)
    fns, built = {}, {}
    for i, s in enumerate(settings):
        try:
            s.check()
            ar = runner.build(s, ar=True)
            fns[("ar", s.ar_key)] = functools.partial(ar[0], s.seed)
            built[i] = ar if s.plan is None else runner.build(s, ar=False)
            fns[i] = functools.partial(built[i][0], s.seed)
        except Exception as err:  # a user's bad setting: its row carries the error, the others run
            if cli.debug():
                raise
            s.error = cli.describe(err)
            logging.warning("setting %s: %s", s.values, s.error)
    times = harness.interleaved_times(fns, repeats) if fns else {}
    outputs = {key: fn() for key, fn in fns.items()}
    rows, ar_rows = [], set()
    for i, s in enumerate(settings):
        if s.error:
            rows.append(row(axes, s.values, "-", error=s.error))
            continue
        ar_name, n_tokens = ("ar", s.ar_key), built[i][1]
        if ar_name not in ar_rows:  # AR once per sampler and length, before its first setting
            ar_rows.add(ar_name)
            ar_values = {n: (v if n in AR_FLAGS else "-") for n, v in s.values.items()}
            rows.append(
                row(axes, ar_values, "AR", tau=1.0, tok_s=n_tokens / np.median(times[ar_name]), same=1.0)
                | dict(ar_tok_s=n_tokens / np.median(times[ar_name]), speedup=1.0, predicted=1.0)
            )
        if s.plan is None:
            continue  # --drafter=none: the AR row above
        m = metrics.pooled([g.stats for g in outputs[i]])
        drafter, adaptive = built[i][2], built[i][3].adaptive_k
        chain = isinstance(drafter.shape, Chain) and adaptive is None
        iid = harness.tau_iid(m["acceptance_rate"], drafter.shape.depth) if chain else np.nan
        speedup = harness.ratio(times[ar_name], times[i])
        rows.append(
            row(
                axes,
                s.values,
                drafter_label(drafter, adaptive, s),
                tau=m["tau"],
                a=m["acceptance_rate"],
                alpha_i=harness.alphas(m),
            )
            | dict(tau_iid=iid, tok_s=n_tokens / np.median(times[i]))
            | dict(ar_tok_s=n_tokens / np.median(times[ar_name]), speedup=speedup)
            | dict(predicted=speedup * iid / m["tau"], same_as_ar=same(outputs[i], outputs[ar_name], s))
            | dict(error="")
        )
    return rows, outputs


def drafter_label(drafter, adaptive, s: Setting) -> str:
    return f"{s.plan[0].name} {(adaptive or drafter.shape).describe()}"


def row(
    axes, values: dict, method: str, tau=np.nan, a=np.nan, alpha_i="", tok_s=np.nan, same=np.nan, error=""
):
    out = {name: values[name] for name, _ in axes} | dict(method=method, tau=tau, a=a, alpha_i=alpha_i)
    out |= dict(tau_iid=np.nan, tok_s=tok_s, ar_tok_s=np.nan, speedup=np.nan, predicted=np.nan)
    return out | dict(same_as_ar=same, error=error)


def same(outputs, reference, s: Setting) -> float:
    """Fraction of prompts whose tokens equal AR's (greedy; nan when sampling: different draws)."""
    if s.sampler.temperature > 0:
        return np.nan
    ours = [t for g in outputs for t in np.asarray(g.tokens)]
    theirs = [t for g in reference for t in np.asarray(g.tokens)]
    return float(np.mean([np.array_equal(x, y) for x, y in zip(ours, theirs)]))


def plot(axes, rows: list[dict], writer: harness.Writer, name: str) -> None:
    """Speedup and tau against the first axis, one line per value of the other axes."""
    plt = harness.pyplot()
    first, others = axes[0][0], [n for n, _ in axes[1:]]
    order = {v: j for j, v in enumerate(axes[0][1])}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    lines = {}
    for r in rows:
        if r["method"] != "AR" and not r["error"]:
            lines.setdefault(tuple(r[o] for o in others), []).append(r)
    for label, mine in lines.items():
        mine.sort(key=lambda r: order[r[first]])
        x = [order[r[first]] for r in mine]
        text = ", ".join(f"{o}={v}" for o, v in zip(others, label)) or "speculative"
        left.plot(x, [r["speedup"] for r in mine], marker="o", label=text)
        right.plot(x, [r["tau"] for r in mine], marker="o", label=text)
    for ax, what in ((left, "speedup over AR"), (right, "tau")):
        ax.set_xticks(range(len(order)), list(order))
        ax.set(xlabel=first, ylabel=what)
    left.axhline(1.0, color="gray", linestyle=":")
    left.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    writer.figure(fig, name)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    passthrough = list(argv[1:])
    if passthrough[:1] == ["--"]:
        passthrough = passthrough[1:]
    axes = parse_grid(FLAGS.grid)
    repeats, folder, name = FLAGS.repeats, Path(FLAGS.results), FLAGS.name
    writer = harness.Writer(folder, matmul_precision=harness.precision())
    rows, _ = sweep(axes, passthrough, repeats)
    title = (
        f"Sweep over {' x '.join(n + ' in {' + ', '.join(v) + '}' for n, v in axes)} of run_decode.py "
        f"{' '.join(passthrough)}: medians of {repeats} rounds in turns; speedup = AR time / setting time within "
        "each round (median); predicted = Theorem 3.8's speedup for the run's a and K at the measured round cost "
        "(speedup x tau_iid / tau, chains only); same_as_ar = prompts whose greedy tokens equal AR's"
    )
    writer.table(name, rows, title)
    plot(axes, rows, writer, name)


def define_flags() -> None:
    """The sweep's own flags, defined when it runs (tests import this module beside other experiments)."""
    flags.DEFINE_multi_string("grid", [], "An axis FLAG:V1,V2,... of a run_decode.py flag (repeatable).")
    flags.DEFINE_integer("repeats", 3, "Timed rounds (each runs every setting and AR once, in turn).")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the table and plot.")
    flags.DEFINE_string("name", "sweep", "Name of the table and plot files.")


if __name__ == "__main__":
    define_flags()
    cli.run(main, positional=True)
