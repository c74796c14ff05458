"""Decoding loops, each one `jax.jit` (prefill, then a `lax.while_loop`): autoregressive (`generate`) and
speculative (`speculative_generate`: draft -> verify in one target pass -> accept -> commit)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.acceptance import greedy_chain, greedy_tree, speculative_sampling, tree_sampling
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward, init_cache
from specjax.sampling import Sampler

CACHE_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """Static settings of one compiled decode: a new spec compiles a new loop."""

    max_new_tokens: int
    sampler: Sampler = Sampler()
    cache_size: int = 0  # 0: smallest bucket that fits the prompts + max_new_tokens
    eos_id: int | None = 2  # None: never stop early


@struct.dataclass
class Generation:
    tokens: jax.Array  # [B, max_new_tokens] int32, pad 0 after a row's end
    lengths: jax.Array  # [B] generated tokens per row (EOS included)
    target_passes: jax.Array  # [] forward passes of the target after prefill


def job_key(seed: int) -> jax.Array:
    """The PRNG key of a decode job. The 'rbg' implementation draws with XLA's RngBitGenerator, one kernel per
    draw: threefry runs as a loop of small kernels on XLA CPU, which cost a sampled speculative round on
    stories260K about 15%. Its streams are reproducible on one platform, not across platforms."""
    return jax.random.key(seed, impl="rbg")


def pad_prompts(prompts: list[list[int]], bucket: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into `[B, P]` (P: longest prompt rounded up to `bucket`) plus lengths `[B]`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (BOS counts); got an empty prompt")
    width = -(-max(map(len, prompts)) // bucket) * bucket
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def cache_size_for(cfg: LlamaConfig, prompt_width: int, new_tokens: int, requested: int = 0) -> int:
    """Cache slots for a job, checked against the model's context; raises before any compile."""
    need = prompt_width + new_tokens
    if need > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} exceeds the "
            f"model's context of {cfg.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    if requested:
        if need > requested:
            raise ValueError(
                f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} does not "
                f"fit the KV cache of {requested} slots; raise cache_size or shorten the job"
            )
        return requested
    return -(-need // CACHE_BUCKET) * CACHE_BUCKET


def prefill(cfg, graphdef, params, tokens_BP, lengths_B, cache_size: int):
    """Runs the padded prompts; returns (logits at each row's last prompt token [B, V], committed cache,
    the prompts' features [B, P, dim])."""
    batch, width = tokens_BP.shape
    cache = init_cache(cfg, batch, cache_size)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, hidden, cache = forward(graphdef, params, tokens_BP, positions, cache, causal_mask(width))
    last = jnp.take_along_axis(logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return last, cache.with_length(lengths_B), hidden.final


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "spec"))
def _generate(cfg, graphdef, params, tokens_BP, lengths_B, key, spec: GenerateSpec):
    batch = tokens_BP.shape[0]
    n_new, sampler = spec.max_new_tokens, spec.sampler
    eos = -1 if spec.eos_id is None else spec.eos_id
    logits, cache, _ = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size)
    uniforms = jax.random.uniform(key, (n_new, batch))  # the whole job's randomness in one PRNG call
    first = sampler.sample_with(uniforms[0], logits)
    out = jnp.zeros((batch, n_new), jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < n_new) & ~jnp.all(done)

    def body(carry):
        i, out, cache, done, n = carry
        prev = out[:, i - 1][:, None]
        logits, _, cache = forward(graphdef, params, prev, cache.length[:, None], cache, causal_mask(1))
        nxt = jnp.where(done, 0, sampler.sample_with(uniforms[i], logits[:, 0]))
        out = out.at[:, i].set(nxt)
        return i + 1, out, cache.advance(1), done | (nxt == eos), n + ~done

    init = (jnp.int32(1), out, cache, first == eos, jnp.ones((batch,), jnp.int32))
    i, out, _, _, n = jax.lax.while_loop(cond, body, init)
    return Generation(out, n, i - 1)


