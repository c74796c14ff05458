"""The README's and docs/'s code blocks run: every ```python block (all in one subprocess, each in a fresh
namespace) and every ```bash block (one bash process, `set -e`, `.venv/bin/python` meaning this interpreter), from
the repository root. A block fenced ```bash no-run: <why> or ```python no-run: <why> is not run (it sets up an
environment, trains for minutes, needs a network or a GPU, ...), but every `python` command in it must still name
a script, module and config file that exist, so a renamed one fails here too."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from children import child_env

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str):
    """(file, info, code) of the `lang` blocks of README.md and docs/*.md, in order."""
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in FENCE.finditer(md.read_text()):
            if m.group(1) == lang:
                yield md.relative_to(ROOT), m.group(2).strip(), m.group(3)


def runnable(lang: str) -> list[tuple]:
    out = []
    for where, info, code in blocks(lang):
        if info.startswith("no-run"):
            assert re.match(r"no-run: \S", info), (
                f"{where}: a no-run block says why (```{lang} no-run: <why>)"
            )
        else:
            assert not info, f"{where}: unknown block marker {info!r} (only 'no-run: <why>')"
            out.append((where, code))
    return out


def commands(code: str):
    """The argument lists of the `python` commands in a shell block (continuation lines joined)."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        at = [i for i, w in enumerate(words) if w.endswith("bin/python") or w == "python"]
        if at:
            yield words[at[0] + 1 :]


def test_every_named_script_module_and_config_exists():
    named = 0
    for where, _, code in blocks("bash"):
        for args in commands(code):
            if args[0] == "-m":
                assert importlib.util.find_spec(args[1]) is not None, f"{where}: no module {args[1]}"
            elif args[0].endswith(".py"):
                assert (ROOT / args[0]).is_file(), f"{where}: no script {args[0]}"
            for arg in args:
                if arg.startswith("--config="):
                    assert (ROOT / arg.split("=", 1)[1].split(":")[0]).is_file(), f"{where}: no {arg}"
            named += 1
    assert named >= 10  # the check reads the blocks (a broken pattern would find none)


def test_python_blocks_run():
    code = runnable("python")
    assert code, "README.md has a runnable python block"
    script = "\n".join(
        f"print('--- {where} block {i}', flush=True)\nexec(compile({src!r}, '{where}', 'exec'), {{}})"
        for i, (where, src) in enumerate(code)
    )
    env = child_env(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Once upon a time" in run.stdout  # the README's decode printed its story


@pytest.mark.skipif(not runnable("bash"), reason="no runnable shell block")
def test_shell_blocks_run():
    script = "\n".join(
        f"echo '--- {where} block {i}'\n{code.replace('.venv/bin/python', shlex.quote(sys.executable))}"
        for i, (where, code) in enumerate(runnable("bash"))
    )
    env = child_env(ROOT)
    run = subprocess.run(
        ["bash", "-ec", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
