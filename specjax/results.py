"""The one results writer of the experiments: markdown + CSV tables and PNG plots, each stamped with the git
commit, the date, the device and the exact command that produced it.

Stamps: a markdown table's second line (`<!-- stamp: {...} -->`, hidden when rendered, then a visible line),
a CSV's first line (`# stamp: {...}`: read it with `pandas.read_csv(..., comment="#")`), a PNG's text chunk
`stamp` and its footer. `read_stamp` reads any of them back.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from specjax import files
from specjax.errors import ResultsError

REPO = Path(__file__).resolve().parents[1]
STAMP_KEYS = ("commit", "date", "device", "command")
# an x86 CPU's widest vector extension, as /proc/cpuinfo flags it
VECTOR_EXTENSIONS = (
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("avx", "AVX"),
    ("sse2", "SSE2"),
)


def _commit() -> str:
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True)
        head = run("rev-parse", "--short=12", "HEAD").stdout.strip()
        # results/ itself is output: a run rewriting its committed tables is not a change to the code
        dirty = run(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+uncommitted changes" if dirty else "")


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where the OS has none)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """The host CPU's model name with its family, model and widest vector extension (a virtual machine may name
    CPUs of different generations alike: "AMD EPYC"), else what the platform reports."""
    info = cpu_info()
    if "model name" not in info:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    details = [
        f"{label} {info[key]}"
        for key, label in (("cpu family", "family"), ("model", "model"))
        if key in info
    ]
    details += [name for flag, name in VECTOR_EXTENSIONS if flag in flags][:1]
    return info["model name"] + (f" ({', '.join(details)})" if details else "")


def device() -> str:
    """The devices JAX runs on, and the host's CPU and core count."""
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind if devices[0].platform != "cpu" else "CPU"
    return f"{len(devices)} x {kind} ({jax.default_backend()}), host {cpu_name()}, {os.cpu_count()} cores"


def stamp(command: str | None = None) -> dict:
    """{commit, date, device, command} of this run (`command`: default this process's command line)."""
    argv = [Path(sys.executable).name, *sys.orig_argv[1:]] if command is None else None
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device(),
        "command": command if command is not None else " ".join(argv),
    }


def _fmt(v) -> str:
    if isinstance(v, float | np.floating):
        return "nan" if np.isnan(v) else f"{v:.3g}"
    return str(v)


def write_table(
    folder: str | Path,
    name: str,
    rows: list[dict],
    title: str,
    notes: str = "",
    the_stamp: dict | None = None,
) -> str:
    """Writes `folder/NAME.md` (title, stamp, table, notes) and `folder/NAME.csv` (stamp line, header, rows);
    returns the markdown. Every row must have the first row's columns."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise ResultsError(f"table {name} has no rows")
    keys = list(rows[0])
    for row in rows:
        if list(row) != keys:
            raise ResultsError(f"table {name}: a row has columns {list(row)}, the first row {keys}")
    s = the_stamp or stamp()
    lines = [f"# {title}", f"<!-- stamp: {json.dumps(s)} -->", _visible(s), ""]
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    text = "\n".join(lines) + "\n" + (f"\n{notes.strip()}\n" if notes else "")
    files.write_text(folder / f"{name}.md", text, replaceable=_ours)  # whole or not at all, even if killed
    out = io.StringIO()
    out.write(f"# stamp: {json.dumps(s)}\n")
    writer = csv.DictWriter(out, keys)
    writer.writeheader()
    writer.writerows(
        {k: (float(v) if isinstance(v, np.floating) else v) for k, v in r.items()} for r in rows
    )
    files.write_text(folder / f"{name}.csv", out.getvalue(), replaceable=_ours)
    return text


def _ours(path: Path) -> bool:
    """results/ is specjax's output: a table or figure there is replaced by the next run that writes it."""
    return path.is_file()


def _visible(s: dict) -> str:
    return f"*{s['date']} · commit {s['commit']} · {s['device']} · `{s['command']}`*"


def save_figure(fig, folder: str | Path, name: str, the_stamp: dict | None = None) -> Path:
    """Saves a matplotlib figure as `folder/NAME.png` with the stamp in its footer and its `stamp` text chunk."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    s = the_stamp or stamp()
    fig.text(0.01, 0.005, f"{s['date']} · {s['commit']} · {s['command']}", fontsize=6, color="gray")
    path = folder / f"{name}.png"
    with files.atomic_file(path, replaceable=_ours) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata={"stamp": json.dumps(s)})
    return path


def read_stamp(path: str | Path) -> dict:
    """The stamp of a results file (.md, .csv or .png); ResultsError if it has none."""
    path = Path(path)
    text = None
    if path.suffix == ".png":
        from PIL import Image

        text = Image.open(path).text.get("stamp")
    else:
        for line in path.read_text().splitlines()[:3]:
            for prefix in ("<!-- stamp: ", "# stamp: "):
                if line.startswith(prefix):
                    text = line[len(prefix) :].removesuffix(" -->")
    try:
        s = json.loads(text) if text else None
    except ValueError:
        s = None
    if not isinstance(s, dict) or any(not s.get(k) for k in STAMP_KEYS):
        raise ResultsError(
            f"{path} has no stamp (commit, date, device, command); regenerate it with make tables"
        )
    return s
