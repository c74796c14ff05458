"""The environment of the tests' child processes."""

import os
from pathlib import Path

WITHOUT_TORCH = Path(__file__).parent / "without_torch"


def child_env(*paths, **variables) -> dict:
    """The environment of a child process running specjax's own commands, as in the base install: without PyTorch,
    which the test extras add for the reference tests and which transformers, where installed, imports with every
    config it parses (3.6 s of a 9 s `run_decode.py` on 2 cores). `paths` go on PYTHONPATH, `variables` are set."""
    path = os.pathsep.join([str(WITHOUT_TORCH), *map(str, paths), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path.rstrip(os.pathsep), **variables)


def cpu_env(devices: int) -> dict:
    """The environment of a child process (`child_env`) with `devices` simulated CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return child_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
