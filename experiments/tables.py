"""`make tables`: regenerates the paper-style tables and plots into results/ (markdown + CSV + PNG, each stamped
with the git commit, the date, the device and the command: `specjax.results`).

    .venv/bin/python -m experiments.tables [--quick] [--sections=leviathan,main,...] [--results=DIR]

Sections:
- leviathan: Leviathan et al. 2023, Theorem 3.8 (expected improvement factor over an (alpha, gamma, c) grid and
  the optimal gamma per (alpha, c), exact), a simulation of the i.i.d. acceptance process against it, and
  Figure 3 (optimal gamma and its improvement against alpha).
- main: the Spec-Bench-style table on stories260K: every drafter at T=0 and T=1 by prompt category (free story
  continuation, input-grounded retelling, long generation), tau, tokens/s, speedup over AR measured side by
  side, and for chains tau against the i.i.d. prediction (1 - a^(K+1)) / (1 - a) from the run's own a.
- memory_bound: the same methods on stories260K expanded to a memory-bound target (synthetic cost, real
  distribution; `experiments.bench_memory_bound` at batch 1): its verify-cost curve and every drafter's tau and
  speedup against the analytic prediction.
- heads: Medusa's Table 1 (per-head top-1 / top-5 accuracy) and per-depth acceptance alpha_i of EAGLE-2 vs EAGLE-3.
- sweeps: tau and speedup against K per chain drafter (the analytic optimum marked), against temperature,
  and against batch size (where the speedup crosses 1), with plots.
- peers: transformers' PyTorch generation on the same weights and prompts: plain, prompt lookup and assisted
  generation (assistant: stories260K's first layer) against specjax's AR, n-gram and draft-model decoding;
  tokens/s, tau and whether the greedy outputs equal specjax AR's.
- distill: distilled draft models (DistillSpec, `experiments.distill_table`): divergence x data source -> held-out
  alpha at T=0 and T=1 and tau at K=4, with the undistilled first-layer draft and a next-token-trained draft of the
  same shape as baselines (each row trained to --distill_steps in checkpoints/distill_table/, resumed if there);
  tau by prompt category; and the draft-model rows of the memory-bound target (`experiments.bench_memory_bound`).
- dflash: parallel (block) drafting: DFlash's block sizes, heads and trees against EAGLE-3 sequential and parallel
  and the distilled draft, tau by category at T=0/1 (`experiments.dflash_table`).
- dflash_speed: the same drafters' speed on the memory-bound target, and EAGLE-3 against the DFlash heads trained
  for greedy (T = 0) and sampled (T = 1) decoding (`experiments.dflash_table`; not in --quick).
- dflash_bound: the tau a block draft could reach: the committed DFlash heads (forward KL, TVD) against the forward
  KL's optimum for corpora sampled at T = 1, 0.5 and 0 and, at T = 1, the TVD objective's (`experiments.dflash_bound`;
  not in --quick).
- suffix: suffix decoding on rollouts (16 samples per prompt at T = 1, 0.7, 0.3) and repeated greedy tasks, with and
  without the outputs of earlier requests in its store, against n-gram (`experiments.suffix_table`).
- batch: AR, EAGLE-3's chain and the policy (adaptive K per round) at batch 1..16, batch after batch and with slots
  refilled, over 64 prompts of mixed lengths on the memory-bound target: tokens/s, latency, against the prediction
  (`experiments.batch_table`; not in --quick).
- systems: per drafter, compile time of the whole decode loop, time per round against one AR step, and the
  parameter bytes it adds to the target's (the verify-cost curve is in memory_bound_curve).
Every metric comes from `specjax.metrics` / `specjax.analysis`. stories260K fits in cache: its speedups measure
fixed overhead, its acceptance is real; speed is ranked on the memory-bound target.
--quick: one prompt per category, a few tokens, a few methods: every file in about two minutes (the test suite).
A full run took 41 minutes on a 2-core CPU before the batch section (which took 27.5 minutes for 32 prompts at
batches 1, 4 and 8; its default, 64 prompts at 1-16, has not been run whole).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from absl import flags, logging

from experiments import common, harness
from specjax import analysis, cli
from specjax.sampling import Sampler

SECTIONS = (
    "leviathan",
    "main",
    "memory_bound",
    "heads",
    "sweeps",
    "peers",
    "distill",
    "systems",
    "dflash",
    "dflash_speed",
    "dflash_bound",
    "suffix",
    "batch",
)
flags.DEFINE_bool("quick", False, "A run of about two minutes that writes every file (the test suite's).")
flags.DEFINE_list("sections", list(SECTIONS), f"Which of {SECTIONS} to regenerate.")
flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables and plots.")
flags.DEFINE_integer("repeats", 3, "Timed runs per decode (median).")
flags.DEFINE_integer("distill_steps", 300, "Training steps of each distilled-draft row (section distill).")
harness.define_precision_flag()
FLAGS = flags.FLAGS

# The literature's ordering (Spec-Bench, Vicuna-13B, greedy; EAGLE-2 = EAGLE's dynamic tree), fastest first.
LITERATURE = [
    "eagle3",
    "eagle (dynamic tree)",
    "eagle (static tree)",
    "medusa",
    "ngram",
    "draft_model",
    "lookahead",
]


# Prompts are padded to a multiple of 64 tokens: one compiled loop per category and drafter (`harness.decode_rows`).
BUCKET = 64


# --- Leviathan et al. 2023 ---------------------------------------------------------------------------------

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
COSTS = (0.01, 0.05, 0.1, 0.2, 0.5)
GAMMAS = tuple(range(1, 9))
SIMULATED = ((0.6, 3, 0.05), (0.7, 2, 0.2), (0.8, 5, 0.1), (0.9, 7, 0.01))  # (alpha, gamma, c)


def improvement_rows() -> list[dict]:
    """Theorem 3.8's expected improvement factor per (alpha, c) for gamma = 1..8, and the optimal gamma."""
    rows = []
    for a in ALPHAS:
        for c in COSTS:
            best = analysis.optimal_k(a, c)
            row = {"alpha": a, "c": c} | {f"gamma={g}": analysis.expected_speedup(a, g, c) for g in GAMMAS}
            rows.append(row | {"optimal_gamma": best, "improvement": analysis.expected_speedup(a, best, c)})
    return rows


