"""Helpers shared by the benchmark scripts: random-weight models on disk, timing, tables."""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.models.llama import causal_mask, forward, init_cache

RESULTS = Path(__file__).resolve().parents[1] / "results"

# The 20 openings of the heads benchmarks (bench_heads, bench_eagle3).
HEAD_PROMPTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named",
    "Tom and his dog went to the",
    "Lily wanted to",
    "One day, a big bear",
    "The sun was hot and the",
    "Sam had a red ball.",
    "There was a small bird who",
    'Mom said, "',
    "Ben and Mia were best friends.",
    "The cat saw a",
    "In the park, the children",
    "A little boy found a",
    "It was a rainy day and",
    "The old tree",
    "Sue liked to play with her",
    "Once there was a fish named",
    "Max was very happy because",
    "The girl looked at the sky and",
    "At night, the moon",
]

# Free-continuation story openings shared by the drafter and verification benchmarks (10 of the 20).
STORY_OPENINGS = [HEAD_PROMPTS[i] for i in (0, 1, 2, 3, 4, 5, 7, 9, 11, 13)]

# Random-weight Llama shapes of the benchmarks (llama2.c's 15M and 110M TinyStories shapes).
SHAPES = {
    "llama-15M": dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=768, vocab_size=32000),
    "llama-110M": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048, vocab_size=32000),
}


def random_hf_model(shape: dict, path: Path, seed: int = 0):
    """A random transformers LlamaForCausalLM of `shape`, saved as safetensors at `path` (tied embeddings)."""
    import torch
    import transformers

    from specjax.models.config import LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_seq_len=1024, tie_embeddings=True, **shape)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    model.save_pretrained(path)
    return model


def median_time(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs, after one untimed warm-up run."""
    return interleaved_medians({"fn": fn}, repeats)["fn"]


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """{name: median wall time of fn()}, the functions timed in turn (see `interleaved_times`)."""
    return {name: statistics.median(t) for name, t in interleaved_times(fns, repeats).items()}


def interleaved_times(fns: dict, repeats: int) -> dict:
    """{name: [wall time of fn() in each of `repeats` rounds]}, the functions timed in turn. Taking turns matters
    on a shared machine whose speed drifts by tens of percent over seconds: the times of one round saw the same
    drift, so a ratio computed within each round (then its median) cancels it. Bursts shorter than one call do
    not cancel: repeat more."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} times nothing; pass --repeats=1 or more")
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            if len(fns) > 1:
                fn()  # untimed: the first call after another function's runs slower (caches, thread wake-up)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def decode_seconds(cfg, graphdef, params, prompts, spec, repeats: int, drafter=None, dparams=None):
    """Summed median decode time over the prompts (batch 1 each, compiled once per padded prompt width), and
    each prompt's speculative statistics (None for AR)."""
    from specjax.decoding import compile_decode

    total, stats, compiled = 0.0, [], {}
    for p in prompts:
        width = -(-len(p) // 8)
        if width not in compiled:
            compiled[width] = compile_decode(cfg, graphdef, params, [p], spec, drafter, dparams)[0]
        run = compiled[width]
        stats.append(getattr(jax.block_until_ready(run([p])), "stats", None))
        total += median_time(lambda: jax.block_until_ready(run([p])), repeats)
    return total, stats


def per_call_loop(cfg, graphdef, params, t: int, cache_size: int, calls: int = 32):
    """A function that runs `calls` forwards of `t` tokens in one compiled loop, each call's input depending on
    the previous call's logits (a true chain, as in decoding, through their max: no argmax or sampling cost
    is counted); batch 1, cache of `cache_size`. The positions depend on the tokens, as in decoding, so that XLA
    cannot hoist their work out of the loop. Time it and divide by `calls` for one model call."""

    @jax.jit
    def loop(params, cache):
        def body(_, carry):
            tokens, cache = carry
            positions = cache.length[:, None] + jnp.arange(t)[None] + (tokens > 10**9)  # + 0
            logits, _, cache = forward(graphdef, params, tokens, positions, cache, causal_mask(t))
            return tokens + (jnp.max(logits, axis=-1) > 1e30).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, calls, body, (jnp.ones((1, t), jnp.int32), cache))[0]

    cache = init_cache(cfg, 1, cache_size).with_length(jnp.array([cache_size // 2]))
    return lambda: loop(params, cache).block_until_ready()


def per_call_seconds(
    cfg, graphdef, params, t: int, cache_size: int, repeats: int, calls: int = 32
) -> float:
    """Median time of one forward of `t` tokens (see `per_call_loop`)."""
    return median_time(per_call_loop(cfg, graphdef, params, t, cache_size, calls), repeats) / calls


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth seen by a compiled JAX reduction over a large float32 array (GB/s)."""
    x = jnp.ones((mbytes * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / median_time(lambda: total(x).block_until_ready(), repeats) / 1e9


def write_table(name: str, rows: list[dict], title: str) -> str:
    """Writes results/NAME.md and NAME.csv; returns the markdown table."""
    RESULTS.mkdir(exist_ok=True)
    keys = list(rows[0])
    lines = [f"# {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)
    return text


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)
