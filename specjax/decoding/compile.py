"""Ahead-of-time compilation of a decode job for a fixed batch shape, timed apart from running it."""

from __future__ import annotations

import contextlib
import time

import jax

from specjax import sharding
from specjax.decoding.autoregressive import generate_compiled
from specjax.decoding.jobs import GenerateSpec, job_key, prepare, prepare_speculative
from specjax.decoding.speculative import measure, speculative_compiled, split
from specjax.drafting.protocol import laid_out
from specjax.errors import DecodingError
from specjax.models.config import LlamaConfig
from specjax.models.llama import multi_row_layout, uses_multi_row_layout


def decoding_layout(graphdef, params, drafter, drafter_params, several_rows: bool):
    """(graphdef, params, drafter, drafter_params) as decoding on one device runs them: the target's linear layers
    by `multi_row_layout` where `uses_multi_row_layout` (a drafter's job always: its rounds verify several tokens),
    the drafter's as `drafter_layout` lays them out."""
    if uses_multi_row_layout(drafter is not None or several_rows):
        graphdef, params = multi_row_layout(graphdef, params)
    return graphdef, params, *drafter_layout(drafter, drafter_params)


def drafter_layout(drafter, drafter_params):
    """(drafter, drafter_params) with the drafter's own linear layers laid out by `multi_row_layout` where a
    drafter's job lays out the target's (`laid_out`; drafters without weights of their own as they are)."""
    if drafter is None or not uses_multi_row_layout(True):
        return drafter, drafter_params
    return laid_out(drafter, drafter_params, multi_row_layout)


def compile_decode(
    cfg: LlamaConfig,
    graphdef,
    params,
    prompts: list[list[int]],
    spec: GenerateSpec,
    drafter=None,
    drafter_params=None,
    bucket: int = 8,
    mesh: jax.sharding.Mesh | None = None,
):
    """Compiles AR decoding (no drafter) or speculative decoding ahead of time for the shape of `prompts`, on one
    device or split over `mesh` (`specjax.sharding`: the target Megatron style over `model`, the batch over
    `data`; the parameters are placed on it here). On one CPU the target's and the drafter's linear layers are
    packed for specjax's CPU kernel where it is built; without it, passes of several rows (a drafter, or a batch)
    read them stored [in, out] (`decoding_layout`; a second copy of the matrices, held while `run` lives).

    Returns (`run(prompts, seed)`, compile seconds); `run` takes any batch of the same size and padded
    width."""
    if drafter is None and spec.adaptive_k is not None:
        raise DecodingError(
            "adaptive K chooses draft lengths: give a drafter, or a spec without adaptive_k"
        )
    on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    given = drafter  # `run` lays other params out as this one's
    if mesh is None:
        graphdef, params, drafter, drafter_params = decoding_layout(
            graphdef, params, drafter, drafter_params, len(prompts) > 1
        )
    else:
        params = sharding.place_target(mesh, cfg, params, len(prompts))
        drafter_params = sharding.place_drafter(mesh, drafter_params)
    if drafter is None:
        prep = lambda batch: prepare(cfg, batch, spec, bucket)
        fn, static, dynamic = generate_compiled, dict(cfg=cfg, graphdef=graphdef), dict(params=params)
    else:
        prep = lambda batch: prepare_speculative(cfg, drafter, batch, spec, bucket)
        fn, static = speculative_compiled, dict(cfg=cfg, graphdef=graphdef, drafter=drafter)
        dynamic = dict(params=params, drafter_params=drafter_params)

    def batch(prompts):  # (tokens, lengths, spec), the batch split over `data` on a mesh
        tokens, lengths, full_spec = prep(prompts)
        if mesh is not None:
            tokens, lengths = sharding.place((tokens, lengths), (sharding.batch_sharding(mesh),) * 2)
        return tokens, lengths, full_spec

    tokens, lengths, full_spec = batch(prompts)
    adaptive = full_spec.adaptive_k
    if adaptive is not None:  # its costs and prior are data: lowered with a forced K's, measured below
        full_spec, dynamic["measured"] = split(full_spec, forced=0)
    start = time.perf_counter()
    with on_mesh:
        lowered = fn.lower(
            **static, **dynamic, tokens_BP=tokens, lengths_B=lengths, key=job_key(0), spec=full_spec
        )
        compiled = lowered.compile()
        if adaptive is not None:  # where costs or prior are not given: timed rounds (compile time)
            rounds = lambda m: compiled(
                **dynamic | dict(measured=m), tokens_BP=tokens, lengths_B=lengths, key=job_key(0)
            )
            adaptive = measure(adaptive, lambda m: rounds(m).stats)
            dynamic["measured"] = adaptive.measured()
    compile_s = time.perf_counter() - start

    def as_compiled(dparams):  # other drafter params, laid out or placed as the compiled ones
        if mesh is not None:
            return sharding.place_drafter(mesh, dparams)
        return drafter_layout(given, dparams)[1]

    def run(prompts: list[list[int]], seed: int = 0, drafter_params=None):
        """The job on `prompts`; `drafter_params` of the same shapes replace the compiled ones (a store that
        learns from earlier outputs)."""
        tokens, lengths = batch(prompts)[:2]
        args = dict(dynamic)
        if drafter_params is not None:
            args["drafter_params"] = as_compiled(drafter_params)
        return compiled(**args, tokens_BP=tokens, lengths_B=lengths, key=job_key(seed))

    return run, compile_s
