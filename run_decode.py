"""Decodes text with a Llama-family model, autoregressively or speculatively. No flags: a story from stories260K.

python run_decode.py --prompt="Once upon a time" --max_new_tokens=200 --temperature=0.8
python run_decode.py --drafter=draft_model --draft_layers=2 --compare_ar   # each round's K chosen (0, 1, 2, 4)
python run_decode.py --drafter=draft_model --draft_layers=2 --k=4 --compare_ar   # K = 4 every round
python run_decode.py --drafter=eagle --heads=heads/stories260K_eagle --tree=dynamic:4,6,24 --compare_ar

A --draft_model or --heads that does not fit the target is refused before the target's weights are read
(`python -m specjax.pair` checks a pair alone). A user error ends with one line `error: ...` (exit status 1),
checked before the model loads where it can be;
SPECJAX_DEBUG=1 shows the traceback. A temperature below 1e-5 decodes greedily, with a warning.
"""

import dataclasses

import jax
import numpy as np
from absl import flags, logging

from specjax import acceptance, cli, pair, precision, sharding
from specjax.decoding import AdaptiveK, GenerateSpec
from specjax.drafting import registry
from specjax.drafting.trees import parse_tree
from specjax.heads import resolve_heads
from specjax.metrics import speedup, summarize
from specjax.models.loading import DEFAULT_MODEL, load_model
from specjax.models.quantize import parse_quantization, quantize_loaded
from specjax.runner import decode_texts

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
flags.DEFINE_bool(
    "refill",
    False,
    "All prompts in one compiled loop of --batch_size slots, each taking the next prompt as its row ends "
    "(one device; not with the suffix drafter).",
)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter and activation dtype.")
flags.DEFINE_enum(
    "matmul_precision",
    "dtype",
    precision.CHOICES,
    "Matrix-product precision: dtype = full float32 for float32 weights, the backend's default for bfloat16/float16; "
    "default/high/highest choose (default runs float32 as TF32 on GPUs: faster, not batch-invariant).",
)
flags.DEFINE_string(
    "quantize",
    "",
    "Quantise the target's weights: int8 (a scale per output channel), int4 (groups of 32) or int4:GROUP; "
    "lossy against the float model (drafters are built from the float weights).",
)
flags.DEFINE_string(
    "drafter", "none", f"Draft source, one of {registry.names()}; none = plain AR decoding."
)
flags.DEFINE_integer(
    "k",
    None,
    "Draft tokens per round, the same in every round (chains; a tree sets it to its depth). Default: each round's K "
    "chosen among 0 (a plain AR round), 1, 2 and 4 (see --adaptive_k) where the drafter can change it, else 4.",
)
flags.DEFINE_string(
    "tree",
    "",
    "Draft a tree: a preset (chain4, balanced_2x3, medusa60), 'dynamic:TOP_K,DEPTH,TOTAL' "
    "or paths like '0;1;0,0'. Empty: a chain of --k tokens.",
)
flags.DEFINE_string(
    "acceptance", acceptance.DEFAULT, f"Acceptance rule, one of {sorted(acceptance.RULES)}."
)
flags.DEFINE_string(
    "adaptive_k",
    "",
    "Choose each round's K on device among these chain lengths, e.g. 1,2,4,8 (0: a plain AR round), from the "
    "acceptance so far and round costs timed before the loop (replaces --k). Default, with neither --k nor --tree: "
    "0,1,2,4 where the drafter can change its K.",
)
flags.DEFINE_float(
    "draft_temperature",
    1.0,
    "The drafter samples at --temperature times this (< 1: sharper drafts, often accepted more often); exact for any "
    "value > 0.",
)
flags.DEFINE_bool("compare_ar", False, "Also decode without speculation and print the speedup.")
flags.DEFINE_string(
    "mesh",
    "",
    "Split decoding over devices, e.g. data:2,model:4: the target Megatron style over model, the batch over data "
    "(see specjax/sharding.py). Empty: one device.",
)
cli.define_process_flags()
# meaningful only with a drafter
SPECULATIVE_FLAGS = {"k", "tree", "acceptance", "adaptive_k", "draft_temperature"}
DEFAULT_K = 4  # a chain's K where neither --k nor a policy sets it
# with neither --k nor --tree nor --adaptive_k: each round's K among these (0: a plain AR round), where the drafter
# can change its K
DEFAULT_POLICY = AdaptiveK((0, 1, 2, 4))


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
    """--prompt values, then the lines of --prompts_file; 'Once upon a time' when neither is given. A prompts
    file that is missing, unreadable, not UTF-8 text or without a non-blank line is an error."""
    prompts = list(FLAGS.prompt or [])
    if FLAGS.prompts_file:
        path = FLAGS.prompts_file
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as err:
            raise cli.UsageError(
                f"--prompts_file={path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                "give a text file with one prompt per line"
            ) from err
        except OSError as err:
            raise cli.UsageError(
                f"cannot read --prompts_file={path} ({(err.strerror or str(err)).lower()}); "
                "give a text file with one prompt per line"
            ) from err
        if not lines:
            raise cli.UsageError(
                f"--prompts_file={path} holds no prompt (no non-blank line); write one prompt per line"
            )
        prompts += lines
    return prompts or ["Once upon a time"]


