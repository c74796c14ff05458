"""Speculative decoding in one `jax.jit`: prefill of target and drafter, then a `lax.while_loop` of rounds.

A round: the drafter proposes (`Drafter.propose`), the target scores the pending token and the draft in
one pass and the acceptance rule decides (`verify`), the outcome is committed to the sequence, the
target's cache and the statistics (`commit`), and the drafter is told (`Drafter.commit`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import precision, sharding
from specjax.decoding.adaptive import AdaptiveK
from specjax.decoding.jobs import GenerateSpec, job_key, prepare_speculative
from specjax.decoding.prefill import prefill
from specjax.drafting.layouts import ChainLayout, Draft, Verification, best_length
from specjax.drafting.protocol import feature_taps, propose
from specjax.metrics import summarize
from specjax.models.config import LlamaConfig
from specjax.models.llama import features, forward


@struct.dataclass
class SpecStats:
    """Accumulated on device; see `specjax.metrics` for what is derived from them. Acceptance counts are on
    what was emitted: draft tokens accepted beyond an EOS or max_new_tokens are not accepted, and in a round cut
    before the token after its accepted drafts, the draft position after the emitted ones is censored (neither
    accepted nor rejected), whatever its verdict: were only accepted ones censored, its rejections would count
    and its acceptances not."""

    rounds: jax.Array  # [] loop iterations
    row_rounds: jax.Array  # [B] rounds in which the row was active (= target verification passes)
    emitted: jax.Array  # [B] tokens emitted by rounds (after EOS / max_new_tokens truncation)
    depth_accepted: jax.Array  # [D+1, D+1] row-rounds by (the round's draft depth, draft tokens accepted)
    censored_hist: jax.Array  # [D+1] row-rounds by draft tokens accepted, whose next accepted one was cut
    row_hist: jax.Array  # [B, D+1] each row's rounds by draft tokens accepted (the batch model's input)

    @classmethod
    def zeros(cls, batch: int, depth: int) -> SpecStats:
        rows = jnp.zeros((batch,), jnp.int32)
        hist = jnp.zeros((depth + 1,), jnp.int32)
        square, row_hist = (
            jnp.zeros((depth + 1, depth + 1), jnp.int32),
            jnp.zeros((batch, depth + 1), jnp.int32),
        )
        return cls(jnp.int32(0), rows, rows, square, hist, row_hist)

    def record(self, active_B, n_emitted_B, n_accepted_B, depth: int) -> SpecStats:
        count = active_B.astype(jnp.int32)
        kept = jnp.minimum(n_accepted_B, n_emitted_B)
        cut = (n_emitted_B <= n_accepted_B) & (kept < depth)  # draft position kept + 1 proposed, then cut
        return SpecStats(
            rounds=self.rounds + 1,
            row_rounds=self.row_rounds + count,
            emitted=self.emitted + n_emitted_B,
            depth_accepted=self.depth_accepted.at[depth, kept].add(count),
            censored_hist=self.censored_hist.at[kept].add(count * cut),
            row_hist=self.row_hist.at[jnp.arange(kept.shape[0]), kept].add(count),
        )

    # Read on the host after a run (numpy: no small XLA programs compiled for each draft depth).
    @property
    def accepted_hist(self) -> np.ndarray:
        """[D+1] row-rounds by number of draft tokens accepted."""
        return np.asarray(self.depth_accepted).sum(0)

    @property
    def k_hist(self) -> np.ndarray:
        """[D+1] row-rounds by draft depth: all at the drafter's K (or tree depth) but with adaptive K."""
        return np.asarray(self.depth_accepted).sum(1)

    @property
    def accepted_at(self) -> np.ndarray:
        """[D] row-rounds in which draft position i was accepted (more than i tokens accepted)."""
        return np.cumsum(self.accepted_hist[::-1])[::-1][1:]

    @property
    def reached_at(self) -> np.ndarray:
        """[D] row-rounds in which draft position i was proposed, all positions before it accepted, and it
        was judged (not censored)."""
        depth_accepted = np.asarray(self.depth_accepted)
        at_least = np.cumsum(depth_accepted[:, ::-1], axis=1)[:, ::-1][:, :-1]  # [depth, i]: n >= i
        depth = np.arange(at_least.shape[0])[:, None]
        proposed = np.sum(np.where(depth > np.arange(at_least.shape[1])[None], at_least, 0), axis=0)
        return proposed - np.asarray(self.censored_hist)[:-1]


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
    estimate: object  # adaptive K's `Estimate` (`AdaptiveK.zeros`), else a placeholder []

    @property
    def pending_B(self) -> jax.Array:
        """[B] each row's last token, the one not yet in the target's cache."""
        return jnp.take_along_axis(self.seq_BS, (self.n_tokens_B - 1)[:, None], axis=1)[:, 0]


