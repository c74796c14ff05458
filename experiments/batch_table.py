"""`make tables --sections=batch`: batches that never lose, on the memory-bound target (stories260K expanded:
synthetic cost, real distribution; `experiments.bench_memory_bound`).

Story openings of 2-23 words, each continued to the end of its sentence (a stop at '.', at most 64 tokens: mixed
output lengths), greedy, at each batch size: AR, EAGLE-3's chain of K, n-gram's chain of K (training-free) and the
policy (EAGLE-3 with each round's K chosen on device among 0 (an AR round), 1, 2, 4 and K from the round costs
measured at that batch before the loop, or the whole job plain where a plain AR round wins from the start:
`AdaptiveK`), each run batch after batch and with slots refilled inside the compiled loop
(`specjax.decoding.refill`). Columns: tokens/s over the whole set and the speedup over AR run the same way (medians
of runs timed in turns), the prefills' share of the time and the speedup of the time after them (the prefills,
priced at the costs below, are the same work for every method: they cap the speedup over the whole set), loop
rounds, each request's latency (the time of the round that made its last token, at the run's mean time per round;
p50 and p90), and the prediction of `specjax.analysis`: rounds from each request's tokens and its own acceptance (as
decoded batch after batch: greedy, the same drafts in both modes; batch after batch, each batch until its slowest
row ends; refilled, the slot schedule `refill_schedule`), priced at the costs measured at that batch (a round: K
head calls and a (K + 1)-token pass, each with its job's own static cache; the prefills) in the same turns as the
decodes (a turn's prediction against that turn's time: the machine's speed drifts by 10-30% between minutes; each
pass the median of 3 timed loops after an untimed one: the fastest predicted 10-15% too little at batch 1, and a
loop's first call after another program runs slower), against the measured time; and the drafters' rounds priced at
the speculative loop's own round at that batch (everything a round does besides its passes: acceptance, the commit,
the head's state, n-gram's lookup). The policy's rounds change K: it has no prediction.

    .venv/bin/python -m experiments.batch_table [--batches=1,2,4,8,16] [--prompts=64] [--k=4] [--repeats=2]
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import jax
import numpy as np
from absl import flags, logging

from experiments import costs, harness
from specjax import analysis, cli, expand
from specjax.decoding.compile import drafter_layout
from specjax.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class Settings:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    prompts: int = 64
    max_new_tokens: int = 64
    k: int = 4  # EAGLE-3's chain (the policy's largest K)
    repeats: int = 2
    calls: int = 8  # passes per timed loop of the costs
    expansion: expand.Expansion = expand.Expansion()


def openings(tokenizer, n: int) -> list[list[int]]:
    """The first 2-23 words (seeded) of the first n stories of `experiments/data/stories.txt`."""
    text = (Path(__file__).parent / "data" / "stories.txt").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    rng = np.random.default_rng(0)
    return [tokenizer.encode(" ".join(lines[i].split()[: int(rng.integers(2, 24))])) for i in range(n)]


@dataclasses.dataclass
class Run:
    """One decoding of every prompt: outputs, loop rounds, each request's end round, the pooled statistics."""

    tokens: np.ndarray  # [N, max_new_tokens]
    lengths: np.ndarray  # [N]
    rounds: int
    ends: np.ndarray  # [N] the round that made each request's last token
    stats: object  # speculative runs' SpecStats, pooled (None: AR)
    # [N, K + 1] each request's rounds by draft tokens accepted (speculative runs batch after batch; else None)
    request_hist: np.ndarray | None = None