def drafter_flags() -> set[str]:
    return {f.name for n in registry.names() for f in dataclasses.fields(registry.get(n).settings)}


def drafter_plan():
    """(registry entry, settings, k, tree, policy) from the flags, or None for AR, checked before anything is loaded;
    a drafter flag that the chosen drafter does not read is an error, not a silent no-op. policy: --adaptive_k's,
    `DEFAULT_POLICY` where neither --k nor --tree fixes the draft, else None."""
    given = {name for name in drafter_flags() | SPECULATIVE_FLAGS if FLAGS[name].present}
    if FLAGS.drafter == "none":
        if FLAGS.compare_ar:
            given.add("compare_ar")
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise cli.UsageError(
                f"--{', --'.join(sorted(given))} {verb} a drafter (speculative decoding); pass --drafter=NAME "
                f"or drop {'it' if len(given) == 1 else 'them'}"
            )
        return None
    entry = registry.get(FLAGS.drafter)
    own = {f.name for f in dataclasses.fields(entry.settings)}
    if given - own - SPECULATIVE_FLAGS:
        stray = ", --".join(sorted(given - own - SPECULATIVE_FLAGS))
        raise cli.UsageError(f"--{stray} do not apply to --drafter={entry.name}; drop them")
    tree, adaptive = parse_tree(FLAGS.tree), adaptive_k()
    if adaptive and (tree or FLAGS["k"].present):
        raise cli.UsageError("--adaptive_k chooses each round's K itself: drop --k and --tree")
    k = tree.depth if tree else adaptive.k_max if adaptive else DEFAULT_K if FLAGS.k is None else FLAGS.k
    if k < 1:
        raise cli.UsageError(f"--k={k} drafts nothing; pass --k=1 or more (draft tokens per round)")
    if not FLAGS.draft_temperature > 0:
        raise cli.UsageError(
            f"--draft_temperature={FLAGS.draft_temperature} must be > 0 (1: the target's temperature); pass one"
        )
    settings = entry.settings(**{name: FLAGS[name].value for name in own})
    fixed = tree is not None or FLAGS.k is not None
    return entry, settings, k, tree, adaptive or (None if fixed else DEFAULT_POLICY)


def make_drafter(target, sampler, plan):
    """(drafter, its params) built on `target` from `drafter_plan()`; (None, None) for AR."""
    if plan is None:
        return None, None
    entry, settings, k, tree, _ = plan
    return entry.build(target, settings, k, tree, sampler.drafting(FLAGS.draft_temperature))


def check_pair(plan, cfg, tokenizer) -> None:
    """Refuses a --draft_model or --heads that does not fit the target (`specjax.pair`), before anything compiles;
    a drafter made from the target or the default heads is left to its builder."""
    settings = plan and plan[1]
    if getattr(settings, "draft_model", None):
        draft = pair.read_draft(settings.draft_model)
    elif getattr(settings, "heads", None):
        draft = pair.read_draft(resolve_heads(settings.heads), model=False)
    else:
        return
    if draft is not None:
        pair.check_pair(cfg, tokenizer, draft, FLAGS.model or DEFAULT_MODEL)


def adaptive_k() -> AdaptiveK | None:
    return AdaptiveK.parse(FLAGS.adaptive_k) if FLAGS.adaptive_k else None


