"""Text in, text out: encoding prompts, timed compiled decoding, and the metrics `run_decode.py` prints."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from specjax import sharding
from specjax.decoding import GenerateSpec, compile_decode
from specjax.decoding.refill import compile_serve
from specjax.errors import DecodingError
from specjax.models.loading import LoadedModel


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids (BOS first) of each prompt; an empty prompt is an error."""
    if not texts:
        raise DecodingError("no prompts given: pass --prompt TEXT or --prompts_file FILE")
    for i, text in enumerate(texts):
        if not text.strip():
            raise DecodingError(f"prompt {i} is empty; give some text to continue")
    return [tokenizer.encode(t) for t in texts]


def continuation(tokenizer, prompt: list[int], new_tokens) -> str:
    """The text `new_tokens` add to `prompt` (decoded together: a token's text can depend on the one before)."""
    full = tokenizer.decode(prompt + list(map(int, new_tokens)))
    return full[len(tokenizer.decode(prompt)) :]


@dataclasses.dataclass
class DecodeReport:
    texts: list[str]
    new_tokens: int
    compile_s: float
    run_s: float
    stats: list = dataclasses.field(default_factory=list)  # per batch SpecStats (speculative runs)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.run_s


def decode_texts(
    model: LoadedModel,
    texts: list[str],
    spec: GenerateSpec,
    seed: int = 0,
    batch_size: int = 8,
    drafter=None,
    drafter_params=None,
    mesh=None,
    refill: bool = False,
) -> DecodeReport:
    """Decodes prompts in batches of `batch_size` with one compiled loop, AR or speculative (with `drafter`), on
    one device or split over `mesh` (`specjax.sharding`). Short batches are padded by repeating a prompt (on a
    mesh, to a multiple of its data axis); their extra rows are dropped. A drafter with `absorb` (suffix decoding)
    learns each batch's outputs before the next batch. `refill`: all prompts in one compiled loop whose
    `batch_size` slots each take the next prompt as their row ends (`specjax.decoding.refill`; one device)."""
    if batch_size < 1:
        raise DecodingError(f"batch_size must be >= 1, got {batch_size}")
    prompts = encode_prompts(model.tokenizer, texts)
    if refill:
        return decode_refilled(model, prompts, spec, seed, batch_size, drafter, drafter_params, mesh)
    size = min(batch_size, len(prompts))
    if mesh is not None:
        size = -(-size // mesh.shape["data"]) * mesh.shape["data"]
    batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    width = max(map(len, prompts))  # one padded width for every batch: one compile
    pad = lambda batch: batch + [batch[-1]] * (size - len(batch))
    run, compile_s = compile_decode(
        model.cfg, model.graphdef, model.params, pad(batches[0]), spec, drafter, drafter_params, width, mesh
    )
    jax.block_until_ready(run(pad(batches[0]), seed))  # warm-up
    outputs, new_tokens, run_s, stats, learned = [], 0, 0.0, [], None
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        gen = jax.block_until_ready(run(pad(batch), seed + i, learned))
        run_s += time.perf_counter() - start
        gen = sharding.to_host(gen)  # on a mesh of several processes, gathered from all of them
        stats.append(getattr(gen, "stats", None))
        tokens, lengths = gen.tokens, gen.lengths
        for row, prompt in enumerate(batch):
            outputs.append(continuation(model.tokenizer, prompt, tokens[row, : lengths[row]]))
            new_tokens += int(lengths[row])
        if hasattr(drafter, "absorb"):  # a drafter that learns from finished outputs (suffix decoding)
            finished = [p + tokens[row, : lengths[row]].tolist() for row, p in enumerate(batch)]
            learned = drafter.absorb(drafter_params if learned is None else learned, finished)
    return DecodeReport(outputs, new_tokens, compile_s, run_s, stats)


def decode_refilled(model, prompts, spec, seed, slots, drafter, drafter_params, mesh) -> DecodeReport:
    """`decode_texts` with slots refilled inside one compiled loop."""
    if mesh is not None:
        raise DecodingError("--refill runs on one device: drop --mesh, or decode batch after batch")
    if hasattr(drafter, "absorb"):
        raise DecodingError(
            "--refill keeps every prompt in one compiled loop, so a drafter that learns between batches (suffix) "
            "would learn nothing: drop --refill"
        )
    args = (model.cfg, model.graphdef, model.params, prompts, spec, slots, drafter, drafter_params)
    run, compile_s = compile_serve(*args)
    jax.block_until_ready(run(prompts, seed))  # warm-up
    start = time.perf_counter()
    served = jax.block_until_ready(run(prompts, seed))
    run_s = time.perf_counter() - start
    tokens, lengths = np.asarray(served.tokens), np.asarray(served.lengths)
    texts = [continuation(model.tokenizer, p, tokens[row, : lengths[row]]) for row, p in enumerate(prompts)]
    stats = [] if served.stats is None else [served.stats]
    return DecodeReport(texts, int(lengths.sum()), compile_s, run_s, stats)
