"""Speculative decoding in one `jax.jit`: prefill of target and drafter, then a `lax.while_loop` of rounds.

A round: the drafter proposes (`Drafter.propose`), the target scores the pending token and the draft in
one pass and the acceptance rule decides (`verify`), the outcome is committed to the sequence, the
target's cache and the statistics (`commit`), and the drafter is told (`Drafter.commit`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.jobs import GenerateSpec, job_key, prepare_speculative
from specjax.decoding.prefill import prefill
from specjax.layouts import Draft, Verification
from specjax.models.config import LlamaConfig
from specjax.models.llama import forward


@struct.dataclass
class SpecStats:
    """Accumulated on device; see `specjax.metrics` for what is derived from them."""

    rounds: jax.Array  # [] loop iterations
    row_rounds: jax.Array  # [B] rounds in which the row was active (= target verification passes)
    emitted: jax.Array  # [B] tokens emitted by rounds (after EOS / max_new_tokens truncation)
    accepted_hist: jax.Array  # [K+1] row-rounds by number of draft tokens accepted and emitted
    censored_hist: jax.Array  # [K+1] of those, row-rounds whose next accepted draft was cut (EOS, limit)

    @classmethod
    def zeros(cls, batch: int, k: int) -> SpecStats:
        rows = jnp.zeros((batch,), jnp.int32)
        return cls(jnp.int32(0), rows, rows, jnp.zeros((k + 1,), jnp.int32), jnp.zeros((k + 1,), jnp.int32))

    def record(self, active_B, n_emitted_B, n_accepted_B) -> SpecStats:
        """Count only what was emitted: draft tokens accepted beyond an EOS or max_new_tokens are not
        accepted tokens, and the first of them is censored (neither accepted nor rejected)."""
        count = active_B.astype(jnp.int32)
        kept = jnp.minimum(n_accepted_B, n_emitted_B)
        return SpecStats(
            rounds=self.rounds + 1,
            row_rounds=self.row_rounds + count,
            emitted=self.emitted + n_emitted_B,
            accepted_hist=self.accepted_hist.at[kept].add(count),
            censored_hist=self.censored_hist.at[kept].add(count * (kept < n_accepted_B)),
        )

    @property
    def accepted_at(self) -> jax.Array:
        """[K] row-rounds in which draft position i was accepted (more than i tokens accepted)."""
        return jnp.cumsum(self.accepted_hist[::-1])[::-1][1:]

    @property
    def reached_at(self) -> jax.Array:
        """[K] row-rounds in which all draft positions before i were accepted and position i was judged
        (at least i accepted, position i not censored)."""
        return (jnp.cumsum(self.accepted_hist[::-1])[::-1] - self.censored_hist)[:-1]


@struct.dataclass
class SpecGeneration:
    tokens: jax.Array  # [B, max_new_tokens]
    lengths: jax.Array  # [B]
    stats: SpecStats


@struct.dataclass
class LoopState:
    seq_BS: jax.Array  # prompt + emitted tokens; the last of each row is pending (not in the target cache)
    n_tokens_B: jax.Array
    done_B: jax.Array
    cache: object  # the target's
    drafter_state: object
    stats: SpecStats


def verify(graphdef, params, spec: GenerateSpec, draft: Draft, pending_B, cache, key):
    """One target pass over the pending token and the draft, then the acceptance rule: (Verification,
    cache holding the pass's keys/values, not yet committed)."""
    tokens = jnp.concatenate([pending_B[:, None], draft.tokens], axis=1)
    layout = draft.layout
    logits, hidden, cache = forward(
        graphdef, params, tokens, layout.positions(cache.length), cache, layout.mask
    )
    return layout.accept(spec.acceptance, key, spec.sampler, draft, logits, hidden.final), cache


def commit(loop: LoopState, layout, verdict: Verification, cache, spec: GenerateSpec, limit_B) -> LoopState:
    """Commits a round's outcome to the target's cache, the sequence and the statistics: the accepted tokens
    then the next token are emitted, cut at EOS and at `limit_B` tokens; rows that are done stay put."""
    active = ~loop.done_B
    n_acc = verdict.n_accepted
    idx = jnp.arange(verdict.accepted_tokens.shape[1] + 1)[None]
    accepted = jnp.pad(verdict.accepted_tokens, ((0, 0), (0, 1)))
    emitted = jnp.where(idx < n_acc[:, None], accepted, verdict.next_token[:, None])
    is_eos = (emitted == spec.stop_id) & (idx <= n_acc[:, None])
    n_emit = jnp.minimum(n_acc + 1, jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1) + 1, idx.shape[1]))
    n_emit = jnp.where(loop.done_B, 0, jnp.minimum(n_emit, limit_B - loop.n_tokens_B))
    rows = jnp.arange(n_acc.shape[0])[:, None]
    write_at = jnp.where(idx < n_emit[:, None], loop.n_tokens_B[:, None] + idx, loop.seq_BS.shape[1])
    n_tokens = loop.n_tokens_B + n_emit
    return loop.replace(
        seq_BS=loop.seq_BS.at[rows, write_at].set(emitted, mode="drop"),  # beyond n_emit: dropped
        n_tokens_B=n_tokens,
        done_B=loop.done_B | (is_eos.any(1) & active) | (n_tokens >= limit_B),
        cache=layout.commit(cache, loop.cache.length, verdict, active),
        stats=loop.stats.record(active, n_emit, n_acc),
    )


