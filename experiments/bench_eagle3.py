"""EAGLE-2 vs EAGLE-3 on stories260K: the same dynamic tree and budget, per-step acceptance, tau and tokens/s.

    .venv/bin/python -m experiments.bench_eagle3 [--eagle=heads/stories260K_eagle] [--eagle3=heads/stories260K_eagle3]
        [--vocab_heads=WORKDIR,...]   # EAGLE-3 heads with other draft vocabularies, trained on the same tokens

Table 1: per head, tree and temperature: alpha_i (acceptance of draft depth i given the depths before it), tau,
tokens/s and speedup over AR, measured side by side in one run (batch 1, 20 prompts, medians). Table 2 (with
--vocab_heads): the same on the first draft shape for each listed EAGLE-3 head, labelled by its draft vocabulary. Writes
results/bench_eagle3{,_vocab}.{md,csv}.
"""

from pathlib import Path

from absl import flags, logging

from experiments import harness
from experiments.harness import HEAD_PROMPTS as PROMPTS
from experiments.harness import write_table
from specjax import cli, heads
from specjax.drafting.trees import parse_tree
from specjax.models.loading import load_model
from specjax.sampling import Sampler

REPO = Path(__file__).resolve().parents[1]
flags.DEFINE_string("eagle", str(REPO / "heads/stories260K_eagle"), "EAGLE-1/2 head (workdir or export).")
flags.DEFINE_string("eagle3", str(REPO / "heads/stories260K_eagle3"), "EAGLE-3 head (workdir or export).")
flags.DEFINE_list("vocab_heads", [], "EAGLE-3 heads with other draft vocabularies, for the second table.")
flags.DEFINE_list(
    "trees", ["dynamic:8,6,48", "chain:6"], "Draft shapes: dynamic:TOP_K,DEPTH,TOTAL or chain:K."
)
flags.DEFINE_integer("repeats", 3, "Timed runs per configuration (median).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("prompts", len(PROMPTS), "How many of the 20 prompts.")
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
harness.define_precision_flag()
FLAGS = flags.FLAGS


def shape_of(text: str):
    """(K, tree) of a draft shape: chain:K or anything `parse_tree` reads."""
    if text.startswith("chain:"):
        return int(text.split(":")[1]), None
    tree = parse_tree(text)
    return tree.depth, tree


def vocabulary(meta: dict, vocab_size: int) -> int:
    ids = meta["shape"].get("draft_ids")
    return vocab_size if ids is None else len(ids)


def rows_for(target, label, workdir, prompts, samplers, trees):
    """One row per (temperature, draft shape in `trees`) for the head in `workdir`, each timed in turns with AR."""
    meta, graphdef, hparams = heads.load_heads(workdir, target.cfg, target.params)
    dparams = heads.drafter_params(meta, hparams, target.cfg, target.params)
    build = lambda k, tree: (
        lambda t, sampler: (heads.make_drafter(meta, graphdef, t.cfg, k, sampler, tree), dparams)
    )
    shapes = [harness.Row(text, build=build(*shape_of(text))) for text in trees]
    rows = []
    for sampler in samplers:
        spec = harness.generate_spec(FLAGS.new_tokens, sampler, eos_id=None)
        for m in harness.decode_rows(target, prompts, spec, shapes, FLAGS.repeats):
            alphas = {f"alpha_{i + 1}": a for i, a in enumerate(m.metrics["alpha"])}  # all prompts together
            rows.append(
                dict(
                    head=label(meta),
                    draft=m.row.method,
                    T=sampler.temperature,
                    tau=m.metrics["tau"],
                    **alphas,
                )
                | dict(tok_s=len(prompts) * FLAGS.new_tokens / m.seconds, speedup=m.speedup)
            )
            print(rows[-1], flush=True)
    return rows


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    target = load_model()
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[: FLAGS.prompts]]
    samplers = [Sampler(float(t)) for t in FLAGS.temperatures]
    what = (
        f"stories260K, batch 1, {len(prompts)} prompts x {FLAGS.new_tokens} new tokens, float32, CPU, medians of "
        f"{FLAGS.repeats}; speedup over AR timed in turns with each row"
    )
    method = lambda meta: "EAGLE-3" if meta["method"] == "eagle3" else "EAGLE-2"
    rows = []
    for workdir in (FLAGS.eagle, FLAGS.eagle3):
        rows += rows_for(target, method, workdir, prompts, samplers, FLAGS.trees)
    print(write_table("bench_eagle3", rows, f"EAGLE-2 vs EAGLE-3 heads: {what}"))
    if FLAGS.vocab_heads:
        label = lambda meta: f"EAGLE-3, draft vocabulary {vocabulary(meta, target.cfg.vocab_size)}"
        rows = [
            r
            for w in FLAGS.vocab_heads
            for r in rows_for(target, label, w, prompts, samplers, FLAGS.trees[:1])
        ]
        print(
            write_table(
                "bench_eagle3_vocab", rows, f"EAGLE-3 draft vocabularies, same training tokens: {what}"
            )
        )


if __name__ == "__main__":
    cli.run(main)
