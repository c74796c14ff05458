"""Every writer killed (as SIGKILL would) at >= 20 points of its run, in this process (`faults`): after each kill
the user's files are byte-identical and a reader sees nothing, the previous output or the finished one, never a
half-written one; the re-run ends in the bytes of an uninterrupted run. The fault table is printed at the end
(`pytest -s tests/test_faults.py`)."""

import json
import re

import jax
import numpy as np
import pytest
from conftest import HEADS, STORIES
from faults import Row, run_faults
from helpers import compile_training_once

from specjax import checkpoint, datastore, errors, heads, results

# A kill in this process stops Orbax's asynchronous save between creating a write coroutine and awaiting it; Python
# warns when that coroutine is collected, during whichever test of this module runs then (a real SIGKILL leaves none)
pytestmark = pytest.mark.filterwarnings(
    "ignore:coroutine 'async_serialize_from_host.<locals>.write_fragment' was never awaited:RuntimeWarning"
)

TABLE: list[Row] = []
REFUSALS = (errors.SpecjaxError, FileNotFoundError)
STAMP = {"date": "2026-01-01", "commit": "abc", "device": "cpu", "command": "make tables"}
STORY = "Once upon a time, there was a little {} named {}. {} liked to play in the park with a red ball.\n"


def user_files(folder):
    """The user's files beside the output: they must come out of every kill byte-identical."""
    (folder / "mine").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine, not specjax's\n")
    (folder / "mine" / "data.bin").write_bytes(bytes(range(256)) * 3)


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    yield
    print(
        "\n| writer | steps | kill points | resumed | restarted | re-run refused (output whole) | read refused "
        "| corrupt reads | changed user files |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in TABLE:
        print(row.line())


def check(row: Row) -> None:
    TABLE.append(row)
    assert (
        row.kill_points >= min(20, row.steps) and row.corrupt_reads == 0 and row.changed_user_files == 0
    ), row


def table_rows(scale):
    return [{"drafter": d, "tau": 1.5 * scale + i, "speedup": 1.1 * scale} for i, d in enumerate("abc")]


def test_results_tables(tmp_path):
    """`make tables`' writer: two tables (.md and .csv each) replacing the previous run's; each file is always
    the old or the new one, whole."""
    names = [f"{t}.{x}" for t in ("spec", "heads") for x in ("md", "csv")]

    def write_all(folder, scale):
        for t in ("spec", "heads"):
            results.write_table(folder / "out", t, table_rows(scale), f"Table {t}", "notes", STAMP)

    def prepare(folder):
        user_files(folder)
        write_all(folder, 1)

    def read(folder):
        return tuple((folder / "out" / n).read_text() for n in names)

    def whole(seen, before, expected):
        return all(s in (b, e) for s, b, e in zip(seen, before, expected, strict=True))

    check(
        run_faults(
            "results/ (make tables)", tmp_path, prepare, lambda f: write_all(f, 2), read, whole=whole
        )
    )


def test_retrieval_datastore(tmp_path, stories):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(STORY.format(a, n, n) for a in ("dog", "cat", "bird") for n in ("Rex", "Tom"))
    )

    def read(folder):
        store = datastore.load(folder / "out")
        manifest = {k: v for k, v in store.manifest.items() if k != "build_s"}
        return store.tokens_R.tobytes(), store.suffix_R.tobytes(), json.dumps(manifest, sort_keys=True)

    row = run_faults(
        "retrieval datastore",
        tmp_path,
        user_files,
        lambda f: datastore.build(corpus, stories.tokenizer, f / "out"),
        read,
        REFUSALS,
    )
    check(row)


def test_head_export(tmp_path):
    def read(folder):
        heads.read_meta(folder / "out")
        return sorted(
            (p.relative_to(folder / "out").as_posix(), p.read_bytes())
            for p in (folder / "out").rglob("*")
            if p.is_file()
        )

    row = run_faults(
        "head export",
        tmp_path,
        user_files,
        lambda f: heads.export(HEADS / "stories260K_medusa", f / "out"),
        read,
        REFUSALS,
    )
    check(row)


