"""What every command-line entry point shares (run_decode.py, train_heads.py, `python -m specjax.convert`,
`python -m specjax.verify_exactness`, the experiments): a user's mistake ends the program with one line on
stderr, `error: <what is wrong>; <how to fix it>`, and a non-zero exit status, never a traceback; with the
environment variable SPECJAX_DEBUG=1 the traceback is shown instead. User mistakes are specjax's typed errors
(all ValueErrors), OSErrors (files), flag errors (an unknown flag, a value of the wrong type) and stray
positional arguments.

    from specjax import cli
    if __name__ == "__main__":
        cli.run(main)   # instead of absl's app.run(main)
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging as std_logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags, logging

from specjax.errors import UsageError

DEBUG = "SPECJAX_DEBUG"
GREEDY_BELOW = 1e-5  # a positive temperature below this decodes greedily (with a warning)
USER_ERRORS = (ValueError, OSError, flags.Error)


def debug() -> bool:
    return os.environ.get(DEBUG, "") not in ("", "0")


def describe(err: BaseException) -> str:
    """One line naming the problem: the error's message with its lines joined (an OSError of the system, which
    names a file but no fix, says what to check; a flag error points to the flags' help)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror.lower()}; check the path and its permissions"
    elif isinstance(err, flags.Error):
        text = f"{str(err).rstrip('.')}; see --helpfull for the flags and their values"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def fail(message: str, status: int = 1) -> NoReturn:
    """Ends the program with the one line `error: message` on stderr and exit status `status`."""
    sys.stdout.flush()
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def guarded(main: Callable, errors: tuple = (), status: int = 1, positional: bool = False) -> Callable:
    """`main(argv)` with user errors (USER_ERRORS + `errors`) ending as one line `error: ...` and exit status
    `status` (SPECJAX_DEBUG=1: the traceback); positional arguments are refused unless `positional`."""

    @functools.wraps(main)
    def wrapper(argv=None, *args, **kwargs):
        try:
            if not positional and argv is not None and len(argv) > 1:
                raise UsageError(
                    f"unexpected argument{'s' if len(argv) > 2 else ''} {' '.join(map(repr, argv[1:]))}; "
                    "this command takes only flags: write them as --name=value (quote values with spaces)"
                )
            refuse_unsafe_xla_flags(os.environ.get("XLA_FLAGS", ""))
            return main(argv, *args, **kwargs)
        except USER_ERRORS + tuple(errors) as err:
            if debug():
                raise
            fail(describe(err), status)

    return wrapper


# a boolean flag in any spelling a flag parser may accept (true/1, t/yes/y; false/0, f/no/n; any case); alone: true
DETERMINISTIC_OPS = re.compile(r"--xla_gpu_deterministic_ops(=(true|t|yes|y|1))?(\s|$)", re.I)
LOOP_SCATTER = re.compile(r"--xla_gpu_enable_scatter_determinism_expander=(false|f|no|n|0)(\s|$)", re.I)


def refuse_unsafe_xla_flags(xla_flags: str, backend: str | None = None) -> None:
    """A UsageError for XLA flags under which specjax computes wrong results on this backend (default: JAX's).

    `--xla_gpu_deterministic_ops=true` rewrites every scatter on a GPU with XLA's scatter determinism expander,
    which flattens a multi-dimensional index before it drops the out-of-range ones: a write that specjax drops on
    purpose (a slot index one past a row's end, `mode="drop"`) lands in the next row's first slot (seen with jax
    0.11.2 on an H100: the lookahead pool's insert). The expander's loop-based fallback checks each index."""
    if not DETERMINISTIC_OPS.search(xla_flags) or LOOP_SCATTER.search(xla_flags):
        return
    import jax

    if (backend or jax.default_backend()) == "gpu":
        raise UsageError(
            "XLA_FLAGS sets --xla_gpu_deterministic_ops=true, whose scatter rewrite on a GPU moves writes that "
            "specjax drops into the next row: remove that flag, or add "
            "--xla_gpu_enable_scatter_determinism_expander=false (XLA's slower loop-based deterministic scatter)"
        )


SHORT_HELP = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
FULL_HELP = ("--helpfull", "-helpfull")


def help_asked(argv: list[str]) -> str | None:
    """'short' or 'full' when `argv` asks for help (--help, -h, --helpshort; --helpfull) before a `--`."""
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg in FULL_HELP:
            return "full"
        if arg in SHORT_HELP:
            return "short"
    return None


def print_help(values: flags.FlagValues, kind: str, doc: str | None = None) -> NoReturn:
    """Prints the command's help on stdout (`doc`, then its flags: this module's for 'short', all for
    'full') and exits with status 0."""
    if values is flags.FLAGS and doc is None:
        app.usage(shorthelp=kind == "short", writeto_stdout=True, exitcode=0)
    print((doc or "").strip() + "\n")
    print(values.main_module_help() if kind == "short" and values is flags.FLAGS else values.get_help())
    sys.stdout.flush()
    raise SystemExit(0)


