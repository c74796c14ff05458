"""Trained Medusa and EAGLE heads vs a truncated-target draft model on stories260K, 20 fixed prompts.

    .venv/bin/python -m experiments.bench_heads [--medusa=heads/stories260K_medusa] [--eagle=heads/stories260K_eagle]

Table 1: Medusa per-head top-1 / top-5 accuracy on the prompts' greedy continuations (the Medusa paper's table).
Table 2: per drafter, tree and temperature: tau, draft efficiency, tokens/s and speedup over AR, measured side by
side in one run (batch 1, medians). Writes results/bench_heads_{accuracy,decode}.{md,csv}.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from experiments import common, harness
from experiments.harness import write_table
from specjax import cli, heads
from specjax.decoding import generate
from specjax.drafting.trees import DynamicTree, medusa_like
from specjax.models.loading import load_model
from specjax.sampling import Sampler

REPO = Path(__file__).resolve().parents[1]
flags.DEFINE_string(
    "medusa", str(REPO / "heads/stories260K_medusa"), "Medusa heads (train_heads.py workdir)."
)
flags.DEFINE_string("eagle", str(REPO / "heads/stories260K_eagle"), "EAGLE head (train_heads.py workdir).")
flags.DEFINE_integer("draft_layers", 2, "Layers of the truncated-target draft model (stories260K has 5).")
flags.DEFINE_integer("repeats", 3, "Timed runs per configuration (median).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
harness.define_precision_flag()
FLAGS = flags.FLAGS

PROMPTS = harness.HEAD_PROMPTS


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    target = load_model()
    cfg, graphdef, params = target.cfg, target.graphdef, target.params
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    n = FLAGS.new_tokens
    loaded = {
        m: heads.load_heads(path, cfg, params)
        for m, path in (("medusa", FLAGS.medusa), ("eagle", FLAGS.eagle))
    }

    # Table 1 on the greedy continuations (cut to the shortest prompt + n tokens).
    greedy = generate(cfg, graphdef, params, prompts, harness.generate_spec(n, eos_id=None))
    width = min(map(len, prompts)) + n
    sequences = jnp.asarray(
        [(p + np.asarray(greedy.tokens[i]).tolist())[:width] for i, p in enumerate(prompts)]
    )
    accuracy = common.medusa_accuracy(target, *loaded["medusa"], sequences)
    print(
        write_table(
            "bench_heads_accuracy",
            accuracy,
            f"Medusa heads on stories260K: accuracy on the greedy "
            f"continuations of {len(prompts)} prompts ({width} tokens each)",
        )
    )

    n_medusa = loaded["medusa"][0]["shape"]["num_heads"]
    medusa_tree, eagle_tree = medusa_like(32, max_depth=n_medusa), medusa_like(32, max_depth=5)
    draft_model = ("draft_model", {"draft_layers": FLAGS.draft_layers})
    medusa, eagle = ("medusa", {"heads": FLAGS.medusa}), ("eagle", {"heads": FLAGS.eagle})
    label = {
        "draft_model": f"draft model ({FLAGS.draft_layers} layers)",
        "medusa": "medusa",
        "eagle": "eagle",
    }
    configs = [  # (drafter and its settings, draft label, K, tree)
        (draft_model, "chain K=4", 4, None),
        (draft_model, "dynamic 4,5,24", 5, DynamicTree(4, 5, 24)),
        (medusa, f"chain K={n_medusa}", n_medusa, None),
        (medusa, f"static {medusa_tree.size - 1} nodes", medusa_tree.depth, medusa_tree),
        (eagle, "chain K=5", 5, None),
        (eagle, f"static {eagle_tree.size - 1} nodes", eagle_tree.depth, eagle_tree),
        (eagle, "dynamic 4,5,24", 5, DynamicTree(4, 5, 24)),
        (eagle, "dynamic 8,6,48", 6, DynamicTree(8, 6, 48)),
    ]
    drafters = [harness.AR] + [
        harness.registered(label[name], shape, name, k, tree, **settings)
        for (name, settings), shape, k, tree in configs
    ]
    rows = []
    for temperature in map(float, FLAGS.temperatures):
        spec = harness.generate_spec(n, Sampler(temperature), eos_id=None)
        for m in harness.decode_rows(target, prompts, spec, drafters, FLAGS.repeats):
            metric = m.metrics
            rows.append(
                dict(
                    drafter="none (AR)" if m.stats is None else m.row.method,
                    draft=m.row.setting,
                    T=temperature,
                )
                | dict(tau=metric["tau"], draft_eff=metric.get("draft_efficiency", np.nan))
                | dict(tok_s=len(prompts) * n / m.seconds, speedup=m.speedup)
            )
            print(rows[-1], flush=True)
    title = (
        f"Drafting heads vs a draft model on stories260K: batch 1, {len(prompts)} prompts x {n} new tokens, "
        f"float32, CPU, medians of {FLAGS.repeats}; draft_eff = accepted / (rounds x depth)"
    )
    print(write_table("bench_heads_decode", rows, title))


if __name__ == "__main__":
    cli.run(main)
