"""Slots refilled inside the compiled loop against the same decoding run batch after batch, on the memory-bound
target (stories260K expanded: synthetic cost, real distribution). 64 story openings of 2-23 words, each continued
to the end of its sentence (a stop at '.', at most 64 tokens: mixed output lengths), greedy; AR and EAGLE-3's
chain at each batch size. Tokens/s over the whole set (medians of interleaved runs), loop rounds, and whether the
outputs are identical.

    .venv/bin/python -m experiments.bench_refill [--batches=4,8] [--k=4] [--repeats=3]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import jax
import numpy as np
from absl import flags, logging

from experiments import bench_memory_bound as bench
from experiments import harness
from specjax import cli
from specjax.decoding import GenerateSpec, compile_decode
from specjax.decoding.refill import compile_serve
from specjax.sampling import Sampler

flags.DEFINE_list("batches", ["4", "8"], "Slots (batch sizes).")
flags.DEFINE_integer("k", 4, "EAGLE-3's chain length.")
flags.DEFINE_integer("prompts", 64, "Story openings.")
flags.DEFINE_integer("repeats", 3, "Timed runs of each job, in turns (median).")
flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the table.")
FLAGS = flags.FLAGS


def openings(tokenizer, n: int) -> list[list[int]]:
    """The first 2-23 words (seeded) of the first n stories of `experiments/data/stories.txt`."""
    text = (Path(__file__).parent / "data" / "stories.txt").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    rng = np.random.default_rng(0)
    return [tokenizer.encode(" ".join(lines[i].split()[: int(rng.integers(2, 24))])) for i in range(n)]


def batch_after_batch(target, prompts, spec, slots: int, drafter, dparams):
    """(run(seed) -> (tokens [N, T], lengths [N], rounds)), the prompts in batches of `slots`, one compiled program."""
    cfg, graphdef, params = target
    width = max(map(len, prompts))
    batches = [prompts[i : i + slots] for i in range(0, len(prompts), slots)]
    pad = lambda batch: batch + [batch[-1]] * (slots - len(batch))
    run, _ = compile_decode(cfg, graphdef, params, pad(batches[0]), spec, drafter, dparams, width)

    def go(seed: int = 0):
        tokens, lengths, rounds = [], [], 0
        for batch in batches:
            gen = jax.block_until_ready(run(pad(batch), seed))
            tokens.append(np.asarray(gen.tokens)[: len(batch)])
            lengths.append(np.asarray(gen.lengths)[: len(batch)])
            rounds += int(gen.stats.rounds if drafter is not None else gen.target_passes)
        return np.concatenate(tokens), np.concatenate(lengths), rounds

    return go


def refilled(target, prompts, spec, slots: int, drafter, dparams):
    cfg, graphdef, params = target
    run, _ = compile_serve(cfg, graphdef, params, prompts, spec, slots, drafter, dparams)

    def go(seed: int = 0):
        served = jax.block_until_ready(run(prompts, seed))
        return np.asarray(served.tokens), np.asarray(served.lengths), int(served.rounds)

    return go


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    settings = bench.Settings()
    small, target, _, loaded = bench.load(settings)
    prompts = openings(small.tokenizer, FLAGS.prompts)
    stop = small.tokenizer.encode("He ran.")[-1]  # '.'
    spec = GenerateSpec(64, Sampler(), eos_id=stop)
    rows = []
    for slots in map(int, FLAGS.batches):
        for method in ("AR", f"eagle3 chain K={FLAGS.k}"):
            drafter, dparams = (None, None)
            if method != "AR":
                drafter, dparams = bench.make_drafter(
                    "eagle3", target, None, loaded, FLAGS.k, None, Sampler()
                )
            jobs = {
                "batch after batch": batch_after_batch(target, prompts, spec, slots, drafter, dparams),
                "refill": refilled(target, prompts, spec, slots, drafter, dparams),
            }
            outputs = {name: go() for name, go in jobs.items()}  # warm-up, and the outputs compared
            times = harness.interleaved_times(jobs, FLAGS.repeats, settle=False)
            (tokens_a, lengths_a, _), (tokens_b, lengths_b, _) = outputs.values()
            same = bool(np.array_equal(lengths_a, lengths_b) and np.array_equal(tokens_a, tokens_b))
            for name, (_, lengths, rounds) in outputs.items():
                rows.append(
                    dict(method=method, batch=slots, mode=name, tokens=int(lengths.sum()), rounds=rounds)
                    | dict(tok_s=int(lengths.sum()) / statistics.median(times[name]))
                    | dict(
                        over_batches=harness.ratio(times["batch after batch"], times[name]), identical=same
                    )
                )
                print(rows[-1], flush=True)
            jax.clear_caches()
    title = (
        f"Slots refilled inside the compiled loop against batch after batch: the expanded stories260K target, "
        f"{len(prompts)} story openings each continued to the end of its sentence (stop at '.', at most 64 tokens), "
        f"greedy, medians of {FLAGS.repeats} interleaved runs; rounds: loop iterations (target passes after prefill)"
    )
    harness.Writer(Path(FLAGS.results)).table("refill", rows, title)


if __name__ == "__main__":
    cli.run(main)