def simulate_improvement(a: float, gamma: int, c: float, rounds: int, seed: int = 0) -> tuple[float, float]:
    """The improvement factor of the simulated i.i.d. process (each draft token accepted with probability a
    until the first rejection; a round emits the accepted tokens plus one and costs gamma c + 1), and the
    half-width of its 99% confidence interval."""
    accepted = np.random.default_rng(seed).random((rounds, gamma)) < a
    tokens = 1 + np.cumprod(accepted, axis=1).sum(axis=1)
    scale = gamma * c + 1
    return tokens.mean() / scale, 2.576 * tokens.std(ddof=1) / np.sqrt(rounds) / scale


def simulation_rows(rounds: int) -> list[dict]:
    rows = []
    for a, g, c in SIMULATED:
        exact = analysis.expected_speedup(a, g, c)
        sim, half = simulate_improvement(a, g, c, rounds)
        rows.append(
            dict(
                alpha=a,
                gamma=g,
                c=c,
                exact=exact,
                simulated=sim,
                ci99=half,
                within=abs(sim - exact) <= half,
            )
        )
    return rows


def leviathan(out: harness.Writer, quick: bool) -> None:
    plt = harness.pyplot()

    out.table(
        "leviathan_theorem38",
        improvement_rows(),
        "Leviathan et al. 2023, Theorem 3.8: expected improvement factor (1 - a^(g+1)) / ((1 - a)(g c + 1))",
        "`optimal_gamma` maximises it over gamma = 1..64 (`specjax.analysis.optimal_k`).",
    )
    rounds = 20_000 if quick else 400_000
    out.table(
        "leviathan_simulation",
        simulation_rows(rounds),
        f"Theorem 3.8 against a simulation of the i.i.d. acceptance process ({rounds} rounds, 99% interval)",
    )
    alphas = np.linspace(0.05, 0.99, 95)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for c in COSTS:
        best = [analysis.optimal_k(a, c) for a in alphas]
        left.plot(alphas, best, label=f"c = {c}")
        right.plot(
            alphas, [analysis.expected_speedup(a, g, c) for a, g in zip(alphas, best)], label=f"c = {c}"
        )
    left.set(xlabel="alpha", ylabel="optimal gamma", yscale="log", title="Optimal gamma (Figure 3)")
    right.set(xlabel="alpha", ylabel="improvement factor", title="Improvement at the optimal gamma")
    right.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.figure(fig, "leviathan_figure3")


