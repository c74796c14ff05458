"""Verification rules on stories260K at T = 0.6, 1.0, 1.3 for the draft model, EAGLE and Medusa: on chains,
token-wise rejection sampling vs block verification (both lossless) and typical acceptance (LOSSY,
`typical_lossy`); on a static tree (`--tree`), token-wise tree sampling vs traversal verification (both lossless).

    .venv/bin/python -m experiments.bench_verification [--k=4] [--new_tokens=128] [--repeats=3] [--smoke]
    .venv/bin/python -m experiments.bench_verification --drafters= --adaptive_k=1,2,4,8  # adaptive K only
    .venv/bin/python -m experiments.bench_verification --drafters= --adaptive_target=expanded --prompts=4 \
        --new_tokens=64 --temperatures=0.6,1.0  # adaptive K on the memory-bound target
    .venv/bin/python -m experiments.bench_verification --drafters= --adaptive_costs=1,1.21,1.35,1.57 \
        --temperatures=0,0.6,1.0  # its choices at the expansion's round costs, on stories260K's acceptance

Drafters come from the registry (the draft model: the target truncated to 3 layers, see SETTINGS; EAGLE and
Medusa: the committed heads in heads/). Per drafter, temperature and rule:
- tau: tokens per target pass measured by decoding the prompts (batch 1 each; `specjax.metrics.summarize`),
- E[tau]: the rule's expected tokens per pass on the same drafts: drafts proposed at contexts taken along the
  token-wise (exact) samples, each rule's expected accepted count given each draft, plus one: exact for chains
  (token-wise: sum_i prod_{j<=i} min(1, p/q); block: sum_i i h_i prod_{j>i} (1 - h_j); typical: deterministic),
  the mean of `--tree_draws` runs of the rule per draft for trees. Same drafts for every rule: no drafting noise
  in the comparison (and none from acceptance for chains),
- tok_s and speedup: new tokens / summed median decode time and the speedup over AR (each rule timed in turns with
  AR per prompt, `harness.decode_rows`), and AR's tokens/s in its own row,
- tv_first: the exact total-variation distance, averaged over the same contexts, between the distribution of a
  round's first emitted token and the target's (`TypicalLossy.first_token_law`; 0 for the lossless rules).
AR's row (tokens/s) is measured once per temperature. A second table (`bench_adaptive`) compares adaptive K with
each fixed K and the best of them, chosen afterwards, on stories260K or (`--adaptive_target=expanded`) on its
memory-bound expansion of `experiments.bench_memory_bound`, where a round's cost is the target's. Writes
results/bench_verification.{md,csv} and results/bench_verification_adaptive[_expanded][_given_costs].{md,csv}
(--smoke: *_smoke, Medusa at T=1 on 2 short prompts, a chain and a small tree untimed, adaptive K in {1, 2}).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from experiments import harness
from specjax import acceptance, cli
from specjax.acceptance.block import block_weights
from specjax.acceptance.rejection import acceptance_probs
from specjax.decoding import AdaptiveK, compile_decode, prepare_speculative
from specjax.decoding.prefill import prefill
from specjax.decoding.speculative import calibrate
from specjax.drafting import registry
from specjax.drafting.trees import parse_tree
from specjax.metrics import summarize
from specjax.models.llama import forward
from specjax.models.loading import load_model
from specjax.sampling import Sampler

flags.DEFINE_integer("k", 4, "Draft tokens per round (Medusa's committed heads draft at most 4).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("repeats", 3, "Timed runs of each decode per prompt (median).")
flags.DEFINE_integer("contexts_every", 8, "Take a context for E[tau] every this many sampled tokens.")
flags.DEFINE_list("temperatures", ["0.6", "1.0", "1.3"], "Sampling temperatures (> 0).")
flags.DEFINE_list("drafters", ["draft_model", "eagle", "medusa"], "Registered drafters.")
flags.DEFINE_list("rules", ["tokenwise", "block", "typical_lossy"], "Acceptance rules on chains.")
flags.DEFINE_list("tree_rules", ["tokenwise", "traversal"], "Acceptance rules on the tree.")
flags.DEFINE_string("tree", "balanced_2x3", "The static tree (see run_decode.py --tree); '' = chains only.")
flags.DEFINE_integer("tree_draws", 64, "Runs of a tree rule per draft for E[tau].")
flags.DEFINE_list(
    "adaptive_k", ["1", "2", "4", "8"], "Adaptive K's draft lengths; empty: no adaptive table."
)
flags.DEFINE_list(
    "adaptive_drafters",
    ["draft_model", "eagle"],
    "Drafters of the adaptive-K table (Medusa's committed heads draft at most 4 tokens); --drafters= "
    "(empty) leaves only this table.",
)
flags.DEFINE_enum(
    "adaptive_target",
    "stories260K",
    ["stories260K", "expanded"],
    "Target of the adaptive-K table: stories260K (fixed overhead dominates its rounds) or its memory-bound "
    "expansion (drafters draft_model and eagle).",
)
flags.DEFINE_list(
    "adaptive_costs",
    [],
    "Adaptive K's round costs per K (relative); empty: timed before the loop. Given costs also price every row's "
    "rounds (modeled_vs_best), e.g. 1,1.21,1.35,1.57 as timed on the memory-bound target: the policy's choices "
    "judged without the machine's noise.",
)
flags.DEFINE_integer("prompts", None, "Use the first this many prompts (default: all 10).")
flags.DEFINE_integer(
    "seeds", 1, "Adaptive-K table: seeds per prompt at T > 0 (more samples, a tighter bootstrap interval)."
)
flags.DEFINE_bool(
    "smoke",
    False,
    "A quick run: Medusa at T=1, 2 prompts, 16 tokens, the rules untimed, adaptive K timed once, no AR row.",
)
flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables.")
harness.define_precision_flag()
FLAGS = flags.FLAGS

# Drafter settings beside the registry's defaults: the default draft model (the target truncated to 1 of its 5
# layers) is accepted about 1% of the time on stories260K, too rarely to compare rules; 3 layers are accepted.
SETTINGS = {"draft_model": {"draft_layers": 3}}

PROMPTS = harness.STORY_OPENINGS


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "drafter", "cache_size"))
def round_inputs(cfg, graphdef, params, drafter, dparams, tokens_BP, lengths_B, key, cache_size):
    """One round's draft at each context `tokens_BP[b, :lengths_B[b]]` (its last token pending, as in the loop)
    and the target's logits over the pending token and the draft (the verification pass): (Draft, logits)."""
    _, cache, feats = prefill(cfg, graphdef, params, tokens_BP, lengths_B - 1, cache_size)
    state = drafter.init(dparams, tokens_BP, lengths_B - 1, cache_size, feats)
    draft, _ = drafter.propose(dparams, state, tokens_BP, lengths_B, key)
    pending = jnp.take_along_axis(tokens_BP, (lengths_B - 1)[:, None], axis=1)
    tokens = jnp.concatenate([pending, draft.tokens], axis=1)
    layout = draft.layout
    logits, _, _ = forward(graphdef, params, tokens, layout.positions(cache.length), cache, layout.mask)
    return draft, logits


