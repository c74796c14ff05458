"""Decode jobs: their static settings (`GenerateSpec`), validation and padding before any compile."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specjax import precision
from specjax.acceptance import AcceptanceRule
from specjax.acceptance.rejection import TokenWise
from specjax.decoding.adaptive import AdaptiveK
from specjax.drafting.trees import Chain
from specjax.errors import DecodingError
from specjax.models.config import LlamaConfig
from specjax.sampling import Sampler

# cache slots are rounded up to a multiple of this: attention reads every slot of the static cache in each pass, so
# a job gets no more than it needs (a 64-slot bucket gave EAGLE-3's K = 4 jobs 192 slots for 133; 19% slower one-token
# passes at batch 16 on the expanded stories260K)
CACHE_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """Static settings of one compiled decode: a new spec compiles a new loop."""

    max_new_tokens: int
    sampler: Sampler = Sampler()
    cache_size: int = 0  # 0: smallest bucket that fits the prompts + max_new_tokens (+ a round's slots)
    eos_id: int | None = 2  # None: never stop early
    acceptance: AcceptanceRule = TokenWise()  # speculative decoding's rule (`specjax.acceptance.get`)
    adaptive_k: AdaptiveK | None = None  # choose each round's K on device (a chain drafter of the largest)
    matmul_precision: str = "dtype"  # `specjax.precision.CHOICES`; dtype: float32 weights at full precision

    def __post_init__(self):
        precision.check(self.matmul_precision)

    @property
    def stop_id(self) -> int:
        """The token that ends a row (-1, no token, when `eos_id` is None)."""
        return -1 if self.eos_id is None else self.eos_id


def job_key(seed: int) -> jax.Array:
    """The PRNG key of a decode job. The 'rbg' implementation draws with XLA's RngBitGenerator, one kernel
    per draw: threefry runs as a loop of small kernels on XLA CPU, which cost a sampled speculative round
    on stories260K about 15%. Its streams are reproducible on one platform, not across platforms."""
    return jax.random.key(seed, impl="rbg")


def pad_prompts(prompts: list[list[int]], bucket: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into `[B, P]` (P: longest prompt rounded up to `bucket`) plus lengths `[B]`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodingError("every prompt needs at least one token (BOS counts); got an empty prompt")
    width = -(-max(map(len, prompts)) // bucket) * bucket
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def cache_size_for(cfg: LlamaConfig, prompt_width: int, new_tokens: int, requested: int = 0) -> int:
    """Cache slots for a job, checked against the model's context; raises before any compile."""
    need = prompt_width + new_tokens
    if need > cfg.max_seq_len:
        raise DecodingError(
            f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} exceeds the "
            f"model's context of {cfg.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    if requested:
        if need > requested:
            raise DecodingError(
                f"prompt ({prompt_width} tokens, padded) + {new_tokens} new tokens = {need} does not "
                f"fit the KV cache of {requested} slots; raise cache_size or shorten the job"
            )
        return requested
    return -(-need // CACHE_BUCKET) * CACHE_BUCKET


def prepare(cfg: LlamaConfig, prompts: list[list[int]], spec: GenerateSpec, bucket: int = 8):
    """Validates a job and pads it: (tokens [B, P], lengths [B], spec with its cache size), before any
    compile."""
    if spec.max_new_tokens < 1:
        raise DecodingError(f"max_new_tokens must be >= 1, got {spec.max_new_tokens}")
    tokens, lengths = pad_prompts(prompts, bucket)
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise DecodingError(
            f"prompt token ids must lie in [0, {cfg.vocab_size}), the model's vocabulary; got "
            f"{int(tokens.min())}..{int(tokens.max())}: the tokenizer does not belong to this model"
        )
    size = cache_size_for(cfg, tokens.shape[1], spec.max_new_tokens, spec.cache_size)
    return tokens, lengths, dataclasses.replace(spec, cache_size=size)


def prepare_speculative(
    cfg: LlamaConfig, drafter, prompts: list[list[int]], spec: GenerateSpec, bucket: int = 8
):
    """Validates a speculative job before any compile; the cache gets the slots one round writes past the
    sequence (`drafter.shape.cache_slots`: K + 1 for a chain, the node count for a tree) beyond the prompt
    and the new tokens (adaptive K: the drafter is built for the largest K)."""
    shape = drafter.shape
    drafter.validate(cfg)
    if shape.width > cfg.vocab_size:
        raise DecodingError(
            f"{shape.describe()} drafts {shape.width} candidates per node, more than the model's vocabulary "
            f"of {cfg.vocab_size}; draft a narrower tree"
        )
    if spec.adaptive_k is not None:
        check_adaptive(drafter, spec.adaptive_k)
    tokens, lengths, _ = prepare(cfg, prompts, dataclasses.replace(spec, cache_size=0), bucket)
    width, slots = tokens.shape[1], shape.cache_slots
    if width + shape.depth > cfg.max_seq_len:
        raise DecodingError(
            f"K={shape.depth} draft tokens per round do not fit the model's context of {cfg.max_seq_len} after a "
            f"prompt of {width} tokens (padded); pass --k={cfg.max_seq_len - width} or less"
        )
    need = width + spec.max_new_tokens + slots
    if spec.cache_size and need > spec.cache_size:
        raise DecodingError(
            f"{shape.describe()} does not fit: prompt ({width}, padded) + {spec.max_new_tokens} new tokens "
            f"+ {slots} verification slots = {need} > cache_size {spec.cache_size}; "
            "draft less or raise the cache"
        )
    size = spec.cache_size or -(-need // CACHE_BUCKET) * CACHE_BUCKET
    return tokens, lengths, dataclasses.replace(spec, cache_size=size)


def check_adaptive(drafter, adaptive: AdaptiveK) -> None:
    """Adaptive K drafts chains with `drafter.with_k(K)` for each K, sharing the state of the drafter built for
    the largest K; raises before any compile if `drafter` cannot."""
    if not hasattr(drafter, "with_k"):
        raise DecodingError(
            f"{type(drafter).__name__} cannot change its draft length per round (no `with_k`); "
            "drop adaptive K or use a drafter that has it (draft_model, eagle, eagle3, medusa, ngram)"
        )
    if drafter.shape != Chain(adaptive.k_max):
        raise DecodingError(
            f"{adaptive.describe()} drafts chains: build the drafter as a chain of the largest K "
            f"(k={adaptive.k_max}), not {drafter.shape.describe()}"
        )
