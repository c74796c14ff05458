"""Fault injection for specjax's writers: `FileSystemSteps` counts the file-system steps a writer takes in this
process (opening a file to write, each write into it, mkdir, rename, replace, copy, unlink, rmtree, fsync) and, at
step N, stops it as SIGKILL would: that step is cut (a write keeps half its bytes) and from then on every step
raises `Killed` at once, so neither the writer's clean-up nor anything else touches the disk again. A temporary
left by a killed run carries this process's pid, which `specjax.files` treats as dead once `killed_pids_dead()`
is active (a real retry runs in a new process). Cheaper than a subprocess per kill: no import, no compile.

`run_faults` kills a writer at >= 20 points spread over its steps, checks after each kill that readers see either
nothing or the last complete state (never a half-written one) and that the user's files are byte-identical, then
re-runs it without faults and compares the result with an uninterrupted run's.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path


class Killed(BaseException):
    """The simulated SIGKILL (a BaseException: no `except Exception` of the writer catches it)."""


class _Writer:
    """A file opened for writing whose `write` calls are steps."""

    def __init__(self, f, steps):
        self._f, self._steps = f, steps

    def write(self, data):
        cut = lambda: self._f.write(data[: len(data) // 2]) and self._f.flush()
        self._steps.step(cut=cut, what=str(getattr(self._f, "name", "")))
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


MUTATORS = [
    (os, "rename"),
    (os, "replace"),
    (os, "mkdir"),
    (os, "makedirs"),
    (os, "unlink"),
    (os, "remove"),
    (os, "rmdir"),
    (os, "fsync"),
    (os, "symlink"),
    (shutil, "copyfile"),
    (shutil, "copy2"),
    (shutil, "copytree"),
    (shutil, "rmtree"),
    (shutil, "move"),
]


class FileSystemSteps:
    """Counts steps; `kill_at=N` kills at the N-th (1-based); `count` is the number taken."""

    def __init__(self, kill_at: int | None = None):
        self.kill_at, self.count, self.killed = kill_at, 0, False
        self.paths: list[str] = []  # what each step touched (its first argument), by step

    def step(self, cut: Callable | None = None, what: str = "") -> None:
        if self.killed:
            raise Killed
        self.count += 1
        self.paths.append(what)
        if self.kill_at is not None and self.count >= self.kill_at:
            self.killed = True
            if cut is not None:
                cut()
            raise Killed

    @contextlib.contextmanager
    def active(self):
        saved = [(m, n, getattr(m, n)) for m, n in MUTATORS] + [
            (builtins, "open", builtins.open),
            (io, "open", io.open),
        ]
        real_open = builtins.open

        def wrap(fn):
            def wrapped(*args, **kwargs):
                self.step(what=str(args[0]) if args else "")
                return fn(*args, **kwargs)

            return wrapped

        def opened(file, mode="r", *args, **kwargs):
            if not any(c in mode for c in "wax+"):
                return real_open(file, mode, *args, **kwargs)
            self.step(what=str(file))
            return _Writer(real_open(file, mode, *args, **kwargs), self)

        for module, name, fn in saved[: len(MUTATORS)]:
            setattr(module, name, wrap(fn))
        builtins.open = io.open = opened
        threads = set(threading.enumerate())
        try:
            yield self
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)
            if self.killed:
                for thread in set(threading.enumerate()) - threads:
                    _died_with_the_process(thread)


def _died_with_the_process(thread: threading.Thread) -> None:
    """A thread the killed run started (Orbax's, waiting 300 s for a signal the killed run never sends) would have
    died with a killed process: the interpreter's exit stops waiting for it, as for a daemon thread (CPython 3.11's
    bookkeeping; elsewhere nothing is done)."""
    lock, locks = getattr(thread, "_tstate_lock", None), getattr(threading, "_shutdown_locks", None)
    if thread.daemon or lock is None or locks is None:
        return
    with threading._shutdown_locks_lock:
        locks.discard(lock)


@contextlib.contextmanager
def killed_pids_dead():
    """In this block `specjax.files` takes this process's temporaries for those of a dead process (a retry after
    a real SIGKILL runs in another process)."""
    from specjax import files

    real = files.pid_alive
    files.pid_alive = lambda pid: pid != os.getpid() and real(pid)
    try:
        yield
    finally:
        files.pid_alive = real


def tree_bytes(folder: Path, skip: Callable[[Path], bool] = lambda p: False) -> dict:
    """{relative path: sha256} of every file under `folder` (`skip` leaves some out)."""
    if folder.is_file():
        return {"": hashlib.sha256(folder.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not skip(p)
    }


@dataclasses.dataclass
class Row:
    writer: str
    steps: int = 0
    kill_points: int = 0
    resumed: int = 0
    restarted: int = 0
    complete: int = 0  # killed after the output was whole: the re-run refuses to overwrite it
    refused: int = 0
    corrupt_reads: int = 0
    changed_user_files: int = 0

    def line(self) -> str:
        return (
            f"| {self.writer} | {self.steps} | {self.kill_points} | {self.resumed} | {self.restarted} | "
            f"{self.complete} | "
            f"{self.refused} | {self.corrupt_reads} | {self.changed_user_files} |"
        )


def kill_points(steps: int, at_least: int = 20) -> list[int]:
    """Every step when there are few, else `at_least` or more spread from the first to the last."""
    if steps <= at_least:
        return list(range(1, steps + 1))
    return sorted({1 + round(i * (steps - 1) / (at_least - 1)) for i in range(at_least)})


def run_faults(
    name: str,
    workspace: Path,
    prepare: Callable[[Path], None],
    write: Callable[[Path], object],
    read: Callable[[Path], object],
    errors: tuple = (),
    at_least: int = 20,
    whole: Callable[[object, object, object], bool] | None = None,
    also: str = "",
) -> Row:
    """Kills `write(folder)` at >= `at_least` points. `prepare(folder)` lays out a fresh folder (the user's files
    and any previous output); `read(folder)` is what a reader gets: a comparable value of the output, or one of
    `errors` (a refusal, or nothing there yet); `whole(seen, before, expected)` says whether a read saw complete
    states only (default: the output before the run or the finished one). Each kill is checked (user files,
    reads), then the write is re-run and must end in the uninterrupted run's output; it `resumed` if it took
    fewer steps than a fresh run. `also` adds a kill at every step that touches a path containing it (a file
    the spread would likely miss)."""
    row = Row(name)
    ref = workspace / "reference"
    prepare(ref)
    user = tree_bytes(ref)
    try:
        before = read(ref)
    except errors:
        before = None
    counter = FileSystemSteps()
    with counter.active():
        write(ref)
    row.steps = counter.count
    expected = read(ref)
    extra = [i + 1 for i, p in enumerate(counter.paths) if also and also in p]
    for n in sorted(
        set(kill_points(row.steps, at_least + 3)) | set(extra)
    ):  # threads (Orbax's) make the count vary a little
        folder = workspace / f"kill{n}"
        prepare(folder)
        killer = FileSystemSteps(kill_at=n)
        try:
            with killer.active():
                write(folder)
        except Killed:
            pass
        if not killer.killed:  # this run finished in fewer steps
            shutil.rmtree(folder)
            continue
        row.kill_points += 1
        now = tree_bytes(folder)
        row.changed_user_files += sum(now.get(p) != h for p, h in user.items() if not _generated(p))
        try:
            seen = read(folder)
            if not (whole(seen, before, expected) if whole else seen in (expected, before)):
                row.corrupt_reads += 1
        except errors:
            row.refused += 1
        again = FileSystemSteps()
        try:
            with killed_pids_dead(), again.active():
                write(folder)
        except (
            errors
        ):  # the kill came after the output was complete; a writer that never overwrites says so
            row.complete += 1
            assert read(folder) == expected, f"{name}: a re-run after a kill at step {n} was refused"
            shutil.rmtree(folder)
            continue
        again_read = read(folder)
        assert again_read == expected, (
            f"{name}: the re-run after a kill at step {n} differs: {_diff(again_read, expected)}"
        )
        if again.count < row.steps:
            row.resumed += 1
        else:
            row.restarted += 1
        shutil.rmtree(folder)
    return row


GENERATED = ("out", "dest")  # the folders the writers write under a workspace; the rest is the user's


def _generated(rel: str) -> bool:
    return rel.split(os.sep)[0] in GENERATED


def _diff(a, b) -> str:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list) and len(a) == len(b):
        return "; ".join(
            f"[{i}] {str(x)[:300]} != {str(y)[:300]}" for i, (x, y) in enumerate(zip(a, b)) if x != y
        )
    return f"{str(a)[:300]} != {str(b)[:300]}"