def prepare(cfg: LlamaConfig, prompts: list[list[int]], spec: GenerateSpec, bucket: int = 8):
    """Validates a job and pads it: (tokens [B, P], lengths [B], spec with its cache size), before any compile."""
    if spec.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {spec.max_new_tokens}")
    tokens, lengths = pad_prompts(prompts, bucket)
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise ValueError(
            f"prompt token ids must lie in [0, {cfg.vocab_size}), the model's vocabulary; got "
            f"{int(tokens.min())}..{int(tokens.max())}: the tokenizer does not belong to this model"
        )
    size = cache_size_for(cfg, tokens.shape[1], spec.max_new_tokens, spec.cache_size)
    return tokens, lengths, dataclasses.replace(spec, cache_size=size)


def generate(
    cfg: LlamaConfig, graphdef, params, prompts: list[list[int]], spec: GenerateSpec, seed: int = 0
):
    """Decodes a batch of token-id prompts (different lengths allowed) in one compiled call."""
    tokens, lengths, spec = prepare(cfg, prompts, spec)
    return _generate(cfg, graphdef, params, tokens, lengths, job_key(seed), spec)


# --- speculative decoding ----------------------------------------------------------------------


@struct.dataclass
class SpecStats:
    """Accumulated on device; see `specjax.metrics` for what is derived from them."""

    rounds: jax.Array  # [] loop iterations
    row_rounds: jax.Array  # [B] rounds in which the row was active (= target verification passes)
    emitted: jax.Array  # [B] tokens emitted by rounds (after EOS / max_new_tokens truncation)
    accepted_hist: jax.Array  # [K+1] row-rounds by number of draft tokens accepted

    @property
    def accepted_at(self) -> jax.Array:
        """[K] row-rounds in which draft position i was accepted (more than i tokens accepted)."""
        return jnp.cumsum(self.accepted_hist[::-1])[::-1][1:]

    @property
    def reached_at(self) -> jax.Array:
        """[K] row-rounds in which all draft positions before i were accepted (at least i accepted)."""
        return jnp.cumsum(self.accepted_hist[::-1])[::-1][:-1]


@struct.dataclass
class SpecGeneration:
    tokens: jax.Array  # [B, max_new_tokens]
    lengths: jax.Array  # [B]
    stats: SpecStats


@struct.dataclass
class _Loop:
    seq: (
        jax.Array
    )  # [B, W] prompt + emitted tokens; the last of each row is pending (not in the target cache)
    n_tokens: jax.Array  # [B]
    done: jax.Array  # [B]
    cache: object
    drafter_state: object
    stats: SpecStats


def verify(cfg, graphdef, params, sampler: Sampler, draft, pending_B, cache, key):
    """One target pass over the pending token and the draft (chain or tree), then the acceptance rule.

    Returns (n_accepted [B], next_token [B], accepted tokens [B, D], accepted node indices [B, D] or None
    for a chain, the target's features [B, D + 1, dim] at the pending token then the accepted ones, cache
    with the accepted keys/values not yet committed)."""
    tokens = jnp.concatenate([pending_B[:, None], draft.tokens], axis=1)
    layout = draft.layout
    if layout is None:
        positions = cache.length[:, None] + jnp.arange(tokens.shape[1])[None]
        logits, hidden, cache = forward(
            graphdef, params, tokens, positions, cache, causal_mask(tokens.shape[1])
        )
        if sampler.greedy:
            n_acc, nxt = greedy_chain(draft.tokens, logits)
        else:
            n_acc, nxt = speculative_sampling(key, draft.tokens, draft.q_probs, sampler.probs(logits))
        return n_acc, nxt, draft.tokens, None, hidden.final, cache
    positions = cache.length[:, None] + layout.depth
    logits, hidden, cache = forward(graphdef, params, tokens, positions, cache, layout.mask)
    if sampler.greedy:
        n_acc, nxt, path = greedy_tree(layout, draft.tokens, logits)
    else:
        n_acc, nxt, path = tree_sampling(
            key, layout, draft.tokens, draft.q_probs, sampler.probs(logits), draft.without_replacement
        )
    keep = jnp.pad(path, ((0, 0), (1, 0)))  # the root, then the accepted path
    feats = jnp.take_along_axis(hidden.final, keep[:, :, None], axis=1)
    return n_acc, nxt, jnp.take_along_axis(tokens, path, axis=1), path, feats, cache


