"""Parallel (block) drafting against sequential drafting: `make tables --sections=dflash,dflash_speed`.

- dflash (`tables`): dflash_categories, tau and acceptance by prompt category at T=0 and T=1 on stories260K for
  DFlash (chains of 3, 7 and 15, its dynamic tree, the one-layer head and the TVD heads where committed, and at T=0
  the head trained for greedy decoding where committed; each draft pass runs the block its head was trained on:
  `draft_pass_tokens`), EAGLE-3 sequential (chain K=7, dynamic 8,6,48), parallel EAGLE-3 (where committed) and the
  distilled draft, and at T=1 DFlash's chain of 7 and EAGLE-3 K = 7 drafting at a sharper temperature; the heads'
  training cost in the notes.
- dflash_speed (`speed`): dflash_memory_bound_*, the same drafters on the memory-bound expansion of stories260K
  (`bench_memory_bound`): tokens/s, c, v and the analytic prediction, batch 1, T = 0 and 1; dflash_greedy_,
  dflash_tvd_ and dflash_tvd_b8_memory_bound_*: EAGLE-3 against DFlash with the head trained for greedy decoding
  (configs/dflash_greedy.py) at T = 0, and with the heads fine-tuned on the TVD objective (configs/dflash_tvd.py,
  configs/dflash_tvd_b8.py) at T = 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from experiments import harness
from specjax import metrics
from specjax.sampling import Sampler

HEADS = Path(__file__).resolve().parents[1] / "heads"
CHECKPOINTS = Path("checkpoints")
GREEDY_HEAD = HEADS / "stories260K_dflash_greedy"  # configs/dflash_greedy.py: trained for greedy decoding
GREEDY_B8_HEAD = HEADS / "stories260K_dflash_greedy_b8"  # configs/dflash_greedy_b8.py: on blocks of 8
TVD_HEAD = HEADS / "stories260K_dflash_tvd"  # configs/dflash_tvd.py: fine-tuned on the TVD objective
TVD_B8_HEAD = HEADS / "stories260K_dflash_tvd_b8"  # configs/dflash_tvd_b8.py: that head on blocks of 8
# (head folder or None for the drafter's default, its training run under checkpoints/)
RUNS = {
    "dflash": "dflash_stories260K",
    "dflash_l1": "dflash_l1_stories260K",
    "dflash_greedy": "dflash_greedy_stories260K",
    "dflash_greedy_b8": "dflash_greedy_b8_stories260K",
    "dflash_tvd": "dflash_tvd_stories260K",
    "dflash_tvd_b8": "dflash_tvd_b8_stories260K",
    "eagle3": "eagle3_stories260K",
    "eagle3_parallel": "eagle3_parallel_stories260K",
}


def present(path: Path, *rows: harness.Row) -> list[harness.Row]:
    """`rows` where this checkout has the head folder `path`, else none."""
    return list(rows) if path.exists() else []


def methods(quick: bool) -> list[harness.Row]:
    """The table's rows (the optional heads' where this checkout has them)."""
    reg, whole = harness.registered, {"confidence": False}  # whole: verify the whole block
    rows = [reg("dflash", "chain 7, L=2", "dflash", 7, **whole), reg("eagle3", "chain K=7", "eagle3", 7)]
    if quick:
        return rows
    l1, parallel = HEADS / "stories260K_dflash_l1", HEADS / "stories260K_eagle3_parallel"
    tvd = {"heads": str(TVD_HEAD)}
    sized = {"confidence": True}
    rows = [
        reg("dflash", "chain 3, L=2", "dflash", 3, **whole),
        rows[0],
        reg("dflash", "chain 15, L=2", "dflash", 15, **whole),
        reg("dflash", "chain 15, L=2, confidence-sized", "dflash", 15, **sized),
        reg("dflash", "chain 7, L=2, confidence-sized", "dflash", 7, **sized),
        reg("dflash", "L=2, dynamic 8,6,48", "dflash", 6, "dynamic:8,6,48"),
        *present(
            TVD_HEAD,
            reg("dflash", "chain 7, L=2, TVD head", "dflash", 7, **whole, **tvd),
            reg("dflash", "chain 15, L=2, TVD head", "dflash", 15, **whole, **tvd),
            reg("dflash", "L=2, TVD head, dynamic 8,6,48", "dflash", 6, "dynamic:8,6,48", **tvd),
        ),
        *present(
            TVD_B8_HEAD,
            reg(
                "dflash", "chain 7, L=2, TVD head of block 8", "dflash", 7, **whole, heads=str(TVD_B8_HEAD)
            ),
            reg(
                "dflash",
                "L=2, TVD head of block 8, dynamic 8,6,48",
                "dflash",
                6,
                "dynamic:8,6,48",
                heads=str(TVD_B8_HEAD),
            ),
        ),
        *present(
            l1, *(reg("dflash", f"chain {k}, L=1", "dflash", k, heads=str(l1), **whole) for k in (3, 7, 15))
        ),
        rows[1],
        reg("eagle3", "dynamic 8,6,48", "eagle3", 6, "dynamic:8,6,48"),
        reg("eagle3", "chain K=4", "eagle3", 4),
        *present(
            parallel, reg("eagle3 parallel", "K=4 (trained unroll 4)", "eagle3", 4, heads=str(parallel))
        ),
        reg(
            "distilled draft",
            "2 layers, chain K=4",
            "draft_model",
            4,
            draft_model=str(HEADS / "stories260K_distill"),
        ),
    ]
    return rows


SEEDS = 3  # sampled rows pool this many seeds' decodes (one moved tau by up to 8%)
DRAFT_TEMPERATURE = 0.8  # the sharpened rows' draft temperature, a multiple of the target's


def sharpened(quick: bool) -> list[harness.Row]:
    """DFlash's chain of 7 and EAGLE-3 K = 7 drafting at DRAFT_TEMPERATURE x T (rows of T > 0: greedy drafts are the
    same)."""
    if quick:
        return []
    return [
        harness.Row(
            row.method,
            f"{row.setting}, draft T x {DRAFT_TEMPERATURE:g}",
            lambda target, sampler, row=row: row.build(target, sampler.drafting(DRAFT_TEMPERATURE)),
            row.k,
        )
        for row in methods(True)
    ]


def greedy_rows(quick: bool) -> list[harness.Row]:
    """Rows of T = 0 only: DFlash's chains of 7 and 15 and its dynamic trees with the head trained for greedy
    decoding (configs/dflash_greedy.py; a chain of 7 with its fine-tune on blocks of 8), where this checkout has
    them, and EAGLE-3's deeper trees beside them."""
    if quick or not GREEDY_HEAD.exists():
        return []
    reg, head = harness.registered, {"heads": str(GREEDY_HEAD)}
    b8 = {"heads": str(GREEDY_B8_HEAD), "confidence": False}
    # (depth, tree): the block's 15 positions reach deeper than EAGLE-2's 6
    deeper = ((8, "dynamic:8,8,48"), (10, "dynamic:10,10,64"))
    return [
        reg("dflash", "chain 7, L=2, greedy head", "dflash", 7, confidence=False, **head),
        reg("dflash", "chain 15, L=2, greedy head", "dflash", 15, confidence=False, **head),
        reg("dflash", "L=2, greedy head, dynamic 8,6,48", "dflash", 6, "dynamic:8,6,48", **head),
        *present(GREEDY_B8_HEAD, reg("dflash", "chain 7, L=2, greedy head of block 8", "dflash", 7, **b8)),
        *(
            reg("dflash", f"L=2, greedy head, {t.replace(':', ' ')}", "dflash", d, t, **head)
            for d, t in deeper
        ),
        *(reg("eagle3", t.replace(":", " "), "eagle3", d, t) for d, t in deeper),
    ]