def verify(graphdef, params, spec: GenerateSpec, draft: Draft, pending_B, cache, key, taps=()):
    """One target pass over the pending token and the draft, then the acceptance rule: (Verification with the
    drafter's features (`taps`), cache holding the pass's keys/values, not yet committed)."""
    tokens = jnp.concatenate([pending_B[:, None], draft.tokens], axis=1)
    layout = draft.layout
    logits, hidden, cache = forward(
        graphdef, params, tokens, layout.positions(cache.length), cache, layout.mask, taps
    )
    feats = features(hidden, taps)
    return layout.accept(spec.acceptance, key, spec.sampler, draft, logits, feats), cache


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
        stats=loop.stats.record(active, n_emit, n_acc, verdict.path.shape[1]),
    )


def speculative_round(
    graphdef,
    params,
    drafter,
    drafter_params,
    spec,
    loop: LoopState,
    limit_B,
    keys,
    verified=None,
    backlog=0.0,
):
    """Draft -> verify in one target pass -> commit. `keys` [max rounds, 2]: each round's drafter and
    acceptance-rule keys. `verified`: only the draft's first tokens are verified (0: a plain AR round, the drafter
    kept in step with the committed tokens as after a rejected draft). `backlog`: tokens each row will emit after
    its current one ends (slots refilled from a queue), which adaptive K counts as work left."""
    k_draft, k_accept = keys[loop.stats.rounds]
    draft, drafter_state, cache = propose(
        drafter, drafter_params, loop.drafter_state, loop.seq_BS, loop.n_tokens_B, k_draft, loop.cache
    )
    if verified is not None:
        draft = draft.prefix(verified)
    pending = loop.pending_B
    checked = lambda d, lp: verify_and_commit(
        graphdef, params, spec, drafter, d, pending, cache, k_accept, lp, limit_B, backlog
    )
    if draft.scores is None:
        loop, n_accepted, path, feats, feedback = checked(draft, loop)
    else:  # the verified prefix chosen on device: one compiled branch per length
        branches = [functools.partial(lambda k, lp: checked(draft.prefix(k), lp), k) for k in draft.lengths]
        choice = best_length(draft.scores, ~loop.done_B)
        loop, n_accepted, path, feats, feedback = jax.lax.switch(choice, branches, loop)
    drafter_state = drafter.commit(
        drafter_params, drafter_state, n_accepted, loop.n_tokens_B, path, feats, **feedback
    )
    return loop.replace(drafter_state=drafter_state)


def verify_and_commit(
    graphdef, params, spec, drafter, draft, pending_B, cache, key, loop: LoopState, limit_B, backlog=0.0
):
    """`verify` then `commit`: (loop state, accepted counts, path and features padded to the largest depth, the
    drafter's feedback as keyword arguments)."""
    verdict, cache = verify(graphdef, params, spec, draft, pending_B, cache, key, feature_taps(drafter))
    active, depth = ~loop.done_B, verdict.path.shape[1]
    loop = commit(loop, draft.layout, verdict, cache, spec, limit_B)
    if spec.adaptive_k is not None:
        loop = loop.replace(
            estimate=spec.adaptive_k.observe(
                loop.estimate,
                depth,
                verdict.n_accepted,
                active,
                jnp.where(loop.done_B, 0, limit_B - loop.n_tokens_B) + backlog,
            )
        )
    pad = ((0, 0), (0, loop.stats.depth_accepted.shape[0] - 1 - depth))  # to the largest K's depth
    path, feats = jnp.pad(verdict.path, pad), jnp.pad(verdict.features, pad + ((0, 0),))
    feedback = {} if verdict.feedback is None else {"feedback": verdict.feedback}
    return loop, verdict.n_accepted, path, feats, feedback


def round_at(graphdef, params, drafter, drafter_params, spec, k: int):
    """`(loop, limit_B, keys, backlog=0) -> loop`: one round drafting `k` tokens (K = 0: the drafter drafts one
    token and none is verified)."""
    return functools.partial(
        speculative_round,
        graphdef,
        params,
        drafter.with_k(max(k, 1)),
        drafter_params,
        spec,
        verified=0 if k == 0 else None,
    )


