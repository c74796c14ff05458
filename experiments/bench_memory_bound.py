"""Speculative decoding where it pays: a memory-bound target with stories260K's exact distribution.

    .venv/bin/python -m experiments.bench_memory_bound [--smoke] [--prompts=4] [--new_tokens=64] [--repeats=3]
        [--batches=1,4] [--temperatures=0,1] [--results=results]

The target is stories260K expanded without changing its function (`specjax.expand`: *synthetic cost, real
distribution*): 32 layers of width 512, 372 MB of float32 weights read per token. Its trained Medusa and EAGLE
heads are expanded the same way, so tau and alpha are stories260K's and the costs are those of a memory-bound
model. Six tables (results/NAME_{machine,curve,pilot,decode,k,batch}.{md,csv}):

- machine and verify-cost curve: read bandwidth (the faster of a compiled sum and a matrix-vector product over
  512 MB, `bandwidth_fns`) and matmul FLOP/s measured in the same run, taking turns with one target pass over
  T = 1, 2, 4, ..., 64 new tokens (batch 1 and 4; stories260K at batch 1), the fastest of >= 5 repetitions each,
  next to the bandwidth floor (weights + the KV cache read / bandwidth) and the compute roof (2 x parameters x
  tokens / FLOP/s, at the host's multiply-add peak where specjax's CPU kernels are built, `kernels.fma_peak_gflops`,
  measured first: XLA's matmul reaches less, and a roof at its rate would flatter every pass).
- pilot: EAGLE's tau for chain lengths and dynamic-tree budgets, measured on stories260K itself (the expansion
  keeps every draft, so tau carries over), turned into a predicted speedup with the curve: the decode table uses
  the best chain K and the two best dynamic budgets, and static trees of the best budget.
- decode: AR, a draft model of the target's first 2 *original* layers (the inserted ones skipped), the distilled
  2-layer draft (`heads/stories260K_distill`, trained on stories260K: it drafts for the expansion unchanged), the
  target's int8 copy (quantised self-draft), n-gram lookup, retrieval (REST) over a datastore of stories260K's own
  stories, lookahead, Medusa (chain, static tree), EAGLE (chain, static and dynamic trees) and EAGLE-3 (chain,
  dynamic trees) at each temperature and batch on free continuation; n-gram, retrieval, lookahead and EAGLE-3's
  chain also greedy at batch 1 on input-grounded retelling and long generation (`jobs`): tau, pooled acceptance rate
  a, draft cost c (one drafter call / one 1-token target pass), verify cost v (the round's target pass / a 1-token
  pass, from the curve), tokens/s, speedup over AR (median of per-repetition ratios, the runs taking turns) end to
  end and of the decoding phase (both times less the jobs' prefill passes, costed from the curve at the padded
  prompt width), the analytic prediction E / (n_calls x c + v) with E = (1 - a^(K+1)) / (1 - a) for chains and the
  measured tau otherwise, the decoding speedup / the prediction, and loop efficiency (the model calls' time from the
  curve / the measured decoding time per round). AR's row gives a decoding step's fraction of the bandwidth floor
  (the weights and the keys/values of the committed tokens, averaged over the steps).
- k: EAGLE-3's chain for K = 1..8 with Theorem 3.8's optimum for the measured costs marked.
- batch: AR against EAGLE-3's chain at batch 1..16, with the costs measured at each batch: where the speedup
  crosses 1.

Rows the expansion makes trivial are left out: a draft of every original layer (skipping the inserted ones) or
stories260K itself as the draft is the target's own function at a fraction of its cost (tau = K + 1 for free).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import jax
import numpy as np
from absl import flags, logging

from experiments import common, costs, harness
from specjax import cli, expand, heads, kernels
from specjax.analysis import batch_speedup, expected_batch_rounds, expected_tokens_per_round
from specjax.decoding.compile import drafter_layout
from specjax.drafting.trees import DynamicTree, medusa_like
from specjax.models.loading import load_model
from specjax.sampling import Sampler

PROMPTS = harness.MEMORY_PROMPTS
HEADS = Path(__file__).resolve().parents[1] / "heads"
KINDS = (
    "draft model",
    "distilled draft",
    "quantized",
    "n-gram",
    "retrieval",
    "lookahead",
    "medusa chain",
    "medusa tree",
    "eagle chain",
    "eagle tree",
    "eagle dynamic",
    "eagle3 chain",
    "eagle3 dynamic",
    "dflash chain",
    "dflash sized",
    "dflash dynamic",
)


@dataclasses.dataclass(frozen=True)
class Settings:
    expansion: expand.Expansion = expand.Expansion()
    prompts: int = 4
    new_tokens: int = 64
    seeds: int = 1  # samples of each prompt at T > 0 (a group and a seed each): tau and speed pooled
    repeats: int = 3
    batches: tuple[int, ...] = (1, 4)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    draft_layers: int = 2  # original layers of the draft model
    distilled_k: int = 4  # chain length of the distilled draft's row
    curve: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    calls: int = 8  # target passes per timed loop of the curve
    bandwidth_mb: int = 512
    chain_ks: tuple[int, ...] = (
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
    )  # EAGLE chains the pilot tries (and the K sweep runs)
    dynamic: tuple[tuple[int, int, int], ...] = ((2, 3, 3), (2, 4, 7), (4, 5, 15), (4, 6, 31), (8, 6, 63))
    pilot_tokens: int = 48
    kinds: tuple[str, ...] = KINDS  # which drafter rows (see `methods`)
    categories: tuple[str, ...] = ("free", "grounded", "long")  # beyond free continuation: batch 1, T = 0,
    category_kinds: tuple[str, ...] = ("n-gram", "retrieval", "lookahead", "eagle3 chain")  # and these rows
    sweep_batches: tuple[int, ...] = (1, 2, 4, 8, 16)  # AR against EAGLE-3's chain, greedy
    datastore_tokens: int = 65_536  # the retrieval drafter's datastore (`common.story_datastore`)
    name: str = "bench_memory_bound"
    dtype: str = "float32"  # of the target, its expansion and the drafters built from them
    sweeps: bool = True  # the K and batch tables
    # DFlash's block sizes B (chains of B - 1 drafted in one pass), and its head's folder under heads/
    dflash_blocks: tuple[int, ...] = (4, 8, 16)
    dflash_head: str = "stories260K_dflash"


SMOKE = Settings(
    expansion=expand.SMOKE,
    prompts=2,
    new_tokens=8,
    repeats=1,
    batches=(1,),
    temperatures=(0.0,),
    curve=(1, 2),
    calls=2,
    bandwidth_mb=16,
    chain_ks=(2,),
    dynamic=(),
    pilot_tokens=8,
    kinds=("draft model", "distilled draft", "quantized", "retrieval", "lookahead", "eagle chain"),
    categories=(),
    sweep_batches=(1,),
    datastore_tokens=4096,
    name="bench_memory_bound_smoke",
)


# --- the parts: the target, its expansion and the drafters' --------------------------------------------------


def load(settings: Settings):
    """stories260K, its expansion, the draft model of the first original layers, and the other drafters' parts:
    the expanded heads, the expansion's int8 copy and the retrieval datastore, where `settings.kinds` uses them."""
    from specjax.models.quantize import Quantization, quantize_model

    small = load_model(None, settings.dtype)
    e = settings.expansion
    cfg, graphdef, params = expand.expand(small.cfg, small.params, e)
    draft = expand.truncated_original(cfg, params, e, small.cfg.n_layers, settings.draft_layers)
    loaded = {}
    uses_dflash = any(kind.startswith("dflash") for kind in settings.kinds)
    for method in ("medusa", "eagle", "eagle3") + (("dflash",) if uses_dflash else ()):
        folder = settings.dflash_head if method == "dflash" else f"stories260K_{method}"
        meta, hgraph, hparams = heads.load_heads(HEADS / folder, small.cfg, small.params)
        big = expand.expand_heads(meta, hparams, small.cfg, cfg, params, e)
        loaded[method] = {"small": (meta, hgraph, hparams), "big": big}
    if "quantized" in settings.kinds:
        loaded["quantized"] = quantize_model(graphdef, params, Quantization(8))
    if "retrieval" in settings.kinds:
        loaded["retrieval"] = common.story_datastore(small, settings.datastore_tokens)
    if "distilled draft" in settings.kinds:
        d = load_model(str(HEADS / "stories260K_distill"), settings.dtype)
        loaded["distilled draft"] = (d.cfg, d.graphdef, d.params)
    return small, (cfg, graphdef, params), draft, loaded