def test_convert(tmp_path):
    """`python -m specjax.convert` (checkpoint.convert): a reader takes a folder with its marker as a checkpoint."""

    def read(folder):
        meta = json.loads((folder / "out" / checkpoint.MARKER).read_text())
        meta["source"].pop("converted", None)
        params = sorted(  # Orbax names its data files by random hashes, how many varies
            {
                re.sub("[0-9a-f]{32}", "H", p.relative_to(folder / "out").as_posix())
                for p in (folder / "out" / "params").rglob("*")
            }
        )
        tok = sorted((p.name, p.read_bytes()) for p in (folder / "out" / "tokenizer").iterdir())
        return json.dumps(meta, sort_keys=True), params, tok

    row = run_faults(
        "specjax.convert",
        tmp_path,
        user_files,
        lambda f: checkpoint.convert(str(STORIES), f / "out"),
        read,
        REFUSALS,
    )
    check(row)


def test_feature_store(tmp_path):
    """`data.build_feature_store` (a temporary folder renamed into place): a reader sees no store or the whole one."""
    from specjax.training import data

    rng = np.random.default_rng(0)
    corpus = data.Corpus(rng.integers(0, 512, (20, 8), dtype=np.int32), rng.integers(0, 2, (20, 8)))
    features = lambda tokens: np.sin(tokens[..., None] * np.arange(1, 5) / 7.0)  # [n, T, 4]

    def read(folder):
        store = data.FeatureStore(folder / "out", {"target": "A"})
        feats = store.features(np.arange(store.manifest["rows"]))
        return (
            json.dumps(store.manifest),
            store.tokens.tobytes(),
            store.loss_mask.tobytes(),
            feats.tobytes(),
        )

    row = run_faults(
        "feature store",
        tmp_path,
        user_files,
        lambda f: data.build_feature_store(
            f / "out", corpus, features, shard_size=4, provenance={"target": "A"}
        ),
        read,
        REFUSALS,
    )
    check(row)


def test_regeneration(tmp_path, stories):
    """`regenerate.regenerate` (conversations rewritten by the target, appended a batch at a time): what a resumed
    run keeps is always whole batches of the uninterrupted run's conversations, in order."""
    from specjax.training import chat, regenerate

    subjects = ("cat", "dog", "bird", "fish", "frog")
    convs = [
        [
            {"role": "user", "content": f"Tell me a story about a {s}."},
            {"role": "assistant", "content": f"The {s} was sad."},
        ]
        for s in subjects
    ]
    target = (stories.cfg, stories.graphdef, stories.params)
    template = (HEADS.parent / "configs" / "chat" / "stories.jinja").read_text()
    settings = {"max_new_tokens": 4, "temperature": 1.0, "seed": 3}
    args = dict(template=template, provenance={"target": "A"}, batch=2, **settings)
    provenance = {"target": "A"} | settings | {"batch": 2}

    def read(folder):
        return regenerate._done(folder / "out.jsonl", provenance, 2, len(convs))

    def whole(
        seen, before, expected
    ):  # the conversations a re-run keeps: whole batches, as written straight
        return seen == expected[: len(seen)] and (len(seen) % 2 == 0 or seen == expected)

    write = lambda f: regenerate.regenerate(convs, target, stories.tokenizer, out=f / "out.jsonl", **args)
    write(tmp_path / "warm")  # compiles (and writes the compilation cache) outside the counted steps
    row = run_faults(
        "regeneration",
        tmp_path,
        user_files,
        write,
        read,
        REFUSALS,
        whole=whole,
    )
    assert (
        chat.read_conversations(tmp_path / "reference" / "out.jsonl")[0][1]["content"] != "The cat was sad."
    )
    check(row)


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the kill in TensorBoard's writer
def test_training_checkpoints(tmp_path, stories, monkeypatch):
    """`trainer.train` (Orbax checkpoints in WORKDIR/checkpoints, resumed by the next run): a reader (`load_heads`)
    sees no heads, or step 2's or step 3's parameters whole; the re-run ends in an uninterrupted run's parameters
    and metrics.jsonl (no merged or repeated line).
    The target and the train step are built once (their reads are not the writer under test)."""
    from specjax.models.loading import tokenizer_files
    from specjax.training import trainer
    from specjax.training.config import base_config, smoke

    target_dir = tmp_path / "target"
    checkpoint.save_model(target_dir, stories.cfg, stories.params, tokenizer_files(stories.path))
    config = smoke(base_config("eagle"))
    config.target, config.data.cache = str(target_dir), str(tmp_path / "corpus.npy")
    config.data.num_samples, config.train.batch_size = 8, 4
    # step 1 logged before any checkpoint, step 2 saved (every 2 steps), step 3 logged before the final save
    config.train.steps, config.train.checkpoint_every, config.train.log_every = 3, 2, 1
    compile_training_once(monkeypatch)

    def read(folder):
        """The latest checkpoint's parameters, and the (step, loss) lines of metrics.jsonl (a tail without its
        newline is a line being written, not one yet; every whole line must parse)."""
        _, _, params = heads.load_heads(folder / "out", stories.cfg, stories.params)
        log = folder / "out" / "metrics.jsonl"
        lines = log.read_text().split("\n")[:-1] if log.exists() else []
        logged = [(m["step"], m["loss"]) for m in map(json.loads, lines)]
        return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(params)], logged

    def whole(
        seen, before, expected
    ):  # step 2's or 3's parameters; the uninterrupted run's log or its start
        return seen[0] in (expected[0], step_two[0]) and seen[1] == expected[1][: len(seen[1])]

    # compiles and caches the corpus outside the counted steps; step 2's parameters
    trainer.train(config, tmp_path / "two" / "out", stop_at=2)
    step_two = read(tmp_path / "two")
    row = run_faults(
        "training checkpoints",
        tmp_path,
        user_files,
        lambda f: trainer.train(config, f / "out"),
        read,
        REFUSALS,
        whole=whole,
        also="metrics.jsonl",  # a kill half-way through each line of the log, and at its opening
    )
    assert step_two[0] != read(tmp_path / "reference")[0]  # a control: step 3 moved the parameters
    check(row)