def plain_round(graphdef, params, spec, loop: LoopState, limit_B, keys):
    """A plain AR round on the loop state: the target's token after the pending one, as a K = 0 round verifies it,
    with no draft and no word to the drafter (once a job runs plain it never drafts again)."""
    pending = loop.pending_B
    empty = Draft(jnp.zeros((pending.shape[0], 0), jnp.int32), None, ChainLayout(0))
    verdict, cache = verify(graphdef, params, spec, empty, pending, loop.cache, keys[loop.stats.rounds][1])
    return commit(loop, empty.layout, verdict, cache, spec, limit_B)


def drafted_then_plain(adaptive: AdaptiveK | None, drafted, plain, go_on, estimate_of, carry):
    """`drafted(go_on')(carry)` until adaptive K runs plain (`Estimate.plain`, at the start or later; only with K = 0
    in its set), then `plain(go_on)` on what is left: two loops one after the other (a branch per round would copy
    the caches each round)."""
    if adaptive is None or adaptive.ks[0] != 0:
        return drafted(go_on)(carry)
    carry = drafted(lambda c: go_on(c) & ~estimate_of(c).plain)(carry)
    return plain(go_on)(carry)


def chosen_round(graphdef, params, drafter, drafter_params, spec, loop: LoopState, limit_B, keys, backlog):
    """One round at the K adaptive K chose: each K's round in a `lax.while_loop` of at most one trip (the caches
    updated in place, see `adaptive_rounds`), the first whose K is chosen running."""
    ran = jnp.bool_(False)
    for i, k in enumerate(spec.adaptive_k.ks):
        one = round_at(graphdef, params, drafter, drafter_params, spec, k)
        chosen = ~ran & (spec.adaptive_k.choose(loop.estimate) == i)
        loop = when(chosen, lambda lp, one=one: one(lp, limit_B, keys, backlog=backlog), loop)
        ran = ran | chosen
    return loop


def when(pred, fn, carry):
    """`fn(carry)` where `pred` (traced) holds, else `carry`, as a `lax.while_loop` of at most one trip: it updates
    the carry in place, where XLA copied the caches into a `lax.cond`'s branches (see `adaptive_rounds`)."""
    return jax.lax.while_loop(lambda c: c[1], lambda c: (fn(c[0]), jnp.bool_(False)), (carry, pred))[0]


def adaptive_rounds(
    graphdef, params, drafter, drafter_params, spec, loop: LoopState, limit_B, keys, go_on, choose
):
    """Rounds while `go_on(loop)`, each drafting the K in `spec.adaptive_k.ks` at index `choose(loop)`: one compiled
    round per K (`drafter.with_k`; K = 0 drafts one token and verifies none of it), all sharing the loop state, each
    in a `lax.while_loop` that runs while the choice stays its K (a round costs one test of the choice, not one per
    K). Loops, not the branches of a `lax.switch`: XLA copied the caches into every branch but the first (rounds a
    third slower on stories260K), while a loop updates its carry in place."""

    def rounds_at(i: int, k: int):
        one = round_at(graphdef, params, drafter, drafter_params, spec, k)
        stay = lambda lp: go_on(lp) & (choose(lp) == i)
        return lambda lp: jax.lax.while_loop(stay, lambda lp: one(lp, limit_B, keys), lp)

    def each_k(lp):  # each K in turn, for as long as it is chosen
        for run in runs:
            lp = run(lp)
        return lp

    runs = [rounds_at(i, k) for i, k in enumerate(spec.adaptive_k.ks)]
    return jax.lax.while_loop(go_on, each_k, loop)


