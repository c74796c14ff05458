"""Nothing a user owns is lost, and runs never mix: exports, conversions, corpus caches and feature stores are
written beside their destination and renamed into place, never over what specjax did not write; caches and
stores carry their provenance; a workdir records its config and is locked; bad settings and a non-finite loss
stop a run with one clear error. Sentinel files must come out byte-for-byte intact."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import child_env
from flax import nnx

from specjax import checkpoint, files, heads
from specjax.drafting import registry
from specjax.models.loading import tokenizer_files
from specjax.models.weights import build_params
from specjax.training import data, trainer
from specjax.training.config import TrainingConfigError, base_config, smoke

REPO = Path(__file__).parents[1]
COMMITTED = REPO / "heads" / "stories260K_medusa"
STORY = (
    "Once upon a time, there was a little {} named {}. {} liked to play in the park with a red ball. "
    "One day, the sun was hot and {} was sad."
)


def sentinels(folder: Path) -> dict:
    """Writes a few files a user owns into `folder`; returns {path: bytes} to compare afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {folder / "notes.txt": b"my notes\n", folder / "sub" / "data.bin": bytes(range(256)) * 3}
    for path, content in made.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
    return made


def intact(made: dict) -> bool:
    return all(path.read_bytes() == content for path, content in made.items())


def leftovers(folder: Path) -> list:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


