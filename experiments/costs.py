"""The costs the analytic model is fed, measured: chained loops of model passes (a target pass over T new tokens, a
drafter call) and the machine's read bandwidth and matrix-product rate, timed in turns; the verify-cost curve
between its points; decodes of prompt groups timed in turns with AR; and the prediction for a batch that runs
until its slowest row ends.

A benchmark declares which passes and decodes it needs (dicts of named functions or drafters); the timing is here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from specjax.analysis import expected_batch_rounds, tokens_per_round
from specjax.models.llama import causal_mask, forward, init_cache, multi_row_layout, uses_multi_row_layout

CURVE_CACHE = 192  # slots of the cache a timed pass sees, half of them committed

# --- chained passes ---------------------------------------------------------------------------------------


def pass_loop(step, params, cache, b: int, t: int, calls: int):
    """A function running `calls` chained passes of `step(params, tokens_BT, positions_BT, cache, mask) ->
    (logits, cache)` over t new tokens per row (each pass's input depends on the last one's logits through their
    max: no argmax or sampling is timed; the positions depend on the tokens, so XLA cannot hoist their work out of
    the loop). The cache is donated and handed back, so one call's output is the next one's input: no copy of it
    and no fresh memory (whose first touch cost a loop of 8 batch-4 passes as much as 2-3 of them) is timed. Every
    call starts from `cache.length` committed slots; the passes write after them without committing. Divide its
    time by `calls`."""
    length = cache.length

    def loop(params, c):
        c = c.with_length(length)

        def body(_, carry):
            tokens, c = carry
            positions = c.length[:, None] + jnp.arange(t)[None] + (tokens > 10**9)
            logits, c = step(params, tokens, positions, c, causal_mask(t))
            return tokens + (jnp.max(logits, axis=-1) > 1e30).astype(jnp.int32), c

        return jax.lax.fori_loop(0, calls, body, (jnp.ones((b, t), jnp.int32), c))

    with harness.matmul_scope(params):
        compiled = jax.jit(loop, donate_argnums=1).lower(params, cache).compile()
    state = [jax.tree.map(jnp.copy, cache)]

    def run():
        tokens, state[0] = compiled(params, state[0])
        return jax.block_until_ready(tokens)

    return run


def model_step(graphdef):
    """A model's pass as `pass_loop` calls it."""
    return lambda params, tokens, positions, cache, mask: forward(
        graphdef, params, tokens, positions, cache, mask
    )[::2]