def parse_flags(
    argv: list[str],
    values: flags.FlagValues = flags.FLAGS,
    status: int = 1,
    check: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Parses `argv` into `values` from their defaults (absl's `flags_parser`), after `check(argv)` (which
    raises what absl would not explain); a flag error is one line. --help and --helpfull print the help and
    exit with status 0."""
    if kind := help_asked(argv):
        print_help(values, kind)
    try:
        if check is not None:
            check(argv)
        values.unparse_flags()  # a re-run in one process starts from the defaults, as a fresh process does
        return values(argv)
    except Exception as err:  # flags, and config files loaded while parsing, raise many types
        if debug():
            raise
        fail(describe(err), status)


def run(
    main: Callable,
    errors: tuple = (),
    status: int = 1,
    positional: bool = False,
    check: Callable[[list[str]], None] | None = None,
) -> None:
    """absl's `app.run(main)` with specjax's error handling (see `guarded` and `parse_flags`); may be called
    again in one process (the flags are parsed afresh)."""
    probes = std_logging.getLogger("jax._src.xla_bridge")
    if not_a_backend_probe not in probes.filters:
        probes.addFilter(not_a_backend_probe)
    collect_for_tracing()
    app.run(
        guarded(main, errors, status, positional),
        flags_parser=functools.partial(parse_flags, status=status, check=check),
    )


def collect_for_tracing() -> None:
    """Garbage collection set for a program that traces and compiles: what is alive now (the imports) is set
    aside (`gc.freeze`) and young objects are collected less often. Tracing makes many short-lived cycles; with
    Python's defaults a decoding command spent about 15% of its CPU collecting them."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)


def not_a_backend_probe(record: std_logging.LogRecord) -> bool:
    """False for JAX's note that a backend it probes for is missing ("Unable to initialize backend 'tpu'", logged
    at INFO on every machine without one): start-up noise in what a user reads. Its warnings and errors pass."""
    return record.levelno > std_logging.INFO or not record.getMessage().startswith(
        "Unable to initialize backend"
    )


def sampler(temp: float, top_k: int = 0, top_p: float = 1.0):
    """The Sampler of the flags --temperature (see `temperature`), --top_k and --top_p; a bad value is a
    UsageError that says which values work."""
    from specjax.sampling import Sampler

    try:
        return Sampler(temperature(temp), top_k, top_p)
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(f"{err}; pass --top_k >= 0 (0 = off) and --top_p in (0, 1] (1 = off)") from err


def temperature(value: float, name: str = "--temperature") -> float:
    """A sampling temperature as decoding uses it: not finite or negative is an error; a positive temperature
    below GREEDY_BELOW decodes greedily (0) with a warning, because dividing logits by it overflows float32
    (NaN probabilities) long before it means anything but argmax."""
    if not math.isfinite(value) or value < 0:
        raise UsageError(
            f"{name}={value} must be a finite number >= 0; pass 0 for greedy decoding or e.g. 0.8"
        )
    if 0 < value < GREEDY_BELOW:
        logging.warning(
            "%s=%g is below %g: decoding greedily (temperature 0); pass 0 to say so, or >= %g to sample",
            name,
            value,
            GREEDY_BELOW,
            GREEDY_BELOW,
        )
        return 0.0
    return value


PROGRESS_S = 15.0  # the most seconds between two progress lines of long work


def time_left(done: int, total: int, elapsed_s: float) -> str:
    """'about MM:SS left' (H:MM:SS past an hour) for `total - done` more units at the pace of `done` in
    `elapsed_s`."""
    left = (total - done) * elapsed_s / max(done, 1)
    return f"about {time.strftime('%H:%M:%S', time.gmtime(left)).removeprefix('00:')} left"


def define_process_flags() -> None:
    """--num_processes, --process_id and --coordinator: a run of one process per host (`join_processes`). Once per
    process (a script run again in the same process, as the bad-input tests do, finds them defined)."""
    if "num_processes" in flags.FLAGS:
        return
    flags.DEFINE_integer("num_processes", 1, "Processes of this run (one per host); 1: this process alone.")
    flags.DEFINE_integer(
        "process_id", 0, "This process's id among --num_processes (0 writes files and logs)."
    )
    flags.DEFINE_string("coordinator", None, "HOST:PORT of process 0, for a run of several processes.")


def join_processes() -> None:
    """Joins the run of --num_processes processes (nothing for one)."""
    from specjax import sharding

    sharding.initialize(flags.FLAGS.coordinator, flags.FLAGS.num_processes, flags.FLAGS.process_id)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the conventions of every specjax command: a mistake is one line `error: ...; see --help`
    (exit status 1; SPECJAX_DEBUG=1: argparse's own message) and --helpfull is --help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--helpfull", action="help", help="the same as --help")

    def error(self, message: str) -> NoReturn:
        if debug():
            super().error(message)
        fail(f"{message}; see {self.prog} --help")