# --- stories260K: the main table -----------------------------------------------------------------------------


def categories(tokenizer, quick: bool) -> dict:
    """{category: (prompts as token ids, new tokens per prompt)}."""
    n = 1 if quick else None
    new = 8 if quick else 128
    return {
        "free": ([tokenizer.encode(p) for p in harness.STORY_OPENINGS[:n]], new),
        "grounded": ([tokenizer.encode(p) for p in harness.GROUNDED[:n]], new),
        "long": (
            [tokenizer.encode(p) for p in harness.STORY_OPENINGS[: 1 if quick else 4]],
            2 * new if quick else 384,
        ),
    }


def methods(quick: bool, datastore=None) -> list[harness.Row]:
    """The main table's drafter rows (the retrieval row drafts from `datastore`, `common.story_datastore`)."""
    from specjax.drafters.retrieval import Retrieval

    reg = harness.registered
    rows = [reg("ngram", "chain K=4, n=1..3", "ngram", 4)]
    if quick:
        return rows
    retrieval = lambda *_: (Retrieval(4), Retrieval.params(datastore))
    return rows + [
        reg("eagle", "chain K=5", "eagle", 5),
        reg("draft_model", "stories260K's first layer, chain K=4", "draft_model", 4, draft_layers=1),
        reg("quantized", "int8, chain K=4", "quantized", 4, bits=8),
        reg(
            "layer_skip",
            f"layers {common.LAYER_SKIP}, chain K=4",
            "layer_skip",
            4,
            layers=common.LAYER_SKIP,
        ),
        harness.Row("retrieval", "65,536-token datastore, chain K=4", retrieval, 4),
        reg("lookahead", "window 4, 4 guesses", "lookahead", 4),
        reg("medusa", "chain K=4", "medusa", 4),
        reg("medusa", "tree balanced_2x3", "medusa", 3, "balanced_2x3"),
        reg("eagle (static tree)", "tree medusa60", "eagle", 4, "medusa60"),
        reg("eagle (dynamic tree)", "dynamic 8,6,48", "eagle", 6, "dynamic:8,6,48"),
        reg("eagle3", "chain K=6", "eagle3", 6),
        reg("eagle3", "dynamic 8,6,48", "eagle3", 6, "dynamic:8,6,48"),
    ]


def main_rows(target, quick: bool, repeats: int) -> list[dict]:
    datastore = None if quick else common.story_datastore(target, 65_536)
    rows = []
    for category, (prompts, n) in categories(target.tokenizer, quick).items():
        for t in (0.0,) if quick else (0.0, 1.0):
            spec = harness.generate_spec(n, Sampler(t), eos_id=None)
            drafters = [harness.AR, *methods(quick, datastore)]
            for m in harness.decode_rows(target, prompts, spec, drafters, repeats, BUCKET):
                metric, nan = m.metrics, float("nan")
                a = metric.get("acceptance_rate", nan)
                iid = (
                    nan
                    if m.stats is None or m.row.k is None
                    else analysis.expected_tokens_per_round(a, m.row.k)
                )
                rows.append(
                    dict(
                        method=m.row.method,
                        setting=m.row.setting,
                        category=category,
                        T=t,
                        tau=metric["tau"],
                    )
                    | dict(tok_s=len(prompts) * n / m.seconds, speedup=m.speedup, a=a, tau_iid=iid)
                    | dict(iid_error=iid / metric["tau"] - 1)
                )
                logging.info("%s", rows[-1])
    return rows


def ordering_notes(rows: list[dict]) -> str:
    """Our greedy ordering on free continuation next to Spec-Bench's."""
    ours = {}
    for r in rows:
        if r["category"] == "free" and r["T"] == 0 and r["method"] != "AR":
            ours[r["method"]] = max(ours.get(r["method"], 0), r["tau"])
    ranked = sorted(ours, key=ours.get, reverse=True)
    return (
        f"By tau (greedy, free continuation): {' > '.join(ranked)}.\n"
        f"Spec-Bench (Vicuna-13B, by speedup): {' > '.join(m for m in LITERATURE)}.\n"
        "Speedups on stories260K measure fixed overhead (the model sits in cache: a target pass costs about as "
        "much as a drafter call), so the ranking here is by tau; the memory-bound target's table ranks by speed."
    )


