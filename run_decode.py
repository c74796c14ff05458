"""Decodes text with a Llama-family model, autoregressively or speculatively. No flags: a story from stories260K.

python run_decode.py --prompt="Once upon a time" --max_new_tokens=200 --temperature=0.8
python run_decode.py --drafter=draft_model --draft_layers=2 --k=4 --compare_ar
python run_decode.py --drafter=eagle --heads=heads/stories260K_eagle --tree=dynamic:4,6,24 --compare_ar
"""

from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging

from specjax import heads
from specjax.decode import GenerateSpec
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.metrics import speedup, summarize
from specjax.models.loading import load_model
from specjax.runner import decode_texts
from specjax.sampling import Sampler
from specjax.trees import parse_tree

FLAGS = flags.FLAGS
HEADS = Path(__file__).resolve().parent / "heads"
flags.DEFINE_string(
    "model", None, "Model path, hub repo id, or None for stories260K (see specjax/models/loading.py)."
)
flags.DEFINE_multi_string("prompt", None, "Prompt text (repeatable). Default: 'Once upon a time'.")
flags.DEFINE_string("prompts_file", None, "A file with one prompt per line.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate per prompt.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1] (1 = off).")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("batch_size", 8, "Prompts decoded together.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter and activation dtype.")
flags.DEFINE_enum(
    "drafter", "none", ["none", "draft_model", "medusa", "eagle"], "Draft source; none = plain AR decoding."
)
flags.DEFINE_string(
    "draft_model", None, "Draft model path/name (default: the target truncated to --draft_layers)."
)
flags.DEFINE_integer(
    "draft_layers", 1, "Layers of the truncated-target draft when --draft_model is not given."
)
flags.DEFINE_string(
    "heads",
    None,
    "Medusa/EAGLE heads: the --workdir of a train_heads.py run (or an export of "
    "one). Default: heads/stories260K_<drafter>.",
)
flags.DEFINE_integer("k", 4, "Draft tokens per round (chains; a tree sets it to its depth).")
flags.DEFINE_string(
    "tree",
    "",
    "Draft a tree: a preset (chain4, balanced_2x3, medusa60), 'dynamic:TOP_K,DEPTH,TOTAL' "
    "or paths like '0;1;0,0'. Empty: a chain of --k tokens.",
)
flags.DEFINE_bool("compare_ar", False, "Also decode without speculation and print the speedup.")


def read_prompts() -> list[str]:
    prompts = list(FLAGS.prompt or [])
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["Once upon a time"]


def make_drafter(target, sampler):
    if FLAGS.drafter == "none":
        return None, None
    tree = parse_tree(FLAGS.tree)
    k = FLAGS.k if tree is None else tree.depth
    if FLAGS.drafter in heads.METHODS:
        workdir = FLAGS.heads or str(HEADS / f"stories260K_{FLAGS.drafter}")
        meta, graphdef, params = heads.load_heads(workdir, target.cfg, target.params)
        if meta["method"] != FLAGS.drafter:
            raise app.UsageError(f"{workdir} holds {meta['method']} heads, not {FLAGS.drafter}")
        drafter = heads.make_drafter(meta, graphdef, target.cfg, k, sampler, tree)
        return drafter, heads.drafter_params(meta, params, target.cfg, target.params)
    if FLAGS.draft_model:
        draft = load_model(FLAGS.draft_model, FLAGS.dtype)
        return DraftModel(draft.cfg, draft.graphdef, k, sampler, tree), draft.params
    cfg, graphdef, params = truncated_target(target.cfg, target.params, FLAGS.draft_layers)
    return DraftModel(cfg, graphdef, k, sampler, tree), params


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    sampler = Sampler(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    prompts = read_prompts()
    model = load_model(FLAGS.model, FLAGS.dtype)
    spec = GenerateSpec(FLAGS.max_new_tokens, sampler, eos_id=model.cfg.eos_id)
    drafter, drafter_params = make_drafter(model, sampler)
    report = decode_texts(model, prompts, spec, FLAGS.seed, FLAGS.batch_size, drafter, drafter_params)
    for prompt, text in zip(prompts, report.texts):
        print(f"--- {prompt!r}\n{prompt}{text}\n")
    runs = [("speculative" if drafter else "ar", report)]
    if drafter and FLAGS.compare_ar:
        runs.append(("ar", decode_texts(model, prompts, spec, FLAGS.seed, FLAGS.batch_size)))
    print(
        "| mode | model | dtype | prompts | new tokens | compile s | decode s | tokens/s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for mode, r in runs:
        print(
            f"| {mode} | {model.path.name} | {model.cfg.dtype} | {len(prompts)} | {r.new_tokens} | {r.compile_s:.2f} "
            f"| {r.run_s:.3f} | {r.tokens_per_s:.1f} |"
        )
    if drafter:
        stats = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *report.stats)  # add up the batches
        m = summarize(stats)
        print(
            f"\nK={drafter.k}: tau {m['tau']:.2f} tokens/pass, draft efficiency {m['draft_efficiency']:.2f}, "
            f"alpha_i {np.round(m['alpha'], 2).tolist()}, accepted histogram {m['hist'].tolist()}"
        )
        if FLAGS.compare_ar:
            print(f"speedup over AR: {speedup(runs[1][1].run_s, report.run_s):.2f}x")


if __name__ == "__main__":
    app.run(main)
