"""Writing without losing data: every output is written under a temporary name beside its destination and
renamed into place, an existing destination is replaced only when specjax made it, and a work directory is
locked while a run uses it.

A write killed half-way leaves only a hidden `.NAME.partial-HOST-PID-XXXXXXXX` beside the destination: it never
passes for a complete output, never blocks a retry, and the next write to that destination removes it once its
process is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from absl import logging

from specjax.errors import DestinationError, FileSafetyError, LockedError, ProvenanceError  # noqa: F401

HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _temp_name(name: str, kind: str) -> str:
    return f".{name}.{kind}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _remove_stale(parent: Path, name: str) -> None:
    """Removes temporaries of `name` that this host's dead processes left (killed half-way through a write)."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.(partial|old)-{HOST}-(\d+)-[0-9a-f]{{8}}$")
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            match = pattern.match(entry.name)
            if match and not pid_alive(int(match.group(2))):
                logging.info("removing %s, left by an interrupted write", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def _refuse_existing(dest: Path, replaceable: Callable[[Path], bool] | None, what: str) -> bool:
    """Whether `dest` exists (and may be replaced); raises if it exists and may not."""
    if not (dest.exists() or dest.is_symlink()):
        return False
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        return True  # an empty directory holds nothing to lose
    if replaceable is not None and replaceable(dest):
        return True
    if replaceable is None:
        raise DestinationError(
            f"{dest} already exists; choose a new destination for the {what} (specjax does not overwrite it)"
        )
    raise DestinationError(
        f"{dest} already exists and is not a {what} written by specjax; choose another destination or "
        "move it away yourself (specjax never deletes what it did not write)"
    )


def _make_parent(dest: Path) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DestinationError(
            f"cannot create the directory {dest.parent} ({err.strerror or err}); choose a writable destination"
        ) from err
    if not os.access(dest.parent, os.W_OK | os.X_OK):
        raise DestinationError(
            f"cannot write in {dest.parent} (permission denied); choose a writable destination"
        )
    _remove_stale(dest.parent, dest.name)


def _create_partial(dest: Path, replaceable, what: str, create: Callable[[Path], object]) -> Path:
    """Checks that `dest` may be written, then creates (with `create`) and returns a temporary beside it."""
    _refuse_existing(dest, replaceable, what)
    _make_parent(dest)
    tmp = dest.parent / _temp_name(dest.name, "partial")
    try:
        create(tmp)
    except OSError as err:
        raise DestinationError(
            f"cannot create {tmp} ({err.strerror or err}); choose a writable destination"
        ) from err
    return tmp


@contextlib.contextmanager
def atomic_dir(
    dest: str | Path, replaceable: Callable[[Path], bool] | None = None, what: str = "directory"
) -> Iterator[Path]:
    """Yields a fresh empty directory beside `dest` to write into; when the block ends without an error it is
    renamed to `dest`, else removed. An existing `dest` is replaced only if it is empty or `replaceable(dest)`
    says specjax wrote it (checked before and after writing); otherwise DestinationError names it."""
    dest = Path(dest).absolute()
    _refuse_existing(dest, replaceable, what)
    _make_parent(dest)
    with writing(dest, what):
        tmp = _create_partial(dest, replaceable, what, Path.mkdir)
        try:
            yield tmp
            _move_into_place(tmp, dest, replaceable, what)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def writing(dest: Path, what: str) -> Iterator[Path]:
    """Holds `.NAME.writing` beside `dest` (an exclusive `flock`, released by the kernel even when the holder is
    killed) while one process writes `dest`: a second writer of the same destination is refused with LockedError
    naming the lock, so two runs never mix their outputs. The file is removed when the write ends."""
    import fcntl

    lock = dest.parent / f".{dest.name}.writing"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise DestinationError(
            f"cannot create the lock {lock} ({err.strerror or err}); choose a writable destination"
        ) from err
    acquired = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_holder(os.pread(fd, 4096, 0).decode(errors="replace")))
            raise LockedError(
                f"another run ({holder}) is writing the {what} {dest} (lock {lock}); wait for it to end or "
                "choose another destination"
            ) from None
        except OSError:  # no flock on this file system: go on unlocked, as before
            pass
        acquired = True
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        yield lock
    finally:
        try:
            if acquired:
                with contextlib.suppress(OSError):
                    lock.unlink()  # while still held: a run refused meanwhile saw it taken
        finally:
            os.close(fd)


