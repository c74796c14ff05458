"""Speculative decoding with the draft-model drafter vs AR, and transformers' assisted generation on the same weights.

    .venv/bin/python -m experiments.bench_spec [--models=stories260K,llama-110M] [--ks=2,4,8] [--repeats=21]
        [--hf_repeats=5] [--drafts=self,truncated,random] [--new_tokens=128] [--nohf]

Per target, draft (self / truncated / random), K and temperature: tau, draft efficiency, tokens/s, speedup
over specjax AR, loop efficiency = (draft steps + verify pass) / measured round time (the median of the per-repetition
ratios, and the fastest model calls against the fastest round: the estimate for a quiet machine), the analytical speedup
(Leviathan et al.) for the measured mean alpha and cost ratio c, and transformers'
`generate(assistant_model=...)` speedup over its own `generate`. Model calls are timed in their own compiled
loops (their logits feed the next call through a max: no argmax or sampling counts as model time), taking
turns with the AR and speculative runs (`interleaved_times`); speedup, loop efficiency and c are computed
within each repetition, then their median is reported, so that the machine's drift cancels. The draft
steps are K - 1 one-token steps and the two-token step that opens each round (the draft model re-reads the
last accepted token with the pending one); the round time excludes the fixed cost of prefill, measured with
a max_new_tokens=1 run on a cache of the same size. The self-draft is the target itself, the same weight
buffers (in transformers too).
Writes results/bench_spec.{md,csv}.
"""

import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from absl import flags, logging

from experiments import harness
from experiments.common import SHAPES, quiet_transformers, random_hf_model
from experiments.costs import target_pass
from experiments.harness import interleaved_times, median_time, write_table
from specjax import cli
from specjax.analysis import expected_speedup
from specjax.decoding import compile_decode, prepare_speculative
from specjax.decoding.compile import decoding_layout, drafter_layout
from specjax.drafters.draft_model import DraftModel
from specjax.metrics import loop_efficiency, summarize
from specjax.models.config import LlamaConfig
from specjax.models.loading import load_model
from specjax.models.weights import params_from_hf, read_safetensors
from specjax.sampling import Sampler

flags.DEFINE_list("models", ["stories260K", "llama-110M"], "Targets.")
flags.DEFINE_list(
    "drafts",
    ["self", "truncated", "random"],
    "Draft models: the target itself, its first layers, a small random model.",
)
flags.DEFINE_list("ks", ["2", "4", "8"], "Draft lengths K.")
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
flags.DEFINE_integer("repeats", 21, "Timed runs of each specjax function per configuration (median).")
flags.DEFINE_integer(
    "hf_repeats", 5, "Timed runs of each transformers generation per configuration (median)."
)
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per run.")
flags.DEFINE_bool("hf", True, "Also time transformers' assisted generation.")
harness.define_precision_flag()
FLAGS = flags.FLAGS
PROMPT = "Once upon a time, there was a little"
RANDOM_DRAFT = {
    "stories260K": dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, hidden_dim=128, vocab_size=512),
    "llama-110M": SHAPES["llama-15M"],
}
TRUNCATED_LAYERS = {"stories260K": 2, "llama-110M": 2}
CALLS = 32  # model calls per timed loop


def hf_dir_to_specjax(path: Path):
    cfg = LlamaConfig.from_hf(transformers.AutoConfig.from_pretrained(path).to_dict())
    return (cfg, *params_from_hf(cfg, read_safetensors(path)))


def drafts(name: str, target_dir: Path, tmp: Path):
    """{draft name: HF model dir} of the drafts in --drafts; the truncated draft is the target's first layers,
    saved as its own model."""
    out = {}
    for draft in FLAGS.drafts:
        if draft == "self":
            out[draft] = target_dir
        elif draft == "truncated":
            hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
            hf.config.num_hidden_layers = TRUNCATED_LAYERS[name]
            hf.model.layers = hf.model.layers[: TRUNCATED_LAYERS[name]]
            hf.save_pretrained(tmp / draft)
            out[draft] = tmp / draft
        elif draft == "random":
            random_hf_model(RANDOM_DRAFT[name], tmp / draft, seed=5)
            out[draft] = tmp / draft
        else:
            raise ValueError(f"unknown draft {draft!r}: choose from self, truncated, random")
    return out


