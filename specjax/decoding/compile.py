"""Ahead-of-time compilation of a decode job for a fixed batch shape, timed apart from running it."""

from __future__ import annotations

import time

from specjax.decoding.autoregressive import generate_compiled
from specjax.decoding.jobs import GenerateSpec, job_key, prepare, prepare_speculative
from specjax.decoding.speculative import calibrate, speculative_compiled
from specjax.models.config import LlamaConfig


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

    Returns (`run(prompts, seed)`, compile seconds); `run` takes any batch of the same size and padded
    width."""
    if drafter is None:
        prep = lambda batch: prepare(cfg, batch, spec, bucket)
        fn, static, dynamic = generate_compiled, dict(cfg=cfg, graphdef=graphdef), dict(params=params)
    else:
        prep = lambda batch: prepare_speculative(cfg, drafter, batch, spec, bucket)
        fn, static = speculative_compiled, dict(cfg=cfg, graphdef=graphdef, drafter=drafter)
        dynamic = dict(params=params, drafter_params=drafter_params)
    tokens, lengths, full_spec = prep(prompts)
    start = time.perf_counter()
    if drafter is not None:  # adaptive K without costs: time a few rounds per K (counted as compile time)
        full_spec = calibrate(cfg, graphdef, params, drafter, drafter_params, tokens, lengths, full_spec)
    lowered = fn.lower(
        **static, **dynamic, tokens_BP=tokens, lengths_B=lengths, key=job_key(0), spec=full_spec
    )
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start

    def run(prompts: list[list[int]], seed: int = 0):
        tokens, lengths = prep(prompts)[:2]
        return compiled(**dynamic, tokens_BP=tokens, lengths_B=lengths, key=job_key(seed))

    return run, compile_s
