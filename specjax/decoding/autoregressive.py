"""Autoregressive decoding: prefill, then one token per `lax.while_loop` iteration, all in one `jax.jit`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax import precision
from specjax.decoding.jobs import GenerateSpec, job_key, prepare
from specjax.decoding.prefill import prefill
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward


@struct.dataclass
class Generation:
    tokens: jax.Array  # [B, max_new_tokens] int32, pad 0 after a row's end
    lengths: jax.Array  # [B] generated tokens per row (EOS included)
    target_passes: jax.Array  # [] forward passes of the target after prefill


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "spec"))
def generate_compiled(cfg, graphdef, params, tokens_BP, lengths_B, key, spec: GenerateSpec):
    with precision.scope(spec.matmul_precision, cfg.dtype):
        return _generate(cfg, graphdef, params, tokens_BP, lengths_B, key, spec)


def _generate(cfg, graphdef, params, tokens_BP, lengths_B, key, spec: GenerateSpec):
    batch = tokens_BP.shape[0]
    n_new, sampler = spec.max_new_tokens, spec.sampler
    logits, cache, _ = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size)
    uniforms = jax.random.uniform(key, (n_new, batch))  # the whole job's randomness in one PRNG call
    first = sampler.sample_with(uniforms[0], logits)
    out = jnp.zeros((batch, n_new), jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < n_new) & ~jnp.all(done)

    def body(carry):
        i, out, cache, done, n = carry
        last = out[:, i - 1][:, None]
        logits, _, cache = forward(graphdef, params, last, cache.length[:, None], cache, causal_mask(1))
        token = jnp.where(done, 0, sampler.sample_with(uniforms[i], logits[:, 0]))
        out = out.at[:, i].set(token)
        return i + 1, out, cache.advance(1), done | (token == spec.stop_id), n + ~done

    init = (jnp.int32(1), out, cache, first == spec.stop_id, jnp.ones((batch,), jnp.int32))
    i, out, _, _, n = jax.lax.while_loop(cond, body, init)
    return Generation(out, n, i - 1)


def generate(
    cfg: LlamaConfig, graphdef, params, prompts: list[list[int]], spec: GenerateSpec, seed: int = 0
):
    """Decodes a batch of token-id prompts (different lengths allowed) in one compiled call."""
    tokens, lengths, spec = prepare(cfg, prompts, spec)
    return generate_compiled(cfg, graphdef, params, tokens, lengths, job_key(seed), spec)