def policy(plan, drafter) -> AdaptiveK | None:
    """How `drafter` (built from `plan`) chooses each round's K: the plan's policy, the default one only where the
    drafter can change its K (it has `with_k`; the choice reads no token of its round, so it stays exact); None:
    the same draft every round."""
    if plan is None or (plan[4] is DEFAULT_POLICY and not hasattr(drafter, "with_k")):
        return None
    return plan[4]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    # every flag is checked before the model is loaded or anything compiled
    if FLAGS.max_new_tokens < 1 or FLAGS.batch_size < 1:
        bad = "max_new_tokens" if FLAGS.max_new_tokens < 1 else "batch_size"
        raise cli.UsageError(f"--{bad}={FLAGS[bad].value} must be >= 1; pass a positive --{bad}")
    sampler = cli.sampler(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    prompts = read_prompts()
    rule = acceptance.get(FLAGS.acceptance)
    plan = drafter_plan()
    quant = parse_quantization(FLAGS.quantize)
    target = pair.read_model(
        FLAGS.model, weights=False
    )  # config and tokenizer, before the weights are read
    if target is not None:
        check_pair(plan, target.cfg, target.tokenizer)
        if quant is not None:
            quant.check(target.cfg)
    cli.join_processes()
    mesh = sharding.make_mesh(*sharding.parse_mesh(FLAGS.mesh)) if FLAGS.mesh else None
    model = load_model(FLAGS.model, FLAGS.dtype, mesh)
    if target is None:
        check_pair(plan, model.cfg, model.tokenizer)
    if quant is not None:
        quant.check(model.cfg)
    drafter, drafter_params = make_drafter(model, sampler, plan)
    spec = GenerateSpec(
        FLAGS.max_new_tokens,
        sampler,
        eos_id=model.cfg.eos_id,
        acceptance=rule,
        adaptive_k=policy(plan, drafter),
        matmul_precision=FLAGS.matmul_precision,
    )
    model = quantize_loaded(model, quant)
    report = decode_texts(
        model, prompts, spec, FLAGS.seed, FLAGS.batch_size, drafter, drafter_params, mesh, FLAGS.refill
    )
    if drafter and FLAGS.compare_ar:  # every process decodes, process 0 prints
        ar_spec = dataclasses.replace(spec, adaptive_k=None)
        ar_report = decode_texts(
            model, prompts, ar_spec, FLAGS.seed, FLAGS.batch_size, mesh=mesh, refill=FLAGS.refill
        )
    if not sharding.is_main():
        return
    for prompt, text in zip(prompts, report.texts):
        print(f"--- {prompt!r}\n{prompt}{text}\n")
    runs = [("speculative" if drafter else "ar", report)]
    if drafter and FLAGS.compare_ar:
        runs.append(("ar", ar_report))
    print(
        "| mode | model | dtype | matmul precision | prompts | new tokens | compile s | decode s | tokens/s |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    name = model.path.name + (f" {quant.describe()}, lossy vs float" if quant else "")
    matmul = precision.describe(spec.matmul_precision, model.cfg.dtype)
    for mode, r in runs:
        print(
            f"| {mode} | {name} | {model.cfg.dtype} | {matmul} | {len(prompts)} | {r.new_tokens} | {r.compile_s:.2f} "
            f"| {r.run_s:.3f} | {r.tokens_per_s:.1f} |"
        )
    if drafter:
        stats = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *report.stats)  # add up the batches
        m = summarize(stats)
        shape = drafter.shape.describe()
        if spec.adaptive_k:
            shape = f"{spec.adaptive_k.describe()} (row-rounds by K {np.asarray(stats.k_hist).tolist()})"
        print(
            f"\n{shape}, acceptance {rule.name}: tau {m['tau']:.2f} tokens/pass, "
            f"draft efficiency {m['draft_efficiency']:.2f}, "
            f"alpha_i {np.round(m['alpha'], 2).tolist()}, accepted histogram {m['hist'].tolist()}"
        )
        if FLAGS.compare_ar:
            print(f"speedup over AR: {speedup(runs[1][1].run_s, report.run_s):.2f}x")


if __name__ == "__main__":
    cli.run(main)
