"""Logit warpers (temperature, top-k, top-p) as one frozen, hashable sampler shared by target and drafter."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.errors import SamplingError

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampler:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 switch those warpers off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise SamplingError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def drafting(self, draft_temperature: float = 1.0) -> Sampler:
        """The sampler a drafter draws with: this temperature times `draft_temperature` (< 1 sharpens the drafts;
        greedy stays greedy), the same warpers. Exact for any value: acceptance reads the q a draft was drawn from."""
        if not draft_temperature > 0:
            raise SamplingError(
                f"draft temperature must be > 0 (1: the target's own), got {draft_temperature}; pass a positive one"
            )
        return dataclasses.replace(self, temperature=self.temperature * draft_temperature)

    def warp(self, logits: jax.Array) -> jax.Array:
        """Warped float32 logits [..., V]; excluded tokens get -inf. Greedy keeps only the argmax."""
        logits = logits.astype(jnp.float32)
        if self.greedy:
            keep = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=bool)
            return jnp.where(keep, 0.0, NEG_INF)
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
            logits = jnp.where(logits < kth, NEG_INF, logits)
        if self.top_p < 1:
            sorted_desc = -jnp.sort(-logits, axis=-1)
            cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
            # keep the smallest prefix whose mass reaches top_p: a token is kept if the mass before it < top_p
            n_keep = jnp.sum(
                cum - jax.nn.softmax(sorted_desc, axis=-1) < self.top_p, axis=-1, keepdims=True
            )
            threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
            logits = jnp.where(logits < threshold, NEG_INF, logits)
        return logits

    @functools.partial(jax.jit, static_argnums=0)
    def probs(self, logits: jax.Array) -> jax.Array:
        """The warped distribution [..., V] (a point mass on the argmax when greedy)."""
        return jax.nn.softmax(self.warp(logits), axis=-1)

    def sample(self, key: jax.Array, logits: jax.Array) -> jax.Array:
        """One token per row of `logits` [..., V] (int32)."""
        return self.sample_with(jax.random.uniform(key, logits.shape[:-1]), logits)

    def sample_with(self, u: jax.Array, logits: jax.Array) -> jax.Array:
        """`sample` driven by uniforms `u` [...] in [0, 1) drawn beforehand, one per row (decode loops draw a
        whole job's or round's uniforms in one PRNG call)."""
        if self.greedy:
            return argmax(logits)
        return inverse_cdf(self.probs(logits), u)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` as int32 (the first maximum wins ties), written as two plain reductions: XLA CPU
    runs the (value, index) pair reduction of `jnp.argmax` 5-8x slower at V = 32000."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, x.shape[-1] - 1), axis=-1)


@functools.partial(jax.jit, static_argnames="block")
def inverse_cdf(probs: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """The token i with cdf(i - 1) <= u * total < cdf(i), per row of `probs` [..., V] (`u` [...] in [0, 1)):
    zero-probability tokens are never returned. Blocked: the CDF over the V / block block sums picks a
    block, then the CDF inside that block picks the token (a cumulative sum over all V costs O(V log V) ops
    that XLA CPU runs 3-4x slower than these)."""
    vocab = probs.shape[-1]
    n_blocks = -(-vocab // block)
    blocks = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, n_blocks * block - vocab)])
    blocks = blocks.reshape(probs.shape[:-1] + (n_blocks, block))
    block_mass = jnp.sum(blocks, axis=-1)  # [..., n_blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u[..., None] * block_cdf[..., -1:]
    # the first block whose CDF passes the target (rounding may pass none: then the last block with mass)
    b = jnp.minimum(jnp.sum(block_cdf <= target, axis=-1), last_positive(block_mass))
    start = jnp.take_along_axis(block_cdf - block_mass, b[..., None], axis=-1)
    inner = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]  # [..., block]
    i = jnp.sum(start + jnp.cumsum(inner, axis=-1) <= target, axis=-1)
    return (b * block + jnp.minimum(i, last_positive(inner))).astype(jnp.int32)


def last_positive(x: jax.Array) -> jax.Array:
    """Index of the last positive entry along the last axis (the last index if none is positive): one reduction."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    last = jnp.max(jnp.where(x > 0, index, -1), axis=-1)
    return jnp.where(last < 0, x.shape[-1] - 1, last)


@jax.jit
def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row of `probs` [..., V] by inverse CDF with one uniform per row (`jax.random.categorical`
    draws V Gumbel variates, 5x slower at V = 32000 on CPU). Zero-probability tokens are never drawn."""
    return inverse_cdf(probs, jax.random.uniform(key, probs.shape[:-1], dtype=probs.dtype))
