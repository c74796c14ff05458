r"""Distilled draft models on stories260K (DistillSpec): divergence x data source -> held-out acceptance (alpha at
T=0 and T=1) and tau at K=4, beside two baselines: the undistilled first-layer draft (the target truncated to one
layer) and a draft of the same shape trained on plain next-token loss. `make tables` runs it as its `distill`
section (with tau by prompt category and the memory-bound speedup); alone:

    python -m experiments.distill_table                 # trains the missing rows (minutes each), prints the table
    python -m experiments.distill_table --steps=100     # shorter runs

Each row trains `configs/draft.py` with its overrides in checkpoints/distill_table/ROW (resumed if present). Data
sources: `samples` is the target's own samples (self-distillation, configs/draft.py's corpus), `text` a fixed
corpus of 220 short stories written for this table (experiments/data/stories.txt: the target's domain, not its
samples), `+ on-policy 0.5` replaces half of each batch with the draft's own continuations of the rows' first
tokens (DistillSpec's student-generated data), scored by the target. alpha is measured on the 64 target samples
that configs/draft.py holds out of training, tau on the 20 HEAD_PROMPTS x 64 new tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.harness import HEAD_PROMPTS
from specjax import heads
from specjax.decoding import GenerateSpec, speculative_generate
from specjax.drafters import distill
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.metrics import summarize
from specjax.models.llama import causal_mask, forward, init_cache
from specjax.sampling import Sampler
from specjax.training import data, divergences, trainer

TEXT = Path(__file__).resolve().parent / "data" / "stories.txt"
TARGET = "checkpoints/stories260K"  # the rows' frozen target: stories260K converted once
COMMITTED = heads.COMMITTED / "stories260K_distill"
UNDISTILLED = "first layer, undistilled"
K = 4

# row -> (divergence, data source, on_policy_fraction)
ROWS = {
    "next_token / samples": ("next_token", "samples", 0.0),
    "forward_kl / text": ("forward_kl", "text", 0.0),
    "forward_kl / text + on-policy 0.5": ("forward_kl", "text", 0.5),
    "forward_kl / samples": ("forward_kl", "samples", 0.0),
    "forward_kl / on-policy 0.5": ("forward_kl", "samples", 0.5),
    "reverse_kl / samples": ("reverse_kl", "samples", 0.0),
    "reverse_kl / on-policy 0.5": ("reverse_kl", "samples", 0.5),
    "jsd 0.5 / samples": ("jsd", "samples", 0.0),
    "tvd / text": ("tvd", "text", 0.0),
    "tvd / text + on-policy 0.5": ("tvd", "text", 0.5),
    "tvd / samples": ("tvd", "samples", 0.0),
    "tvd / on-policy 0.5": ("tvd", "samples", 0.5),
}


def row_config(divergence: str, source: str, on_policy: float, steps: int):
    from configs.draft import get_config

    c = get_config()
    c.target = TARGET
    c.heads.divergence, c.data.on_policy_fraction = divergence, on_policy
    if source == "text":  # packed in seconds: no cache (the samples' cache stays the samples')
        c.data.source, c.data.cache = str(TEXT), ""
    c.train.steps, c.train.batch_size, c.train.log_every = steps, 16, 50
    c.optimizer.warmup_steps = min(50, steps // 5)
    return c


def slug(row: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in row).strip("_")


def train_row(row: str, steps: int, root: Path) -> tuple[Path, float]:
    """The row's workdir, trained to `steps` (resumed or skipped if done), and the seconds it took."""
    from specjax.models.conversion import converted

    converted("stories260K", TARGET)
    workdir = root / slug(row)
    start = time.perf_counter()
    trainer.train(row_config(*ROWS[row], steps), workdir)
    return workdir, time.perf_counter() - start


def heldout_tokens(target, tokenizer, variant: str = ""):
    """The rows configs/draft.py (its `variant`) holds out of training (the last `data.heldout` of its corpus)."""
    from configs.draft import get_config

    config = get_config(variant)
    config.target = TARGET
    corpus = data.load_corpus(config, target, tokenizer)
    return jnp.asarray(corpus.tokens[-config.data.heldout :])


def alphas(target, draft, tokens_BT) -> tuple[float, float]:
    """Held-out (alpha_T0, alpha_T1) of a draft (cfg, graphdef, params): argmax agreement and mean 1 - TVD at
    T=1, every position."""
    b, t = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits = lambda c, g, p: forward(g, p, tokens_BT, positions, init_cache(c, b, t), causal_mask(t))[0]
    a1, a0 = divergences.acceptance(logits(*target), logits(*draft))
    return float(jnp.mean(a0)), float(jnp.mean(a1))