def passes(drafter) -> int:
    """Draft passes a round makes: one for a block or a parallel head, else one per depth."""
    return (
        1 if getattr(drafter, "parallel", False) or hasattr(drafter, "taps_width") else drafter.shape.depth
    )


def category_rows(target, categories: dict, quick: bool) -> list[dict]:
    import jax

    from specjax.decoding import speculative_generate

    rows = []
    temperatures = [(row, (0.0,) if quick else (0.0, 1.0)) for row in methods(quick)]
    temperatures += [(row, (0.0,)) for row in greedy_rows(quick)] + [
        (row, (1.0,)) for row in sharpened(quick)
    ]
    for row, ts in temperatures:
        for t in ts:
            sampler = Sampler(t)
            drafter, dparams = row.build(target, sampler)
            for category, (prompts, n) in categories.items():
                spec = harness.generate_spec(n, sampler, eos_id=None)
                stats = [
                    speculative_generate(
                        target.cfg,
                        target.graphdef,
                        target.params,
                        drafter,
                        dparams,
                        prompts,
                        spec,
                        seed=seed,
                    ).stats
                    for seed in range(SEEDS if t > 0 else 1)  # greedy decoding draws nothing
                ]
                m = metrics.pooled(stats)
                hist = sum(np.asarray(s.k_hist) for s in stats)  # rounds by verified length
                rows.append(
                    dict(method=row.method, setting=row.setting, category=category, T=t, tau=m["tau"])
                    | dict(verified_per_round=float(np.dot(np.arange(len(hist)), hist) / hist.sum()))
                    | dict(a=m["acceptance_rate"], draft_passes_per_round=passes(drafter))
                    | dict(draft_pass_tokens=getattr(drafter, "block", float("nan")))
                )
            # each drafter's programs freed: XLA CPU maps every compiled program until JAX's caches let go, and
            # this section's decodes, then the memory-bound runs, crashed on the process's vm.max_map_count
            jax.clear_caches()
    return rows