@pytest.fixture(scope="module")
def target_dir(stories, tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "stories260K"
    checkpoint.save_model(path, stories.cfg, stories.params, tokenizer_files(stories.path))
    return path


@pytest.fixture(scope="module")
def other_target_dir(stories, tmp_path_factory):
    """stories260K with one weight changed: the same config, another target."""
    pure = jax.tree.map(np.array, nnx.to_pure_dict(stories.params))
    pure["norm"]["weight"] = pure["norm"]["weight"] * 1.5
    _, params = build_params(stories.cfg, pure)
    path = tmp_path_factory.mktemp("target2") / "stories260K_changed"
    checkpoint.save_model(path, stories.cfg, params, tokenizer_files(stories.path))
    return path


@pytest.fixture(scope="module")
def text_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "stories.txt"
    names = ["Tom", "Lily", "Max", "Sue", "Ben", "Amy"]
    path.write_text(
        "\n".join(STORY.format(a, n, n, n) for a in ("cat", "dog", "bird") for n in names for _ in range(3))
    )
    return path


def config_for(target, source, method="medusa"):
    c = smoke(base_config(method))
    c.target, c.data.source = str(target), str(source)
    c.train.log_every = 1
    return c


def workdir_copy(tmp_path) -> tuple[Path, dict]:
    """A training workdir (the committed heads plus files a run writes), and its sentinels."""
    work = tmp_path / "work"
    shutil.copytree(COMMITTED, work)
    made = sentinels(work)
    (work / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    made[work / "metrics.jsonl"] = (work / "metrics.jsonl").read_bytes()
    for f in (work / "checkpoints").rglob("*"):
        if f.is_file():
            made[f] = f.read_bytes()
    return work, made


# --- heads.export ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
def test_export_refuses_the_workdir(where, tmp_path):
    work, made = workdir_copy(tmp_path)
    dest = {"equal": work, "inside": work / "export", "containing": tmp_path}[where]
    with pytest.raises(
        files.DestinationError, match=re.escape(f"{dest} is, lies inside or contains the workdir")
    ):
        heads.export(work, dest)
    assert intact(made)
    assert not (work / "export").exists()


def test_export_never_replaces_a_foreign_directory(tmp_path):
    work, _ = workdir_copy(tmp_path)
    exports = tmp_path / "exports"
    heads.export(work, exports / "a")  # an earlier export beside the user's files
    made = sentinels(exports)
    made.update({f: f.read_bytes() for f in (exports / "a").rglob("*") if f.is_file()})
    with pytest.raises(
        files.DestinationError, match=re.escape(f"{exports} already exists and is not a heads export")
    ):
        heads.export(work, exports)  # the folder that holds exports, not an export
    foreign = tmp_path / "mine"
    made.update(sentinels(foreign))
    (foreign / "heads.json").write_text('{"method": "medusa"}')  # looks a little like heads, still not ours
    made[foreign / "heads.json"] = (foreign / "heads.json").read_bytes()
    with pytest.raises(files.DestinationError, match=re.escape(f"{foreign} already exists")):
        heads.export(work, foreign)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(files.DestinationError, match="already exists"):
        heads.export(work, tmp_path / "file")
    assert intact(made) and (tmp_path / "file").read_bytes() == b"x"
    assert not leftovers(tmp_path) and not leftovers(exports)


def test_export_replaces_a_previous_export_and_loads(tmp_path, stories):
    work, _ = workdir_copy(tmp_path)
    legacy = tmp_path / "legacy"  # an export made before export.json existed (the committed heads)
    shutil.copytree(COMMITTED, legacy)
    for dest in (tmp_path / "out", tmp_path / "out", legacy):
        assert heads.export(work, dest) == dest
        assert json.loads((dest / heads.EXPORT).read_text())["step"] == 2000
        assert not (dest / "checkpoints" / "2000" / "opt_state").exists()
    (tmp_path / "empty").mkdir()
    heads.export(work, tmp_path / "empty")  # an empty directory holds nothing to lose
    meta, _, params = heads.load_heads(tmp_path / "out", stories.cfg, stories.params)
    _, _, original = heads.load_heads(COMMITTED, stories.cfg, stories.params)
    assert meta["method"] == "medusa"
    jax.tree.map(np.testing.assert_array_equal, params, original)
    assert not leftovers(tmp_path)


def test_interrupted_export_leaves_nothing_and_retries(tmp_path, monkeypatch):
    work, _ = workdir_copy(tmp_path)
    heads.export(work, tmp_path / "out")
    before = {f: f.read_bytes() for f in (tmp_path / "out").rglob("*") if f.is_file()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copy2", full_disk)
    for dest in (tmp_path / "new", tmp_path / "out"):
        with pytest.raises(OSError, match="No space left"):
            heads.export(work, dest)
    assert not (tmp_path / "new").exists() and intact(before)  # the previous export is untouched
    assert not leftovers(tmp_path)
    monkeypatch.undo()
    heads.export(work, tmp_path / "new")
    assert (tmp_path / "new" / heads.META).exists()


def test_leftover_of_a_killed_export_is_ignored_and_removed(tmp_path):
    work, _ = workdir_copy(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    partial = tmp_path / f".out.partial-{files.HOST}-{dead.pid}-0123abcd"
    (partial / "checkpoints").mkdir(parents=True)  # what `kill -9` during an export leaves
    heads.export(work, tmp_path / "out")
    assert not partial.exists() and (tmp_path / "out" / heads.EXPORT).exists()


# --- checkpoint.save_model / specjax.convert ------------------------------------------------------------


def test_convert_never_writes_over_a_directory_and_retries_cleanly(tmp_path, stories, monkeypatch):
    made = sentinels(tmp_path / "mine")
    with pytest.raises(files.DestinationError, match="mine already exists; choose a new destination"):
        checkpoint.save_model(tmp_path / "mine", stories.cfg, stories.params)
    assert intact(made) and sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt", "sub"]

    real_copy = shutil.copy2
    monkeypatch.setattr(shutil, "copy2", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_model(tmp_path / "ckpt", stories.cfg, stories.params, tokenizer_files(stories.path))
    assert not (tmp_path / "ckpt").exists() and not leftovers(tmp_path)  # nothing passes for a checkpoint
    monkeypatch.setattr(shutil, "copy2", real_copy)
    path = checkpoint.save_model(
        tmp_path / "ckpt", stories.cfg, stories.params, tokenizer_files(stories.path)
    )
    cfg, _, params = checkpoint.restore_model(path)
    assert cfg == stories.cfg
    assert checkpoint.identity(path, cfg, params) == checkpoint.model_identity(
        cfg, checkpoint.params_digest(stories.params)
    )


def test_convert_cli_refuses_an_existing_directory(tmp_path):
    made = sentinels(tmp_path / "dest")
    out = subprocess.run(
        [sys.executable, "-m", "specjax.convert", "stories260K", str(tmp_path / "dest")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and intact(made), out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in out.stderr
    assert "dest already exists; choose a new destination" in out.stderr


# --- corpus cache ---------------------------------------------------------------------------------------


def test_corpus_cache_is_rebuilt_when_source_setting_or_target_changes(tmp_path, stories, text_source):
    target = (stories.cfg, stories.graphdef, stories.params)
    source = tmp_path / "docs.txt"
    source.write_text(text_source.read_text())
    config = config_for("unused", source)
    config.data.cache = str(tmp_path / "cache" / "corpus.npy")

    def load(target_id="A", **change):
        c = config.copy_and_resolve_references()
        for k, v in change.items():
            setattr(c.data, k, v)
        return data.load_corpus(c, target, stories.tokenizer, target_id)

    def fresh(**change):
        c = config.copy_and_resolve_references()
        c.data.cache = ""
        for k, v in change.items():
            setattr(c.data, k, v)
        return data.load_corpus(c, target, stories.tokenizer)

    first = load().tokens
    np.testing.assert_array_equal(first, fresh().tokens)
    assert np.load(config.data.cache).shape == (2, *first.shape)
    record = json.loads(Path(config.data.cache + ".json").read_text())
    assert record["provenance"]["source"]["sha256"] == files.sha256_file(source)

    source.write_text(source.read_text().replace("ball", "kite"))  # another text
    np.testing.assert_array_equal(load().tokens, fresh().tokens)
    assert not np.array_equal(load().tokens, first)
    np.testing.assert_array_equal(load(seq_len=16).tokens, fresh(seq_len=16).tokens)  # another setting
    assert load(seq_len=16).tokens.shape[1] == 16
    load(target_id="B")  # another target: rebuilt (the provenance now names B)
    assert json.loads(Path(config.data.cache + ".json").read_text())["provenance"]["target"] == "B"

    # A write killed half-way (provenance written, tokens truncated) is rebuilt, never read.
    cache = Path(config.data.cache)
    cache.write_bytes(cache.read_bytes()[:100])
    np.testing.assert_array_equal(load(target_id="B", seq_len=16).tokens, fresh(seq_len=16).tokens)
    assert not leftovers(cache.parent)


def test_corpus_cache_is_rebuilt_when_the_tokenizer_changes(tmp_path, stories, text_source):
    """The same target and text tokenised by a tokenizer whose vocabulary swaps two pieces' ids: the cache is
    rebuilt (its tokens are the new tokenizer's, two ids swapped); a tokenizer naming no files is refused."""
    from specjax.models.loading import load_tokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for f in tokenizer_files(stories.path):
        shutil.copy(f, folder)
    target = (stories.cfg, stories.graphdef, stories.params)
    config = config_for("unused", text_source)
    config.data.cache = str(tmp_path / "corpus.npy")
    load = lambda: data.load_corpus(config, target, load_tokenizer(folder, stories.cfg.vocab_size), "A")
    first = load().tokens
    a, b = np.argsort(np.bincount(first.ravel()))[-2:]  # the two commonest ids
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    piece = {i: p for p, i in vocab.items()}
    vocab[piece[a]], vocab[piece[b]] = int(b), int(a)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    swapped = np.where(first == a, b, np.where(first == b, a, first))
    np.testing.assert_array_equal(load().tokens, swapped)

    class Unnamed:  # a tokenizer of the caller's own, without the files it was read from
        bos_id, eos_id = 1, 2

        def encode(self, text):
            return stories.tokenizer.encode(text)

    with pytest.raises(data.DataError, match=r"names no files it was read from: .* or set data.cache=''"):
        data.load_corpus(config, target, Unnamed(), "A")


def test_corpus_cache_never_overwrites_a_foreign_file(tmp_path, stories, text_source):
    config = config_for("unused", text_source)
    config.data.cache = str(tmp_path / "mine.npy")
    np.save(tmp_path / "mine.npy", np.arange(10))
    before = (tmp_path / "mine.npy").read_bytes()
    target = (stories.cfg, stories.graphdef, stories.params)
    with pytest.raises(files.DestinationError, match="mine.npy exists without its provenance"):
        data.load_corpus(config, target, stories.tokenizer, "A")
    assert (tmp_path / "mine.npy").read_bytes() == before


def test_token_ids_outside_the_vocabulary_are_an_error(tmp_path, stories, text_source):
    class Foreign:  # a tokenizer that does not belong to the target
        bos_id, eos_id = 1, 2

        def encode(self, text):
            return [1] + [600] * 40

    config = config_for("unused", text_source)
    target = (stories.cfg, stories.graphdef, stories.params)
    with pytest.raises(data.DataError, match=r"token id 600, outside the target's vocabulary \[0, 512\)"):
        data.load_corpus(config, target, Foreign(), "A")
    # A cache edited by hand (its hash updated too) is checked as well.
    config.data.cache = str(tmp_path / "corpus.npy")
    tokens = data.load_corpus(config, target, stories.tokenizer, "A").tokens
    tokens[3, 5] = -1
    np.save(tmp_path / "corpus.npy", np.stack([tokens, np.ones_like(tokens)]))
    record = json.loads((tmp_path / "corpus.npy.json").read_text())
    record["sha256"] = files.sha256_file(tmp_path / "corpus.npy")
    (tmp_path / "corpus.npy.json").write_text(json.dumps(record))
    with pytest.raises(data.DataError, match="corpus.npy holds token id -1"):
        data.load_corpus(config, target, stories.tokenizer, "A")


# --- feature store --------------------------------------------------------------------------------------


def test_feature_store_of_another_target_or_corpus_is_refused(tmp_path, stories, text_source):
    target = (stories.cfg, stories.graphdef, stories.params)
    config = config_for("unused", text_source)
    config.data.features, config.data.store = "store", str(tmp_path / "store")
    corpus = data.load_corpus(config, target, stories.tokenizer, "A")
    store = trainer._feature_store(config, target, corpus, "A")
    np.testing.assert_array_equal(store.tokens, corpus.tokens)
    np.testing.assert_array_equal(store.loss_mask, corpus.loss_mask)
    assert trainer._feature_store(config, target, corpus, "A").manifest == store.manifest  # reused
    with pytest.raises(files.ProvenanceError, match="store was built from another target than this run's"):
        trainer._feature_store(config, target, corpus, "B")
    with pytest.raises(files.ProvenanceError, match="store was built from another corpus than this run's"):
        trainer._feature_store(config, target, data.Corpus(*(a[1:] for a in corpus)), "A")
    masked = data.Corpus(corpus.tokens, corpus.loss_mask * (np.arange(corpus.tokens.shape[1]) % 2))
    with pytest.raises(
        files.ProvenanceError, match="store was built from another loss mask than this run's"
    ):
        trainer._feature_store(config, target, masked, "A")
    config.matmul_precision = "high"  # features computed at float32's full precision (the dtype rule)
    with pytest.raises(
        files.ProvenanceError, match="store was built from another matmul precision than this run's"
    ):
        trainer._feature_store(config, target, corpus, "A")
    config.matmul_precision = "highest"  # what the dtype rule resolved to: the same store
    assert trainer._feature_store(config, target, corpus, "A").manifest == store.manifest
    # A store folder that is not a finished store (the user's, or one specjax did not write) is never touched.
    made = sentinels(tmp_path / "other")
    (tmp_path / "other" / "tokens.npy").write_bytes(b"mine")
    made[tmp_path / "other" / "tokens.npy"] = b"mine"
    config.data.store = str(tmp_path / "other")
    with pytest.raises(files.DestinationError, match="other already exists"):
        trainer._feature_store(config, target, corpus, "A")
    assert intact(made) and not leftovers(tmp_path)


# --- settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.keep_checkpoints", 0, "keep_checkpoints=0 must be >= 1"),
        ("train.keep_checkpoints", -2, "keep_checkpoints=-2 must be >= 1"),
        ("train.steps", 0, "train.steps=0 must be >= 1"),
        ("train.batch_size", 0, "batch_size=0 must be >= 1"),
        ("train.log_every", 0, "log_every=0 must be >= 1"),
        ("train.checkpoint_every", -1, "checkpoint_every=-1 must be >= 1"),
        ("data.seq_len", 1, "seq_len=1 must be >= 2"),
        ("optimizer.lr", 0.0, "lr=0.0 must be > 0"),
        ("optimizer.lr", -1e-3, "lr=-0.001 must be > 0"),
        ("optimizer.lr", float("nan"), "lr=nan is not a finite number"),
        ("optimizer.warmup_steps", -5, "warmup_steps=-5 must be >= 0"),
        ("data.num_samples", 0, "num_samples=0 must be >= 1"),
        ("data.source", "/no/such/file.txt", "neither 'self_distill' nor an existing"),
        ("heads.decay", 0.0, "heads.decay=0.0 must be > 0"),
        ("heads.num_heads", 0, "heads.num_heads=0 must be >= 1"),
        ("method", "eagle", "heads keys ['decay', 'num_heads', 'num_layers'] are not the eagle settings"),
        (
            "method",
            "ngram",
            "method='ngram' is not one of ['dflash', 'distill', 'eagle', 'eagle3', 'medusa']",
        ),
    ],
)
def test_bad_settings_fail_before_anything_runs(key, value, message, tmp_path):
    config = smoke(base_config("medusa"))
    config.target = str(tmp_path / "nowhere")  # validation comes before the target is even looked for
    *section, name = key.split(".")
    setattr(config[section[0]] if section else config, name, value)
    with pytest.raises(TrainingConfigError, match=re.escape(message)):
        trainer.train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_head_settings_come_from_the_drafters_dataclass():
    for method in registry.head_methods():
        settings = registry.trained(method).settings
        assert base_config(method).heads.to_dict() == dataclasses.asdict(settings())
        assert set(settings.RULES) <= set(base_config(method).heads.keys())


def test_sequence_beyond_the_targets_context(target_dir, text_source, tmp_path):
    config = config_for(target_dir, text_source)
    config.data.seq_len = 600
    with pytest.raises(TrainingConfigError, match="seq_len=600 exceeds the target's context of 512"):
        trainer.train(config, tmp_path / "run")


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "train_heads.py", "--config=configs/medusa.py:smoke", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(out, *needles):
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert last.startswith("error: ") and all(n in last for n in needles), last


def test_cli_keep_zero_is_one_line_error(tmp_path):
    out = cli(f"--workdir={tmp_path / 'run'}", "--config.train.keep_checkpoints=0")
    one_line_error(out, "keep_checkpoints=0 must be >= 1")


# --- the workdir: lock, recorded config, non-finite loss ------------------------------------------------


def test_second_run_in_a_locked_workdir_is_refused(tmp_path, target_dir):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from specjax import files\n"
            f"with files.locked({str(tmp_path / 'run')!r}):\n"
            "    print('held', flush=True); time.sleep(600)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = json.loads((tmp_path / "run" / files.LOCK).read_text())
        assert lock["pid"] == holder.pid
        with pytest.raises(files.LockedError, match=f"run is in use by process {holder.pid}"):
            trainer.train(config_for(target_dir, "self_distill"), tmp_path / "run")
        out = cli(f"--workdir={tmp_path / 'run'}", f"--config.target={target_dir}")
        one_line_error(out, "is in use by process", str(holder.pid), "use another --workdir")
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    with files.locked(tmp_path / "run"):  # killed: the lock is free again
        pass


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / files.LOCK).write_text(json.dumps({"pid": dead.pid, "host": files.HOST, "since": "then"}))
    warnings = []
    monkeypatch.setattr(files.logging, "warning", lambda msg, *args: warnings.append(msg % args))
    with files.locked(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with (
            pytest.raises(files.LockedError, match=f"in use by process {os.getpid()}"),
            files.locked(tmp_path),
        ):
            pass
    assert len(warnings) == 1 and f"stale lock {lock} of process {dead.pid}" in warnings[0]
    assert lock.read_text() == ""  # released
    with files.locked(tmp_path):
        pass
    assert len(warnings) == 1  # a released lock is not stale


@pytest.fixture(scope="module")
def trained(target_dir, text_source, tmp_path_factory):
    """A workdir trained for 3 steps (checkpoint at step 3) on a text corpus."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    config = config_for(target_dir, text_source)
    config.train.steps = 3
    assert trainer.train(config, workdir)["step"] == 3
    return workdir, config


def test_resume_with_another_config_is_refused(trained, other_target_dir, tmp_path):
    workdir, config = trained
    recorded = json.loads((workdir / trainer.CONFIG).read_text())
    assert recorded["config"]["optimizer.lr"] == config.optimizer.lr and recorded["target_id"]
    changed = config.copy_and_resolve_references()
    changed.optimizer.lr = 3e-3
    with pytest.raises(
        files.ProvenanceError, match=r"optimizer.lr: 0.001 -> 0.003.*allow_config_change=True"
    ):
        trainer.train(changed, workdir)
    other = config.copy_and_resolve_references()
    other.target = str(other_target_dir)
    with pytest.raises(files.ProvenanceError, match=r"another config \(target \(identity\)"):
        trainer.train(other, workdir)
    assert json.loads((workdir / trainer.CONFIG).read_text()) == recorded
    operational = config.copy_and_resolve_references()
    operational.train.log_every, operational.train.keep_checkpoints = 5, 2
    assert trainer.train(operational, workdir)["step"] == 3  # nothing left to train, nothing refused
    changed.train.allow_config_change = True
    assert trainer.train(changed, workdir)["step"] == 3
    assert json.loads((workdir / trainer.CONFIG).read_text())["config"]["optimizer.lr"] == 3e-3
    assert (workdir / files.LOCK).read_text() == ""


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    target_dir, text_source, tmp_path, monkeypatch
):
    config = config_for(target_dir, text_source)
    config.train.steps, config.train.checkpoint_every = 10, 2
    real = trainer.loss_fn
    poisoned = jax.random.key_data(jax.random.fold_in(jax.random.key(config.seed), 3))  # the 4th step's key

    def loss_fn(*args):
        inner = real(*args)

        def loss(params, target_params, tokens, mask, feats, key):
            value, metrics = inner(params, target_params, tokens, mask, feats, key)
            value = jnp.where(jnp.all(jax.random.key_data(key) == poisoned), jnp.nan, value)
            return value, metrics | {"loss": value}

        return loss

    monkeypatch.setattr(trainer, "loss_fn", loss_fn)
    with pytest.raises(
        trainer.NonFiniteLossError, match="non-finite at step 4, .*last good checkpoint, step 2"
    ):
        trainer.train(config, tmp_path / "run")
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2]
    logged = [
        json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(logged) == 3 and all(np.isfinite(logged))
    assert (tmp_path / "run" / files.LOCK).read_text() == ""


def test_a_head_setting_added_since_resumes_at_its_default(trained):
    """A workdir recorded before a head setting existed resumes while the setting keeps its default (what the
    older run trained with), and records it; set otherwise, it is a changed config."""
    workdir, config = trained
    path = workdir / trainer.CONFIG
    recorded = json.loads(path.read_text())
    config = config.copy_and_resolve_references()
    config.optimizer.lr = recorded["config"]["optimizer.lr"]  # as the workdir holds it after the test above
    defaults = dataclasses.asdict(registry.trained(config.method).settings())
    key = next(
        f"heads.{k}" for k, v in defaults.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    assert recorded["config"][key] == defaults[key[6:]]
    older = {**recorded, "config": {k: v for k, v in recorded["config"].items() if k != key}}
    path.write_text(json.dumps(older))
    assert trainer.train(config, workdir)["step"] == 3
    assert json.loads(path.read_text())["config"][key] == defaults[key[6:]]  # recorded now
    path.write_text(json.dumps(older))
    changed = config.copy_and_resolve_references()
    changed.heads[key[6:]] = defaults[key[6:]] * 2 + 1
    with pytest.raises(files.ProvenanceError, match=rf"{key}: .* -> "):
        trainer.train(changed, workdir)
    path.write_text(json.dumps(recorded))