def start(cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec, measured=None):
    """Prefill of target and drafter and the first token: (LoopState, each row's token limit [B], each round's
    keys [max_new_tokens, 2]). `measured`: adaptive K's costs and prior (`AdaptiveK.measured`)."""
    batch, width = tokens_BP.shape
    n_new = spec.max_new_tokens
    taps = feature_taps(drafter)
    logits, cache, feats = prefill(cfg, graphdef, params, tokens_BP, lengths_B, spec.cache_size, taps)
    key, sub = jax.random.split(key)
    first = spec.sampler.sample(sub, logits)
    round_keys = jax.random.split(key, (n_new, 2))  # every round emits a token: at most n_new rounds
    seq = jnp.zeros((batch, spec.cache_size), jnp.int32).at[:, :width].set(tokens_BP)
    seq = seq.at[jnp.arange(batch), lengths_B].set(first)
    done = (first == spec.stop_id) | (n_new == 1)
    loop = LoopState(
        seq_BS=seq,
        n_tokens_B=lengths_B + 1,
        done_B=done,
        cache=cache,
        drafter_state=drafter.init(drafter_params, tokens_BP, lengths_B, spec.cache_size, feats),
        stats=SpecStats.zeros(batch, drafter.shape.depth),
        estimate=jnp.zeros(())
        if spec.adaptive_k is None
        else spec.adaptive_k.zeros(jnp.where(done, 0, n_new - 1), measured),
    )
    return loop, lengths_B + n_new, round_keys


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "drafter", "spec"))
def speculative_compiled(
    cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec, measured=None
):
    """The compiled decode loop. With adaptive K, `spec` holds its static part and `measured` its costs and prior
    (`split`)."""
    with precision.scope(spec.matmul_precision, cfg.dtype):
        return _speculative(
            cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec, measured
        )


def _speculative(cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec, measured):
    loop, limit, round_keys = start(
        cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, key, spec, measured
    )
    go_on = lambda lp: ~jnp.all(lp.done_B)
    if spec.adaptive_k is None:
        one = lambda lp: speculative_round(
            graphdef, params, drafter, drafter_params, spec, lp, limit, round_keys
        )
        loop = jax.lax.while_loop(go_on, one, loop)
    else:  # adaptive K; a forced K (calibrating) runs the given number of rounds, ended rows idle
        timed = lambda lp: lp.stats.rounds < measured.rounds
        until = lambda lp: jnp.where(measured.forced >= 0, timed(lp), go_on(lp))
        choose = lambda lp: spec.adaptive_k.choose(lp.estimate)
        args = (graphdef, params, drafter, drafter_params, spec)
        drafted = lambda go: lambda lp: adaptive_rounds(*args, lp, limit, round_keys, go, choose)
        plain_one = lambda lp: plain_round(graphdef, params, spec, lp, limit, round_keys)
        plain = lambda go: lambda lp: jax.lax.while_loop(go, plain_one, lp)
        loop = drafted_then_plain(spec.adaptive_k, drafted, plain, until, lambda lp: lp.estimate, loop)
    n_new = spec.max_new_tokens
    out = jnp.take_along_axis(loop.seq_BS, lengths_B[:, None] + jnp.arange(n_new)[None], axis=1)
    n_out = loop.n_tokens_B - lengths_B
    out = jnp.where(jnp.arange(n_new)[None] < n_out[:, None], out, 0)
    return SpecGeneration(out, n_out, loop.stats)


def split(spec: GenerateSpec, forced: int = -1, rounds: int = 0):
    """(the compiled loop's static spec, adaptive K's measured inputs as data or None; see
    `AdaptiveK.measured`): every job of one adaptive K shares one program, whatever its costs."""
    if spec.adaptive_k is None:
        return spec, None
    adaptive = spec.adaptive_k
    return dataclasses.replace(spec, adaptive_k=adaptive.unmeasured), adaptive.measured(forced, rounds)


def calibrate(
    cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, spec, rounds=8, repeats=3
):
    """`spec` with adaptive K's round costs and prior measured (`measure`) where not given, on the program that
    decodes the job (`speculative_compiled`)."""
    if spec.adaptive_k is None:
        return spec
    job = split(spec, forced=0)[0]
    args = (cfg, graphdef, params, drafter, drafter_params, tokens_BP, lengths_B, job_key(0), job)
    run = lambda measured: speculative_compiled(*args, measured).stats
    return dataclasses.replace(spec, adaptive_k=measure(spec.adaptive_k, run, rounds, repeats))


