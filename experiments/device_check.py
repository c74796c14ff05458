"""`make device-check`: on a machine with an accelerator, the test suite there and the device-sized benchmarks.

    PYTHONPATH=. python -m experiments.device_check [--sizes=device|smoke] [--notests] [--results=results]
        [--test_timeout=SECONDS] [--passed_in=an earlier device_tests.log]

Writes, each file stamped with the device (`experiments.harness.Writer`):
- results/device_tests.{md,csv}: the suite on JAX's default backend (`pytest -n --workers --dist loadscope`,
  XLA_PYTHON_CLIENT_PREALLOCATE=false so that the workers share one GPU): passed, failed, seconds.
- results/device_ar.{md,csv}: specjax AR against transformers' PyTorch generation on the same device, bfloat16,
  random-weight Llama shapes of about 110M and 1B parameters (smoke: a tiny one), greedy, batch 1: ms/token,
  tokens/s, and the fraction of the bandwidth floor (weight and KV-cache bytes read per token / the read
  bandwidth measured in the same run) each reaches.
- results/device_memory_bound_{float32,bfloat16}_*.{md,csv}: `experiments.bench_memory_bound` with an expansion
  sized from the device (on a GPU >= 1B parameters, so a target pass takes over a millisecond), every drafter
  row at T = 0 and T = 1, batch 1.
On a CPU it runs with small sizes (`--sizes=smoke`: what the test suite runs, without --tests).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import flags, logging

from experiments import harness
from specjax import cli

REPO = Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS

# Random-weight Llama shapes of the AR comparison (vocabulary 32000, tied embeddings).
AR_SHAPES = {
    "llama-110M": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048, vocab_size=32000),
    "llama-1.1B": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden_dim=5632, vocab_size=32000),
    "llama-tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=128, vocab_size=512),
}
# The memory-bound target on a GPU: 24 layers x 2048 (about 1.1B parameters, 4.5 GB of float32).
GPU_EXPANSION = dict(dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=5504)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the check runs on this device."""

    ar_shapes: tuple[str, ...]
    new_tokens: int
    repeats: int
    expansion: object  # specjax.expand.Expansion
    memory: object  # bench_memory_bound.Settings (without the expansion and dtype)


def plan(platform: str, memory_bytes: float | None, sizes: str) -> Plan:
    """The sizes for a device: smoke (tiny everything), a CPU (stories260K's default expansion, 110M), or an
    accelerator (110M and 1B, an expansion of >= 1B parameters scaled down where the memory is short)."""
    from experiments import bench_memory_bound as mb
    from specjax import expand

    every = dict(temperatures=(0.0, 1.0), batches=(1,), categories=(), kinds=mb.KINDS)
    if sizes == "smoke":
        memory = dataclasses.replace(
            mb.SMOKE, temperatures=(0.0,), kinds=("eagle chain",), prompts=1, new_tokens=4, sweeps=False
        )
        return Plan(("llama-tiny",), 8, 1, expand.SMOKE, memory)
    if platform == "cpu":
        return Plan(("llama-110M",), 64, 3, expand.Expansion(), mb.Settings(**every))
    layers = GPU_EXPANSION["n_layers"]
    if memory_bytes:  # the target's float32 weights in at most a tenth of the memory
        per_layer = 4 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5504)
        layers = int(np.clip(memory_bytes / 10 // per_layer, 5, layers))
    e = expand.Expansion(**(GPU_EXPANSION | dict(n_layers=layers)))
    return Plan(("llama-110M", "llama-1.1B"), 128, 3, e, mb.Settings(**every, bandwidth_mb=2048))


def device_memory() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


# --- the test suite -----------------------------------------------------------------------------------------


def summary_counts(text: str) -> dict:
    """{passed, failed, errors, skipped} from pytest's last summary line, or where a stopped run has none, from its
    verbose result lines."""
    lines = [
        line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error).* in [\d.]+s", line)
    ]
    if not lines:
        results = re.findall(r"\] (PASSED|FAILED|ERROR|SKIPPED) tests/", text)
        return {k: results.count(w) for k, w in RESULT_WORDS.items()}
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])}
    found["errors"] = found.pop("error", 0) + found.pop("errors", 0)
    return {k: found.get(k, 0) for k in RESULT_WORDS}


RESULT_WORDS = dict(passed="PASSED", failed="FAILED", errors="ERROR", skipped="SKIPPED")


def passed_tests(text: str) -> list[str]:
    """The node ids a verbose pytest log reports passed (parametrised ids may hold spaces)."""
    return sorted({m.strip() for m in re.findall(r"PASSED (tests/\S.*)$", text, re.M)})