def training_notes() -> str:
    """The committed heads' training cost, from their runs' logs under checkpoints/ or in their exports."""
    lines = []
    for head, run in RUNS.items():
        # the run, or the export, which keeps its config and log (exports made before it did: none)
        kept = [
            d for d in (CHECKPOINTS / run, HEADS / f"stories260K_{head}") if (d / "metrics.jsonl").exists()
        ]
        if not kept or not (kept[0] / "config.json").exists():
            continue
        log, config = kept[0] / "metrics.jsonl", kept[0] / "config.json"
        c = json.loads(config.read_text())["config"]
        logged = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        tokens = c["train.batch_size"] * c["data.seq_len"]
        steps = [r["step"] for r in logged]
        spans = np.diff([0] + steps)
        seconds = float(sum(s * tokens / r["tokens_per_s"] for s, r in zip(spans, logged)))
        rate = np.median([r["tokens_per_s"] for r in logged])
        mixed = (
            f" and as many at T = {c['data.mix_temperature']:g}"
            if c.get("data.mix_temperature", -1) >= 0
            else ""
        )
        data = (
            f"{c['data.num_samples']} self-distilled documents{mixed}"
            if c["data.source"] == "self_distill"
            else c["data.source"]
        )
        objective = f", {c['heads.divergence']}" if "heads.divergence" in c else ""
        start = c.get("train.init_from") or "random weights"
        lines.append(
            f"- {head}: {steps[-1]} steps x {tokens} tokens from {data}{objective}, started from {start}, median "
            f"{rate:.0f} tokens/s, "
            f"{seconds / 60:.1f} min of train steps (from the logged rate; compile and checkpoints aside)"
        )
    if not lines:
        return "Training cost: no log of these heads' training under checkpoints/ or in their exports (`make heads`)."
    return "Training cost (`make heads`, on the machine that trained each head):\n" + "\n".join(lines)


def tables(out: harness.Writer, quick: bool, target, categories: dict) -> None:
    """dflash_categories: tau by prompt category (quick: the first category, a few rows)."""
    if quick:  # one category: the other sections' quick runs cover the rest
        categories = dict(list(categories.items())[:1])
    out.table(
        "dflash_categories",
        category_rows(target, categories, quick),
        "Parallel against sequential drafting on stories260K (batch 1, float32): tau and acceptance rate by prompt "
        f"category (T = 1: {SEEDS} seeds pooled); a DFlash round drafts its whole block in one pass",
        training_notes(),
    )


def speed(out: harness.Writer, repeats: int) -> None:
    """dflash_memory_bound_*: the drafters on the memory-bound target (`bench_memory_bound`), T = 0 and 1; then
    EAGLE-3 against DFlash with the greedy head at T = 0 and with the TVD heads (blocks of 16 and 8) at T = 1, where
    committed."""
    from experiments import bench_memory_bound as bench

    settings = bench.Settings(
        batches=(1,),
        kinds=(
            "distilled draft",
            "eagle3 chain",
            "eagle3 dynamic",
            "dflash chain",
            "dflash sized",
            "dflash dynamic",
        ),
        categories=(),
        sweeps=False,
        chain_ks=(7,),
        dynamic=((8, 6, 48),),
        repeats=repeats,
        seeds=6,  # one sample a prompt: T = 1's tau varied between seeds by a standard deviation of 0.2-0.28
        name="dflash_memory_bound",
    )
    bench.run(settings, out.folder)
    runs = (
        (GREEDY_HEAD, "dflash_greedy", 0.0),
        (GREEDY_B8_HEAD, "dflash_greedy_b8", 0.0),
        (TVD_HEAD, "dflash_tvd", 1.0),
        (TVD_B8_HEAD, "dflash_tvd_b8", 1.0),
    )
    for head, name, t in runs:
        if head.exists():
            kinds = ("eagle3 chain", "dflash chain", "dflash dynamic")
            blocks = (8,) if head in (TVD_B8_HEAD, GREEDY_B8_HEAD) else (8, 16)  # chains of 7 (and 15)
            own = dict(temperatures=(t,), dflash_blocks=blocks, dflash_head=head.name, kinds=kinds)
            bench.run(dataclasses.replace(settings, name=f"{name}_memory_bound", **own), out.folder)
