"""The AR decode step on an accelerator, against its bandwidth floor: ms/token, the verify curve, and where the
step's time goes, kernel by kernel (per layer, by kind of kernel, against the layer's share of the floor).

    PYTHONPATH=. python -m experiments.device_profile [--shapes=llama-110M,llama-1.1B] [--new_tokens=256]
        [--name=device_profile] [--results=results]

Random-weight Llama shapes (`experiments.device_check.AR_SHAPES`), bfloat16, batch 1, greedy. Writes, stamped:
- {name}_step: ms/token (the whole compiled decode loop, a prompt of 9 tokens), the floor (weights + the committed
  KV cache read once per token, at the read bandwidth measured in the same run) and the fraction reached; the
  same with a 2048-slot cache (what reading the whole static cache costs); one target pass over T = 8 and 64
  tokens relative to one token (`experiments.costs.per_call_seconds`, a 512-slot cache half full).
- {name}_kernels: the decode loop's device kernels from a `jax.profiler` trace, by kind, in microseconds per
  layer per token (kernel time summed; `launch gap` is the step's wall time not covered by kernels), against
  the layer's floor; and the 12 costliest kernels by name.
On a CPU the trace has no device kernels: the kernel table then says so.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics
import tempfile
from pathlib import Path

import jax
import numpy as np
from absl import flags, logging

from experiments import harness
from experiments.costs import per_call_seconds, read_bandwidth_gbs
from experiments.device_check import AR_SHAPES
from specjax import cli
from specjax.decoding.autoregressive import generate
from specjax.models.config import LlamaConfig
from specjax.models.llama import init_params

FLAGS = flags.FLAGS
PROMPT = [1, *range(300, 308)]

# Kernel kinds, first match wins (XLA's GPU kernel names: cuBLAS/cuBLASLt/CUTLASS/Triton products, fusions named
# after their root: loop_*, input_reduce_*, *scatter*, *dynamic_update_slice*).
KINDS = (
    ("product", r"gemm|nvjet|cublas|xmma|cutlass|matmul|dot|cudnn"),
    ("cache write", r"scatter|dynamic.update.slice"),
    ("reduction (norms, softmax)", r"reduce|softmax"),
    ("copy / transpose", r"copy|transpose|concatenate"),
    ("elementwise fusion", r"fusion|loop"),
)


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def device_kernels(trace_dir: Path) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel on a device in the perfetto trace under `trace_dir`."""
    path = next(trace_dir.rglob("*perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "/device:" in e["args"].get("name", "")
    }
    return [
        (e["name"], float(e.get("dur", 0))) for e in events if e.get("ph") == "X" and e["pid"] in devices
    ]


def decode_seconds(cfg, graphdef, params, new_tokens: int, cache_size: int, repeats: int):
    spec = harness.generate_spec(new_tokens, eos_id=None, cache_size=cache_size)
    run = lambda: jax.block_until_ready(generate(cfg, graphdef, params, [PROMPT], spec).tokens)
    return harness.median_time(run, repeats), run


def floor_seconds(cfg: LlamaConfig, committed: float, bandwidth: float) -> float:
    """Weights once plus `committed` cached positions' keys and values, per token, at `bandwidth` bytes/s."""
    item = np.dtype(cfg.dtype).itemsize
    return (
        (cfg.num_params + 2 * cfg.n_layers * committed * cfg.n_kv_heads * cfg.head_dim) * item / bandwidth
    )


def profile_shape(name: str, new_tokens: int, repeats: int, bandwidth: float):
    cfg = LlamaConfig(max_seq_len=4096, tie_embeddings=True, dtype="bfloat16", **AR_SHAPES[name])
    graphdef, params = init_params(cfg)
    committed = len(PROMPT) + new_tokens / 2  # the mean committed length over the run
    floor = floor_seconds(cfg, committed, bandwidth)
    seconds, run = decode_seconds(cfg, graphdef, params, new_tokens, 0, repeats)
    wide, _ = decode_seconds(cfg, graphdef, params, new_tokens, 2048, repeats)
    one, *verify = (per_call_seconds(cfg, graphdef, params, t, 512, repeats) for t in (1, 8, 64))
    step = dict(model=name, params=f"{cfg.num_params / 1e6:.0f}M", layers=cfg.n_layers)
    step |= dict(
        ms_tok=1e3 * seconds / new_tokens, floor_ms=1e3 * floor, of_floor=floor * new_tokens / seconds
    )
    step |= dict(cache2048_ms_tok=1e3 * wide / new_tokens, pass_1_ms=1e3 * one)
    step |= dict(pass_8_over_1=verify[0] / one, pass_64_over_1=verify[1] / one)

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            run()
        found = device_kernels(Path(tmp))
    per_layer = 1 / (new_tokens * cfg.n_layers)  # microseconds per layer per token
    by_kind = collections.defaultdict(float)
    for kernel, us in found:
        by_kind[kind(kernel)] += us
    layer_bytes = (cfg.num_params - cfg.vocab_size * cfg.dim) / cfg.n_layers * 2
    kinds = [
        dict(model=name, kind=k, us_per_layer=us * per_layer, share=us / max(sum(by_kind.values()), 1e-9))
        for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])
    ]
    if found:
        kernel_us = sum(by_kind.values()) / new_tokens
        gap = 1e6 * seconds / new_tokens - kernel_us
        kinds.append(
            dict(model=name, kind="launch gap", us_per_layer=gap / cfg.n_layers, share=float("nan"))
        )
        kinds.append(
            dict(
                model=name,
                kind="layer floor",
                us_per_layer=1e6 * layer_bytes / bandwidth,
                share=float("nan"),
            )
        )
    calls = collections.defaultdict(list)
    for kernel, us in found:
        calls[kernel].append(us)
    top = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:12]
    tops = [
        dict(
            model=name, kernel=k[:70], kind=kind(k), per_token=len(v) / new_tokens, us=statistics.median(v)
        )
        for k, v in top
    ]
    return step, kinds, tops, len(found) / new_tokens


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    unknown = set(FLAGS.shapes) - set(AR_SHAPES)
    if unknown:
        raise cli.UsageError(f"--shapes names {sorted(unknown)}; choose from {', '.join(AR_SHAPES)}")
    writer = harness.Writer(Path(FLAGS.results))
    bandwidth = read_bandwidth_gbs(FLAGS.bandwidth_mb) * 1e9
    steps, kinds, tops = [], [], []
    for name in FLAGS.shapes:
        step, kind_rows, top, per_token = profile_shape(name, FLAGS.new_tokens, FLAGS.repeats, bandwidth)
        steps.append(step | dict(kernels_per_token=per_token))
        kinds += kind_rows
        tops += top
    device = jax.devices()[0].device_kind
    writer.table(
        f"{FLAGS.name}_step",
        steps,
        f"AR decoding on {device}, random weights, bfloat16, batch 1, greedy, {FLAGS.new_tokens} new tokens, medians "
        f"of {FLAGS.repeats}; floor = (weights + the mean committed KV cache) / {bandwidth / 1e9:.0f} GB/s (read "
        "bandwidth measured); cache2048: the same with a 2048-slot cache; pass_T_over_1: one target pass over T "
        "tokens / one over 1 (512-slot cache, 256 committed)",
    )
    writer.table(
        f"{FLAGS.name}_kernels",
        kinds or [dict(model="-", kind="no device kernels in the trace (a CPU run)")],
        "The decode loop's kernels by kind, microseconds per layer per token (jax.profiler trace; the LM head "
        "counted in with the layers); launch gap: wall time per token not covered by kernels; layer floor: one "
        "layer's weights / the read bandwidth",
    )
    if tops:
        writer.table(
            f"{FLAGS.name}_top",
            tops,
            "The costliest kernels of the decode loop: calls per token, median us",
        )


def define_flags() -> None:
    flags.DEFINE_list(
        "shapes", ["llama-110M", "llama-1.1B"], "Model shapes (experiments.device_check.AR_SHAPES)."
    )
    flags.DEFINE_integer("new_tokens", 256, "Tokens generated per run.")
    flags.DEFINE_integer("repeats", 3, "Timed runs (medians).")
    flags.DEFINE_integer("bandwidth_mb", 2048, "Size of the bandwidth probe's array.")
    flags.DEFINE_string("name", "device_profile", "Table name prefix.")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables.")
    harness.define_precision_flag()


if __name__ == "__main__":
    define_flags()
    cli.run(main)
