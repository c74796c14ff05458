"""Shared fixtures: the real stories260K model (loaded once per session) and tiny random configs; the compile
flags and garbage-collector settings of the run."""

import os
from pathlib import Path

# Compiling dominates the suite. On the CPU, XLA optimises less and compiles fusions with its older loop emitters
# (together about a third less CPU over the suite: most programs run once or twice), and generates each program's
# code in one piece (split for parallel code generation, which three workers on two cores cannot use, six
# speculative programs took 8.1-9.1 s of CPU to compile, unsplit 7.6-7.9 s). The flags are set by the controlling
# process before JAX starts and inherited by every worker and subprocess. No persistent compilation cache: the
# processes share few programs (over a run it saved 12 s of compiling and cost more in keys, writes and reads; one
# module ran 3% faster without it).


def _accelerator_plugins() -> set[str]:
    """The GPU and TPU plugins of JAX installed ("cuda", "rocm", "tpu"; asked without starting JAX)."""
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    kinds = {"jax-cuda": "cuda", "jax-rocm": "rocm", "libtpu": "tpu"}
    return {kind for prefix, kind in kinds.items() for n in names if n.startswith(prefix)}


# On an NVIDIA GPU, XLA compiles several candidate kernels for each product and times them (autotuning); the suite
# times nothing, so it takes the default kernel of each, which computes the same products. It runs without XLA's
# deterministic GPU kernels, as a user does (`cli.refuse_unsafe_xla_flags` says why).
if "SPECJAX_TEST_FLAGS" not in os.environ:
    os.environ["SPECJAX_TEST_FLAGS"] = "1"
    plugins = _accelerator_plugins()
    if not plugins:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
            + " --xla_cpu_parallel_codegen_split_count=1"
        )
    elif plugins == {"cuda"}:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
# On an accelerator the xdist workers share one device: each takes memory as it needs it, not 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402

from specjax import cli  # noqa: E402
from specjax.models.config import LlamaConfig  # noqa: E402
from specjax.models.loading import load_model, resolve  # noqa: E402

# The longest modules first (their seconds in a 3-worker run on 2 cores, 2026-11-27): the Makefile's
# `--dist loadscope --no-loadscope-reorder` hands whole modules to the workers in this order, so the short ones fill
# in at the end instead of one worker finishing a long module alone (xdist's own order, by number of tests, left a
# 100 s module to the end).
LONGEST_FIRST = (
    "test_tables",  # 246 s in one test: first, or a worker ends alone
    "test_verification",  # 278
    "test_families",  # 213
    "test_training",  # 140
    "test_adaptive_k",  # 121
    "test_bad_inputs",  # 116
    "test_sharding",  # 115
    "test_trees",  # 103
    "test_eagle3",  # 99
    "test_ngram",  # 97
    "test_heads",  # 94
    "test_dflash",  # 82
    "test_docs",  # 77
    "test_faults",  # 75
    "test_layer_skip",  # 74
    "test_suffix",  # 65
    "test_speculative",  # 65
    "test_distill",  # 62
    "test_sweep",  # 61
    "test_refill",  # 48
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module keeps its order


def pytest_collection_finish(session):
    """Tracing makes many short-lived cycles and a worker's heap grows large: what the imports and the collection
    made is set aside from garbage collection, as in every command (a module of tree tests spent 3.3 s of 100 s of
    CPU in 2,461 collections, 1.3 s in 72 after)."""
    cli.collect_for_tracing()


def pytest_runtest_logreport(report):
    """Where SPECJAX_FAILURE_LOG names a file, each failure's report is appended to it as it arrives (on the
    controlling process under xdist): a run stopped at its time limit keeps why its tests failed."""
    path = os.environ.get("SPECJAX_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


STORIES = (
    resolve("stories260K")
    if (Path(__file__).parents[1].parent / "shared/models/stories260K").exists()
    or os.environ.get("SPECJAX_MODELS")
    else None
)

# The first 64 greedy ids after BOS, from ../shared/models/README.md.
STORIES_REFERENCE_IDS = [
    403,
    407,
    261,
    378,
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
    433,
    426,
    385,
    328,
    432,
    358,
    394,
    261,
    370,
    432,
    352,
    266,
    268,
    388,
    426,
    338,
    391,
    266,
    267,
    337,
    335,
    312,
    432,
    398,
    312,
    286,
    267,
    414,
    270,
    333,
    415,
    426,
    13,
    438,
    310,
]
STORIES_PROMPT = "Once upon a time, there was a dog named"
STORIES_PROMPT_REFERENCE = (
    "Once upon a time, there was a dog named Max. Max loved to play with his toys and run "
    "around. One day, Max saw a big box in the gr"
)

TINY = LlamaConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256
)


@pytest.fixture(scope="session")
def stories():
    if STORIES is None:
        pytest.fail(
            "../shared/models/stories260K is missing: the real-model tests need it (or set SPECJAX_MODELS)"
        )
    return load_model(str(STORIES))


@pytest.fixture
def offline_hub(monkeypatch):
    """No network: the hub library reads HF_HUB_OFFLINE once, on import, so a process that imported it earlier would
    still try to connect (20 s of retries here); the variable and the library's constant are both set."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


HEADS = Path(__file__).parents[1] / "heads"


@pytest.fixture(scope="session")
def trained_heads(stories):
    """The committed stories260K heads (`heads/stories260K_{medusa,eagle}`): {method: (meta, graphdef, params)}."""
    from specjax.heads import load_heads

    return {
        m: load_heads(HEADS / f"stories260K_{m}", stories.cfg, stories.params) for m in ("medusa", "eagle")
    }