def _move_into_place(tmp: Path, dest: Path, replaceable, what: str) -> None:
    exists = _refuse_existing(dest, replaceable, what)  # something may have appeared meanwhile
    if exists and any(dest.iterdir()):  # a previous output of ours: swap, then delete the old one
        old = dest.parent / _temp_name(dest.name, "old")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, dest)  # atomic; replaces an empty directory, fails on a non-empty one
    except OSError as err:
        raise DestinationError(
            f"cannot move the finished output into {dest} ({err.strerror or err}); "
            "choose another destination or move that one away"
        ) from err


@contextlib.contextmanager
def atomic_file(
    dest: str | Path, replaceable: Callable[[Path], bool] | None = None, what: str = "file"
) -> Iterator[Path]:
    """Yields a temporary path beside `dest` (an empty file) to write; when the block ends without an error it
    is flushed to disk and renamed to `dest`, else removed. An existing `dest` is replaced only if
    `replaceable(dest)`."""
    dest = Path(dest).absolute()
    if dest.is_dir():
        raise DestinationError(f"{dest} is a directory; give the path of a file")
    tmp = _create_partial(dest, replaceable, what, lambda path: path.touch(exist_ok=False))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _refuse_existing(dest, replaceable, what)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(dest: str | Path, text: str, replaceable: Callable[[Path], bool] | None = None) -> None:
    """Writes `text` to `dest` atomically (see `atomic_file`)."""
    with atomic_file(dest, replaceable) as tmp:
        tmp.write_text(text)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def overlaps(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are the same path or one lies inside the other (symlinks resolved)."""
    a, b = Path(a).resolve(), Path(b).resolve()
    return a == b or a in b.parents or b in a.parents


# --- work-directory lock ---------------------------------------------------------------------------------

LOCK = ".lock"


def _holder(text: str) -> dict:
    try:
        holder = json.loads(text)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


def _describe(holder: dict) -> str:
    return (
        f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
    )


@contextlib.contextmanager
def locked(workdir: str | Path) -> Iterator[Path]:
    """Holds `WORKDIR/.lock` (an exclusive `flock`, released by the kernel even when the holder is killed; the
    file records the holder's pid while it runs). A second run is refused with LockedError; a lock whose
    process is gone is taken over with a warning. Yields the lock file's path."""
    import fcntl

    workdir = Path(workdir).absolute()
    if workdir.exists() and not workdir.is_dir():
        raise DestinationError(f"workdir {workdir} is a file; give a directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(workdir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise DestinationError(
            f"cannot create the workdir lock {workdir / LOCK} ({err.strerror or err}); choose a writable --workdir"
        ) from err
    path = workdir / LOCK
    acquired = False
    try:
        previous = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(
                f"workdir {workdir} is in use by {_describe(previous)} (lock {path}); wait for that run to "
                "end, stop it, or use another --workdir"
            ) from None
        except OSError:  # no flock on this file system: trust the recorded pid
            if previous.get("host") == HOST and pid_alive(int(previous.get("pid", 0) or 0)):
                raise LockedError(
                    f"workdir {workdir} is in use by {_describe(previous)} (lock {path}); wait for that run "
                    "to end, stop it, or use another --workdir"
                ) from None
        acquired = True
        previous = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))  # as the last holder left it
        if previous:
            logging.warning(
                "taking over the stale lock %s of %s, which no longer holds it (killed?)",
                path,
                _describe(previous),
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        os.fsync(fd)
        yield path
    finally:
        if acquired:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released; the file stays (deleting it would race with a waiting run)
        os.close(fd)  # releases the flock