def draft_probs(draft, vocab: int):
    """The draft distributions [B, K|N, V] (one-hot for deterministic drafts)."""
    if draft.q_probs is not None:
        return draft.q_probs
    return jax.nn.one_hot(draft.tokens, vocab, dtype=jnp.float32)


def expected_accepted(rule, sampler, draft, logits, key) -> np.ndarray:
    """The rule's expected number of accepted draft tokens given each draft [B]: exact for chains, the mean of
    `--tree_draws` runs for trees."""
    if draft.layout.__class__.__name__ == "TreeLayout":
        keys = jax.random.split(key, FLAGS.tree_draws)
        run = lambda k: rule.tree(
            k, sampler, draft.layout, draft.tokens, draft.q_probs, logits, draft.without_replacement
        )[0]
        return np.asarray(jax.jit(jax.vmap(run))(keys), np.float64).mean(0)
    q, p = draft_probs(draft, logits.shape[-1]), sampler.probs(logits)
    if rule.name == "tokenwise":
        return np.asarray(jnp.sum(jnp.cumprod(acceptance_probs(draft.tokens, q, p), axis=1), axis=1))
    if rule.name == "block":
        h = np.asarray(block_weights(draft.tokens, q, p)[0], np.float64)  # [B, K]
        later_fail = np.cumprod((1 - h)[:, ::-1], axis=1)[:, ::-1]  # prod_{j >= i} (1 - h_j)
        after = np.concatenate([later_fail[:, 1:], np.ones_like(h[:, :1])], axis=1)  # prod_{j > i}
        return (np.arange(1, h.shape[1] + 1) * h * after).sum(1)
    return np.asarray(rule.chain(None, sampler, draft.tokens, q, logits)[0], np.float64)  # deterministic


