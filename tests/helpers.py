"""Test helpers shared by several test modules: models, prompts, the chi-square test, negative controls."""

import dataclasses
import functools
import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from absl import flags
from children import cpu_env
from conftest import STORIES_PROMPT, TINY
from scipy.stats import chi2_contingency

from specjax.decoding import AdaptiveK, GenerateSpec, generate
from specjax.decoding.speculative import speculative_compiled
from specjax.models.config import LlamaConfig
from specjax.models.llama import init_params

TARGET = init_params(TINY, seed=1)
RANDOM_DRAFT_CFG = LlamaConfig(
    vocab_size=97, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=24, max_seq_len=256
)
RAGGED = [[1, 5, 9], [1], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1, 7, 7, 7, 7]]


def greedy_case(model, stories):
    """(cfg, graphdef, params, ragged prompts, spec, greedy AR tokens) of the tiny model or stories260K."""
    if model == "tiny":
        cfg, (graphdef, params), prompts = TINY, TARGET, RAGGED
    else:
        cfg, graphdef, params = stories.cfg, stories.graphdef, stories.params
        prompts = [stories.tokenizer.encode(t) for t in (STORIES_PROMPT, "Lily", "The sun was hot and the")]
    spec = GenerateSpec(40, eos_id=None)
    return (
        cfg,
        graphdef,
        params,
        prompts,
        spec,
        np.asarray(generate(cfg, graphdef, params, prompts, spec).tokens),
    )


SMALL = LlamaConfig(
    vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32, max_seq_len=64
)
N_SAMPLES = 20_000


def peaked(cfg, seed):
    """Random weights with a scaled-up (untied) LM head, so next-token distributions are far from uniform."""
    graphdef, params = init_params(cfg, seed)
    params["lm_head"]["weight"].set_value(params["lm_head"]["weight"][...] * 60)
    return graphdef, params


def first_three(tokens):
    return np.asarray(tokens[:, 0]) * 64 + np.asarray(tokens[:, 1]) * 8 + np.asarray(tokens[:, 2])


def two_sample_pvalue(a, b):
    counts = np.stack([np.bincount(a, minlength=512), np.bincount(b, minlength=512)])
    big = counts.sum(0) >= 20
    table = np.concatenate([counts[:, big], counts[:, ~big].sum(1, keepdims=True)], axis=1)
    return chi2_contingency(table[:, table.sum(0) > 0]).pvalue


def run_patched(monkeypatch, name: str, replacement, run):
    """`run()` with `name` (e.g. a piece of the acceptance rule) replaced, compiled afresh: negative controls."""
    monkeypatch.setattr(name, replacement)
    speculative_compiled.clear_cache()
    try:
        return run()
    finally:
        speculative_compiled.clear_cache()


def once(fn):
    """`fn` called the first time only; later calls (the same arguments' equals) get its first result."""
    first = []
    return lambda *args: first[0] if first else first.append(fn(*args)) or first[0]


def compile_training_once(monkeypatch):
    """The trainer's target load and train step built by its first run only: a test's later runs (resumed,
    killed) reuse them, as they would build the same ones."""
    from specjax.training import trainer

    for name in ("load_target", "make_train_step"):
        monkeypatch.setattr(trainer, name, once(getattr(trainer, name)))


@functools.cache
def cli():
    """run_decode.py as a module, loaded once per process (its flags are defined once): the one
    `experiments.sweep` imports, where a test of the sweep ran first in this worker."""
    if "run_decode" in sys.modules:
        return sys.modules["run_decode"]
    spec = importlib.util.spec_from_file_location("run_decode", Path(__file__).parents[1] / "run_decode.py")
    module = sys.modules["run_decode"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(module, capsys, *args) -> str:
    """Runs run_decode's main with these flags (after a short default prompt); returns what it printed."""
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["run_decode.py", "--prompt=Once upon a time", "--max_new_tokens=40", *args])
    try:
        module.main([])
    finally:
        flags.FLAGS.unparse_flags()
    return capsys.readouterr().out


def run_processes(args: list[str], n: int = 2, devices: int = 4) -> list[str]:
    """Runs the command `args` as one jax.distributed run of `n` local processes of `devices` CPU devices each
    (--num_processes, --process_id, --coordinator added); each must succeed. Their stdouts."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    run = [f"--coordinator=localhost:{port}", f"--num_processes={n}"]
    procs = [
        subprocess.Popen(
            args + run + [f"--process_id={i}"],
            env=cpu_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"
    return [out for out, _ in outs]


def assert_cached_steps_match(cfg, graphdef, params, tokens_BT, expected_BTV, depth: int) -> None:
    """Decoding `tokens_BT` one token at a time through the KV cache gives the `expected_BTV` logits at every step,
    to float32 rounding over `depth` stages at the logits' magnitude."""
    import jax.numpy as jnp
    from tolerance import assert_close

    from specjax.models.llama import causal_mask, forward, init_cache

    b, t = tokens_BT.shape
    cache, magnitude = init_cache(cfg, b, t + 4), np.abs(expected_BTV).max()
    for i in range(t):
        step, _, cache = forward(
            graphdef,
            params,
            jnp.asarray(tokens_BT[:, i : i + 1]),
            jnp.full((b, 1), i),
            cache,
            causal_mask(1),
        )
        cache = cache.advance(1)
        assert_close(step[:, 0], expected_BTV[:, i], dtype=jnp.float32, depth=depth, magnitude=magnitude)


@dataclasses.dataclass(frozen=True)
class Alternating(AdaptiveK):
    """The smallest and the largest K of `ks` in turn, whatever was accepted (a scripted adaptive K)."""

    def observe(self, estimate, k, n_accepted_B, active_B, remaining_B):
        return estimate.replace(choice=len(self.ks) - 1 - estimate.choice)