def run_tests(
    writer: harness.Writer,
    workers: int,
    timeout: float | None = None,
    skip: list[str] = (),
    paths: tuple[str, ...] = ("tests",),
    dist: str = "loadscope",
) -> dict:
    """The suite on this device; its output goes to `device_tests.log` and each failure's report to
    `device_failures.log` as it runs (a stopped run keeps what failed before it stopped, and why)."""
    failures = writer.folder / "device_failures.log"
    env = os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "SPECJAX_FAILURE_LOG": str(failures)}
    order = [f"--dist={dist}", "--no-loadscope-reorder"]  # loadscope: conftest's longest modules first
    shown = ["pytest", "-v", "-rfE", f"-n={workers}", *order, *paths]
    command = [sys.executable, "-m", *shown, *(f"--deselect={test}" for test in skip)]
    writer.folder.mkdir(parents=True, exist_ok=True)
    failures.unlink(missing_ok=True)
    log = writer.folder / "device_tests.log"
    start = time.perf_counter()
    with open(log, "w") as out:  # its own process group: a stopped run leaves no worker behind
        suite = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = suite.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # what ran is still reported, as not passed whole
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
            status = f"stopped after {timeout} s"
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    failed = sorted(set(re.findall(r"(?:FAILED|ERROR) (tests/\S+)", text)))
    row = summary_counts(text) | dict(seconds=seconds, exit_status=status)
    notes = "Failed:\n" + "\n".join(f"- {t}" for t in failed) if failed else "No test failed."
    if skip:
        notes += f"\n\nLeft out: the {len(skip)} tests an earlier run passed (`--passed_in`)."
    writer.table("device_tests", [row], f"The test suite on this device: {' '.join(shown)}", notes)
    return row


# --- AR against transformers --------------------------------------------------------------------------------