def spec_round(
    cfg, graphdef, params, drafter, drafter_params, spec: GenerateSpec, loop: _Loop, limit_B, keys
):
    """One round: draft -> verify in one target pass -> accept -> commit. Rows that are done stay put.
    `keys` [max rounds, 2]: the drafter's and the acceptance rule's key of each round."""
    k = drafter.k  # most draft tokens one round can accept: the chain length or the tree depth
    k_draft, k_accept = keys[loop.stats.rounds]
    draft, drafter_state = drafter.propose(
        drafter_params, loop.drafter_state, loop.seq, loop.n_tokens, k_draft
    )
    pending = jnp.take_along_axis(loop.seq, (loop.n_tokens - 1)[:, None], axis=1)[:, 0]
    n_acc, nxt, accepted, path, feats, cache = verify(
        cfg, graphdef, params, spec.sampler, draft, pending, loop.cache, k_accept
    )
    active = ~loop.done
    if path is None:  # chain: the accepted tokens already sit right after the committed region
        cache = cache.with_length(jnp.where(active, loop.cache.length + n_acc + 1, loop.cache.length))
    else:  # tree: gather the root and the accepted path into the committed region
        cache = cache.compact(jnp.pad(path, ((0, 0), (1, 0))), jnp.where(active, n_acc + 1, 0))

    # Emit the accepted tokens then the next token, cut at EOS and at max_new_tokens; done rows emit nothing.
    idx = jnp.arange(k + 1)[None]
    emitted = jnp.where(idx < n_acc[:, None], jnp.pad(accepted, ((0, 0), (0, 1))), nxt[:, None])
    is_eos = (emitted == (-1 if spec.eos_id is None else spec.eos_id)) & (idx <= n_acc[:, None])
    n_emit = jnp.minimum(n_acc + 1, jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1) + 1, k + 1))
    n_emit = jnp.where(loop.done, 0, jnp.minimum(n_emit, limit_B - loop.n_tokens))
    rows = jnp.arange(pending.shape[0])[:, None]
    write_at = jnp.where(
        idx < n_emit[:, None], loop.n_tokens[:, None] + idx, loop.seq.shape[1]
    )  # else dropped
    seq = loop.seq.at[rows, write_at].set(emitted, mode="drop")
    n_tokens = loop.n_tokens + n_emit
    drafter_state = drafter.commit(drafter_params, drafter_state, n_acc, n_tokens, path, feats)

    s = loop.stats
    count = active.astype(jnp.int32)
    stats = SpecStats(
        rounds=s.rounds + 1,
        row_rounds=s.row_rounds + count,
        emitted=s.emitted + n_emit,
        accepted_hist=s.accepted_hist.at[n_acc].add(count),
    )
    done = loop.done | is_eos.any(1) & active | (n_tokens >= limit_B)
    return _Loop(seq, n_tokens, done, cache, drafter_state, stats)


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "drafter", "spec"))
def _speculative(
    cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec: GenerateSpec
):
    batch, width = tokens_BP.shape
    k, n_new = drafter.k, spec.max_new_tokens
    logits, cache, feats = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size)
    key, sub = jax.random.split(key)
    first = spec.sampler.sample(sub, logits)
    round_keys = jax.random.split(key, (n_new, 2))  # every round emits a token: at most n_new rounds
    seq = jnp.zeros((batch, spec.cache_size), jnp.int32).at[:, :width].set(tokens_BP)
    seq = seq.at[jnp.arange(batch), lengths_B].set(first)
    zeros = jnp.zeros((batch,), jnp.int32)
    stats = SpecStats(jnp.int32(0), zeros, zeros, jnp.zeros((k + 1,), jnp.int32))
    eos = -1 if spec.eos_id is None else spec.eos_id
    loop = _Loop(
        seq,
        lengths_B + 1,
        (first == eos) | (n_new == 1),
        cache,
        drafter.init(drafter_params, tokens_BP, lengths_B, spec.cache_size, feats),
        stats,
    )
    limit = lengths_B + n_new
    loop = jax.lax.while_loop(
        lambda lp: ~jnp.all(lp.done),
        lambda lp: spec_round(cfg, graphdef, params, drafter, drafter_params, spec, lp, limit, round_keys),
        loop,
    )
    out = jnp.take_along_axis(loop.seq, lengths_B[:, None] + jnp.arange(n_new)[None], axis=1)
    n_out = loop.n_tokens - lengths_B
    out = jnp.where(jnp.arange(n_new)[None] < n_out[:, None], out, 0)
    return SpecGeneration(out, n_out, loop.stats)