def speculative_round(graphdef, params, drafter, drafter_params, spec, loop: LoopState, limit_B, keys):
    """Draft -> verify in one target pass -> commit. `keys` [max rounds, 2]: each round's drafter and
    acceptance-rule keys."""
    k_draft, k_accept = keys[loop.stats.rounds]
    draft, drafter_state = drafter.propose(
        drafter_params, loop.drafter_state, loop.seq_BS, loop.n_tokens_B, k_draft
    )
    pending = jnp.take_along_axis(loop.seq_BS, (loop.n_tokens_B - 1)[:, None], axis=1)[:, 0]
    verdict, cache = verify(graphdef, params, spec, draft, pending, loop.cache, k_accept)
    loop = commit(loop, draft.layout, verdict, cache, spec, limit_B)
    drafter_state = drafter.commit(
        drafter_params, drafter_state, verdict.n_accepted, loop.n_tokens_B, verdict.path, verdict.features
    )
    return loop.replace(drafter_state=drafter_state)


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "drafter", "spec"))
def speculative_compiled(cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec):
    batch, width = tokens_BP.shape
    n_new = spec.max_new_tokens
    logits, cache, feats = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size)
    key, sub = jax.random.split(key)
    first = spec.sampler.sample(sub, logits)
    round_keys = jax.random.split(key, (n_new, 2))  # every round emits a token: at most n_new rounds
    seq = jnp.zeros((batch, spec.cache_size), jnp.int32).at[:, :width].set(tokens_BP)
    seq = seq.at[jnp.arange(batch), lengths_B].set(first)
    loop = LoopState(
        seq_BS=seq,
        n_tokens_B=lengths_B + 1,
        done_B=(first == spec.stop_id) | (n_new == 1),
        cache=cache,
        drafter_state=drafter.init(drafter_params, tokens_BP, lengths_B, spec.cache_size, feats),
        stats=SpecStats.zeros(batch, drafter.shape.depth),
    )
    limit = lengths_B + n_new
    loop = jax.lax.while_loop(
        lambda lp: ~jnp.all(lp.done_B),
        lambda lp: speculative_round(
            graphdef, params, drafter, drafter_params, spec, lp, limit, round_keys
        ),
        loop,
    )
    out = jnp.take_along_axis(loop.seq_BS, lengths_B[:, None] + jnp.arange(n_new)[None], axis=1)
    n_out = loop.n_tokens_B - lengths_B
    out = jnp.where(jnp.arange(n_new)[None] < n_out[:, None], out, 0)
    return SpecGeneration(out, n_out, loop.stats)


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
    """Speculative decoding of a batch of prompts: same output distribution as `generate` (greedy: same
    tokens) for a lossless acceptance rule."""
    tokens, lengths, spec = prepare_speculative(cfg, drafter, prompts, spec)
    return speculative_compiled(
        cfg, graphdef, params, drafter, drafter_params, tokens, lengths, job_key(seed), spec
    )
