"""Chain vs static tree presets vs EAGLE-2-style dynamic trees on stories260K with a truncated-target draft.

    .venv/bin/python -m experiments.bench_trees [--draft_layers=3] [--repeats=5] [--new_tokens=128]

Per tree and temperature: tau, verify-pass cost relative to a 1-token pass, tokens/s and speedup over AR,
side by side in one run. Writes results/bench_trees.{md,csv}.
"""

from absl import flags, logging

from experiments import harness
from experiments.costs import per_call_seconds
from experiments.harness import write_table
from specjax import cli
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafting.trees import PRESETS, DynamicTree
from specjax.models.loading import load_model
from specjax.sampling import Sampler

flags.DEFINE_integer("draft_layers", 3, "Layers of the truncated-target draft (stories260K has 5).")
flags.DEFINE_integer("repeats", 5, "Timed runs per configuration (median).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per run.")
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
harness.define_precision_flag()
FLAGS = flags.FLAGS
PROMPTS = ["Once upon a time, there was a little", "Tom and his dog went to the", "Lily wanted to"]
TREES = [
    ("chain K=4", None),
    ("chain4 (as tree)", PRESETS["chain4"]),
    ("balanced_2x3", PRESETS["balanced_2x3"]),
    ("medusa60", PRESETS["medusa60"]),
    ("dynamic 2,4,8", DynamicTree(2, 4, 8)),
    ("dynamic 4,4,16", DynamicTree(4, 4, 16)),
    ("dynamic 4,5,32", DynamicTree(4, 5, 32)),
]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.repeats < 1:  # before anything loads or compiles
        raise cli.UsageError(f"repeats={FLAGS.repeats} times nothing; pass --repeats=1 or more")
    target = load_model()
    cfg, graphdef, params = target.cfg, target.graphdef, target.params
    dcfg, dgraphdef, dparams = truncated_target(cfg, params, FLAGS.draft_layers)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    n, rows = FLAGS.new_tokens, []
    one_token = per_call_seconds(cfg, graphdef, params, 1, 256, FLAGS.repeats)
    for temperature in map(float, FLAGS.temperatures):
        spec = harness.generate_spec(n, Sampler(temperature), eos_id=None)
        drafters = [harness.AR] + [
            harness.Row(
                name,
                build=lambda target, sampler, tree=tree: (
                    DraftModel(dcfg, dgraphdef, 4 if tree is None else tree.depth, sampler, tree),
                    dparams,
                ),
            )
            for name, tree in TREES
        ]
        for m in harness.decode_rows(target, prompts, spec, drafters, FLAGS.repeats):
            drafter = m.row.build and m.row.build(target, spec.sampler)[0]
            nodes = 1 if drafter is None else drafter.shape.size
            verify = (
                drafter and per_call_seconds(cfg, graphdef, params, nodes, 256, FLAGS.repeats) / one_token
            )
            rows.append(
                dict(tree="none (AR)" if drafter is None else m.row.method, nodes=nodes, T=temperature)
                | dict(tau=m.metrics["tau"], verify_cost=verify or 1.0)
                | dict(tok_s=len(prompts) * n / m.seconds, speedup=m.speedup)
            )
            print(rows[-1], flush=True)
    title = (
        f"Trees on stories260K, draft = target truncated to {FLAGS.draft_layers} layers, batch 1, {n} new tokens "
        f"x {len(prompts)} prompts, float32, medians of {FLAGS.repeats}; verify_cost = target pass over `nodes` "
        "tokens / 1-token pass"
    )
    print(write_table("bench_trees", rows, title))


if __name__ == "__main__":
    cli.run(main)
