"""Decodes text with a Llama-family model, autoregressively or speculatively. No flags: a story from stories260K.

python run_decode.py --prompt="Once upon a time" --max_new_tokens=200 --temperature=0.8
python run_decode.py --drafter=draft_model --draft_layers=2 --k=4 --compare_ar
python run_decode.py --drafter=eagle --heads=heads/stories260K_eagle --tree=dynamic:4,6,24 --compare_ar
"""

import dataclasses
import os
import sys

import jax
import numpy as np
from absl import app, flags, logging

from specjax import acceptance
from specjax.decoding import GenerateSpec
from specjax.drafters import registry
from specjax.metrics import speedup, summarize
from specjax.models.loading import load_model
from specjax.runner import decode_texts
from specjax.sampling import Sampler
from specjax.trees import parse_tree

FLAGS = flags.FLAGS
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
flags.DEFINE_string(
    "drafter", "none", f"Draft source, one of {registry.names()}; none = plain AR decoding."
)
flags.DEFINE_integer("k", 4, "Draft tokens per round (chains; a tree sets it to its depth).")
flags.DEFINE_string(
    "tree",
    "",
    "Draft a tree: a preset (chain4, balanced_2x3, medusa60), 'dynamic:TOP_K,DEPTH,TOTAL' "
    "or paths like '0;1;0,0'. Empty: a chain of --k tokens.",
)
flags.DEFINE_string(
    "acceptance", acceptance.DEFAULT, f"Acceptance rule, one of {sorted(acceptance.RULES)}."
)
flags.DEFINE_bool("compare_ar", False, "Also decode without speculation and print the speedup.")
SPECULATIVE_FLAGS = {"k", "tree", "acceptance"}  # meaningful only with a drafter


def define_drafter_flags() -> None:
    """One flag per field of every registered drafter's settings (a field shared by drafters is one
    flag); call again after registering a drafter to add its flags."""
    kinds = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float}
    for name in registry.names():
        entry = registry.get(name)
        for field in dataclasses.fields(entry.settings):
            if field.name not in FLAGS:
                define = kinds.get(type(field.default), flags.DEFINE_string)
                define(field.name, field.default, entry.help.get(field.name, f"{name} setting"))


define_drafter_flags()


def read_prompts() -> list[str]:
    prompts = list(FLAGS.prompt or [])
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["Once upon a time"]


def drafter_flags() -> set[str]:
    return {f.name for n in registry.names() for f in dataclasses.fields(registry.get(n).settings)}


def make_drafter(target, sampler):
    """(drafter, its params) from the flags, or (None, None) for AR; a drafter flag that the chosen drafter
    does not read is an error, not a silent no-op."""
    given = {name for name in drafter_flags() | SPECULATIVE_FLAGS if FLAGS[name].present}
    if FLAGS.drafter == "none":
        if given:
            raise ValueError(f"--{', --'.join(sorted(given))} need a drafter; pass --drafter=NAME")
        return None, None
    entry = registry.get(FLAGS.drafter)
    own = {f.name for f in dataclasses.fields(entry.settings)}
    if given - own - SPECULATIVE_FLAGS:
        stray = ", --".join(sorted(given - own - SPECULATIVE_FLAGS))
        raise ValueError(f"--{stray} do not apply to --drafter={entry.name}; drop them")
    tree = parse_tree(FLAGS.tree)
    k = FLAGS.k if tree is None else tree.depth
    settings = entry.settings(**{name: FLAGS[name].value for name in own})
    return entry.build(target, settings, k, tree, sampler)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    sampler = Sampler(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    prompts = read_prompts()
    model = load_model(FLAGS.model, FLAGS.dtype)
    rule = acceptance.get(FLAGS.acceptance)
    spec = GenerateSpec(FLAGS.max_new_tokens, sampler, eos_id=model.cfg.eos_id, acceptance=rule)
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
            f"\n{drafter.shape.describe()}, acceptance {rule.name}: tau {m['tau']:.2f} tokens/pass, "
            f"draft efficiency {m['draft_efficiency']:.2f}, "
            f"alpha_i {np.round(m['alpha'], 2).tolist()}, accepted histogram {m['hist'].tolist()}"
        )
        if FLAGS.compare_ar:
            print(f"speedup over AR: {speedup(runs[1][1].run_s, report.run_s):.2f}x")


def run(argv) -> None:
    """`main` with user errors as one line `error: ...` and exit status 1 (SPECJAX_DEBUG=1: traceback)."""
    try:
        main(argv)
    except (ValueError, OSError) as err:  # specjax's typed errors are ValueErrors
        if os.environ.get("SPECJAX_DEBUG"):
            raise
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    app.run(run)