def half_cache(cfg, b: int, size: int = CURVE_CACHE):
    """A cache of `size` slots per row, half of them committed."""
    return init_cache(cfg, b, size).with_length(jnp.full((b,), size // 2))


def target_pass(cfg, graphdef, params, b: int, t: int, calls: int, cache_size: int = CURVE_CACHE):
    """`pass_loop` of the model's own passes over t new tokens for b rows (a cache of `cache_size`, half full)."""
    return pass_loop(model_step(graphdef), params, half_cache(cfg, b, cache_size), b, t, calls)


def per_call_seconds(
    cfg, graphdef, params, t: int, cache_size: int, repeats: int, calls: int = 32
) -> float:
    """Median time of one pass over `t` tokens, batch 1 (`target_pass`)."""
    return harness.median_time(target_pass(cfg, graphdef, params, 1, t, calls, cache_size), repeats) / calls


def as_decoded(rows: int, plain, multi_row):
    """The target's (graphdef, params) for a pass of `rows` rows as `compile_decode` runs it: `multi_row` where
    `specjax.models.llama.uses_multi_row_layout`, else `plain` ([out, in])."""
    return multi_row if uses_multi_row_layout(rows > 1) else plain


def on_cpu_multi_row(graphdef, params):
    """The copy of the target laid out for several rows that `as_decoded` uses on one CPU
    (`specjax.models.llama.multi_row_layout`; None elsewhere: no second copy)."""
    return multi_row_layout(graphdef, params) if jax.default_backend() == "cpu" else None


# --- drafter calls ------------------------------------------------------------------------------------------


def head_step(drafter, dim: int):
    """One call of an EAGLE or EAGLE-3 head on its own features: a drafting step."""

    def step(params, tokens, positions, cache, mask):
        feats = jnp.zeros(tokens.shape + (dim,), jnp.float32)
        logits, _, cache = drafter.apply(params, tokens, feats, positions, cache, mask)
        return logits, cache

    return step


def dflash_step(drafter):
    """One DFlash round's draft: a round's committed features into its cache, then the block (t tokens each) with
    its Markov head's bias (if it has one) at positions 1 .. t - 1 after the tokens before them."""
    from flax import nnx

    from specjax.drafters.dflash import dflash_block, dflash_extend

    def step(params, tokens, positions, cache, mask):
        taps = jnp.zeros((*tokens.shape, drafter.taps_width), jnp.float32) + tokens[..., None]
        cache = dflash_extend(drafter.graphdef, params, taps, positions, cache)
        logits = dflash_block(drafter.graphdef, params, tokens, positions, cache)[0]
        bias = nnx.merge(drafter.graphdef, params["head"]).bias(tokens[:, :-1])
        return logits.at[:, 1:].add(bias), cache

    return step


def medusa_loop(graphdef, params, b: int, dim: int, calls: int):
    """`calls` chained calls of Medusa's heads on b rows of features."""
    from specjax.drafters.medusa import medusa_logits

    @jax.jit
    def loop(params):
        def body(_, f):
            return f + (jnp.max(medusa_logits(graphdef, params, f)) > 1e30)

        return jax.lax.fori_loop(0, calls, body, jnp.ones((b, dim), jnp.float32))

    with harness.matmul_scope(params):
        compiled = loop.lower(params).compile()
    return lambda: jax.block_until_ready(compiled(params))


# --- the machine --------------------------------------------------------------------------------------------


def bandwidth_fns(mbytes: int) -> tuple[int, dict]:
    """(bytes, {reader: timed function}): two ways to read `mbytes` MB of float32, a sum and a matrix-vector
    product over a [rows, 4096] matrix. Neither is always the faster (on the 2-core host the sum read 41-46 GB/s
    and the product 46-51 in one hour, 70-74 and 61-67 in another; on an H200 the sum alone read 1.87 TB/s where the
    decode step's own product kernels read 4.1), so the floor takes the faster."""
    x = jnp.ones((mbytes * 2**20 // 4,), jnp.float32)
    w, v = x.reshape(-1, 4096), jnp.ones((4096,), jnp.float32)
    total, product = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    return x.nbytes, {
        "sum": lambda: total(x).block_until_ready(),
        "matvec": lambda: product(w, v).block_until_ready(),
    }


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth (GB/s): the faster of the two readers of `bandwidth_fns`, medians of `repeats`."""
    nbytes, readers = bandwidth_fns(mbytes)
    return nbytes / min(harness.interleaved_medians(readers, repeats).values()) / 1e9


def matmul_fn():
    """(FLOPs, timed function): a [512, 2048] x [2048, 2048] float32 product."""
    a = jnp.ones((512, 2048), jnp.float32)
    w = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a, w: jnp.sum(a @ w))
    return 2 * a.shape[0] * a.shape[1] * w.shape[1], lambda: mm(a, w).block_until_ready()


def fastest(fns: dict, repeats: int) -> dict:
    """{name: the fastest of `repeats` runs}, the functions in turn (no settling call). A pass's cost is a property
    of the program, and other work on a shared machine only adds to it (medians moved by 2x between runs while the
    machine was busy; minima held)."""
    return {k: min(v) for k, v in harness.interleaved_times(fns, repeats, settle=False).items()}


def interp_cost(curve: dict, t: int) -> float:
    """Cost of a pass over t tokens from the measured curve {T: seconds}, log-linear between its points and
    proportional to t beyond the last (a pass over that many tokens is compute-bound)."""
    ts = sorted(curve)
    if t > ts[-1]:
        return curve[ts[-1]] * t / ts[-1]
    return float(np.interp(np.log2(t), np.log2(ts), [curve[x] for x in ts]))


# --- decodes of prompt groups against AR --------------------------------------------------------------------


def prompt_width(groups) -> int:
    """The width every group of `groups` pads its prompts to (one compiled program per method)."""
    return 32 * -(-max(len(p) for g in groups for p in g) // 32)


class PerGroup(list):
    """A drafter's params for each group of `timed_groups` in turn (a store that learned each group's history)."""


def timed_groups(target, groups, kw: dict, drafters: dict, repeats: int):
    """({name: seconds per repetition}, {name: the last repetition's outputs per group}): AR and each
    {name: (drafter, params)} (or (drafter, params, its own GenerateSpec keywords)) compiled for the groups' padded
    width (`target` = (cfg, graphdef, params)), then run in turns, group i with seed i (and params[i] where params
    is a `PerGroup`)."""
    from specjax.decoding import compile_decode

    bucket = prompt_width(groups)

    def compiled(own: dict, drafter=None, dparams=None):
        spec = harness.generate_spec(eos_id=None, **(kw | own))
        return compile_decode(*target, groups[0], spec, drafter, dparams, bucket=bucket)[0]

    runs, per_group = {"AR": compiled({})}, {"AR": [None] * len(groups)}
    for name, (drafter, dp, *own) in drafters.items():
        runs[name] = compiled(own[0] if own else {}, drafter, dp[0] if isinstance(dp, PerGroup) else dp)
        per_group[name] = dp if isinstance(dp, PerGroup) else [None] * len(groups)
    outputs = {}

    def job(name, run):
        def go():
            outputs[name] = [
                jax.block_until_ready(run(g, seed=i, drafter_params=dp))
                for i, (g, dp) in enumerate(zip(groups, per_group[name]))
            ]

        return go

    times = harness.interleaved_times(
        {name: job(name, r) for name, r in runs.items()}, repeats, settle=False
    )
    # XLA CPU keeps every compiled program mapped until JAX's caches let go: a run of several dozen decode
    # programs exhausted the process's memory maps (vm.max_map_count) and crashed in LLVM
    del runs
    jax.clear_caches()
    return times, outputs


def decoding_speedup(ar: list[float], spec: list[float], prefill_s: float) -> float:
    """Median over repetitions of AR's time / the speculative run's time, both less `prefill_s` (the prefill
    passes, the same for both): the decoding phase, which speculation speeds up and the per-round prediction
    describes. The end-to-end ratio is diluted towards 1 by the shared prefill."""
    return harness.ratio(ar, spec, prefill_s)


# --- the prediction for a batch -------------------------------------------------------------------------------


def row_distributions(stats) -> list[np.ndarray]:
    """Each row's distribution of tokens per round in a run (`specjax.analysis.tokens_per_round`)."""
    return [tokens_per_round(h) for h in np.asarray(stats.row_hist) if h.sum() > 0]


def predicted_speedup(generations, new_tokens: int, round_cost: float) -> float:
    """The decoding speedup over AR of runs whose rounds cost `round_cost` one-token target passes (calls x c + v):
    each group of rows runs until its slowest row has its tokens, rounds expected from each row's acceptance."""
    rounds = sum(expected_batch_rounds(row_distributions(g.stats), new_tokens - 1) for g in generations)
    return len(generations) * (new_tokens - 1) / (rounds * round_cost)