def main_table(out: harness.Writer, quick: bool, target) -> None:
    rows = main_rows(target, quick, 1 if quick else FLAGS.repeats)
    out.table(
        "main_stories260K",
        rows,
        "Every drafter on stories260K (batch 1, float32): tau, tokens/s and speedup over AR in the same run, by "
        "prompt category; chains: the i.i.d. prediction of tau from the run's acceptance rate a",
        ordering_notes(rows) + "\n\n" + iid_notes(rows),
    )


def iid_notes(rows: list[dict]) -> str:
    """How far the i.i.d. prediction of tau is from the measured tau over the chain rows."""
    errors = [r["iid_error"] for r in rows if not np.isnan(r["iid_error"])]
    if not errors:
        return ""
    worst = max(errors, key=abs)
    over = sum(abs(e) > 0.05 for e in errors)
    return (
        f"`iid_error` = tau_iid / tau - 1, where tau_iid = (1 - a^(K+1)) / (1 - a) from the run's pooled "
        f"acceptance rate a: over {len(errors)} chain rows it is at most {worst:+.1%} ({over} beyond 5%). A "
        "positive error means fewer tokens per round than an i.i.d. process with the same a gives: acceptance "
        "varies from round to round and along a draft, which the i.i.d. model ignores."
    )


def memory_bound(out: harness.Writer, quick: bool) -> None:
    import dataclasses

    from experiments import bench_memory_bound as bench

    plt = harness.pyplot()

    settings = bench.SMOKE if quick else bench.Settings(batches=(1,))
    tabs = bench.run(dataclasses.replace(settings, name="memory_bound"), out.folder)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    ks = tabs["k"]
    left.plot([r["K"] for r in ks], [r["speedup"] for r in ks], marker="o", label="measured")
    left.plot([r["K"] for r in ks], [r["predicted"] for r in ks], linestyle="--", label="predicted")
    best = [r for r in ks if r["analytic_optimum"]]
    left.scatter(
        [r["K"] for r in best], [r["speedup"] for r in best], s=140, facecolors="none", edgecolors="k"
    )
    left.set(xlabel="K", ylabel="speedup over AR", title="EAGLE-3 chain, memory-bound (circled: optimum)")
    left.legend(fontsize=7)
    batches = tabs["batch"]
    right.plot([r["batch"] for r in batches], [r["speedup"] for r in batches], marker="o", label="measured")
    right.plot(
        [r["batch"] for r in batches], [r["predicted"] for r in batches], linestyle="--", label="predicted"
    )
    right.axhline(1.0, color="gray", linestyle=":")
    right.set(xlabel="batch", ylabel="speedup over AR", xscale="log", title="EAGLE-3 chain against batch")
    right.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.figure(fig, "memory_bound_sweeps")


# --- heads --------------------------------------------------------------------------------------------------


def head_tables(out: harness.Writer, quick: bool, target) -> None:
    import jax.numpy as jnp

    from specjax import heads
    from specjax.decoding import generate

    cfg = target.cfg
    prompts = [target.tokenizer.encode(p) for p in harness.HEAD_PROMPTS[: 2 if quick else None]]
    n = 16 if quick else 128
    greedy = generate(cfg, target.graphdef, target.params, prompts, harness.generate_spec(n, eos_id=None))
    width = min(map(len, prompts)) + n
    sequences = jnp.asarray(
        [(p + np.asarray(greedy.tokens[i]).tolist())[:width] for i, p in enumerate(prompts)]
    )
    meta, graphdef, params = heads.load_heads(heads.COMMITTED / "stories260K_medusa", cfg, target.params)
    out.table(
        "heads_medusa_accuracy",
        common.medusa_accuracy(target, meta, graphdef, params, sequences),
        f"Medusa heads on stories260K (Medusa's Table 1 layout): accuracy on the greedy continuations of "
        f"{len(prompts)} prompts",
    )
    rows = []
    shapes = (("chain K=6", None), ("dynamic 8,6,48", "dynamic:8,6,48"))
    for method in ("eagle", "eagle3"):
        for setting, tree in shapes[:1] if quick else shapes:
            row = harness.registered(
                "EAGLE-3" if method == "eagle3" else "EAGLE-2", setting, method, 6, tree
            )
            for t in (0.0,) if quick else (0.0, 1.0):
                spec = harness.generate_spec(n, Sampler(t), eos_id=None)
                m = next(harness.decode_rows(target, prompts, spec, [row], 0, BUCKET)).metrics
                alphas = {f"alpha_{i + 1}": float(a) for i, a in enumerate(m["alpha"])}
                rows.append(dict(head=row.method, draft=setting, T=t, tau=m["tau"]) | alphas)
    out.table(
        "heads_eagle_acceptance",
        rows,
        f"EAGLE-2 vs EAGLE-3 heads on stories260K: acceptance alpha_i of draft depth i (given the depths before "
        f"it) and tau, {len(prompts)} prompts x {n} tokens",
    )