def batch_after_batch(target, prompts, spec, slots: int, drafter, dparams):
    """run(seed) -> `Run`: the prompts in batches of `slots` (the last padded), one compiled program."""
    from specjax.decoding import compile_decode

    width = max(map(len, prompts))
    batches = [prompts[i : i + slots] for i in range(0, len(prompts), slots)]
    pad = lambda batch: batch + [batch[-1]] * (slots - len(batch))
    run, _ = compile_decode(*target, pad(batches[0]), spec, drafter, dparams, width)

    def go(seed: int = 0) -> Run:
        tokens, lengths, ends, stats, hists, rounds = [], [], [], [], [], 0
        for batch in batches:
            gen = jax.block_until_ready(run(pad(batch), seed))
            n = len(batch)
            length = np.asarray(gen.lengths)[:n]
            tokens.append(np.asarray(gen.tokens)[:n])
            lengths.append(length)
            own = length - 1 if drafter is None else np.asarray(gen.stats.row_rounds)[:n]
            ends.append(rounds + own)
            rounds += int(gen.target_passes if drafter is None else gen.stats.rounds)
            if drafter is not None:
                stats.append(gen.stats)
                hists.append(np.asarray(gen.stats.row_hist)[:n])
        out = (np.concatenate(tokens), np.concatenate(lengths), rounds, np.concatenate(ends))
        if drafter is None:
            return Run(*out, None)
        pooled = jax.tree.map(lambda *x: sum(np.asarray(v) for v in x), *stats)
        return Run(*out, pooled, np.concatenate(hists))

    return go


def refilled(target, prompts, spec, slots: int, drafter, dparams):
    """run(seed) -> `Run`: the prompts through `slots` slots refilled inside one compiled loop."""
    from specjax.decoding.refill import compile_serve

    run, _ = compile_serve(*target, prompts, spec, slots, drafter, dparams)

    def go(seed: int = 0) -> Run:
        served = jax.block_until_ready(run(prompts, seed))
        out = (np.asarray(served.tokens), np.asarray(served.lengths), int(served.rounds))
        stats = None if served.stats is None else jax.tree.map(np.asarray, served.stats)
        return Run(*out, np.asarray(served.end_rounds), stats)

    return go


BUILD = {"batch after batch": batch_after_batch, "refill": refilled}  # mode -> run(seed) of every prompt


def pass_loops(settings: Settings, target, multi_row, loaded, prompts, spec, b: int, eagle3) -> dict:
    """{name: a loop of `settings.calls` passes}: a 1-token and a (K + 1)-token target pass, an EAGLE-3 head call
    and a prefill of the prompts' width at batch b, and a one-row prefill of each width a refilled slot uses
    (`("prefill_1", width)`), each with the static cache its job has (attention reads the whole cache); `multi_row`:
    the target's multi-row copy (`costs.on_cpu_multi_row`)."""
    from experiments.bench_memory_bound import head_call
    from specjax.decoding import AdaptiveK, refill
    from specjax.decoding.jobs import prepare, prepare_speculative

    cfg, graphdef, params = target
    width, k, calls = max(map(len, prompts)), settings.k, settings.calls
    ar_cache = prepare(cfg, prompts, spec, width)[2].cache_size  # as batch after batch pads the jobs
    one_k = dataclasses.replace(spec, adaptive_k=AdaptiveK((k,), prior=0.5))
    spec_cache = prepare_speculative(cfg, eagle3, prompts[:b], one_k, width)[2].cache_size
    widths = refill.prefill_widths(prepare(cfg, prompts, spec)[0].shape[1])  # of the refill job's buffer
    passes = {  # name: (rows, tokens, cache)
        "step": (b, 1, ar_cache),
        "verify": (b, k + 1, spec_cache),
        "prefill": (b, width, ar_cache),
    } | {("prefill_1", w): (1, w, ar_cache) for w in widths}
    fns = {}
    for name, (rows, t, size) in passes.items():
        g, p = costs.as_decoded(rows * t, (graphdef, params), multi_row)
        fns[name] = costs.target_pass(cfg, g, p, rows, t, calls, size)
    fns["head"] = head_call(loaded, "eagle3", target, b, calls, spec_cache)
    return fns


def priced(seconds: dict, settings: Settings, prompts, b: int) -> dict:
    """The costs of one turn from its `pass_loops` times: seconds of each pass, and `refills`, the refilled
    prompts' one-row prefills, each at the narrowest width that holds it (`refill.start_row`)."""
    cost = {name: s / settings.calls for name, s in seconds.items()}
    widths = sorted(name[1] for name in cost if isinstance(name, tuple))
    at = np.searchsorted(widths, [len(p) for p in prompts[b:]])
    cost["refills"] = sum(cost["prefill_1", widths[i]] for i in at)
    return cost


