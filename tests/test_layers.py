"""specjax's import graph: no circle, and no import running up the declared layers (`LAYERS`, lowest first); drawn
by folders (each package one node, each top-level module its own), no circle either, so the folders show the layers.

Every import of a specjax module counts, at the top of a file or inside a function. A module belongs to the
first layer with a pattern that matches it (a pattern ending in `.` matches a package and the modules in it); a
module no pattern matches fails the check until it is declared. `python tests/test_layers.py` prints the report.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    (
        "foundations",
        "specjax specjax.models specjax.drafters specjax.drafting specjax.training specjax.files specjax.sampling "
        "specjax.cache specjax.metrics specjax.analysis specjax.results specjax.tokenizer specjax.models.config "
        "specjax.drafting.registry specjax.precision specjax.errors specjax.hf_import specjax.kernels.",
    ),
    ("model", "specjax.models.llama specjax.models.weights specjax.models.quantize specjax.sharding "
     "specjax.drafting.layouts"),
    ("model files", "specjax.models.store specjax.models.loading specjax.models.conversion"),
    ("draft shapes and acceptance", "specjax.drafting. specjax.acceptance."),
    ("decoding", "specjax.decoding."),
    ("data and CLI", "specjax.cli specjax.training.chat specjax.training.regenerate specjax.training.data "
     "specjax.training.losses specjax.training.divergences specjax.training.config specjax.datastore"),
    ("trained-head formats", "specjax.published specjax.speculators_format specjax.heads"),
    ("drafters", "specjax.drafters."),
    ("tools", "specjax.expand specjax.training. specjax.runner specjax.verify_exactness specjax.checkpoint "
     "specjax.convert specjax.pair"),
]  # fmt: skip


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for file in sorted((root / "specjax").rglob("*.py")):
        parts = list(file.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return found


def imports(file: Path, known) -> set[str]:
    """The specjax modules `file` imports (`from pkg import sub` counts as importing `pkg.sub` when it is one)."""
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "specjax"}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "specjax"
        ):
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            }
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(f, mods) - {m} for m, f in mods.items()}


def layer_of(module: str) -> int | None:
    for i, (_, patterns) in enumerate(LAYERS):
        for p in patterns.split():
            if module in (p, p.rstrip(".")) or (p.endswith(".") and module.startswith(p)):
                return i
    return None


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules that import each other (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return groups


def problems(g: dict[str, set[str]]) -> list[str]:
    out = [
        f"undeclared module {m}: add it to a layer in tests/test_layers.py"
        for m in g
        if layer_of(m) is None
    ]
    out += [f"import circle: {' <-> '.join(c)}" for c in cycles(g)]
    for m in sorted(g):
        for dep in sorted(g[m]):
            lm, ld = layer_of(m), layer_of(dep)
            if lm is not None and ld is not None and ld > lm:
                out.append(f"upward import: {m} ({LAYERS[lm][0]}) imports {dep} ({LAYERS[ld][0]})")
    return out


def folder(module: str) -> str:
    """The folder a module sits in (a top-level module is its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the folders its modules import (the package root `specjax` left out: it imports nothing)."""
    out = {}
    for m, deps in g.items():
        if m != "specjax":
            out.setdefault(folder(m), set()).update(folder(d) for d in deps if d != "specjax")
    return {f: deps - {f} for f, deps in out.items()}


def folder_problems(g: dict[str, set[str]]) -> list[str]:
    """One line per circle of folders, naming an import that makes each of its arrows."""
    fg, out = folder_graph(g), []
    for group in cycles(fg):
        arrows = [
            f"{m} -> {d}"
            for m in sorted(g)
            for d in sorted(g[m])
            if folder(m) in group and folder(d) in group and folder(m) != folder(d) and d != "specjax"
        ]
        out.append(f"folder circle: {' <-> '.join(group)} ({'; '.join(arrows)})")
    return out


def test_no_circle_and_no_upward_import():
    assert problems(graph()) == []


def test_no_circle_between_folders():
    assert folder_problems(graph()) == []


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    for name, text in {
        "specjax/files.py": "from specjax import sampling\n",
        "specjax/sampling.py": "def f():\n    from specjax import files\n",
        "specjax/models/llama.py": "from specjax.decoding import jobs\n",
        "specjax/decoding/jobs.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert problems(graph(tmp_path)) == [
        "import circle: specjax.files <-> specjax.sampling",
        "upward import: specjax.models.llama (model) imports specjax.decoding.jobs (decoding)",
    ]
    (tmp_path / "specjax/decoding/prefill.py").write_text("from specjax.models import llama\n")
    assert folder_problems(graph(tmp_path)) == [
        "folder circle: specjax.decoding <-> specjax.models "
        "(specjax.decoding.prefill -> specjax.models.llama; specjax.models.llama -> specjax.decoding.jobs)",
        "folder circle: specjax.files <-> specjax.sampling "
        "(specjax.files -> specjax.sampling; specjax.sampling -> specjax.files)",
    ]


if __name__ == "__main__":
    found = problems(graph()) + folder_problems(graph())
    print(
        "\n".join(found) or f"no circle, no upward import ({len(graph())} modules in {len(LAYERS)} layers)"
    )
    sys.exit(bool(found))