def ar_row(name: str, path: Path, hf, new_tokens: int, repeats: int, bandwidth: float) -> dict:
    """specjax AR and transformers' generate on one random-weight model, bfloat16, taking turns."""
    import jax
    import torch

    from specjax.decoding import compile_decode
    from specjax.models.loading import load_model

    model = load_model(str(path), "bfloat16")
    prompt = [1] + list(range(300, 308))
    spec = harness.generate_spec(new_tokens, eos_id=None)
    run, _ = compile_decode(model.cfg, model.graphdef, model.params, [prompt], spec)
    ours = np.asarray(run([prompt]).tokens[0])
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    hf = hf.to(device=device, dtype=torch.bfloat16)
    ids = torch.tensor([prompt], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def theirs():
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync()
        return out

    with torch.inference_mode():
        peer = theirs()[0, len(prompt) :].cpu().numpy()
        t = harness.interleaved_medians(
            {"jax": lambda: jax.block_until_ready(run([prompt]).tokens), "torch": theirs}, repeats
        )
    cfg = model.cfg
    slots = 64 * -(-(8 * -(-len(prompt) // 8) + new_tokens) // 64)  # the static cache, read whole
    read = cfg.num_params * 2 + 2 * cfg.n_layers * slots * cfg.n_kv_heads * cfg.head_dim * 2
    floor = read / bandwidth
    ms, torch_ms = 1e3 * t["jax"] / new_tokens, 1e3 * t["torch"] / new_tokens
    common = int(np.argmin(np.append(ours == peer, False)))  # bfloat16 rounding differs between frameworks
    return (
        dict(model=name, params=f"{cfg.num_params / 1e6:.0f}M", dtype="bfloat16", torch_device=device)
        | dict(specjax_ms_tok=ms, torch_ms_tok=torch_ms, specjax_tok_s=1e3 / ms, torch_tok_s=1e3 / torch_ms)
        | dict(floor_ms_tok=1e3 * floor, specjax_of_floor=1e3 * floor / ms)
        | dict(torch_of_floor=1e3 * floor / torch_ms, same_prefix=common / new_tokens)
    )


def ar_table(writer: harness.Writer, p: Plan) -> list[dict]:
    import torch
    import transformers

    from experiments.common import quiet_transformers, random_hf_model
    from experiments.costs import read_bandwidth_gbs
    from specjax.models.loading import load_model

    quiet_transformers()
    bandwidth = read_bandwidth_gbs(2048 if p.ar_shapes != ("llama-tiny",) else 64) * 1e9
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in p.ar_shapes:
            path = Path(tmp) / name
            hf = random_hf_model(AR_SHAPES[name], path)
            for f in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer: the ids are given
                shutil.copy(load_model().path / f, path)
            rows.append(ar_row(name, path, hf.eval(), p.new_tokens, p.repeats, bandwidth))
            del hf
            shutil.rmtree(path)
    title = (
        f"AR decoding against transformers {transformers.__version__} (PyTorch {torch.__version__}) on the same "
        f"device, random weights, bfloat16, batch 1, greedy, {p.new_tokens} new tokens, medians of {p.repeats} "
        f"in turns; floor = (weights + the static KV cache) / {bandwidth / 1e9:.0f} GB/s (read bandwidth measured)"
    )
    writer.table(
        "device_ar",
        rows,
        title,
        "same_prefix: the fraction of the greedy tokens up to the first that differs between the two frameworks "
        "(bfloat16 rounds their sums differently).",
    )
    return rows


# --- the memory-bound benchmark -----------------------------------------------------------------------------


def memory_bound(folder: Path, p: Plan, dtypes, **overrides) -> dict:
    from experiments import bench_memory_bound as mb

    out = {}
    for dtype in dtypes:
        settings = dataclasses.replace(
            p.memory, expansion=p.expansion, dtype=dtype, name=f"device_memory_bound_{dtype}", **overrides
        )
        out[dtype] = mb.run(settings, str(folder))
    return out


def main(argv):
    del argv
    import jax

    from experiments import bench_memory_bound as mb

    logging.set_verbosity(logging.WARNING)
    unknown = set(FLAGS.parts) - {"ar", "memory_bound"}
    if unknown:
        raise cli.UsageError(f"--parts names {sorted(unknown)}; choose from ar, memory_bound")
    if set(FLAGS.dtypes) - {"float32", "bfloat16"}:
        raise cli.UsageError(f"--dtypes={','.join(FLAGS.dtypes)}; choose from float32, bfloat16")
    p = plan(jax.default_backend(), device_memory(), FLAGS.sizes)
    if FLAGS.repeats is not None:
        p = dataclasses.replace(p, repeats=FLAGS.repeats)
    folder = Path(FLAGS.results)
    writer = harness.Writer(folder)
    if FLAGS.tests:
        skip = passed_tests(Path(FLAGS.passed_in).read_text(errors="replace")) if FLAGS.passed_in else []
        row = run_tests(
            writer, FLAGS.workers, FLAGS.test_timeout, skip, tuple(FLAGS.test_paths), FLAGS.dist
        )
        print(row, flush=True)
    if "ar" in FLAGS.parts:
        ar_table(writer, p)
    if "memory_bound" in FLAGS.parts:
        unknown = set(FLAGS.kinds or ()) - set(mb.KINDS)
        if unknown:
            raise cli.UsageError(f"--kinds names {sorted(unknown)}; choose from {', '.join(mb.KINDS)}")
        kinds = dict(kinds=tuple(FLAGS.kinds)) if FLAGS.kinds else {}
        memory_bound(folder, p, FLAGS.dtypes, sweeps=FLAGS.sweeps, **kinds)


def define_flags() -> None:
    """This script's flags, defined when it runs (tests import this module beside other experiments)."""
    flags.DEFINE_enum("sizes", "device", ["device", "smoke"], "device: sized from the device; smoke: tiny.")
    flags.DEFINE_bool("tests", True, "Run the test suite first (device_tests table).")
    flags.DEFINE_integer("workers", 8, "pytest workers on the device.")
    flags.DEFINE_float("test_timeout", None, "Seconds the suite may run (what ran is reported).")
    flags.DEFINE_string(
        "passed_in",
        None,
        "A device_tests.log of an earlier run: the tests it passed are left out (a suite longer than one lease, "
        "run over several).",
    )
    flags.DEFINE_list("test_paths", ["tests"], "What pytest runs: the suite, or some of its files.")
    flags.DEFINE_enum(
        "dist",
        "loadscope",
        ["loadscope", "worksteal"],
        "How pytest-xdist shares the tests: whole modules, longest first, or single tests (a few modules on many "
        "workers).",
    )
    flags.DEFINE_list("parts", ["ar", "memory_bound"], "Benchmarks to run: ar, memory_bound.")
    flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Dtypes of the memory-bound benchmark.")
    flags.DEFINE_list("kinds", None, "Drafter rows of the memory-bound benchmark (default: every one).")
    flags.DEFINE_bool("sweeps", True, "The memory-bound benchmark's K and batch sweeps.")
    flags.DEFINE_integer("repeats", None, "Timed rounds (default 3; smoke 1).")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder for the tables.")
    harness.define_precision_flag()


if __name__ == "__main__":
    define_flags()
    cli.run(main)