def loop_rounds(settings: Settings, target, multi_row, prompts, spec, b: int, drafters: dict) -> dict:
    """{method: seconds of one round of its speculative loop} for each of `drafters` ({method: (drafter,
    params)}) on the first b prompts (every step a round takes, not only its passes): the loop with adaptive K over
    K alone, timed by `speculative.calibrate` (rounds from the start of the job less a call running none)."""
    from specjax.decoding import AdaptiveK
    from specjax.decoding.jobs import prepare_speculative
    from specjax.decoding.speculative import calibrate

    cfg, graphdef, params = target
    width, k = max(map(len, prompts)), settings.k
    one_k = dataclasses.replace(spec, adaptive_k=AdaptiveK((k,), prior=0.5))
    # the loop's target as compile_decode runs a drafter's job
    g, p = costs.as_decoded(b * (k + 1), (graphdef, params), multi_row)
    out = {}
    for method, (drafter, dparams) in drafters.items():
        tokens, lengths, job = prepare_speculative(cfg, drafter, prompts[:b], one_k, width)
        loop = calibrate(cfg, g, p, *drafter_layout(drafter, dparams), tokens, lengths, job)
        out[method] = loop.adaptive_k.costs[0]
    return out


def request_distributions(request_hist: np.ndarray) -> list[np.ndarray]:
    """Each request's distribution of tokens per round (`analysis.tokens_per_round`) from its own rounds; a request
    that ran none (its prefill's token ended it) gets the pooled one."""
    pooled = analysis.tokens_per_round(request_hist.sum(0))
    return [analysis.tokens_per_round(h) if h.sum() else pooled for h in request_hist]


def passes_seconds(method: str, k: int, cost: dict) -> float:
    """A drafted round's passes: the (K + 1)-token verify pass and the draft's calls, K head calls for EAGLE-3, none
    for n-gram (its lookup is part of the loop's round)."""
    return k * cost["head"] * (method == "eagle3") + cost["verify"]


def predicted_seconds(
    method: str,
    mode: str,
    run: Run,
    b: int,
    k: int,
    cost: dict,
    round_s: float | None = None,
    request_hist: np.ndarray | None = None,
) -> tuple[float, float]:
    """(predicted rounds, predicted seconds) of `run`'s requests decoded by `method` at batch b in `mode`, a round
    costing `round_s` (None: its passes', a one-token pass or K head calls and a (K + 1)-token pass), each request's
    rounds from its own acceptance (`request_hist`, [N, K + 1]; None: the run's pooled acceptance for every request:
    a batch of requests that differ waits for its slowest more than that predicts)."""
    n = run.lengths - 1  # tokens after each request's first (from its prefill)
    if method == "AR":
        each, passes_s = n.astype(float), cost["step"]
        batch_rounds = lambda rows: float(max(n[rows]))
    else:
        if request_hist is None:
            p = [analysis.tokens_per_round(np.asarray(run.stats.row_hist).sum(0))] * len(n)
        else:
            p = request_distributions(request_hist)
        each = np.array([analysis.expected_batch_rounds([p_i], m) for p_i, m in zip(p, n)])
        passes_s = passes_seconds(method, k, cost)
        batch_rounds = lambda rows: analysis.expected_batch_rounds([p[i] for i in rows], n[rows])
    round_s = passes_s if round_s is None else round_s
    groups = [np.arange(i, min(i + b, len(n))) for i in range(0, len(n), b)]
    if mode == "refill":
        rounds = analysis.refill_schedule(each, b)[0]
    else:
        rounds = sum(batch_rounds(rows) for rows in groups)
    return rounds, rounds * round_s + prefill_seconds(mode, len(n), b, cost)