def first_token_tv(rule, sampler, draft, logits) -> np.ndarray:
    """Total variation between the law of a round's first emitted token and the target's p there [B] (chains)."""
    if rule.lossless:
        return np.zeros(logits.shape[0])
    law = rule.first_token_law(sampler, draft_probs(draft, logits.shape[-1])[:, 0], logits[:, 0])
    return 0.5 * np.asarray(jnp.sum(jnp.abs(law - sampler.probs(logits[:, 0])), axis=-1))


def contexts_from(prompts, samples, every: int):
    """Right-padded contexts prompt + the first j sampled tokens, j = 1, 1 + every, ... ([C, W], lengths [C])."""
    ctx = [p + s[:j] for p, s in zip(prompts, samples) for j in range(1, len(s), every)]
    width = -(-max(map(len, ctx)) // 8) * 8
    tokens = np.zeros((len(ctx), width), np.int32)
    for row, c in enumerate(ctx):
        tokens[row, : len(c)] = c
    return tokens, np.array([len(c) for c in ctx], np.int32)


def bench(target, prompts, name, temperature, rules, tree, with_ar: bool) -> list[dict]:
    """Rows for one drafter, temperature and draft shape (`tree` None: a chain of --k)."""
    cfg, graphdef, params = target.cfg, target.graphdef, target.params
    sampler, n = Sampler(temperature), FLAGS.new_tokens
    k = FLAGS.k if tree is None else tree.depth
    entry = registry.get(name)
    drafter, dparams = entry.build(target, entry.settings(**SETTINGS.get(name, {})), k, tree, sampler)
    spec = harness.generate_spec(n, sampler, eos_id=None)
    build = lambda *_: (drafter, dparams)
    rows = [harness.Row(rule.name, build=build, spec=dict(acceptance=rule)) for rule in rules]
    bucket = -(-max(map(len, prompts)) // 8) * 8  # one program per rule for every prompt
    repeats = (
        0 if FLAGS.smoke else FLAGS.repeats
    )  # the smoke run's rules untimed (the timing is the harness's)
    measured = harness.decode_rows(target, prompts, spec, rows, repeats, bucket)
    decoded = {m.row.method: m for m in measured}
    samples = decoded["tokenwise"].tokens
    tokens, lengths = contexts_from(prompts, samples, FLAGS.contexts_every)
    cache_size = -(-(tokens.shape[1] + drafter.shape.cache_slots) // 64) * 64
    draft, logits = round_inputs(
        cfg, graphdef, params, drafter, dparams, tokens, lengths, jax.random.key(0), cache_size
    )
    rows = []
    for rule in rules:
        m = decoded[rule.name].metrics
        accepted = expected_accepted(rule, sampler, draft, logits, jax.random.key(1))
        rows.append(
            dict(
                drafter=name,
                shape=drafter.shape.describe(),
                T=temperature,
                rule=rule.name,
                tau=m["tau"],
                e_tau_same_drafts=1.0 + float(np.mean(accepted)),
                draft_eff=m["draft_efficiency"],
                tok_s=len(prompts) * n / decoded[rule.name].seconds,
                speedup=decoded[rule.name].speedup,
                tv_first=float(np.mean(first_token_tv(rule, sampler, draft, logits))),
                contexts=int(tokens.shape[0]),
            )
        )
    if with_ar:
        ar = dict(drafter="none (AR)", shape="-", T=temperature, rule="-", tau=1.0, e_tau_same_drafts=1.0)
        ar_s = decoded["tokenwise"].ar_seconds
        rows.append(
            ar
            | dict(draft_eff=np.nan, tok_s=len(prompts) * n / ar_s, speedup=1.0, tv_first=0.0, contexts=0)
        )
    return rows


def bench_adaptive(target, prompts, name, temperature, ks, build) -> list[dict]:
    """Rows of each fixed K in `ks` and of adaptive K over them (chains, token-wise rule) for the drafter
    `build(name, k_max, sampler) -> (drafter, params)` on `target` (cfg, graphdef, params). Adaptive K's round
    costs are --adaptive_costs, else calibrated on the first prompt before compiling (`costs`, relative to K = 1's).
    Each prompt is decoded with --seeds seeds at T > 0 (a sample: one prompt and seed). vs_best is the median over
    repeats of the best fixed K's summed decode time over this row's (the best chosen afterwards by median
    tokens/s), each repeat timing the runs in turn per sample. modeled_vs_best compares tokens per modeled time,
    every round priced at adaptive K's cost of its K: the choice of K without the machine's noise or the loop's
    own overhead. Each ratio comes with a 95% bootstrap interval over the samples (`bootstrap_vs_best`): at
    T > 0 the rows' tau differ by sampling noise as well as by their choice of K."""
    cfg, graphdef, params = target
    sampler, n = Sampler(temperature), FLAGS.new_tokens
    drafter, dparams = build(name, ks[-1], sampler)
    bucket = -(-max(map(len, prompts)) // 8) * 8
    spec = harness.generate_spec(n, sampler, eos_id=None)
    given = tuple(map(float, FLAGS.adaptive_costs)) or None
    job = dataclasses.replace(spec, adaptive_k=AdaptiveK(ks, given))
    tokens, lengths, job = prepare_speculative(cfg, drafter, prompts[:1], job, bucket)
    adaptive = calibrate(cfg, graphdef, params, drafter, dparams, tokens, lengths, job).adaptive_k
    jobs = {f"K={k}": (drafter.with_k(k), spec) for k in ks}
    jobs[adaptive.describe()] = (drafter, dataclasses.replace(spec, adaptive_k=adaptive))
    runs = {
        key: compile_decode(cfg, graphdef, params, prompts[:1], job_spec, job_drafter, dparams, bucket)[0]
        for key, (job_drafter, job_spec) in jobs.items()
    }
    seeds = FLAGS.seeds if temperature > 0 else 1  # greedy decoding draws nothing
    samples = [(p, i * seeds + j) for i, p in enumerate(prompts) for j in range(seeds)]
    totals, stats = dict.fromkeys(runs, 0.0), {key: [] for key in runs}  # totals: [repeats] over samples
    sample_s = {key: [] for key in runs}  # per sample: median over repeats
    for p, seed in samples:
        fns = {key: (lambda r=run: jax.block_until_ready(r([p], seed))) for key, run in runs.items()}
        for key, times in harness.interleaved_times(fns, FLAGS.repeats).items():
            totals[key] = totals[key] + np.array(times)
            sample_s[key].append(np.median(times))
            stats[key].append(jax.block_until_ready(runs[key]([p], seed)).stats)
    totals_stats = {key: jax.tree.map(lambda *xs: np.sum(xs, axis=0), *s) for key, s in stats.items()}
    modeled_by_sample = {key: modeled_tokens_and_cost(s, ks, adaptive.costs) for key, s in stats.items()}
    modeled = {key: emitted.sum() / spent.sum() for key, (emitted, spent) in modeled_by_sample.items()}
    fixed = [key for key in runs if key.startswith("K=")]
    best = min(fixed, key=lambda key: np.median(totals[key]))
    best_modeled = max(modeled[key] for key in fixed)
    tokens = np.full(len(samples), float(n))
    wall_ci = bootstrap_vs_best({key: (tokens, np.array(sample_s[key])) for key in runs}, fixed)
    modeled_ci = bootstrap_vs_best(modeled_by_sample, fixed)
    costs = " ".join(f"{c / adaptive.costs[0]:.2f}" for c in adaptive.costs)
    rows = []
    for key, total in totals_stats.items():
        row = dict(drafter=name, T=temperature, draft=key, tau=summarize(total)["tau"])
        row |= dict(tok_s=len(samples) * n / np.median(totals[key]), best_fixed=best)
        row |= dict(vs_best=float(np.median(totals[best] / totals[key])), vs_best_95=wall_ci[key])
        row |= dict(modeled_vs_best=modeled[key] / best_modeled, modeled_vs_best_95=modeled_ci[key])
        k_hist = np.asarray(total.k_hist)
        row["rounds_by_k"] = " ".join(f"{k}:{k_hist[k]}" for k in ks if k < len(k_hist) and k_hist[k])
        row["costs"] = costs if key == adaptive.describe() else ""
        rows.append(row)
    return rows


def modeled_tokens_and_cost(stats_list, ks, costs) -> tuple[np.ndarray, np.ndarray]:
    """Per run's statistics: (emitted tokens, the rounds' summed cost, a round drafting ks[i] tokens costing
    costs[i]); a row's modeled rate is emitted.sum() / cost.sum()."""
    emitted, spent = [], []
    for stats in stats_list:
        k_hist = np.asarray(stats.k_hist)
        emitted.append(float(np.asarray(stats.emitted).sum()))
        spent.append(sum(k_hist[k] * c for k, c in zip(ks, costs) if k < len(k_hist)))
    return np.array(emitted), np.array(spent)


def bootstrap_vs_best(per_sample: dict, fixed: list, draws: int = 2000, seed: int = 0) -> dict:
    """{key: "lo-hi"}: the 95% bootstrap interval of key's rate over the best fixed K's, a row's rate over samples S
    being sum(tokens[S]) / sum(cost[S]) (`per_sample[key] = (tokens, cost)`, one entry per sample); the samples
    are drawn with replacement, the same draw for every row, and the best fixed K is chosen within each draw."""
    n = len(next(iter(per_sample.values()))[0])
    draw = np.random.default_rng(seed).integers(0, n, (draws, n))
    rate = {key: tok[draw].sum(1) / cost[draw].sum(1) for key, (tok, cost) in per_sample.items()}
    best = np.max([rate[key] for key in fixed], axis=0)
    return {key: "{:.3f}-{:.3f}".format(*np.percentile(r / best, [2.5, 97.5])) for key, r in rate.items()}


def adaptive_setup(small):
    """(target, description, build) of the adaptive-K table: stories260K with the registry's drafters, or its
    memory-bound expansion (`experiments.bench_memory_bound`: synthetic cost, real distribution) with the
    expanded EAGLE heads and the draft model of its first 2 original layers."""
    if FLAGS.adaptive_target == "stories260K":

        def build(name, k, sampler):
            entry = registry.get(name)
            return entry.build(small, entry.settings(**SETTINGS.get(name, {})), k, None, sampler)

        return (small.cfg, small.graphdef, small.params), "stories260K", build
    from experiments import bench_memory_bound as mb

    unknown = set(FLAGS.adaptive_drafters) - {"draft_model", "eagle"}
    if unknown:
        raise cli.UsageError(
            f"--adaptive_target=expanded has the drafters draft_model and eagle, not {sorted(unknown)}; "
            "choose among them with --adaptive_drafters"
        )
    settings = mb.Settings()
    _, target, draft, loaded = mb.load(settings)
    methods = {"draft_model": "draft model", "eagle": "eagle"}

    def build(name, k, sampler):
        return mb.make_drafter(methods[name], target, draft, loaded, k, None, sampler)

    cfg = target[0]
    title = (
        f"expanded stories260K ({cfg.n_layers} layers x {cfg.dim}: synthetic cost, real distribution; draft "
        f"model: its first {settings.draft_layers} original layers)"
    )
    return target, title, build


def adaptive_table(small, prompts) -> str:
    """The adaptive-K table for --adaptive_drafters at --temperatures on --adaptive_target, written to results/."""
    ks = tuple(int(k) for k in FLAGS.adaptive_k)
    target, where, build = adaptive_setup(small)
    rows = []
    for temperature in map(float, FLAGS.temperatures):
        for name in FLAGS.adaptive_drafters:
            for row in bench_adaptive(target, prompts, name, temperature, ks, build):
                rows.append(row)
                print(row, flush=True)
    title = (
        f"{AdaptiveK(ks).describe().capitalize()} vs each fixed K on {where} (chains, token-wise rule; "
        "adaptive is told no K: its round costs are timed before the loop unless given, costs relative to K=1; "
        "modeled_vs_best prices every round at those costs), batch 1, "
        f"{len(prompts)} prompts (x {FLAGS.seeds} seeds at T > 0) x {FLAGS.new_tokens} new tokens, float32, CPU, "
        f"medians of {FLAGS.repeats}; *_95: 95% bootstrap intervals over the samples"
    )
    suffix = "" if FLAGS.adaptive_target == "stories260K" else "_expanded"
    suffix += "_given_costs" if FLAGS.adaptive_costs else ""
    name = "bench_verification_adaptive" + suffix + ("_smoke" if FLAGS.smoke else "")
    return harness.write_table(name, rows, title)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.smoke:
        FLAGS.new_tokens, FLAGS.repeats, FLAGS.contexts_every, FLAGS.tree_draws = 16, 1, 4, 8
        FLAGS.temperatures, FLAGS.drafters, FLAGS.tree = ["1.0"], ["medusa"], "0;1;0,0"
        FLAGS.adaptive_k, FLAGS.adaptive_drafters = ["1", "2"], ["medusa"]
    harness.RESULTS = Path(FLAGS.results)  # where write_table writes
    if FLAGS.prompts is not None and FLAGS.prompts < 1:
        raise cli.UsageError(f"--prompts must be at least 1, got {FLAGS.prompts}")
    if FLAGS.seeds < 1:
        raise cli.UsageError(f"--seeds must be at least 1, got {FLAGS.seeds}")
    if "tokenwise" not in FLAGS.rules or (FLAGS.tree and "tokenwise" not in FLAGS.tree_rules):
        raise cli.UsageError(
            "--rules and --tree_rules must include tokenwise (its samples give the contexts); add it"
        )
    shapes = [(None, [acceptance.get(r) for r in FLAGS.rules])]
    if FLAGS.tree:
        shapes.append((parse_tree(FLAGS.tree), [acceptance.get(r) for r in FLAGS.tree_rules]))
    target = load_model()
    texts = PROMPTS[:2] if FLAGS.smoke else PROMPTS[: FLAGS.prompts]
    prompts = [target.tokenizer.encode(t) for t in texts]
    rows = []
    for temperature in map(float, FLAGS.temperatures):
        for d, name in enumerate(FLAGS.drafters):
            for s, (tree, rules) in enumerate(shapes):
                with_ar = d == 0 and s == 0 and not FLAGS.smoke  # AR once per temperature
                for row in bench(target, prompts, name, temperature, rules, tree, with_ar):
                    rows.append(row)
                    print(row, flush=True)
    title = (
        "Verification rules on stories260K (typical_lossy is LOSSY: tv_first is its exact per-round distance from "
        f"the target's distribution): chains of K={FLAGS.k} and the tree {FLAGS.tree or '-'}, batch 1, "
        f"{len(prompts)} prompts x {FLAGS.new_tokens} new tokens, float32, CPU, medians of {FLAGS.repeats}; "
        "tau measured by decoding, e_tau_same_drafts the expectation of each rule on the same drafts"
    )
    if rows:
        name = "bench_verification_smoke" if FLAGS.smoke else "bench_verification"
        print(harness.write_table(name, rows, title))
    if FLAGS.adaptive_k:
        print(adaptive_table(target, prompts))


if __name__ == "__main__":
    cli.run(main)
