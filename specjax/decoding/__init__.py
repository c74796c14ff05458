"""Decoding, one `jax.jit` per job: job preparation (`jobs`), prefill, the AR loop (`autoregressive`), the
speculative loop and its round (`speculative`), adaptive draft length (`adaptive`), slots refilled inside the loop
(`refill`), and ahead-of-time compilation (`compile`)."""

from specjax.decoding.adaptive import AdaptiveK
from specjax.decoding.autoregressive import Generation, generate
from specjax.decoding.compile import compile_decode
from specjax.decoding.jobs import GenerateSpec, job_key, prepare, prepare_speculative
from specjax.decoding.speculative import SpecGeneration, SpecStats, speculative_generate

__all__ = [
    "AdaptiveK",
    "GenerateSpec",
    "Generation",
    "SpecGeneration",
    "SpecStats",
    "compile_decode",
    "generate",
    "job_key",
    "prepare",
    "prepare_speculative",
    "speculative_generate",
]