def make_drafter(method: str, target, draft, loaded, k: int, tree, sampler, which: str = "big"):
    """(drafter, drafter params) for `method` on the expanded target (`which="big"`) or on stories260K."""
    from specjax.drafters.draft_model import DraftModel
    from specjax.drafters.retrieval import Retrieval
    from specjax.drafting import registry

    cfg, _, params = target
    if method in ("draft model", "distilled draft"):
        dcfg, dgraph, dparams = draft if method == "draft model" else loaded[method]
        return DraftModel(dcfg, dgraph, k, sampler, tree), dparams
    if method == "quantized":  # as `specjax.drafters.quantized` builds it, the int8 copy made once
        qgraph, qparams = loaded["quantized"]
        return DraftModel(cfg, qgraph, k, sampler, tree), qparams
    if method == "retrieval":
        return Retrieval(k), Retrieval.params(loaded["retrieval"])
    if method in ("n-gram", "lookahead"):
        entry = registry.get("ngram" if method == "n-gram" else method)
        return entry.build(None, entry.settings(), k, tree, sampler)
    meta, hgraph, hparams = loaded["dflash" if method.startswith("dflash") else method][which]
    drafter = heads.make_drafter(meta, hgraph, cfg, k, sampler, tree)
    # "dflash sized": its confidence head sizes each round's verified prefix
    if method.startswith("dflash"):
        drafter = dataclasses.replace(drafter, confidence=method == "dflash sized")
    return drafter, heads.drafter_params(meta, hparams, cfg, params)