def prepare_speculative(
    cfg: LlamaConfig, drafter, prompts: list[list[int]], spec: GenerateSpec, bucket: int = 8
):
    """Validates a speculative job before any compile; the cache gets the drafter's per-round slack (K + 1 for a
    chain, the node count for a tree) beyond the prompt and the new tokens."""
    if not isinstance(drafter.k, int) or drafter.k < 1:
        raise ValueError(f"K (draft tokens per round) must be an integer >= 1, got {drafter.k!r}")
    drafter.validate(cfg)
    tokens, lengths, _ = prepare(cfg, prompts, dataclasses.replace(spec, cache_size=0), bucket)
    tree = getattr(drafter, "tree", None)
    verify_slots = getattr(drafter, "slack", drafter.k + 1)
    width, need = tokens.shape[1], tokens.shape[1] + spec.max_new_tokens + verify_slots
    if spec.cache_size and need > spec.cache_size:
        what = f"K={drafter.k}" if tree is None else f"a tree of {tree.size} nodes"
        raise ValueError(
            f"{what} does not fit: prompt ({width}, padded) + {spec.max_new_tokens} new tokens + "
            f"{verify_slots} verification slots = {need} > cache_size {spec.cache_size}; "
            "draft less or raise the cache"
        )
    size = spec.cache_size or -(-need // CACHE_BUCKET) * CACHE_BUCKET
    return tokens, lengths, dataclasses.replace(spec, cache_size=size)


def speculative_generate(
    cfg: LlamaConfig,
    graphdef,
    params,
    drafter,
    drafter_params,
    prompts: list[list[int]],
    spec: GenerateSpec,
    seed: int = 0,
) -> SpecGeneration:
    """Speculative decoding of a batch of prompts: same output distribution as `generate` (greedy: same tokens)."""
    tokens, lengths, spec = prepare_speculative(cfg, drafter, prompts, spec)
    return _speculative(
        cfg, graphdef, params, drafter, drafter_params, tokens, lengths, job_key(seed), spec
    )


def compile_decode(
    cfg: LlamaConfig,
    graphdef,
    params,
    prompts: list[list[int]],
    spec: GenerateSpec,
    drafter=None,
    drafter_params=None,
    bucket: int = 8,
):
    """Compiles AR decoding (no drafter) or speculative decoding ahead of time for the shape of `prompts`.

    Returns (`run(prompts, seed)`, compile seconds); `run` takes any batch of the same size and padded width.
    """
    if drafter is None:
        prep = lambda batch: prepare(cfg, batch, spec, bucket)
        fn, static, dynamic = _generate, dict(cfg=cfg, graphdef=graphdef), dict(params=params)
    else:
        prep = lambda batch: prepare_speculative(cfg, drafter, batch, spec, bucket)
        fn, static = _speculative, dict(cfg=cfg, graphdef=graphdef, drafter=drafter)
        dynamic = dict(params=params, drafter_params=drafter_params)
    tokens, lengths, full_spec = prep(prompts)
    start = time.perf_counter()
    compiled = fn.lower(
        **static, **dynamic, tokens_BP=tokens, lengths_B=lengths, key=job_key(0), spec=full_spec
    ).compile()
    compile_s = time.perf_counter() - start

    def run(prompts: list[list[int]], seed: int = 0):
        tokens, lengths = prep(prompts)[:2]
        return compiled(**dynamic, tokens_BP=tokens, lengths_B=lengths, key=job_key(seed))

    return run, compile_s