def measure(adaptive: AdaptiveK, run, rounds=8, repeats=3) -> AdaptiveK:
    """`adaptive` with its round costs and prior measured, where not given, by `run(measured)` (the job's compiled
    loop; its SpecStats). Costs: per K (and, with K = 0 in the set, per plain round: `AdaptiveK.plain_cost`), the
    median over `repeats` of the time of a call running `rounds` rounds at that K less that of a call running none
    (the prefill and the call's overhead: one such call a repeat, shared by every K, whose program does the same work
    before its first round), divided by `rounds`; again with 4x then 16x the rounds where noise hid a cost (<= 0) or
    the cheapest K's rounds took less than half the call running none (at batch 16 of the expanded stories260K, a
    1 s prefill beside 8 rounds of 26-107 ms: three calibrations put K = 1's round at 40-57 ms and a plain one at
    21-30, and one of them chose K = 1 rounds where the other two ran plain; with 32 rounds, 47-49 and 24-27, all
    plain); a cost still hidden takes the least one measured, every cost alike where none showed. The defaults cost
    a tenth of 32 rounds x 9 repeats (EAGLE-3 on the expanded stories260K, K in 0, 1, 2, 4, 8: 3.1 s against 29.5 s
    at batch 1, 8 s against 71 s at batch 8) and their costs over a plain round's differed from those by no more
    than two runs of 32 x 9 differed from each other (up to 8%); that was with a call running none for every K, which
    the shared one cut from 28-32 s to 19-20 s (batch 4, prompts of up to 52 tokens, K in 0, 1, 2, 4; three of each
    in turns on a Zen 1 host: the costs over a plain round's spread alike, 1.46-1.66 and 1.48-1.62 at K = 1).
    Prior: the acceptance rate of all draft positions over `rounds` rounds at the largest K (kept within
    [0.05, 0.95]). With several processes, all take process 0's measurements (`agreed`)."""
    if adaptive.costs is not None and adaptive.prior is not None:
        return adaptive
    timed = lambda index, n: jax.block_until_ready(run(adaptive.measured(index, n)))
    stats = timed(len(adaptive.ks) - 1, rounds)  # compiles, where not compiled yet
    if adaptive.prior is None:
        rate = summarize(stats)["acceptance_rate"]
        adaptive = dataclasses.replace(adaptive, prior=min(max(rate, 0.05), 0.95))
    if adaptive.costs is None:

        def seconds(index: int, n: int, plain: bool) -> float:
            begin = time.perf_counter()
            jax.block_until_ready(run(adaptive.measured(index, n, plain)))
            return time.perf_counter() - begin

        # each K's rounds, then (with K = 0 in the set) plain rounds
        plain = adaptive.ks[0] == 0 and adaptive.plain_cost is None
        runs = [(i, False) for i in range(len(adaptive.ks))] + [(0, True)] * plain
        for n in (rounds, 4 * rounds, 16 * rounds):  # more rounds where the machine's noise hid their cost
            per_round, fixed = [[] for _ in runs], []
            for _ in range(repeats):  # each in turn: a drifting machine speed reaches all alike
                fixed.append(seconds(0, 0, False))
                for (i, as_plain), t in zip(runs, per_round):
                    t.append((seconds(i, n, as_plain) - fixed[-1]) / n)
            costs = [float(np.median(t)) for t in per_round]
            # the noise of a call grows with its length: rounds that took less than half its fixed part are
            # timed again with more
            if min(costs) > 0 and n * min(costs) >= np.median(fixed) / 2:
                break
        # a cost the noise still hides takes the least one measured (every cost alike where none was)
        seen = [c for c in costs if c > 0]
        costs = [c if c > 0 else min(seen, default=1.0) for c in costs]
        adaptive = dataclasses.replace(adaptive, costs=tuple(costs[: len(adaptive.ks)]))
        # a plain round does a K = 0 round's work but the drafter's: timed above that, it is noise
        if plain:
            adaptive = dataclasses.replace(adaptive, plain_cost=min(costs[-1], costs[0]))
    return agreed(adaptive)


def agreed(adaptive: AdaptiveK) -> AdaptiveK:
    """`adaptive` with process 0's measured costs, prior and plain cost on every process (each timed its own): the
    processes of one program must choose the same K each round."""
    plain = -1.0 if adaptive.plain_cost is None else adaptive.plain_cost
    values = sharding.from_main(np.array([*adaptive.costs, adaptive.prior, plain], np.float64))
    n = len(adaptive.ks)
    costs, prior, plain = tuple(values[:n].tolist()), float(values[n]), float(values[n + 1])
    return dataclasses.replace(adaptive, costs=costs, prior=prior, plain_cost=None if plain < 0 else plain)


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
    tokens) for a lossless acceptance rule. Adaptive K without costs or prior first runs a few rounds per K."""
    tokens, lengths, spec = prepare_speculative(cfg, drafter, prompts, spec)
    spec = calibrate(cfg, graphdef, params, drafter, drafter_params, tokens, lengths, spec)
    args = (cfg, graphdef, params, drafter, drafter_params, tokens, lengths, job_key(seed))
    return speculative_compiled(*args, *split(spec))