def prefill_seconds(mode: str, n_requests: int, b: int, cost: dict) -> float:
    """The prefills' seconds of a job of `n_requests` at batch b in `mode`, the same for every method: one prefill
    of b rows a batch after batch, or the opening one and the refilled prompts' one-row prefills."""
    if mode == "refill":
        return cost["prefill"] + cost["refills"]
    return -(-n_requests // b) * cost["prefill"]


def rows_at(settings: Settings, target, loaded, prompts, stop: int, b: int) -> list[dict]:
    """Every method and mode at batch b (a row ends at `stop`), timed in turns."""
    from experiments.bench_memory_bound import make_drafter
    from specjax.decoding import AdaptiveK, GenerateSpec

    spec = GenerateSpec(settings.max_new_tokens, Sampler(), eos_id=stop)
    drafters = {
        m: make_drafter(name, target, None, loaded, settings.k, None, Sampler())
        for m, name in (("eagle3", "eagle3"), ("ngram", "n-gram"))
    }
    policy = AdaptiveK(tuple(sorted({k for k in (0, 1, 2, 4) if k < settings.k} | {settings.k})))
    jobs = {"AR": (spec, None, None)} | {m: (spec, *d) for m, d in drafters.items()}
    jobs["policy"] = (dataclasses.replace(spec, adaptive_k=policy), *drafters["eagle3"])
    fns = {
        (m, mode): BUILD[mode](target, prompts, s, b, d, dp)
        for m, (s, d, dp) in jobs.items()
        for mode in BUILD
    }
    runs = {}  # each job's last run (seed 0): the outputs compared and the statistics

    def recorded(key):
        def call():
            runs[key] = fns[key]()

        return call

    # the passes timed in the same turns as the decodes: each turn's prediction sees the machine its decodes saw
    multi_row = costs.on_cpu_multi_row(*target[1:])  # packed once, for the passes and the loop's rounds
    passes = pass_loops(settings, target, multi_row, loaded, prompts, spec, b, drafters["eagle3"][0])
    pass_times = {name: [] for name in passes}

    def time_passes():  # each settled (the first call after another program's runs slower), a median of 3
        for name, fn in passes.items():
            pass_times[name].append(harness.median_time(fn, 3))

    timed = {key: recorded(key) for key in fns} | {"passes": time_passes}
    times = harness.interleaved_times(timed, settings.repeats, settle=False)
    turns = [  # the last `repeats` calls of time_passes: the timed turns' (the first is the warm-up's)
        priced({name: pass_times[name][r - settings.repeats] for name in passes}, settings, prompts, b)
        for r in range(settings.repeats)
    ]
    passes.clear()  # the loops' programs and caches freed with the decodes'
    timed.clear()
    jax.clear_caches()  # the programs freed (XLA CPU maps each until then)
    loop_round = loop_rounds(settings, target, multi_row, prompts, spec, b, drafters)
    first = next(iter(runs.values()))
    rows = []
    for (method, mode), run in runs.items():
        seconds = statistics.median(times[(method, mode)])
        same = np.array_equal(run.lengths, first.lengths) and np.array_equal(run.tokens, first.tokens)
        latency = seconds * run.ends / max(run.rounds, 1)
        row = dict(batch=b, method=method, mode=mode, tokens=int(run.lengths.sum()), rounds=run.rounds)
        # the prefills' share of the time and the speedup of what follows them (each turn's measured time less its
        # priced prefills: the same work for every method, which caps the speedup over the whole set)
        prefill_s = [prefill_seconds(mode, len(prompts), b, cost) for cost in turns]
        after = lambda t: [x - p for x, p in zip(t, prefill_s)]
        row |= dict(
            tok_s=run.lengths.sum() / seconds,
            speedup=harness.ratio(times[("AR", mode)], times[(method, mode)]),
            prefill_share=statistics.median(p / x for p, x in zip(prefill_s, times[(method, mode)])),
            decode_speedup=harness.ratio(after(times[("AR", mode)]), after(times[(method, mode)])),
        )
        row |= dict(
            latency_p50_s=float(np.median(latency)), latency_p90_s=float(np.percentile(latency, 90))
        )
        rounds, predicted_s, over, over_loop, loop_over_passes = (np.nan,) * 5
        # each request's acceptance, from its decoding batch after batch (greedy: the same drafts in both modes)
        hist = runs[(method, "batch after batch")].request_hist
        predict = lambda cost, round_s=None: predicted_seconds(
            method, mode, run, b, settings.k, cost, round_s, hist
        )
        if method != "policy":
            rounds = predict(turns[0])[0]
            each = [predict(cost)[1] for cost in turns]
            predicted_s, over = statistics.median(each), harness.ratio(each, times[(method, mode)])
        if method in drafters:  # priced at the loop's own round
            loop_each = [predict(cost, loop_round[method])[1] for cost in turns]
            over_loop = harness.ratio(loop_each, times[(method, mode)])
            passes_s = statistics.median(passes_seconds(method, settings.k, cost) for cost in turns)
            loop_over_passes = loop_round[method] / passes_s
        row |= dict(predicted_rounds=rounds, predicted_tok_s=run.lengths.sum() / predicted_s)
        row |= dict(measured_over_predicted=over, measured_over_loop_predicted=over_loop)
        row |= dict(loop_round_over_passes=loop_over_passes, identical=bool(same))
        hist = [] if run.stats is None else np.asarray(run.stats.k_hist).tolist()  # row-rounds by K
        row["rounds_by_k"] = " ".join(f"K={k}:{c}" for k, c in enumerate(hist) if c) or "-"
        rows.append(row)
        print(row, flush=True)
    return rows


def table(out: harness.Writer, settings: Settings) -> list[dict]:
    """The section: every batch size, written as `batch`."""
    from experiments import bench_memory_bound as bench

    small, target, _, loaded = bench.load(
        bench.Settings(expansion=settings.expansion, kinds=("eagle3 chain",))
    )
    stop = small.tokenizer.encode("He ran.")[-1]  # '.'
    prompts = openings(small.tokenizer, settings.prompts)
    rows = [r for b in settings.batches for r in rows_at(settings, target, loaded, prompts, stop, b)]
    cfg = target[0]
    out.table(
        "batch",
        rows,
        f"Batches on the expanded stories260K ({cfg.n_layers} layers x {cfg.dim}, float32): {len(prompts)} story "
        f"openings each continued to the end of its sentence (at most {settings.max_new_tokens} tokens), greedy; AR, "
        f"EAGLE-3's and n-gram's chains K={settings.k} and the policy (EAGLE-3, adaptive K per round, or the whole "
        "job plain), batch after batch and refilled; "
        f"medians of {settings.repeats} runs in turns; latency: the time of the round that made a request's last "
        "token; predicted: rounds from each request's own acceptance (specjax.analysis) x the round's cost measured "
        "at that batch in the same turns, plus the prefills; measured_over_predicted = median over turns of "
        "predicted time / measured time; *_loop_*: a "
        "round priced at the speculative loop's own round at that batch (timed from the start of the first batch's "
        "job), loop_round_over_passes = that round / its passes; prefill_share: the prefills' priced time / the "
        "measured time, decode_speedup: the speedup over AR of the time after them",
    )
    return rows


def define_flags() -> None:
    flags.DEFINE_list("batches", ["1", "2", "4", "8", "16"], "Batch sizes (slots).")
    flags.DEFINE_integer("prompts", 64, "Story openings.")
    flags.DEFINE_integer("k", 4, "EAGLE-3's chain length (the policy's largest K).")
    flags.DEFINE_integer("repeats", 2, "Timed runs of each job, in turns (median).")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the table.")
    harness.define_precision_flag()


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    settings = Settings(tuple(map(int, f.batches)), f.prompts, k=f.k, repeats=f.repeats)
    if min(settings.batches) < 1 or f.prompts < 1 or f.k < 1 or f.repeats < 1:
        raise cli.UsageError("--batches, --prompts, --k and --repeats must each be at least 1")
    table(harness.Writer(Path(f.results)), settings)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
