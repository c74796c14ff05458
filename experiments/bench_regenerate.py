"""Regenerated conversation data for head training: the tau gain of letting the target rewrite the assistant turns.

    .venv/bin/python -m experiments.bench_regenerate [--conversations=512] [--steps=600]

stories260K is not a chat model, so the conversations are story requests ("Tell me a story about a dog.",
"Tell me another one.") rendered with `configs/chat/stories.jinja`. Their assistant turns are first written by
another writer than the target: the target sampled at `--writer_temperature` (1.5: a flatter distribution than
the one decoding samples), standing in for data written by another model. Two EAGLE-3 heads (configs/eagle3.py)
are then trained with the same steps, batch and seed, the loss masked to the assistant's tokens: one on the
conversations as written, one on the same conversations after the target rewrote every assistant turn
(`data.regenerate`, at `--regen_temperature`). The table: tau and per-depth acceptance of each head on held-out
requests (subjects absent from training), at T=0 and T=1 on the same draft tree. Writes results/bench_regenerate.
"""

import runpy
from pathlib import Path

from absl import flags, logging

from experiments import harness
from experiments.harness import write_table
from specjax import cli, heads
from specjax.drafting.trees import parse_tree
from specjax.models.loading import load_model
from specjax.sampling import Sampler
from specjax.training import chat, regenerate, trainer

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "configs" / "chat" / "stories.jinja"
TRAIN_SUBJECTS = [
    "cat",
    "dog",
    "bird",
    "fish",
    "frog",
    "bear",
    "duck",
    "cow",
    "pig",
    "horse",
    "lion",
    "mouse",
    "owl",
    "fox",
    "bee",
    "ant",
]
HELD_OUT = ["rabbit", "turtle", "tiger", "sheep", "goat", "whale", "snake", "monkey", "zebra", "penguin"]

flags.DEFINE_string("workdir", str(REPO / "results" / "regenerate"), "Data, corpora and heads of this run.")
flags.DEFINE_integer("conversations", 512, "Training conversations (two assistant turns each).")
flags.DEFINE_integer("turn_tokens", 120, "Tokens per assistant turn, written and regenerated.")
flags.DEFINE_float("writer_temperature", 1.5, "Temperature of the other writer of the original turns.")
flags.DEFINE_float("regen_temperature", 1.0, "Temperature of the target's rewrite.")
flags.DEFINE_integer("steps", 600, "Training steps of each head (same batch and seed).")
flags.DEFINE_string("tree", "dynamic:8,6,48", "Draft tree of the evaluation.")
flags.DEFINE_list("temperatures", ["0", "1"], "Evaluation temperatures (0 = greedy).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per held-out request.")
harness.define_precision_flag()
FLAGS = flags.FLAGS


def requests(subjects, n: int) -> list[list[dict]]:
    """`n` two-turn story conversations with empty assistant turns, cycling through `subjects`."""
    return [
        [
            {"role": "user", "content": f"Tell me a story about a {subjects[i % len(subjects)]}."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Tell me another one."},
            {"role": "assistant", "content": ""},
        ]
        for i in range(n)
    ]


def train(name: str, source: Path, regenerate_to: str, workdir: Path) -> Path:
    c = runpy.run_path(str(REPO / "configs" / "eagle3.py"))["get_config"]()
    c.data.source, c.data.chat_template, c.data.regenerate = str(source), str(TEMPLATE), regenerate_to
    c.data.sample_len, c.data.temperature = FLAGS.turn_tokens, FLAGS.regen_temperature
    c.data.cache = str(workdir / f"corpus_{name}.npy")
    c.train.steps, c.train.checkpoint_every = FLAGS.steps, FLAGS.steps
    out = workdir / f"heads_{name}"
    trainer.train(c, out)
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    workdir = Path(FLAGS.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    target = load_model()
    model = (target.cfg, target.graphdef, target.params)
    template = TEMPLATE.read_text()
    written = workdir / "written.jsonl"  # the original data: another writer's turns
    regenerate.regenerate(
        requests(TRAIN_SUBJECTS, FLAGS.conversations),
        model,
        target.tokenizer,
        template,
        written,
        {"writer": "stories260K", "subjects": TRAIN_SUBJECTS},
        FLAGS.turn_tokens,
        FLAGS.writer_temperature,
        seed=1,
        batch=64,
    )
    runs = {
        "as written": train("written", written, "", workdir),
        "regenerated": train("regenerated", written, str(workdir / "regenerated.jsonl"), workdir),
    }
    logging.set_verbosity(logging.WARNING)
    prompts = [
        chat.prompt_ids(target.tokenizer, c[:1], template) for c in requests(HELD_OUT, len(HELD_OUT))
    ]
    tree = parse_tree(FLAGS.tree)
    rows = []
    for label, path in runs.items():
        meta, graphdef, hparams = heads.load_heads(path, target.cfg, target.params)
        dparams = heads.drafter_params(meta, hparams, target.cfg, target.params)
        for t in FLAGS.temperatures:
            sampler = Sampler(float(t))
            drafter = heads.make_drafter(meta, graphdef, target.cfg, tree.depth, sampler, tree)
            spec = harness.generate_spec(FLAGS.new_tokens, sampler, eos_id=None)
            row = harness.Row(label, build=lambda *_: (drafter, dparams))
            m = next(harness.decode_rows(target, prompts, spec, [row], repeats=0)).metrics
            alphas = {f"alpha_{i + 1}": a for i, a in enumerate(m["alpha"])}
            rows.append(dict(data=label, T=sampler.temperature, tau=m["tau"], **alphas))
            print(rows[-1], flush=True)
    title = (
        f"EAGLE-3 heads on stories260K conversations ({FLAGS.conversations} x 2 turns of up to {FLAGS.turn_tokens} "
        f"tokens, written at T={FLAGS.writer_temperature}; regenerated at T={FLAGS.regen_temperature}), "
        f"{FLAGS.steps} steps each; tau on {len(prompts)} held-out requests x {FLAGS.new_tokens} tokens, "
        f"tree {FLAGS.tree}"
    )
    print(write_table("bench_regenerate", rows, title))


if __name__ == "__main__":
    cli.run(main)
