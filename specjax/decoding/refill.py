"""Slots refilled inside the compiled loop: N prompts decoded through B slots in one `jax.jit`. When a row ends (EOS
or its token budget) the next waiting prompt is prefilled into its slot without leaving the program, so a batch no
longer waits for its slowest row with its other slots idle.

The prompts and the outputs live in static-shape device buffers (`[N, P]`, `[N, max_new_tokens]`); a slot's
target cache row, sequence, counters and drafter state are replaced by those of its new prompt (`put_row`). Each
prompt's greedy output is its output decoded alone; a prompt's first token is drawn with a key of its own.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import precision
from specjax.decoding.compile import decoding_layout
from specjax.decoding.jobs import GenerateSpec, job_key, prepare, prepare_speculative
from specjax.decoding.prefill import prefill
from specjax.decoding.speculative import (
    LoopState,
    SpecStats,
    calibrate,
    chosen_round,
    drafted_then_plain,
    plain_round,
    speculative_round,
    when,
)
from specjax.drafting.protocol import feature_taps
from specjax.errors import DecodingError
from specjax.models.llama import causal_mask, forward


@struct.dataclass
class Served:
    tokens: jax.Array  # [N, max_new_tokens] each prompt's output, 0 after its end
    lengths: jax.Array  # [N] tokens generated per prompt (EOS included)
    rounds: jax.Array  # [] loop iterations: target passes after the prefills
    stats: SpecStats | None  # speculative runs: the rounds' statistics (rows: slots)
    # [N] the iteration that made each prompt's last token (where its prefill's token ended it, the iteration that
    # placed it: 0 for the first slots)
    end_rounds: jax.Array


@struct.dataclass
class Queue:
    """The prompts waiting and the outputs written, on device."""

    next: jax.Array  # [] the first prompt not yet started
    request_B: jax.Array  # [B] the prompt each slot serves
    out_NT: jax.Array  # [N, max_new_tokens]
    n_out_N: jax.Array  # [N]
    rounds: jax.Array  # [] loop iterations so far
    end_N: jax.Array  # [N] the iteration that made each prompt's last token so far


def put_row(full, row, slot, batch: int):
    """`full` (a pytree built for `batch` rows) with slot `slot`'s part replaced by `row` (the same pytree built for
    one row). A leaf whose leading axis is `batch` times the row's holds per-row state (a cache's rows x heads too); a
    leaf of the row's shape is shared by the rows and kept (one slot: replaced). Any other leaf is refused when the
    program is traced: its batch axis is not leading."""

    def put(f, r):
        if f.shape == r.shape and batch > 1:
            return f
        if f.ndim == 0 or f.shape[1:] != r.shape[1:] or f.shape[0] != batch * r.shape[0]:
            raise DecodingError(
                f"cannot refill a slot: a state array of shape {f.shape} (one row: {r.shape}) does not lead with "
                "the batch axis; decode batch after batch instead"
            )
        at = (slot * r.shape[0],) + (0,) * (f.ndim - 1)
        return jax.lax.dynamic_update_slice(f, r.astype(f.dtype), at)

    return jax.tree.map(put, full, row)


def refill(state, done_B, queue: Queue, new_row, place):
    """Starts the next waiting prompt in every finished slot (`done_B`), one slot at a time. For a slot that takes
    one, `new_row(prompt)` -> (the prompt's row of state, its first token) and `place(state, slot, row, first,
    prompt)` writes it (`speculative.when`: in place), and a slot that takes nothing costs nothing (writing every
    slot's row back each round, taken or not, read and wrote all the caches: AR rounds at batch 8 of the expanded
    stories260K cost 1.10x decoding's steps). Returns (state, queue)."""
    n = queue.n_out_N.shape[0]

    def each(b, carry):
        def start(c):
            state, queue = c
            prompt = queue.next
            row, first = new_row(prompt)
            queue = queue.replace(
                next=prompt + 1,
                request_B=queue.request_B.at[b].set(prompt),
                out_NT=queue.out_NT.at[prompt, 0].set(first),
                n_out_N=queue.n_out_N.at[prompt].set(1),
                end_N=queue.end_N.at[prompt].set(queue.rounds),
            )
            return place(state, b, row, first, prompt), queue

        return when(done_B[b] & (carry[1].next < n), start, carry)

    return jax.lax.fori_loop(0, queue.request_B.shape[0], each, (state, queue))


def opening(tokens_NP, lengths_N, slots: int, n_new: int):
    """(the first `slots` prompts [B, P], their lengths, their indices, an empty output buffer)."""
    n = tokens_NP.shape[0]
    request = jnp.arange(slots, dtype=jnp.int32)
    return tokens_NP[:slots], lengths_N[:slots], request, jnp.zeros((n, n_new), jnp.int32)


def opening_queue(request_B, out_NT, first_B) -> Queue:
    """The queue after the opening prefill: the first slots' prompts started, each with its first token."""
    zeros = jnp.zeros((out_NT.shape[0],), jnp.int32)
    out = out_NT.at[request_B, 0].set(first_B)
    return Queue(jnp.int32(len(request_B)), request_B, out, zeros.at[request_B].set(1), jnp.int32(0), zeros)


def ended(queue: Queue, live_B) -> Queue:
    """`queue` after an iteration: the rows live in it (`live_B`) made tokens in it."""
    rounds = queue.rounds + 1
    rows = jnp.where(live_B, queue.request_B, queue.end_N.shape[0])  # idle slots write nothing
    return queue.replace(rounds=rounds, end_N=queue.end_N.at[rows].set(rounds, mode="drop"))


def prefill_widths(width: int) -> tuple[int, ...]:
    """The widths a refilled slot's prompt is prefilled at: a quarter, half and all of the buffer's `width`, each
    rounded up to a multiple of 8 (a short prompt does not pay for the longest one's padding)."""
    up_to_8 = lambda n: -(-n // 8) * 8
    return tuple(sorted({min(width, up_to_8(-(-width // d))) for d in (4, 2, 1)}))


def start_row(begin, tokens_NP, lengths_N, prompt):
    """`begin(tokens [1, w], lengths [1], prompts [1])` for prompt `prompt`, at the narrowest of `prefill_widths`
    that holds it (one `lax.switch` branch per width); at the buffer's width alone where a drafter's state would
    differ between widths."""
    widths = prefill_widths(tokens_NP.shape[1])
    lengths_1 = jax.lax.dynamic_slice_in_dim(lengths_N, prompt, 1)

    def at(w):
        return lambda p: begin(jax.lax.dynamic_slice(tokens_NP, (p, 0), (1, w)), lengths_1, p[None])

    shapes = [jax.tree.flatten(jax.eval_shape(at(w), prompt)) for w in widths]
    if any(s != shapes[-1] for s in shapes):
        return at(widths[-1])(prompt)
    index = jnp.searchsorted(jnp.asarray(widths), lengths_1[0])
    return jax.lax.switch(index, [at(w) for w in widths], prompt)


def first_tokens(sampler, key, prompts_B, logits_BV, n_prompts: int):
    """Each prompt's first token, drawn with the uniform at its index in one draw for all `n_prompts` (the same
    whichever slot serves it; 'rbg' keys folded per prompt under `vmap` draw from the first prompt's stream)."""
    u_N = jax.random.uniform(key, (n_prompts,))
    return sampler.sample_with(u_N[prompts_B], logits_BV)


# --- autoregressive -------------------------------------------------------------------------------------------


@struct.dataclass
class ARSlots:
    cache: object
    last_B: jax.Array  # each slot's last token (not yet in the cache)
    pos_B: jax.Array  # tokens its prompt has generated
    done_B: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "spec", "slots"))
def ar_serve_compiled(
    cfg, graphdef, params, tokens_NP, lengths_N, budget_N, key, spec: GenerateSpec, slots: int
):
    with precision.scope(spec.matmul_precision, cfg.dtype):
        return _ar_serve(cfg, graphdef, params, tokens_NP, lengths_N, budget_N, key, spec, slots)


def _ar_serve(cfg, graphdef, params, tokens_NP, lengths_N, budget_N, key, spec, slots):
    n_new, sampler, stop = spec.max_new_tokens, spec.sampler, spec.stop_id
    k_first, k_steps = jax.random.split(key)

    def begin(tokens, lengths, prompts):  # (cache, first tokens)
        logits, cache, _ = prefill(cfg, graphdef, params, tokens, lengths, spec.cache_size)
        return cache, first_tokens(sampler, k_first, prompts, logits, tokens_NP.shape[0])

    tokens, lengths, request, out = opening(tokens_NP, lengths_N, slots, n_new)
    cache, first = begin(tokens, lengths, request)
    n = out.shape[0]
    ends = lambda first, prompt: (first == stop) | (budget_N[prompt] <= 1)  # at its first token
    state = ARSlots(cache, first, jnp.ones((slots,), jnp.int32), ends(first, request))
    queue = opening_queue(request, out, first)

    def new_row(prompt):
        cache_1, first_1 = start_row(begin, tokens_NP, lengths_N, prompt)
        return cache_1, first_1[0]

    def place(s: ARSlots, b, cache_1, first, prompt):
        return ARSlots(
            cache=put_row(s.cache, cache_1, b, slots),
            last_B=s.last_B.at[b].set(first),
            pos_B=s.pos_B.at[b].set(1),
            done_B=s.done_B.at[b].set(ends(first, prompt)),
        )

    def body(carry):
        s, queue = carry
        active = ~s.done_B
        positions = s.cache.length[:, None]
        logits, _, cache = forward(graphdef, params, s.last_B[:, None], positions, s.cache, causal_mask(1))
        u = jax.random.uniform(jax.random.fold_in(k_steps, queue.rounds), (slots,))
        token = sampler.sample_with(u, logits[:, 0])
        rows = jnp.where(active, queue.request_B, n)  # idle slots write nothing
        pos = s.pos_B + active
        queue = queue.replace(
            out_NT=queue.out_NT.at[rows, s.pos_B].set(token, mode="drop"),
            n_out_N=queue.n_out_N.at[rows].set(pos, mode="drop"),
        )
        done = s.done_B | (token == stop) | (pos >= budget_N[queue.request_B])
        s = ARSlots(cache.advance(active.astype(jnp.int32)), token, pos, done)
        return refill(s, done, ended(queue, active), new_row, place)

    go_on = lambda carry: (
        ~jnp.all(carry[0].done_B) | (carry[1].next < n)
    )  # a row to run, or a prompt waiting
    _, queue = jax.lax.while_loop(go_on, body, (state, queue))
    return Served(queue.out_NT, queue.n_out_N, queue.rounds, None, queue.end_N)


# --- speculative ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "graphdef", "drafter", "spec", "slots"))
def speculative_serve_compiled(
    cfg, graphdef, params, drafter, drafter_params, tokens_NP, lengths_N, budget_N, key, spec, slots: int
):
    with precision.scope(spec.matmul_precision, cfg.dtype):
        return _speculative_serve(
            cfg, graphdef, params, drafter, drafter_params, tokens_NP, lengths_N, budget_N, key, spec, slots
        )


def _speculative_serve(
    cfg, graphdef, params, drafter, drafter_params, tokens_NP, lengths_N, budget_N, key, spec, slots
):
    n_new, stop, size = spec.max_new_tokens, spec.stop_id, spec.cache_size
    taps = feature_taps(drafter)
    k_first, k_rounds = jax.random.split(key)
    tokens, lengths, request, out = opening(tokens_NP, lengths_N, slots, n_new)
    n = tokens_NP.shape[0]
    # every round emits a token for each live slot: N x max_new_tokens rounds at most
    round_keys = jax.random.split(k_rounds, (n * n_new, 2))

    def prefilled(tokens_bp, lengths_b, prompts_b, taps):  # (cache, first tokens, features, sequences)
        logits, cache, feats = prefill(cfg, graphdef, params, tokens_bp, lengths_b, size, taps)
        first = first_tokens(spec.sampler, k_first, prompts_b, logits, n)
        rows = jnp.arange(tokens_bp.shape[0])
        seq = jnp.zeros((tokens_bp.shape[0], size), jnp.int32).at[:, : tokens_bp.shape[1]].set(tokens_bp)
        return cache, first, feats, seq.at[rows, lengths_b].set(first)

    def begin(tokens_bp, lengths_b, prompts_b):  # (cache, first tokens, drafter state, sequences)
        cache, first, feats, seq = prefilled(tokens_bp, lengths_b, prompts_b, taps)
        return cache, first, drafter.init(drafter_params, tokens_bp, lengths_b, size, feats), seq

    def begin_plain(tokens_bp, lengths_b, prompts_b):  # the same without features or drafter state
        cache, first, _, seq = prefilled(tokens_bp, lengths_b, prompts_b, ())
        return cache, first, None, seq

    cache, first, drafter_state, seq = begin(tokens, lengths, request)
    done = (first == stop) | (budget_N[request] <= 1)
    queued = lambda next_: jnp.sum(jnp.where(jnp.arange(n) >= next_, budget_N, 0)) / slots
    estimate = jnp.zeros(())
    if spec.adaptive_k is not None:
        left = jnp.where(done, 0, budget_N[request] - 1) + queued(slots)
        estimate = spec.adaptive_k.zeros(left, spec.adaptive_k.measured())
    loop = LoopState(
        seq_BS=seq,
        n_tokens_B=lengths + 1,
        done_B=done,
        cache=cache,
        drafter_state=drafter_state,
        stats=SpecStats.zeros(slots, drafter.shape.depth),
        estimate=estimate,
    )
    queue = opening_queue(request, out, first)
    carry = (loop, lengths, queue)  # with each slot's prompt length

    def harvest(loop: LoopState, start_B, queue: Queue) -> Queue:
        """Every slot's tokens so far into its prompt's output row."""
        idx = start_B[:, None] + jnp.arange(n_new)[None]
        made = jnp.take_along_axis(loop.seq_BS, jnp.minimum(idx, size - 1), axis=1)
        n_out = loop.n_tokens_B - start_B
        made = jnp.where(jnp.arange(n_new)[None] < n_out[:, None], made, 0)
        return queue.replace(
            out_NT=queue.out_NT.at[queue.request_B].set(made),
            n_out_N=queue.n_out_N.at[queue.request_B].set(n_out),
        )

    # `refill`'s new_row: a prompt's row of state from `start` (`begin` or `begin_plain`)
    def rows_from(start):
        def new_row(prompt):
            cache_1, first_1, drafter_1, seq_1 = start_row(start, tokens_NP, lengths_N, prompt)
            return (cache_1, drafter_1, seq_1, lengths_N[prompt]), first_1[0]

        return new_row

    def place(state, b, row, first, prompt):
        (loop, start_B), (cache_1, drafter_1, seq_1, length) = state, row
        loop = loop.replace(
            seq_BS=put_row(loop.seq_BS, seq_1, b, slots),
            n_tokens_B=loop.n_tokens_B.at[b].set(length + 1),
            done_B=loop.done_B.at[b].set((first == stop) | (budget_N[prompt] <= 1)),
            cache=put_row(loop.cache, cache_1, b, slots),
        )
        if drafter_1 is not None:  # a plain job's rows start no drafter
            loop = loop.replace(drafter_state=put_row(loop.drafter_state, drafter_1, b, slots))
        return loop, start_B.at[b].set(length)

    def drafted(loop, start_B, queue):  # a round
        args = (graphdef, params, drafter, drafter_params, spec, loop, start_B + budget_N[queue.request_B])
        if spec.adaptive_k is None:
            return speculative_round(*args, round_keys)
        # the queue's tokens are work left too: a refilled batch does not wait for its slowest row
        return chosen_round(*args, round_keys, queued(queue.next))

    def plain(loop, start_B, queue):
        return plain_round(graphdef, params, spec, loop, start_B + budget_N[queue.request_B], round_keys)

    # go_on -> the serving loop of `one_round`s, refilling ended slots from `start`
    def rounds(one_round, start):
        def body(carry):
            loop, start_B, queue = carry
            live = ~loop.done_B
            loop = one_round(loop, start_B, queue)
            queue = ended(harvest(loop, start_B, queue), live)
            (loop, start_B), queue = refill((loop, start_B), loop.done_B, queue, rows_from(start), place)
            return loop, start_B, queue

        return lambda go: lambda carry: jax.lax.while_loop(go, body, carry)

    go_on = lambda carry: ~jnp.all(carry[0].done_B) | (carry[2].next < n)
    # plain rounds' refills neither tap features nor start the drafter, never called again (they cost a plain job
    # 9% of AR's time in a probe at batch 16 of the expanded stories260K)
    loop, start_B, queue = drafted_then_plain(
        spec.adaptive_k,
        rounds(drafted, begin),
        rounds(plain, begin_plain),
        go_on,
        lambda c: c[0].estimate,
        carry,
    )
    return Served(queue.out_NT, queue.n_out_N, loop.stats.rounds, loop.stats, queue.end_N)


def token_budgets(budgets, n_prompts: int, max_new: int) -> np.ndarray:
    """[N] each prompt's token budget (None: `max_new_tokens` for every prompt), checked before any compile."""
    if budgets is None:
        return np.full(n_prompts, max_new, np.int32)
    out = np.asarray(budgets, np.int32)
    if out.shape != (n_prompts,) or out.min() < 1 or out.max() > max_new:
        raise DecodingError(
            f"token budgets must be one per prompt ({n_prompts}), each in 1..max_new_tokens={max_new}; "
            f"got {len(out)} in {out.min()}..{out.max()}"
        )
    return out


def job(cfg, graphdef, params, spec: GenerateSpec, slots: int, n_prompts: int, drafter, drafter_params):
    """(the compiled function, its static and array arguments, `prep(prompts, budgets)` -> the job's arrays and
    spec, the slots), checked."""
    if slots < 1:
        raise DecodingError(f"a batch needs at least one slot, got batch_size={slots}")
    slots = min(slots, n_prompts)

    def prep(prompts, budgets):
        if drafter is None:
            tokens, lengths, full = prepare(cfg, prompts, spec)
        else:
            tokens, lengths, full = prepare_speculative(cfg, drafter, prompts, spec)
        budget = token_budgets(budgets, len(prompts), spec.max_new_tokens)
        return dict(tokens_NP=tokens, lengths_N=lengths, budget_N=budget), full

    if drafter is None:
        return ar_serve_compiled, dict(cfg=cfg, graphdef=graphdef), dict(params=params), prep, slots
    static = dict(cfg=cfg, graphdef=graphdef, drafter=drafter)
    return (
        speculative_serve_compiled,
        static,
        dict(params=params, drafter_params=drafter_params),
        prep,
        slots,
    )


def serve(
    cfg,
    graphdef,
    params,
    prompts: list[list[int]],
    spec: GenerateSpec,
    slots: int,
    drafter=None,
    drafter_params=None,
    seed: int = 0,
    budgets=None,
) -> Served:
    """Decodes `prompts` through `slots` rows in one compiled call, each slot taking the next prompt as its row
    ends (EOS, or its token budget: `budgets[i]` <= max_new_tokens, default that): AR without a drafter,
    speculative decoding with one (same output distribution as `generate`)."""
    fn, static, arrays, prep, slots = job(
        cfg, graphdef, params, spec, slots, len(prompts), drafter, drafter_params
    )
    job_arrays, spec = prep(prompts, budgets)
    spec = measured(spec, job_arrays, slots, cfg, graphdef, params, drafter, drafter_params)
    return fn(**static, **arrays, **job_arrays, key=job_key(seed), spec=spec, slots=slots)


def measured(spec, job_arrays, slots, cfg, graphdef, params, drafter, drafter_params):
    """`spec` with adaptive K's round costs and prior measured on the first `slots` prompts, where not given."""
    if drafter is None:
        return spec
    tokens, lengths = job_arrays["tokens_NP"][:slots], job_arrays["lengths_N"][:slots]
    return calibrate(cfg, graphdef, params, drafter, drafter_params, tokens, lengths, spec)


def compile_serve(
    cfg,
    graphdef,
    params,
    prompts: list[list[int]],
    spec: GenerateSpec,
    slots: int,
    drafter=None,
    drafter_params=None,
):
    """`serve` compiled ahead of time for the count and padded width of `prompts`: (`run(prompts, seed, budgets)`,
    compile seconds). On one CPU its matrices are laid out as `compile_decode` lays them out (`decoding_layout`)."""
    graphdef, params, drafter, drafter_params = decoding_layout(
        graphdef, params, drafter, drafter_params, min(slots, len(prompts)) > 1
    )
    fn, static, arrays, prep, slots = job(
        cfg, graphdef, params, spec, slots, len(prompts), drafter, drafter_params
    )
    job_arrays, full_spec = prep(prompts, None)
    full_spec = measured(full_spec, job_arrays, slots, cfg, graphdef, params, drafter, drafter_params)
    begin = time.perf_counter()
    compiled = fn.lower(
        **static, **arrays, **job_arrays, key=job_key(0), spec=full_spec, slots=slots
    ).compile()
    compile_s = time.perf_counter() - begin

    def run(prompts: list[list[int]], seed: int = 0, budgets=None) -> Served:
        return compiled(**arrays, **prep(prompts, budgets)[0], key=job_key(seed))

    return run, compile_s