def pilot_taus(settings: Settings, small, loaded) -> dict:
    """EAGLE's tau on stories260K itself (greedy, batch 1) for each candidate chain K and dynamic tree."""
    from specjax.decoding import speculative_generate
    from specjax.metrics import summarize

    prompts = [small.tokenizer.encode(p) for p in PROMPTS[:2]]
    target = (small.cfg, small.graphdef, small.params)
    shapes = [(k, None) for k in settings.chain_ks] + [(d[1], DynamicTree(*d)) for d in settings.dynamic]
    if len(shapes) == 1:  # nothing to choose
        return {shapes[0]: float("nan")}
    taus = {}
    for k, tree in shapes:
        drafter, dp = make_drafter("eagle", target, None, loaded, k, tree, Sampler(), which="small")
        gen = speculative_generate(
            *target, drafter, dp, prompts, harness.generate_spec(settings.pilot_tokens, eos_id=None)
        )
        taus[(k, tree)] = summarize(gen.stats)["tau"]
    return taus


# --- the benchmark ---------------------------------------------------------------------------------------


def head_call(loaded, method: str, target, b: int, calls: int, cache_size: int = costs.CURVE_CACHE):
    """The timed loop of one call of the expanded `method` head (EAGLE or EAGLE-3) at batch b."""
    cfg, _, params = target
    meta, hgraph, hparams = loaded[method]["big"]
    drafter, dparams = drafter_layout(
        heads.make_drafter(meta, hgraph, cfg, 1, Sampler()),
        heads.drafter_params(meta, hparams, cfg, params),
    )
    head = costs.head_step(drafter, cfg.dim)
    cache = costs.half_cache(cfg.replace(n_layers=1), b, cache_size)
    return costs.pass_loop(head, dparams, cache, b, 1, calls)


def drafter_calls(settings: Settings, target, draft_model, loaded, b: int) -> dict:
    """{(method, b): timed loop of one drafter call at batch b} (DFlash: {(("dflash", B), b): one block of B}):
    the draft cost c of each row `settings.kinds` has (EAGLE's for the pilot, EAGLE-3's for the sweeps always)."""
    from specjax.drafters.draft_model import DraftModel

    cfg, _, params = target
    calls, fns = settings.calls, {}
    models = {"draft model": draft_model, "distilled draft": loaded.get("distilled draft")}
    if "quantized" in settings.kinds:
        models["quantized"] = (cfg, *loaded["quantized"])
    for kind, (dcfg, dgraph, dparams) in ((k, m) for k, m in models.items() if k in settings.kinds):
        drafter, dparams = drafter_layout(DraftModel(dcfg, dgraph, 1), dparams)
        fns[(kind, b)] = costs.target_pass(dcfg, drafter.graphdef, dparams, b, 1, calls)
    for method in ("eagle", "eagle3"):
        fns[(method, b)] = head_call(loaded, method, target, b, calls)
    if "dflash" in loaded:  # one call drafts a block: its cost per block size
        meta, hgraph, hparams = loaded["dflash"]["big"]
        for size in settings.dflash_blocks:
            drafter, dparams = drafter_layout(
                heads.make_drafter(meta, hgraph, cfg, size - 1, Sampler()),
                heads.drafter_params(meta, hparams, cfg, params),
            )
            cache = costs.half_cache(drafter.draft_cfg, b)
            fns[(("dflash", size), b)] = costs.pass_loop(
                costs.dflash_step(drafter), dparams, cache, b, size, calls
            )
    if any(kind.startswith("medusa") for kind in settings.kinds):
        meta, mgraph, mparams = loaded["medusa"]["big"]
        medusa, mparams = drafter_layout(heads.make_drafter(meta, mgraph, cfg, 1, Sampler()), mparams)
        fns[("medusa", b)] = costs.medusa_loop(medusa.graphdef, mparams, b, cfg.dim, calls)
    return fns


