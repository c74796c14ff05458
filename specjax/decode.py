"""Autoregressive decoding: prefill and generation in one `jax.jit` with a `lax.while_loop`."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

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
        raise ValueError(f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} exceeds the "
                         f"model's context of {cfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    if requested:
        if need > requested:
            raise ValueError(f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} does not "
                             f"fit the KV cache of {requested} slots; raise cache_size or shorten the job")
        return requested
    return -(-need // CACHE_BUCKET) * CACHE_BUCKET


def prefill(cfg, graphdef, params, tokens_BP, lengths_B, cache_size: int):
    """Runs the padded prompts; returns (logits at each row's last prompt token [B, V], committed cache)."""
    batch, width = tokens_BP.shape
    cache = init_cache(cfg, batch, cache_size)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, _, cache = forward(graphdef, params, tokens_BP, positions, cache, causal_mask(width))
    last = jnp.take_along_axis(logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return last, cache.with_length(lengths_B)


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "spec"))
def _generate(cfg, graphdef, params, tokens_BP, lengths_B, key, spec: GenerateSpec):
    batch = tokens_BP.shape[0]
    n_new, sampler = spec.max_new_tokens, spec.sampler
    eos = -1 if spec.eos_id is None else spec.eos_id
    logits, cache = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size)
    key, sub = jax.random.split(key)
    first = sampler.sample(sub, logits)
    out = jnp.zeros((batch, n_new), jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < n_new) & ~jnp.all(done)

    def body(carry):
        i, out, cache, done, n, key = carry
        prev = out[:, i - 1][:, None]
        logits, _, cache = forward(graphdef, params, prev, cache.length[:, None], cache, causal_mask(1))
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, 0, sampler.sample(sub, logits[:, 0]))
        out = out.at[:, i].set(nxt)
        return i + 1, out, cache.advance(1), done | (nxt == eos), n + ~done, key

    init = (jnp.int32(1), out, cache, first == eos, jnp.ones((batch,), jnp.int32), key)
    i, out, _, _, n, _ = jax.lax.while_loop(cond, body, init)
    return Generation(out, n, i - 1)


def prepare(cfg: LlamaConfig, prompts: list[list[int]], spec: GenerateSpec, bucket: int = 8):
    """Validates a job and pads it: (tokens [B, P], lengths [B], spec with its cache size), before any compile."""
    if spec.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {spec.max_new_tokens}")
    tokens, lengths = pad_prompts(prompts, bucket)
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}), the model's vocabulary; got "
                         f"{int(tokens.min())}..{int(tokens.max())}: the tokenizer does not belong to this model")
    size = cache_size_for(cfg, tokens.shape[1], spec.max_new_tokens, spec.cache_size)
    return tokens, lengths, dataclasses.replace(spec, cache_size=size)


def generate(cfg: LlamaConfig, graphdef, params, prompts: list[list[int]], spec: GenerateSpec, seed: int = 0):
    """Decodes a batch of token-id prompts (different lengths allowed) in one compiled call."""
    tokens, lengths, spec = prepare(cfg, prompts, spec)
    return _generate(cfg, graphdef, params, tokens, lengths, jax.random.key(seed), spec)


def compile_generate(cfg: LlamaConfig, graphdef, params, prompts: list[list[int]], spec: GenerateSpec,
                     bucket: int = 8):
    """Compiles ahead of time for the shape of `prompts`: returns (`run(prompts, seed) -> Generation`,
    compile seconds). `run` accepts any batch of the same size whose padded width is the same."""
    tokens, lengths, spec = prepare(cfg, prompts, spec, bucket)
    start = time.perf_counter()
    compiled = _generate.lower(cfg=cfg, graphdef=graphdef, params=params, tokens_BP=tokens, lengths_B=lengths,
                               key=jax.random.key(0), spec=spec).compile()
    compile_s = time.perf_counter() - start

    def run(prompts: list[list[int]], seed: int = 0) -> Generation:
        tokens, lengths = prepare(cfg, prompts, spec, bucket)[:2]
        return compiled(params=params, tokens_BP=tokens, lengths_B=lengths, key=jax.random.key(seed))

    return run, compile_s
