"""Training-free drafters on stories260K: n-gram prompt lookup (chains, n ranges, trees), retrieval, lookahead,
layer-skip and quantised self-drafts vs AR, side by side with transformers' prompt lookup on the same weights and
prompts.

    .venv/bin/python -m experiments.bench_drafters [--repeats=5] [--hf_repeats=3] [--new_tokens=128] [--smoke]

20 fixed prompts: 10 free story openings and 10 input-grounded ones (a short story, then its first sentence again:
the continuation retells it, repeating the prompt's names and phrases, as in summarisation or code editing).
Per setting and temperature: tau (all prompts, grounded, free), draft efficiency = accepted / (rounds x depth),
tokens/s and speedup over specjax AR, the AR and speculative runs timed in turn per prompt (batch 1, medians,
summed over the prompts); transformers' `generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=max_ngram)`
on the same prompts: tokens/s and tau = new tokens / target forward passes (counted with a forward hook; its
first pass reads the prompt and verifies a draft, specjax's prefill only emits the first token, so transformers'
tau counts one more token over one more pass). transformers matches n-grams of length 1..max only, so its
columns are given for the chains with min_ngram = 1. Both sides decode exactly `new_tokens` tokens, EOS
included (specjax `eos_id=None`, transformers `eos_token_id=None`). Retrieval's datastore: no story corpus is
available offline, so it holds `--corpus_tokens` tokens that stories260K itself sampled (T=1) from other openings
(`common.story_datastore`); layer-skip runs the layers its `--layers=auto` search chose on stories260K
(`common.LAYER_SKIP`).
Writes results/bench_drafters.{md,csv} (--smoke: bench_drafters_smoke, a few tokens on 2 prompts).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from absl import flags, logging

from experiments import common, harness
from specjax import cli
from specjax.decoding import compile_decode
from specjax.drafters.ngram import NGram
from specjax.drafters.retrieval import Retrieval
from specjax.models.loading import load_model
from specjax.sampling import Sampler

flags.DEFINE_integer("repeats", 5, "Timed runs of each specjax decode per prompt (median).")
flags.DEFINE_integer("hf_repeats", 2, "Timed runs of each transformers generation per prompt (median).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
flags.DEFINE_bool("hf", True, "Also run transformers' prompt lookup.")
flags.DEFINE_integer(
    "hf_threads",
    1,
    "PyTorch threads (on 2 shared cores, 2 threads ran stories260K's generate ~10x slower).",
)
flags.DEFINE_integer("corpus_tokens", 65_536, "Tokens in the retrieval drafter's datastore.")
flags.DEFINE_bool("smoke", False, "A quick run: 2 prompts, 16 tokens, T = 1, two settings, one repetition.")
flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables.")
harness.define_precision_flag()
FLAGS = flags.FLAGS

FREE = harness.STORY_OPENINGS
GROUNDED = harness.GROUNDED
CHAIN_DEFAULT = (1, 3)  # n range of the chains with K in 2, 4, 8


def ngram(d: NGram) -> harness.Row:
    """The row of an n-gram drafter (compared with transformers' prompt lookup where it drafts a chain from n = 1)."""
    shape = f"chain K={d.k}" if d.tree is None else f"{d.branches} branches x K={d.k}"
    return harness.Row("ngram", f"{shape}, n={d.min_ngram}..{d.max_ngram}", lambda *_: (d, None), d.k)


def registered(name: str, setting: str, k: int, **settings) -> harness.Row:
    """The chain row of the registered drafter `name`."""
    return harness.registered(name, setting, name, k, **settings)


def settings(target, smoke: bool) -> list[harness.Row]:
    if smoke:
        return [ngram(NGram(2, *CHAIN_DEFAULT)), registered("quantized", "int8, chain K=2", 2, bits=8)]
    chains = [NGram(k, *CHAIN_DEFAULT) for k in (2, 4, 8)]
    ranges = [NGram(4, 1, 1), NGram(4, 2, 4), NGram(4, 1, 6)]
    trees = [NGram(4, 1, 3, branches=3), NGram(8, 1, 3, branches=2)]
    store = Retrieval.params(common.story_datastore(target, FLAGS.corpus_tokens))
    retrieval = [
        harness.Row("retrieval", f"{desc}, suffix 1..8", lambda *_, d=d: (d, store))
        for desc, d in [("chain K=4", Retrieval(4)), ("3 branches x K=4", Retrieval(4, branches=3))]
    ]
    return [
        *map(ngram, chains + ranges + trees),
        *retrieval,
        registered("lookahead", "W=5, N=4, G=5", 3, window=5, guesses=5),
        registered("layer_skip", f"layers {common.LAYER_SKIP}, chain K=4", 4, layers=common.LAYER_SKIP),
        registered("quantized", "int8 per channel, chain K=4", 4, bits=8),
        registered("quantized", "int4 groups of 32, chain K=4", 4, bits=4, group_size=32),
    ]


def spec_rows(target, prompts, grounded, spec, settings) -> list[dict]:
    """AR and every setting's drafter on each prompt (batch 1, one padded width: one compile each), timed in
    turn."""
    cfg, graphdef, params = target.cfg, target.graphdef, target.params
    bucket = -(-max(map(len, prompts)) // 16) * 16
    runs = {"ar": compile_decode(cfg, graphdef, params, prompts[:1], spec, bucket=bucket)[0]}
    depths = []
    for i, setting in enumerate(settings):
        d, dparams = setting.build(target, spec.sampler)
        runs[i] = compile_decode(cfg, graphdef, params, prompts[:1], spec, d, dparams, bucket=bucket)[0]
        depths.append(d.shape.depth)
    seconds = dict.fromkeys(runs, 0.0)
    stats = {i: [] for i in range(len(settings))}
    for p in prompts:
        fns = {name: (lambda r=run: jax.block_until_ready(r([p]))) for name, run in runs.items()}
        for name, t in harness.interleaved_medians(fns, FLAGS.repeats).items():
            seconds[name] += t
        for i in stats:
            stats[i].append(jax.block_until_ready(runs[i]([p])).stats)
    n_tokens = len(prompts) * spec.max_new_tokens
    rows = [dict(drafter="none (AR)", setting="-", tau=1.0, tau_grounded=1.0, tau_free=1.0)]
    rows[0].update(draft_eff=np.nan, tok_s=n_tokens / seconds["ar"], speedup=1.0)
    for i, setting in enumerate(settings):
        tau = lambda rows: (
            sum(int(s.emitted.sum()) for s in rows) / sum(int(s.row_rounds.sum()) for s in rows)
        )
        accepted = sum(int(np.asarray(s.accepted_at).sum()) for s in stats[i])
        rounds = sum(int(s.row_rounds.sum()) for s in stats[i])
        rows.append(
            dict(
                drafter=setting.method,
                setting=setting.setting,
                tau=tau(stats[i]),
                tau_grounded=tau([s for s, g in zip(stats[i], grounded) if g]),
                tau_free=tau([s for s, g in zip(stats[i], grounded) if not g]),
                draft_eff=accepted / (rounds * depths[i]),
                tok_s=n_tokens / seconds[i],
                speedup=seconds["ar"] / seconds[i],
            )
        )
    return rows


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    common.quiet_transformers()
    smoke = FLAGS.smoke
    if smoke:
        FLAGS.repeats, FLAGS.hf_repeats, FLAGS.new_tokens, FLAGS.temperatures = 1, 1, 16, ["1"]
    harness.RESULTS = Path(FLAGS.results)  # where write_table writes
    target = load_model()
    texts = [(t, True) for t in GROUNDED] + [(t, False) for t in FREE]
    if smoke:
        texts = [texts[0], texts[-1]]
    prompts = [target.tokenizer.encode(t) for t, _ in texts]
    grounded = [g for _, g in texts]
    drafters = settings(target, smoke)
    torch.set_num_threads(FLAGS.hf_threads)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(target.path).eval() if FLAGS.hf else None
    n, rows = FLAGS.new_tokens, []
    for temperature in map(float, FLAGS.temperatures):
        spec = harness.generate_spec(n, Sampler(temperature), eos_id=None)
        block = spec_rows(target, prompts, grounded, spec, drafters)
        for row, setting in zip(block, [None, *drafters]):
            d = setting.build(target, spec.sampler)[0] if setting and setting.method == "ngram" else None
            hf = (np.nan, np.nan)
            if FLAGS.hf and (setting is None or (d and d.tree is None and d.min_ngram == 1)):
                lookup = (
                    {}
                    if d is None
                    else dict(prompt_lookup_num_tokens=d.k, max_matching_ngram_size=d.max_ngram)
                )
                hf = common.hf_generate(hf_model, prompts, n, temperature, FLAGS.hf_repeats, **lookup)[:2]
            rows.append(
                dict(
                    drafter=row["drafter"],
                    setting=row["setting"],
                    T=temperature,
                    **{k: v for k, v in row.items() if k not in ("drafter", "setting")},
                    hf_tau=hf[1],
                    hf_tok_s=hf[0],
                    tau_vs_hf=row["tau"] / hf[1],
                    tok_s_vs_hf=row["tok_s"] / hf[0],
                )
            )
            print(rows[-1], flush=True)
    title = (
        f"Training-free drafters on stories260K vs AR, and transformers {transformers.__version__} prompt lookup "
        f"(PyTorch {torch.__version__}): batch 1, {len(prompts)} prompts ({sum(grounded)} input-grounded) x {n} "
        f"new tokens, float32, CPU, medians of {FLAGS.repeats} (transformers {FLAGS.hf_repeats}); "
        "draft_eff = accepted / (rounds x depth); hf_tau = new tokens / target passes"
    )
    print(harness.write_table("bench_drafters_smoke" if smoke else "bench_drafters", rows, title))


if __name__ == "__main__":
    cli.run(main)