def measure_curve(settings: Settings, small, target, draft_model, loaded):
    """(machine row, curve rows, {batch: {T: seconds}}, draft costs {(method, batch): seconds per call}, read
    bandwidth): the machine, the target passes of the curve and the drafter calls, timed in turns."""
    cfg, graphdef, params = target
    targets = {"expanded": (cfg, graphdef, params, settings.batches)}
    targets["stories260K"] = (small.cfg, small.graphdef, small.params, (1,))
    fns = {}
    nbytes, readers = costs.bandwidth_fns(settings.bandwidth_mb)
    fns |= {f"read {name}": fn for name, fn in readers.items()}
    flop, fns["matmul"] = costs.matmul_fn()
    for name, (c, g, p, batches) in targets.items():
        multi_row = costs.on_cpu_multi_row(g, p)
        for b in batches:
            for t in settings.curve:
                fns[(name, b, t)] = costs.target_pass(
                    c, *costs.as_decoded(b * t, (g, p), multi_row), b, t, settings.calls
                )
            if name == "expanded":
                fns |= drafter_calls(settings, target, draft_model, loaded, b)
    on_kernels = jax.default_backend() == "cpu" and kernels.available()
    peak_gflops = kernels.fma_peak_gflops() if on_kernels else None  # alone, before the passes
    times = costs.fastest(fns, max(settings.repeats, 5))
    reads = {name: nbytes / times[f"read {name}"] for name in readers}
    bw, flops = max(reads.values()), flop / times["matmul"]
    machine = dict(
        read_GBs=bw / 1e9,
        sum_read_GBs=reads["sum"] / 1e9,
        matvec_read_GBs=reads["matvec"] / 1e9,
        matmul_GFLOPs=flops / 1e9,
        target_weight_MB=expand.weight_bytes(cfg) / 1e6,
        kv_KB_per_position=expand.kv_bytes_per_position(cfg) / 1024,
        target_layers=cfg.n_layers,
        target_dim=cfg.dim,
    )
    machine["fma_peak_GFLOPs"] = np.nan if peak_gflops is None else peak_gflops
    machine["roof_GFLOPs"] = max(flops / 1e9, peak_gflops or 0.0)
    rows, curves = [], {}
    for name, (c, _, _, batches) in targets.items():
        for b in batches:
            curves.setdefault(name, {})[b] = {}
            for t in settings.curve:
                s = times[(name, b, t)] / settings.calls
                curves[name][b][t] = s
                read = expand.weight_bytes(c) + b * (
                    costs.CURVE_CACHE // 2 + t
                ) * expand.kv_bytes_per_position(c)
                floor, roof = read / bw, 2 * c.num_params * b * t / (machine["roof_GFLOPs"] * 1e9)
                rows.append(
                    dict(target=name, batch=b, T=t, ms=s * 1e3)
                    | dict(per_T1=s / (times[(name, b, 1)] / settings.calls), floor_ms=floor * 1e3)
                    | dict(roof_ms=roof * 1e3, bound_over_ms=max(floor, roof) / s)
                )
    calls = {key: times[key] / settings.calls for key in fns if len(key) == 2 and isinstance(key, tuple)}
    return machine, rows, curves["expanded"], calls, bw


def choose_shapes(settings: Settings, taus: dict, curve1: dict, c_eagle: float):
    """Pilot rows and the EAGLE shapes to run: the best chain K and the two best dynamic trees by predicted
    speedup tau / (depth x c + v(nodes + 1)), c and v relative to a 1-token target pass (batch 1)."""
    one = curve1[1]
    rows = []
    for (k, tree), tau in taus.items():
        nodes = k if tree is None else tree.total_tokens
        v = costs.interp_cost(curve1, nodes + 1) / one
        rows.append(
            dict(
                shape=f"chain K={k}"
                if tree is None
                else f"dynamic {tree.top_k},{tree.depth},{tree.total_tokens}",
                nodes=nodes,
                tau_stories260K=tau,
                v=v,
                predicted=tau / (k * c_eagle + v),
                _key=(k, tree),
            )
        )
    chains = sorted((r for r in rows if r["_key"][1] is None), key=lambda r: -r["predicted"])
    trees = sorted((r for r in rows if r["_key"][1] is not None), key=lambda r: -r["predicted"])
    chosen = [chains[0]["_key"]] + [r["_key"] for r in trees[:2]]  # settings.chain_ks must not be empty
    for r in rows:
        r["chosen"] = r["_key"] in chosen
        del r["_key"]
    return rows, chosen[0][0], [t for _, t in chosen[1:]]