def tau(target, draft, prompts, n_new: int, temperature: float) -> float:
    """tau of the draft's K=4 chain on the prompts (seed 0)."""
    dcfg, dgraph, dparams = draft
    sampler = Sampler(temperature)
    spec = GenerateSpec(n_new, sampler, eos_id=None)
    gen = speculative_generate(
        *target, DraftModel(dcfg, dgraph, K, sampler), dparams, prompts, spec, seed=0
    )
    return summarize(gen.stats)["tau"]


def baselines(target) -> dict:
    """{name: ((cfg, graphdef, params), training record)} of the drafts that need no training here: the
    undistilled first layer and the committed default draft (configs/draft.py, `make heads`)."""
    from configs.draft import get_config
    from specjax.models.loading import load_model

    committed = load_model(str(COMMITTED), target[0].dtype)
    return {
        UNDISTILLED: (
            truncated_target(target[0], target[2], 1),
            dict(divergence="-", data="-", steps=0),
        ),
        "forward_kl / samples (committed)": (
            (committed.cfg, committed.graphdef, committed.params),
            dict(divergence="forward_kl", data="samples", steps=get_config().train.steps),
        ),
    }


def trained(target, steps: int, root: Path, rows: list[str]) -> dict:
    """{row: ((cfg, graphdef, params), training record)}, each row trained to `steps` in root/ROW."""
    cfg, _, params = target
    out = {}
    for row in rows:
        workdir, seconds = train_row(row, steps, root)
        meta, dgraph, dparams = heads.load_heads(workdir, cfg, params)
        log = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
        divergence, source, on_policy = ROWS[row]
        out[row] = (
            (distill.draft_config(meta["shape"], cfg), dgraph, dparams),
            dict(divergence=divergence, data=source + (f" + on-policy {on_policy:g}" if on_policy else ""))
            | dict(steps=steps, train_s=seconds, tokens_per_s=float(np.mean(speeds[1:] or speeds))),
        )
    return out


def divergence_rows(target, tokenizer, drafts: dict, quick: bool = False) -> list:
    """Per draft: divergence, data, steps, held-out alpha at T=0 and T=1, tau at K=4 (T=0 and T=1) on the
    HEAD_PROMPTS, training seconds and tokens/s (`quick`: configs/draft.py's smoke corpus, 2 prompts, 8 tokens)."""
    held = heldout_tokens(target, tokenizer, "smoke" if quick else "")
    n_new, n_prompts = (8, 2) if quick else (64, None)
    prompts = [tokenizer.encode(p) for p in HEAD_PROMPTS[:n_prompts]]
    rows = []
    for name, (draft, record) in drafts.items():
        a0, a1 = alphas(target, draft, held)
        rows.append(
            dict(draft=name, divergence=record["divergence"], data=record["data"], steps=record["steps"])
            | dict(alpha_T0=a0, alpha_T1=a1)
            | {f"tau_T{t:g}": tau(target, draft, prompts, n_new, t) for t in (0.0, 1.0)}
            | dict(
                train_s=record.get("train_s", float("nan")),
                tokens_per_s=record.get("tokens_per_s", float("nan")),
            )
        )
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    return (
        f"| {r['draft']} | {r['alpha_T0']:.3f} | {r['alpha_T1']:.3f} | {r['tau_T0']:.2f} | {r['tau_T1']:.2f} "
        f"| {r['train_s']:.0f} | {r['tokens_per_s']:.0f} |"
    )


HEADER = (
    "| draft (divergence / data) | alpha T=0 | alpha T=1 | tau K=4 T=0 | tau K=4 T=1 | train s | tokens/s |\n"
    "|---|---|---|---|---|---|---|"
)


def main(argv):
    del argv
    from specjax.models.loading import load_model

    FLAGS = flags.FLAGS
    model = load_model()
    target = (model.cfg, model.graphdef, model.params)
    print(HEADER, flush=True)
    drafts = baselines(target) | trained(
        target, FLAGS.steps, Path(FLAGS.root).absolute(), FLAGS.rows or list(ROWS)
    )
    divergence_rows(target, model.tokenizer, drafts)


if __name__ == "__main__":  # flags defined here: `experiments.tables` imports this module
    flags.DEFINE_integer("steps", 300, "training steps per row")
    flags.DEFINE_string("root", "checkpoints/distill_table", "workdirs of the rows")
    flags.DEFINE_list("rows", [], "only these rows (default: all)")
    app.run(main)
