"""Divergences between the target's and a draft's next-token distributions (DistillSpec, Zhou et al. 2024), on
logits warped at a training temperature, per position, and the acceptance rates they predict.

`1 - TVD(p, q)` is the probability that a draft token sampled from q is accepted by rejection sampling against
p, so `alpha_T1 = mean(1 - TVD)` at temperature 1; greedy decoding accepts a token when the two argmaxes agree
(`alpha_T0`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.errors import TrainingConfigError

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")


def _kl(logp, logq):
    """KL(p || q) over the last axis from log-probabilities (terms with p = 0 contribute 0)."""
    p = jnp.exp(logp)
    return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def divergence(name: str, target_logits, draft_logits, temperature: float = 1.0, beta: float = 0.5):
    """Per-position divergence `[...]` between p = softmax(target / T) and q = softmax(draft / T).

    forward_kl: KL(p || q); reverse_kl: KL(q || p); jsd: beta KL(p || m) + (1 - beta) KL(q || m) with
    m = beta p + (1 - beta) q; tvd: sum |p - q| / 2."""
    logp = jax.nn.log_softmax(target_logits.astype(jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32) / temperature, axis=-1)
    if name == "forward_kl":
        return _kl(logp, logq)
    if name == "reverse_kl":
        return _kl(logq, logp)
    if name == "jsd":
        logm = jnp.logaddexp(jnp.log(beta) + logp, jnp.log1p(-beta) + logq)
        return beta * _kl(logp, logm) + (1 - beta) * _kl(logq, logm)
    if name == "tvd":
        return tvd(logp, logq)
    raise TrainingConfigError(f"unknown divergence {name!r}; choose one of {DIVERGENCES}")


def tvd(logp, logq):
    """Total variation distance `[...]` between two distributions given as log-probabilities. Differences within
    a few float32 rounding units of the probabilities count as 0 (so has their gradient: |p - q| has none at
    p = q, and two evaluations of the same model may differ by rounding)."""
    p, q = jnp.exp(logp), jnp.exp(logq)
    d = p - q
    d = jnp.where(jnp.abs(d) <= 16 * jnp.finfo(jnp.float32).eps * jnp.maximum(p, q), 0.0, d)
    return 0.5 * jnp.sum(jnp.abs(d), axis=-1)


def acceptance(target_logits, draft_logits):
    """(alpha_T1 = 1 - TVD at temperature 1, alpha_T0 = 1 where the argmaxes agree) per position."""
    logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    same = jnp.argmax(target_logits, axis=-1) == jnp.argmax(draft_logits, axis=-1)
    return 1.0 - tvd(logp, logq), same.astype(jnp.float32)