def methods(settings: Settings, chain_k: int, dynamic: list, n_medusa: int):
    """(method, draft description, k, tree) of the decode table, for the kinds in `settings.kinds`."""
    budget = dynamic[0].total_tokens if dynamic else 8  # the best-predicted dynamic budget
    medusa_tree, eagle_tree = medusa_like(budget, max_depth=n_medusa), medusa_like(budget, max_depth=5)
    out = [
        ("draft model", "draft model", f"{settings.draft_layers} original layers, chain K=3", 3, None),
        (
            "distilled draft",
            "distilled draft",
            f"heads/stories260K_distill (2 layers), chain K={settings.distilled_k}",
            settings.distilled_k,
            None,
        ),
        ("quantized", "quantized", "int8 copy of the target, chain K=4", 4, None),
        ("n-gram", "n-gram", "chain K=3", 3, None),
        ("retrieval", "retrieval", f"{settings.datastore_tokens:,}-token datastore, chain K=4", 4, None),
        ("lookahead", "lookahead", "window 4, 4 guesses, N=5", 4, None),
        ("medusa chain", "medusa", f"chain K={n_medusa}", n_medusa, None),
        (
            "medusa tree",
            "medusa",
            f"static tree {medusa_tree.size - 1} nodes",
            medusa_tree.depth,
            medusa_tree,
        ),
        ("eagle chain", "eagle", f"chain K={chain_k}", chain_k, None),
        ("eagle tree", "eagle", f"static tree {eagle_tree.size - 1} nodes", eagle_tree.depth, eagle_tree),
    ]
    out.append(("eagle3 chain", "eagle3", f"chain K={chain_k}", chain_k, None))
    for method in ("eagle", "eagle3"):  # EAGLE-3 on EAGLE's shapes: the same trees and budgets
        for t in dynamic:
            desc = f"dynamic {t.top_k},{t.depth},{t.total_tokens}"
            out.append((f"{method} dynamic", method, desc, t.depth, t))
    for size in settings.dflash_blocks:
        out.append(("dflash chain", "dflash", f"chain of {size - 1}", size - 1, None))
    for size in settings.dflash_blocks[-1:]:
        desc = f"chain of {size - 1}, verified prefix sized by the confidence head"
        out.append(("dflash sized", "dflash sized", desc, size - 1, None))
    for t in dynamic[:1]:  # the block's per-position top-k, searched as EAGLE-2 searches
        desc = f"dynamic {t.top_k},{t.depth},{t.total_tokens}"
        out.append(("dflash dynamic", "dflash", desc, t.depth, t))
    return [row[1:] for row in out if row[0] in settings.kinds]


def run(settings: Settings, results: str | None = None) -> dict:
    """Runs the benchmark; returns {table name: rows} and writes each table."""
    out = harness.Writer(Path(results) if results else harness.RESULTS)
    small, target, draft_model, loaded = load(settings)
    cfg = target[0]
    machine, curve_rows, curves, calls, bw = measure_curve(settings, small, target, draft_model, loaded)
    out.table(f"{settings.name}_machine", [machine], "Machine, measured in this run")
    out.table(
        f"{settings.name}_curve",
        curve_rows,
        f"One target pass over T new tokens (cache of 192 slots, 96 committed; fastest of "
        f"{max(settings.repeats, 5)} timed loops of {settings.calls}): ms, relative to T = 1, the "
        f"bandwidth floor and the compute roof ({machine['read_GBs']:.1f} GB/s, {machine['roof_GFLOPs']:.0f} "
        "GFLOP/s: the faster of XLA's matmul and the host's multiply-add peak); bound_over_ms = max(floor, roof) / ms",
    )
    c_eagle = calls[("eagle", 1)] / curves[1][1]
    taus = pilot_taus(settings, small, loaded)
    pilot, chain_k, dynamic = choose_shapes(settings, taus, curves[1], c_eagle)
    out.table(
        f"{settings.name}_pilot",
        pilot,
        f"EAGLE shapes: tau on stories260K (greedy, 2 prompts x {settings.pilot_tokens} tokens), verify "
        f"cost v from the curve, predicted speedup tau / (depth x c + v), c = {c_eagle:.3f}",
    )
    n_medusa = loaded["medusa"]["big"][0]["shape"]["num_heads"]
    rows = decode_rows(
        settings, small, target, draft_model, loaded, curves, calls, bw, chain_k, dynamic, n_medusa
    )
    title = (
        f"Expanded stories260K ({cfg.n_layers} layers x {cfg.dim}, {expand.weight_bytes(cfg) / 1e6:.0f} MB "
        f"{cfg.dtype}: synthetic cost, real distribution), {settings.prompts} prompts x {settings.new_tokens} new "
        f"tokens ({settings.seeds} samples of each at T > 0), medians of {settings.repeats}; c = drafter call / "
        "1-token target pass, v = verify pass / 1-token pass, predicted = (new tokens - 1) / (E[rounds until the "
        "batch's slowest row ends] x (calls x c + v))"
    )
    out.table(f"{settings.name}_decode", rows, title)
    if not settings.sweeps:
        return dict(machine=[machine], curve=curve_rows, pilot=pilot, decode=rows)
    ks = k_sweep(settings, small, target, loaded, curves, calls)
    title = (
        f"EAGLE-3's chain against K on the expanded target (greedy, batch 1, {settings.prompts} prompts x "
        f"{settings.new_tokens} tokens, medians of {settings.repeats}): predicted = E(a, K) / (K c + v(K + 1)); "
        "analytic_optimum: the K maximising it at the sweep's mean a"
    )
    out.table(f"{settings.name}_k", ks, title)
    batches = batch_table(out, settings, small, target, loaded, chain_k)
    return dict(machine=[machine], curve=curve_rows, pilot=pilot, decode=rows, k=ks, batch=batches)