# --- sweeps -------------------------------------------------------------------------------------------------


def sweeps(out: harness.Writer, quick: bool, target) -> None:
    plt = harness.pyplot()

    model = (target.cfg, target.graphdef, target.params)
    prompts = [target.tokenizer.encode(p) for p in harness.STORY_OPENINGS[: 1 if quick else 5]]
    n, repeats = (8, 1) if quick else (128, FLAGS.repeats)
    ks = (1, 2) if quick else tuple(range(1, 9))
    drafters = ("ngram",) if quick else ("ngram", "medusa", "eagle", "eagle3")
    greedy = harness.generate_spec(n, Sampler(0.0), eos_id=None)
    chains = [  # the committed Medusa head has 4 heads
        harness.registered(name, f"chain K={k}", name, k)
        for name in drafters
        for k in ks
        if name != "medusa" or k <= 4
    ]
    k_rows = []
    for m in harness.decode_rows(target, prompts, greedy, chains, repeats, BUCKET):
        metric = m.metrics
        k_rows.append(
            dict(
                drafter=m.row.method,
                K=m.row.k,
                tau=metric["tau"],
                a=metric["acceptance_rate"],
                speedup=m.speedup,
            )
        )
    for name in drafters:  # the analytic optimum from each drafter's measured a and its measured K=1 cost
        mine = [r for r in k_rows if r["drafter"] == name]
        one = mine[0]
        c = max(one["tau"] / one["speedup"] - 1, 1e-3)  # speedup(K=1) = tau / (c + 1)
        best = analysis.optimal_k(float(np.mean([r["a"] for r in mine])), c, k_max=max(ks))
        for r in mine:
            r["analytic_optimum"] = r["K"] == best
    out.table(
        "sweep_k",
        k_rows,
        f"Chain length K on stories260K (greedy, {len(prompts)} prompts x {n} tokens): tau, acceptance rate a, "
        "speedup over AR; analytic_optimum: Theorem 3.8's optimal K for the drafter's mean a and the draft cost c "
        "implied by its K=1 speedup",
    )
    temps = (0.0, 1.0) if quick else (0.0, 0.3, 0.6, 1.0, 1.3)
    t_rows = []
    for name in drafters:
        for t in temps:
            spec = harness.generate_spec(n, Sampler(t), eos_id=None)
            row = harness.registered(name, "chain K=4", name, 4)
            t_rows.append(
                dict(
                    drafter=name,
                    T=t,
                    tau=next(harness.decode_rows(target, prompts, spec, [row], 0, BUCKET)).metrics["tau"],
                )
            )
    title = f"Temperature on stories260K (chain K=4, {len(prompts)} prompts x {n} tokens): tau"
    out.table("sweep_temperature", t_rows, title)
    batches = (1, 2) if quick else (1, 2, 4, 8, 16)
    b_rows = []
    for b in batches:
        batch = (prompts * b)[:b]
        run_ar = lambda: harness.median_time(lambda: _decode(model, batch, greedy), repeats)
        ar = run_ar()
        for name in drafters[-1:]:
            drafter, dparams = harness.registered(name, "chain K=4", name, 4).build(target, Sampler(0.0))
            spec = harness.median_time(lambda: _decode(model, batch, greedy, drafter, dparams), repeats)
            b_rows.append(
                dict(drafter=name, batch=b, ar_tok_s=b * n / ar, spec_tok_s=b * n / spec, speedup=ar / spec)
            )
    out.table(
        "sweep_batch",
        b_rows,
        f"Batch size on stories260K (greedy, chain K=4, {n} tokens a row): speedup over AR at the same batch",
        "The speedup shrinks as the batch grows (a batched target pass is no longer free); it crosses 1 where "
        "speedup < 1.",
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name in drafters:
        mine = [r for r in k_rows if r["drafter"] == name]
        left.plot([r["K"] for r in mine], [r["tau"] for r in mine], marker="o", label=name)
        best = [r for r in mine if r["analytic_optimum"]]
        left.scatter(
            [r["K"] for r in best], [r["tau"] for r in best], s=120, facecolors="none", edgecolors="k"
        )
    left.set(xlabel="K", ylabel="tau", title="tau against K (circled: analytic optimum)")
    left.legend(fontsize=7)
    right.plot([r["batch"] for r in b_rows], [r["speedup"] for r in b_rows], marker="o")
    right.axhline(1.0, color="gray", linestyle="--")
    right.set(
        xlabel="batch", ylabel="speedup over AR", xscale="log", title=f"{drafters[-1]} K=4 against batch"
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.figure(fig, "sweeps")


# --- peers --------------------------------------------------------------------------------------------------


def peers(out: harness.Writer, quick: bool, target) -> None:
    import torch

    transformers = common.quiet_transformers()
    torch.set_num_threads(1)  # on 2 shared cores, 2 threads ran stories260K's generate ~10x slower
    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(target.path).eval()
    assistant.config.num_hidden_layers, assistant.model.layers = 1, assistant.model.layers[:1]
    texts = (
        harness.STORY_OPENINGS[:1] + harness.GROUNDED[:1]
        if quick
        else harness.STORY_OPENINGS[:5] + harness.GROUNDED[:5]
    )
    prompts = [target.tokenizer.encode(t) for t in texts]
    n, repeats = (8, 1) if quick else (128, FLAGS.repeats)
    ours = [  # specjax's rows, then transformers' generate arguments of the same methods
        harness.AR,
        harness.registered("n-gram K=4, n=1..3", "-", "ngram", 4),
        harness.registered("draft model (first layer) K=4", "-", "draft_model", 4, draft_layers=1),
    ]
    assisted = dict(
        assistant_model=assistant, num_assistant_tokens=4, num_assistant_tokens_schedule="constant"
    )
    assisted |= dict(assistant_confidence_threshold=0.0)
    theirs = [{}, dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3), assisted]
    rows = []
    for t in (0.0,) if quick else (0.0, 1.0):
        spec = harness.generate_spec(n, Sampler(t), eos_id=None)
        reference = None  # specjax AR's tokens (its row comes first)
        for m, hf_kwargs in zip(harness.decode_rows(target, prompts, spec, ours, repeats, BUCKET), theirs):
            method, reference = m.row.method, reference or m.tokens
            rows.append(
                dict(peer="specjax", method=method, T=t, tok_s=len(prompts) * n / m.seconds)
                | dict(tau=m.metrics["tau"], same_as_specjax_ar=_same(m.tokens, reference, t))
            )
            tok_s, hf_tau, outputs = common.hf_generate(hf, prompts, n, t, repeats, **hf_kwargs)
            rows.append(
                dict(
                    peer="transformers",
                    method=method,
                    T=t,
                    tok_s=tok_s,
                    tau=hf_tau,
                    same_as_specjax_ar=_same(outputs, reference, t),
                )
            )
            logging.info("%s", rows[-1])
    out.table(
        "peers",
        rows,
        f"specjax against transformers {transformers.__version__} (PyTorch {torch.__version__}, 1 thread) on the same "
        f"stories260K weights, {len(prompts)} prompts (half free, half grounded) x {n} tokens, batch 1",
        "transformers' tau = new tokens / target forward passes (its first pass reads the prompt and verifies a draft; "
        "specjax's prefill emits the first token only). same_as_specjax_ar: the fraction of prompts whose greedy "
        "output equals specjax AR's (sampled outputs are not comparable across frameworks).",
    )


# --- distilled drafts ---------------------------------------------------------------------------------------


def distill_tables(out: harness.Writer, quick: bool, target) -> None:
    import dataclasses

    from experiments import bench_memory_bound as bench
    from experiments import distill_table as dt

    model = (target.cfg, target.graphdef, target.params)
    drafts = dt.baselines(model)
    if not quick:
        root = Path("checkpoints/distill_table").absolute()
        drafts |= dt.trained(model, FLAGS.distill_steps, root, list(dt.ROWS))
    held = (
        "configs/draft.py's smoke corpus" if quick else "the 64 target samples configs/draft.py holds out"
    )
    out.table(
        "distill_divergence",
        dt.divergence_rows(model, target.tokenizer, drafts, quick),
        f"Distilled 2-layer drafts of stories260K by divergence and data source: alpha on {held} (T=0: argmax "
        "agreement, T=1: mean 1 - TVD) and tau of the K=4 chain",
        "Data: `samples` = the target's own samples, `text` = a fixed corpus of stories (experiments/data/"
        "stories.txt), `on-policy 0.5` = half of each batch the draft's own continuations, scored by the target.",
    )
    rows = []
    names = ("forward_kl / samples (committed)",) + (
        () if quick else (dt.UNDISTILLED, "next_token / samples")
    )
    for category, (prompts, n) in categories(target.tokenizer, quick).items():
        for t in (0.0,) if quick else (0.0, 1.0):
            for name in names:
                rows.append(
                    dict(
                        draft=name,
                        category=category,
                        T=t,
                        tau=dt.tau(model, drafts[name][0], prompts, n, t),
                    )
                )
    out.table(
        "distill_categories",
        rows,
        f"Draft models of stories260K by prompt category: tau of the K={dt.K} chain (as the main table's prompts)",
    )
    if quick:  # the memory-bound rows need minutes; `memory_bound` smoke-tests the distilled draft's row
        return
    settings = bench.Settings(
        batches=(1,),
        kinds=("draft model", "distilled draft", "quantized"),
        categories=(),
        sweeps=False,
        name="distill_memory_bound",
    )
    bench.run(dataclasses.replace(settings, repeats=FLAGS.repeats), out.folder)


# --- parallel drafting ---------------------------------------------------------------------------------------


def dflash(out: harness.Writer, quick: bool, target) -> None:
    from experiments import dflash_table

    dflash_table.tables(out, quick, target, categories(target.tokenizer, quick))


def dflash_speed(out: harness.Writer, quick: bool, target) -> None:
    if quick:  # minutes: `memory_bound` smoke-tests the benchmark
        return
    from experiments import dflash_table

    dflash_table.speed(out, FLAGS.repeats)


def dflash_bound(out: harness.Writer, quick: bool, target) -> None:
    if quick:  # minutes of sampling: tests/test_dflash_bound.py checks it on a few contexts
        return
    from experiments import dflash_bound as bound
    from experiments.dflash_table import HEADS, TVD_HEAD

    heads = [h for h in (HEADS / "stories260K_dflash", TVD_HEAD) if h.exists()]
    out.table("dflash_bound", bound.rows(target, heads), bound.TITLE)


def suffix(out: harness.Writer, quick: bool, target) -> None:
    from experiments import suffix_table

    suffix_table.tables(out, quick, target)


# --- batches ------------------------------------------------------------------------------------------------


def batch(out: harness.Writer, quick: bool) -> None:
    if quick:  # minutes of compiling: tests/test_refill.py checks its runs and AR's predicted rounds
        return
    from experiments import batch_table

    batch_table.table(out, batch_table.Settings(repeats=FLAGS.repeats))


# --- systems ------------------------------------------------------------------------------------------------


def systems(out: harness.Writer, quick: bool, target) -> None:
    import jax

    from specjax.decoding import compile_decode

    model = (target.cfg, target.graphdef, target.params)
    prompt = target.tokenizer.encode(harness.STORY_OPENINGS[0])
    n, repeats = (8, 1) if quick else (128, FLAGS.repeats)
    spec = harness.generate_spec(n, Sampler(0.0), eos_id=None)
    datastore = None if quick else common.story_datastore(target, 65_536)
    shared = {id(x) for x in jax.tree.leaves(target.params)}
    rows, ar_step = [], None
    for row in [harness.AR, *methods(quick, datastore)]:
        drafter, dparams = (None, None) if row.build is None else row.build(target, Sampler(0.0))
        run, compile_s = compile_decode(*model, [prompt], spec, drafter, dparams)
        seconds = harness.median_time(lambda run=run: jax.block_until_ready(run([prompt])), repeats)
        rounds = n if drafter is None else int(jax.device_get(run([prompt]).stats.rounds))
        round_ms = 1e3 * seconds / max(rounds, 1)
        ar_step = ar_step or round_ms
        extra = sum(
            x.nbytes for x in jax.tree.leaves(dparams) if hasattr(x, "nbytes") and id(x) not in shared
        )
        kv, state = _loop_memory(model, [prompt], spec, drafter, dparams)
        rows.append(
            dict(
                method=row.method,
                setting=row.setting,
                compile_s=compile_s,
                rounds=rounds,
                round_ms=round_ms,
            )
            | dict(round_over_ar_step=round_ms / ar_step, extra_param_MB=extra / 1e6)
            | dict(target_kv_KB=kv / 1024, draft_state_KB=state / 1024)
        )
    out.table(
        "systems",
        rows,
        f"Systems on stories260K (greedy, batch 1, {n} tokens, float32): compile time of the decode loop, time per "
        "round (one target pass plus the drafter) against one AR step, parameter bytes beyond the target's, the "
        "target's KV cache (its slots include one round's verification slots) and the drafter's own state (its "
        "KV cache, n-gram pool, features)",
        "Loop efficiency (model calls / measured round time) is measured where it means something, on the "
        "memory-bound target (`memory_bound_decode`, column loop_eff): on stories260K every call is fixed "
        "overhead.",
    )


def _loop_memory(model, prompts, spec, drafter, dparams) -> tuple[int, int]:
    """Bytes of the decode loop's target KV cache and of the drafter's state, from the loop's abstract start
    (no compile, no allocation)."""
    import jax

    from specjax.decoding.jobs import job_key, prepare, prepare_speculative
    from specjax.decoding.speculative import start
    from specjax.models.llama import init_cache

    cfg, graphdef, params = model
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    if drafter is None:
        _, _, full = prepare(cfg, prompts, spec)
        return nbytes(jax.eval_shape(lambda: init_cache(cfg, len(prompts), full.cache_size))), 0
    tokens, lengths, full = prepare_speculative(cfg, drafter, prompts, spec)
    loop = jax.eval_shape(
        lambda p, dp: start(cfg, graphdef, p, drafter, dp, tokens, lengths, job_key(0), full)[0],
        params,
        dparams,
    )
    return nbytes(loop.cache), nbytes(loop.drafter_state)


def _same(outputs, reference, temperature: float):
    if temperature > 0:
        return float("nan")
    return float(np.mean([list(o)[: len(r)] == r for o, r in zip(outputs, reference)]))


def _decode(model, prompts, spec, drafter=None, dparams=None):
    import jax

    from specjax.decoding import generate, speculative_generate

    if drafter is None:
        return jax.block_until_ready(generate(*model, prompts, spec).tokens)
    return jax.block_until_ready(speculative_generate(*model, drafter, dparams, prompts, spec).tokens)


def main(argv):
    del argv
    from specjax.models.loading import load_model

    logging.set_verbosity(logging.WARNING)
    unknown = sorted(set(FLAGS.sections) - set(SECTIONS))
    if unknown:
        cli.fail(f"unknown --sections {unknown}; choose from {list(SECTIONS)}")
    out = harness.Writer(Path(FLAGS.results), echo=False)
    target = load_model()
    run = {
        "leviathan": lambda: leviathan(out, FLAGS.quick),
        "memory_bound": lambda: memory_bound(out, FLAGS.quick),
    }
    run |= {
        name: (lambda f=f: f(out, FLAGS.quick, target))
        for name, f in (
            ("main", main_table),
            ("heads", head_tables),
            ("sweeps", sweeps),
            ("peers", peers),
            ("distill", distill_tables),
            ("systems", systems),
            ("dflash", dflash),
            ("dflash_speed", dflash_speed),
            ("dflash_bound", dflash_bound),
            ("suffix", suffix),
        )
    }
    run["batch"] = lambda: batch(out, FLAGS.quick)
    began = time.perf_counter()
    for i, name in enumerate(FLAGS.sections, 1):
        print(f"[{i}/{len(FLAGS.sections)}] {name} ...", flush=True)
        start = time.perf_counter()
        run[name]()
        done = time.perf_counter()
        print(
            f"[{i}/{len(FLAGS.sections)}] {name}: {done - start:.0f} s ({done - began:.0f} s in all)",
            flush=True,
        )


if __name__ == "__main__":
    cli.run(main)