def test_distilled_draft_export(tmp_path, stories):
    """`distill.export_model` (files.atomic_dir): a reader (`load_model`) sees no draft or the whole export.
    The draft is a 2-step smoke distillation trained outside the counted steps."""
    from specjax.drafters import distill
    from specjax.models.loading import load_model, tokenizer_files
    from specjax.training import trainer
    from specjax.training.config import base_config, smoke

    target_dir = tmp_path / "target"
    checkpoint.save_model(target_dir, stories.cfg, stories.params, tokenizer_files(stories.path))
    config = smoke(base_config("distill"))
    config.target, config.data.cache = str(target_dir), str(tmp_path / "corpus.npy")
    config.heads.n_layers, config.heads.init = 1, "layers:0"
    config.data.num_samples, config.data.sample_len, config.data.heldout = 8, 16, 0
    config.train.batch_size, config.train.steps, config.train.checkpoint_every = 4, 2, 2
    trainer.train(config, tmp_path / "run")

    def read(folder):
        model = load_model(str(folder / "out"))
        files = sorted((p.name, p.read_bytes()) for p in (folder / "out").iterdir())
        return (
            repr(model.cfg),
            [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(model.params)],
            files,
        )

    row = run_faults(
        "distilled draft export",
        tmp_path,
        user_files,
        lambda f: distill.export_model(tmp_path / "run", f / "out", target_dir),
        read,
        REFUSALS,
    )
    check(row)


# --- two writers at once ---------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from specjax import files
with files.writing(Path(sys.argv[1]), "output"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_writer_of_the_same_destination_is_refused_naming_the_lock(tmp_path, stories, capsys):
    """Another process writes each destination (it holds the destination's lock, as a running datastore build,
    conversion or export does): the datastore, the conversion and the export are refused with LockedError naming
    `.out.writing`, the command line with one line; killed, that process leaves a lock the next run takes."""
    import os
    import signal
    import subprocess
    import sys

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(STORY.format("dog", "Rex", "Rex"))
    writers = {
        "datastore": lambda out: datastore.build(corpus, stories.tokenizer, out),
        "convert": lambda out: checkpoint.convert(str(STORIES), out),
        "export": lambda out: heads.export(HEADS / "stories260K_medusa", out),
    }
    for name, write in writers.items():
        out = tmp_path / name / "out"
        out.parent.mkdir()
        other = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(out)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(HEADS.parent)},
        )
        try:
            assert other.stdout.readline() == "held\n"
            with pytest.raises(errors.LockedError, match=r"is writing the .* \(lock .*/\.out\.writing\)"):
                write(out)
            assert not out.exists() and [p.name for p in out.parent.iterdir()] == [".out.writing"]
            if name == "export":
                with pytest.raises(SystemExit):
                    heads.main(["export", str(HEADS / "stories260K_medusa"), str(out)])
                line = capsys.readouterr().err.strip()
                assert "\n" not in line and line.startswith("error: ") and ".out.writing" in line
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()
        write(out)  # the killed writer's lock is free again
        assert out.is_dir() and [p.name for p in out.parent.iterdir()] == ["out"]