def batch_table(out: harness.Writer, settings: Settings, small, target, loaded, chain_k: int) -> list[dict]:
    """`batch_sweep`, written as `{name}_batch`."""
    batches = batch_sweep(settings, small, target, loaded, chain_k)
    title = (
        f"Batch size on the expanded target: AR against EAGLE-3's chain K={chain_k} (greedy, "
        f"{max(settings.new_tokens // 2, 1)} tokens a row, medians of {settings.repeats}); c and v measured at "
        "each batch; predicted: the batch runs until its slowest row ends (rounds: measured loop rounds, "
        "predicted_rounds: their expectation from the measured acceptance); speedup < 1 where a batched target pass "
        "is no longer nearly free"
    )
    out.table(f"{settings.name}_batch", batches, title)
    return batches


def jobs(settings: Settings) -> list[tuple]:
    """(category, batch, temperature, prompt texts, new tokens) of the decode table: free continuation at every
    batch and temperature (at T > 0 each prompt `settings.seeds` times, each its own seed); input-grounded
    retelling (`harness.GROUNDED`) and long generation (3x the tokens) at batch 1, greedy, for the rows in
    `settings.category_kinds`."""
    out = []
    for b in settings.batches:
        n = -(-max(settings.prompts, b) // b) * b
        out += [
            ("free", b, t, (PROMPTS * n)[:n] * (settings.seeds if t > 0 else 1), settings.new_tokens)
            for t in settings.temperatures
        ]
    if "grounded" in settings.categories:
        out.append(
            ("grounded", 1, 0.0, harness.GROUNDED[: max(settings.prompts // 2, 1)], settings.new_tokens)
        )
    if "long" in settings.categories:
        out.append(("long", 1, 0.0, PROMPTS[: max(settings.prompts // 4, 1)], 3 * settings.new_tokens))
    return out


def decode_rows(
    settings, small, target, draft_model, loaded, curves, calls, bw, chain_k, dynamic, n_medusa
):
    """The decode table: for each job (`jobs`), AR and the rows of `methods` timed in turns; tau, a, c, v, the
    speedups and the prediction (`costs.predicted_speedup`)."""
    from specjax.metrics import loop_efficiency, pooled

    cfg = target[0]
    rows, nan = [], float("nan")
    for category, b, temperature, texts, new_tokens in jobs(settings):
        prompts = [small.tokenizer.encode(p) for p in texts]
        groups = [prompts[i : i + b] for i in range(0, len(prompts), b)]
        one = curves[b][1]
        sampler = Sampler(temperature)
        kinds = tuple(k for k in settings.kinds if category == "free" or k in settings.category_kinds)
        drafters = {
            (method, desc): make_drafter(method, target, draft_model, loaded, k, tree, sampler)
            for method, desc, k, tree in methods(
                dataclasses.replace(settings, kinds=kinds), chain_k, dynamic, n_medusa
            )
        }
        kw = dict(max_new_tokens=new_tokens, sampler=sampler)
        times, outputs = costs.timed_groups(target, groups, kw, drafters, settings.repeats)
        ar = times["AR"]
        prefill_s = len(groups) * costs.interp_cost(
            curves[b], costs.prompt_width(groups)
        )  # a prefill a group
        ar_step = (statistics.median(ar) - prefill_s) / (len(groups) * (new_tokens - 1))  # after prefill
        slots = np.mean([len(p) for p in prompts]) + new_tokens / 2  # committed, averaged over the steps
        read = expand.weight_bytes(cfg) + b * slots * expand.kv_bytes_per_position(cfg)
        base = dict(category=category, batch=b, T=temperature)
        rows.append(
            base
            | dict(method="AR", draft="-", tau=1.0, a=nan, c=nan, v=1.0)
            | dict(tok_s=len(prompts) * new_tokens / statistics.median(ar), speedup=1.0, decode_speedup=1.0)
            | dict(predicted=1.0, measured_over_predicted=1.0, of_floor=(read / bw) / ar_step)
            | dict(loop_eff=one / ar_step)
        )
        for (method, desc), (drafter, _) in drafters.items():
            generations = outputs[(method, desc)]
            m = pooled([g.stats for g in generations])
            verified = drafter.shape.size - 1
            if getattr(drafter, "verify_lengths", ()):  # confidence-sized: the mean verified length
                hist = sum(np.asarray(g.stats.k_hist) for g in generations)
                verified = float(np.dot(np.arange(len(hist)), hist) / hist.sum())
            v = costs.interp_cost(curves[b], verified + 1) / one
            n_calls, call_s = drafter_cost(method, drafter, calls, b)
            dflash = method.startswith("dflash")
            c = call_s / one
            predicted = costs.predicted_speedup(generations, new_tokens, n_calls * c + v)
            spec = times[(method, desc)]
            spec_s = statistics.median(spec)
            decoding = costs.decoding_speedup(ar, spec, prefill_s)
            round_s = (spec_s - prefill_s) / m["rounds"]
            rows.append(
                base
                | dict(method=method, draft=desc + (f", block of {drafter.block}" if dflash else ""))
                | dict(tau=m["tau"], a=m["acceptance_rate"], c=c, v=v)
                | dict(tok_s=len(prompts) * new_tokens / spec_s)
                | dict(speedup=harness.ratio(ar, spec), decode_speedup=decoding)
                | dict(predicted=predicted, measured_over_predicted=decoding / predicted, of_floor=nan)
                | dict(loop_eff=loop_efficiency(n_calls * c * one, v * one, round_s))
            )
            print(rows[-1], flush=True)
    return rows


def drafter_cost(method: str, drafter, calls: dict, b: int) -> tuple[int, float]:
    """(drafter calls per round, seconds per call at batch b) of a decode row: none for the lookups, one for
    Medusa's heads and a DFlash block, one per depth otherwise."""
    if method in ("n-gram", "retrieval", "lookahead"):
        return 0, 0.0
    if method.startswith("dflash"):
        return 1, calls[(("dflash", block_measured(calls, b, drafter.block)), b)]
    return (1 if method == "medusa" else drafter.shape.depth), calls[(method, b)]


def block_measured(calls: dict, b: int, size: int) -> int:
    """The smallest DFlash block size >= `size` whose draft cost was measured at batch b (an upper bound)."""
    return min(
        s for (kind, bb) in calls if bb == b and isinstance(kind, tuple) for s in [kind[1]] if s >= size
    )


def k_sweep(settings: Settings, small, target, loaded, curves, calls) -> list[dict]:
    """EAGLE-3's chain for each K in `settings.chain_ks` (greedy, batch 1, free continuation): tau, a, speedup,
    the prediction E(a, K) / (K c + v(K + 1)) with the measured costs, and Theorem 3.8's optimum: the K that
    maximises the prediction at the sweep's mean a."""
    from specjax.metrics import pooled

    one, c = curves[1][1], calls[("eagle3", 1)] / curves[1][1]
    cost = lambda k: k * c + costs.interp_cost(curves[1], k + 1) / one
    prompts = [[small.tokenizer.encode(p)] for p in PROMPTS[: settings.prompts]]
    drafters = {
        k: make_drafter("eagle3", target, None, loaded, k, None, Sampler()) for k in settings.chain_ks
    }
    times, outputs = costs.timed_groups(
        target, prompts, dict(max_new_tokens=settings.new_tokens), drafters, settings.repeats
    )
    prefill_s = len(prompts) * costs.interp_cost(curves[1], costs.prompt_width(prompts))
    rows = []
    for k in settings.chain_ks:
        m = pooled([g.stats for g in outputs[k]])
        a = m["acceptance_rate"]
        rows.append(
            dict(K=k, tau=m["tau"], a=a, c=c, v=cost(k) - k * c)
            | dict(speedup=harness.ratio(times["AR"], times[k]))
            | dict(decode_speedup=costs.decoding_speedup(times["AR"], times[k], prefill_s))
            | dict(predicted=expected_tokens_per_round(a, k) / cost(k))
        )
    mean_a = float(np.mean([r["a"] for r in rows]))
    best = max(settings.chain_ks, key=lambda k: expected_tokens_per_round(mean_a, k) / cost(k))
    for r in rows:
        r["analytic_optimum"] = r["K"] == best
    return rows


def batch_sweep(settings: Settings, small, target, loaded, chain_k: int) -> list[dict]:
    """AR against EAGLE-3's chain of `chain_k` at each batch in `settings.sweep_batches` (greedy, free
    continuation, half the new tokens): tokens/s, speedup, and the prediction from the costs measured at that
    batch (a 1-token and a (K + 1)-token target pass, one head call) and the rounds until the batch's slowest row
    ends (`specjax.analysis.batch_speedup`; `one_row_model`: the one-row model it replaces, E(a, K) / (K c + v));
    and the same chain with each round's K chosen on device among 0 (a plain AR round), 1, 2, 4 (those below
    `chain_k`) and `chain_k` from the round costs measured at that batch before the loop (`policy_*`; `AdaptiveK`)."""
    from specjax.decoding import AdaptiveK
    from specjax.metrics import pooled

    cfg, graphdef, params = target
    groups = {b: [small.tokenizer.encode(p) for p in (PROMPTS * b)[:b]] for b in settings.sweep_batches}
    width = costs.prompt_width(list(groups.values()))
    fns, multi_row = {}, costs.on_cpu_multi_row(graphdef, params)
    for b in settings.sweep_batches:
        for t in (1, chain_k + 1, width):
            g, p = costs.as_decoded(b * t, (graphdef, params), multi_row)
            fns[(b, t)] = costs.target_pass(cfg, g, p, b, t, settings.calls)
        fns[(b, "head")] = head_call(loaded, "eagle3", target, b, settings.calls)
    cost = costs.fastest(fns, max(settings.repeats, 5))
    rows, n = [], max(settings.new_tokens // 2, 1)
    for b in settings.sweep_batches:
        eagle3 = make_drafter("eagle3", target, None, loaded, chain_k, None, Sampler())
        policy = dict(
            adaptive_k=AdaptiveK(tuple(sorted({k for k in (0, 1, 2, 4) if k < chain_k} | {chain_k})))
        )
        drafters = {"eagle3": eagle3, "policy": (*eagle3, policy)}
        times, outputs = costs.timed_groups(
            target, [groups[b]], dict(max_new_tokens=n), drafters, settings.repeats
        )
        m = pooled([g.stats for g in outputs["eagle3"]])
        c, v = cost[(b, "head")] / cost[(b, 1)], cost[(b, chain_k + 1)] / cost[(b, 1)]
        per_round = costs.row_distributions(outputs["eagle3"][0].stats)
        predicted = batch_speedup(per_round, n - 1, chain_k * c + v)
        decode = costs.decoding_speedup(times["AR"], times["eagle3"], cost[(b, width)] / settings.calls)
        rows.append(
            dict(batch=b, K=chain_k, tau=m["tau"], a=m["acceptance_rate"], c=c, v=v)
            | dict(rounds=m["rounds"], predicted_rounds=expected_batch_rounds(per_round, n - 1))
            | dict(ar_tok_s=b * n / statistics.median(times["AR"]))
            | dict(spec_tok_s=b * n / statistics.median(times["eagle3"]))
            | dict(speedup=harness.ratio(times["AR"], times["eagle3"]))
            | dict(decode_speedup=decode, predicted=predicted, measured_over_predicted=decode / predicted)
            | dict(
                one_row_model=expected_tokens_per_round(m["acceptance_rate"], chain_k) / (chain_k * c + v)
            )
            | dict(policy_tok_s=b * n / statistics.median(times["policy"]))
            | dict(policy_speedup=harness.ratio(times["AR"], times["policy"]))
            | dict(policy_rounds_by_k=k_counts(outputs["policy"][0].stats))
        )
        print(rows[-1], flush=True)
    return rows


def k_counts(stats) -> str:
    """Row-rounds by draft length K as one table cell ('K=0:12 K=4:30'), the Ks that ran."""
    return " ".join(f"K={k}:{n}" for k, n in enumerate(np.asarray(stats.k_hist).tolist()) if n)


def define_flags() -> None:
    """This script's flags, defined when it runs (not on import: other experiments import its functions)."""
    flags.DEFINE_bool(
        "smoke", False, "Small expansion, two prompts, a few tokens: a quick end-to-end check."
    )
    flags.DEFINE_integer("prompts", None, "Prompts per batch size (default 4; smoke 2).")
    flags.DEFINE_integer("new_tokens", None, "Tokens generated per prompt (default 64; smoke 8).")
    flags.DEFINE_integer("repeats", None, "Timed repetitions (median; default 3).")
    flags.DEFINE_integer(
        "seeds", None, "Samples of each prompt at T > 0, each with its own seed (default 1)."
    )
    flags.DEFINE_list("batches", None, "Batch sizes (default 1,4; smoke 1).")
    flags.DEFINE_list("temperatures", None, "Sampling temperatures, 0 = greedy (default 0,1; smoke 0).")
    flags.DEFINE_list("kinds", None, f"Drafter rows (default all: {', '.join(KINDS)}).")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables.")
    flags.DEFINE_bool("sweeps", True, "Also the K and batch sweeps of EAGLE-3's chain.")
    flags.DEFINE_integer(
        "batch_only",
        None,
        "Only the batch sweep, of EAGLE-3's chain of this K (the full run picks K by a pilot).",
    )
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype of the target.")
    harness.define_precision_flag()


FLAGS = flags.FLAGS


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    settings = SMOKE if FLAGS.smoke else Settings()
    changes = {
        "prompts": FLAGS.prompts,
        "new_tokens": FLAGS.new_tokens,
        "repeats": FLAGS.repeats,
        "seeds": FLAGS.seeds,
        "batches": FLAGS.batches and tuple(map(int, FLAGS.batches)),
        "temperatures": FLAGS.temperatures and tuple(map(float, FLAGS.temperatures)),
        "kinds": FLAGS.kinds and tuple(FLAGS.kinds),
        "dtype": FLAGS.dtype,
        "sweeps": FLAGS.sweeps,
    }
    unknown = set(FLAGS.kinds or ()) - set(KINDS)
    if unknown:
        raise ValueError(f"--kinds names unknown rows {sorted(unknown)}; choose from {list(KINDS)}")
    settings = dataclasses.replace(settings, **{k: v for k, v in changes.items() if v is not None})
    if FLAGS.batch_only:
        small, target, _, loaded = load(settings)
        batch_table(harness.Writer(Path(FLAGS.results)), settings, small, target, loaded, FLAGS.batch_only)
        return
    run(settings, FLAGS.results)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