def hf_generate_seconds(target, assistant, ids, n, k, temperature):
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=0, do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if assistant is not None:
        kwargs.update(
            assistant_model=assistant,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    with torch.inference_mode():
        return median_time(lambda: target.generate(ids, **kwargs), FLAGS.hf_repeats)


def bench_target(name: str, target_dir: Path, tmp: Path) -> list[dict]:
    target = load_model(str(target_dir))
    cfg, n = target.cfg, FLAGS.new_tokens
    prompt = target.tokenizer.encode(PROMPT)
    ids = torch.tensor([prompt])
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval() if FLAGS.hf else None
    # the target's passes timed apart laid out as a drafter's job runs them (`decoding_layout`)
    vgraph, vparams, _, _ = decoding_layout(target.graphdef, target.params, None, None, True)
    rows = []
    for temperature in map(float, FLAGS.temperatures):
        sampler = Sampler(temperature)
        spec = harness.generate_spec(n, sampler, eos_id=None)
        ar_run, _ = compile_decode(cfg, target.graphdef, target.params, [prompt], spec)
        ar_s = median_time(lambda: jax.block_until_ready(ar_run([prompt])), FLAGS.repeats)
        hf_ar_s = hf_generate_seconds(hf_target, None, ids, n, 0, temperature) if FLAGS.hf else np.nan
        rows.append(
            dict(
                target=name,
                draft="none (AR)",
                K=0,
                T=temperature,
                tau=1.0,
                draft_eff=np.nan,
                tok_s=n / ar_s,
                speedup=1.0,
                loop_eff=np.nan,
                loop_eff_min=np.nan,
                analytic=1.0,
                hf_tok_s=n / hf_ar_s,
                hf_speedup=1.0,
            )
        )
        for draft_name, draft_dir in drafts(name, target_dir, tmp).items():
            if draft_name == "self":  # the target's own buffers, not a copy: one weight set in the caches
                dcfg, dgraphdef, dparams, hf_draft = cfg, target.graphdef, target.params, hf_target
            else:
                dcfg, dgraphdef, dparams = hf_dir_to_specjax(draft_dir)
                hf_draft = (
                    transformers.AutoModelForCausalLM.from_pretrained(draft_dir).eval()
                    if FLAGS.hf
                    else None
                )
            for k in map(int, FLAGS.ks):
                drafter = DraftModel(dcfg, dgraphdef, k, sampler)
                run, _ = compile_decode(
                    cfg, target.graphdef, target.params, [prompt], spec, drafter, dparams
                )
                m = summarize(jax.block_until_ready(run([prompt])).stats)
                # round time without the fixed cost (prefills, first token): a run of max_new_tokens=1 (same cache
                # size: prefill time grows with it) has no round
                size = prepare_speculative(cfg, drafter, [prompt], spec)[2].cache_size
                laid, lparams = drafter_layout(drafter, dparams)  # as the decode runs it
                fixed, _ = compile_decode(
                    cfg,
                    target.graphdef,
                    target.params,
                    [prompt],
                    harness.generate_spec(1, sampler, size, eos_id=None),
                    drafter,
                    dparams,
                )
                t = {
                    part: np.array(v)
                    for part, v in interleaved_times(
                        {
                            "ar": lambda: jax.block_until_ready(ar_run([prompt])),
                            "spec": lambda: jax.block_until_ready(run([prompt])),
                            "fixed": lambda: jax.block_until_ready(fixed([prompt])),
                            "step": target_pass(dcfg, laid.graphdef, lparams, 1, 1, CALLS, size),
                            "reread": target_pass(dcfg, laid.graphdef, lparams, 1, 2, CALLS, size),
                            "verify": target_pass(cfg, vgraph, vparams, 1, k + 1, CALLS, size),
                            "target_step": target_pass(cfg, vgraph, vparams, 1, 1, CALLS, size),
                        },
                        FLAGS.repeats,
                    ).items()
                }  # ratios below are taken within each repetition, then their median
                round_s = (t["spec"] - t["fixed"]) / m["rounds"]
                draft_s = ((k - 1) * t["step"] + t["reread"]) / CALLS
                c = np.median(t["step"] / t["target_step"])
                a = float(np.nanmean(m["alpha"]))  # i.i.d. acceptance rate of the analytical model
                hf_s = (
                    hf_generate_seconds(hf_target, hf_draft, ids, n, k, temperature) if FLAGS.hf else np.nan
                )
                rows.append(
                    dict(
                        target=name,
                        draft=draft_name,
                        K=k,
                        T=temperature,
                        tau=m["tau"],
                        draft_eff=m["draft_efficiency"],
                        tok_s=n / np.median(t["spec"]),
                        speedup=np.median(t["ar"] / t["spec"]),
                        loop_eff=np.median(loop_efficiency(draft_s, t["verify"] / CALLS, round_s)),
                        loop_eff_min=np.min(draft_s + t["verify"] / CALLS) / np.min(round_s),
                        analytic=expected_speedup(a, k, c),
                        hf_tok_s=n / hf_s,
                        hf_speedup=hf_ar_s / hf_s,
                    )
                )
                print(rows[-1], flush=True)
    return rows


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    quiet_transformers()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in FLAGS.models:
            if name == "stories260K":
                path = load_model().path
            else:
                path = tmp / name
                random_hf_model(SHAPES[name], path)
                for f in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer: the prompt ids only
                    shutil.copy(load_model().path / f, path)
            (tmp / name).mkdir(exist_ok=True)
            rows += bench_target(name, path, tmp / name)
    title = (
        f"Speculative decoding (draft model) vs AR, batch 1, {FLAGS.new_tokens} new tokens, float32, medians of "
        f"{FLAGS.repeats} (transformers {FLAGS.hf_repeats}); hf = transformers {transformers.__version__} "
        "assisted generation vs its own generate"
    )
    print(write_table("bench_spec", rows, title))


if __name__ == "__main__":
    cli.run(main)
