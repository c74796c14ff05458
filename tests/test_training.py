"""Training heads on stories260K: the loss falls, the target is untouched, resuming is exact, half-written
checkpoints are ignored, 8 devices train like 1, the feature store trains like online features, clear errors."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import child_env, cpu_env
from helpers import compile_training_once, run_processes
from tolerance import LAYER_DEPTH, assert_close, assert_far, forward_depth

from specjax import checkpoint, files, heads
from specjax.drafters.eagle3 import frequent_tokens
from specjax.models.loading import tokenizer_files
from specjax.models.weights import CheckpointError
from specjax.training import data, trainer
from specjax.training.config import TrainingConfigError, base_config, smoke

REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def target_dir(stories, tmp_path_factory):
    """stories260K as a specjax (Orbax) checkpoint, as `python -m specjax.convert` writes it."""
    path = tmp_path_factory.mktemp("target") / "stories260K"
    checkpoint.save_model(path, stories.cfg, stories.params, tokenizer_files(stories.path))
    return path


@pytest.fixture(scope="module")
def corpus(target_dir, tmp_path_factory):
    """A small self-distilled corpus, built once and shared through `data.cache`."""
    config = smoke_config("medusa", target_dir)
    config.data.cache = str(tmp_path_factory.mktemp("corpus") / "corpus.npy")
    cfg, graphdef, params = checkpoint.restore_model(target_dir)
    from specjax.models.loading import load_tokenizer

    data.load_corpus(
        config, (cfg, graphdef, params), load_tokenizer(target_dir / "tokenizer", cfg.vocab_size)
    )
    return config.data.cache


def smoke_config(method, target_dir, corpus_path=""):
    c = smoke(base_config(method))
    c.target = str(target_dir)
    c.data.cache = corpus_path
    c.train.log_every = 1
    return c


def training_depth(steps: int) -> int:
    """Rounding stages behind a loss or a weight after `steps` steps: the target's features (stories260K), the
    head's forward and loss, and each optimiser step, which carries the earlier steps' rounding forward once."""
    return forward_depth(5) + LAYER_DEPTH + 4 + steps


def losses(workdir):
    return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_smoke_training_lowers_loss_and_leaves_target_bit_identical(
    method, target_dir, corpus, tmp_path, monkeypatch
):
    loaded = {}

    def spy(config, mesh):  # keep the trainer's in-memory target to compare after training
        loaded["target"], tok = real_load(config, mesh)
        loaded["before"] = jax.tree.map(np.array, loaded["target"][2])
        return loaded["target"], tok

    real_load, real_loss_fn, noises = trainer.load_target, trainer.loss_fn, []
    monkeypatch.setattr(trainer, "load_target", spy)
    monkeypatch.setattr(  # the losses built: training's, then the held-out metrics'
        trainer,
        "loss_fn",
        lambda meta, c, *a: noises.append(c.heads.get("noise")) or real_loss_fn(meta, c, *a),
    )
    config = smoke_config(method, target_dir, corpus)
    summary = trainer.train(config, tmp_path)
    assert summary["step"] == 30
    if method == "eagle":  # held out: the features as decoding feeds them, without training's noise
        assert noises == [config.heads.noise, 0.0] and config.heads.noise > 0
    trajectory = losses(tmp_path)
    assert np.mean(trajectory[-5:]) < 0.9 * np.mean(trajectory[:5]), trajectory
    after = jax.tree.map(np.array, loaded["target"][2])  # fails if the train step donated the target
    jax.tree.map(np.testing.assert_array_equal, loaded["before"], after)
    _, _, on_disk = checkpoint.restore_model(target_dir)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, on_disk), after)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_equals_uninterrupted_and_ignores_half_written(
    target_dir, corpus, tmp_path, stories, monkeypatch
):
    compile_training_once(monkeypatch)
    config = smoke_config("eagle", target_dir, corpus)
    config.train.steps, config.train.checkpoint_every = 12, 4
    trainer.train(config, tmp_path / "straight")
    trainer.train(config, tmp_path / "resumed", stop_at=6)  # "interrupted" after step 6: it saves step 6
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [4, 6]
    junk = ckpts / "10.orbax-checkpoint-tmp-1795000000"  # a save killed half-way
    junk.mkdir()
    (junk / "params").mkdir()
    (junk / "params" / "partial").write_bytes(b"\0" * 10)
    _, _, at_six = heads.load_heads(tmp_path / "resumed", stories.cfg, stories.params)
    shutil.copytree(tmp_path / "resumed", tmp_path / "damaged")
    for f in (tmp_path / "damaged" / "checkpoints" / "6" / "opt_state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot resume from step 6 .* delete that step directory"):
        trainer.train(config, tmp_path / "damaged")
    trainer.train(config, tmp_path / "resumed")  # restarts from step 6, not from the half-written 10
    _, _, straight = heads.load_heads(tmp_path / "straight", stories.cfg, stories.params)
    _, _, resumed = heads.load_heads(tmp_path / "resumed", stories.cfg, stories.params)
    # the same programs on the same data: bit for bit
    jax.tree.map(np.testing.assert_array_equal, straight, resumed)
    assert losses(tmp_path / "resumed")[6:] == losses(tmp_path / "straight")[6:]
    flat = lambda tree: np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    assert_far(
        flat(at_six), flat(straight), dtype=np.float32
    )  # a control: six more steps moved the weights


def test_init_from_starts_a_run_from_trained_heads(target_dir, corpus, tmp_path, stories, monkeypatch):
    """A new run with train.init_from starts from those heads' parameters (its first update is 0: the warmup starts
    at lr 0), one without it from a random start (control); its export keeps its config and log; heads of another
    shape are refused."""
    compile_training_once(monkeypatch)
    source = REPO / "heads" / "stories260K_medusa"
    _, _, committed = heads.load_heads(source, stories.cfg, stories.params)
    flat = lambda tree: np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    config = smoke_config("medusa", target_dir, corpus)
    config.train.steps = 1
    first_loss = {}
    for name, init_from in (("continued", str(source)), ("fresh", "")):
        config.train.init_from = init_from
        trainer.train(config, tmp_path / name)
        _, _, params = heads.load_heads(tmp_path / name, stories.cfg, stories.params)
        first_loss[name] = losses(tmp_path / name)[0]
        if init_from:
            jax.tree.map(np.testing.assert_array_equal, committed, params)
        else:
            assert_far(flat(committed), flat(params), dtype=np.float32)
    assert first_loss["continued"] < 0.9 * first_loss["fresh"], first_loss
    exported = heads.export(
        tmp_path / "continued", tmp_path / "exported"
    )  # keeps how the heads were trained
    for record in heads.RUN_RECORDS:
        assert (exported / record).read_bytes() == (tmp_path / "continued" / record).read_bytes()
    other = tmp_path / "other"
    shutil.copytree(source, other)
    meta = json.loads((other / "heads.json").read_text())
    meta["shape"]["num_heads"] = 2
    (other / "heads.json").write_text(json.dumps(meta))
    config.train.init_from = str(other)
    with pytest.raises(
        TrainingConfigError, match="init_from=.* holds other heads .*shape.*num_heads.: 2.*num_heads.: 4"
    ):
        trainer.train(config, tmp_path / "refused")
    config.train.init_from = str(tmp_path / "nowhere")
    with pytest.raises(TrainingConfigError, match="train.init_from=.*nowhere.* names no heads folder"):
        trainer.train(config, tmp_path / "refused")


def dflash_block_outputs(stories, meta, params, text="Once upon a time there was a little dog"):
    """A DFlash head's block logits (Markov-biased) and confidence logits after `text`'s context."""
    from flax import nnx

    from specjax.drafters.dflash import dflash_block, dflash_extend, draft_config
    from specjax.models.llama import init_cache
    from specjax.training.losses import target_features

    graphdef = heads.new_heads(meta, stories.cfg, stories.params)[0]
    tokens = jnp.asarray([stories.tokenizer.encode(text)], jnp.int32)
    n, block = tokens.shape[1] - 1, meta["shape"]["block_size"]
    feats = target_features(
        stories.cfg, stories.graphdef, stories.params, tokens, tuple(meta["shape"]["layers"])
    )
    dparams = heads.drafter_params(meta, params, stories.cfg, stories.params)
    cache = init_cache(draft_config(stories.cfg, meta["shape"]), 1, 32)
    taps = feats[:, :n, : len(meta["shape"]["layers"]) * stories.cfg.dim]
    cache = dflash_extend(graphdef, dparams, taps, jnp.arange(n)[None], cache).with_length(jnp.array([n]))
    tokens_B = jnp.concatenate([tokens[:, n:], jnp.zeros((1, block - 1), jnp.int32)], 1)
    logits, x = dflash_block(graphdef, dparams, tokens_B, n + jnp.arange(block)[None], cache)
    head = nnx.merge(graphdef, dparams["head"])
    return jnp.concatenate([logits + head.bias(tokens_B), head.acceptance(x, tokens_B)], -1)


def test_init_from_takes_heads_with_the_same_arrays(stories):
    """A DFlash run at block 8 may start from the committed head trained at block 16 (a block size changes no array)
    and gets its parameters; a deeper run starts from them with its new layer silent, drafting what they draft (a
    control: the same layer not silenced drafts otherwise); a shallower run may not, nor one tapping other target
    layers (the same arrays, meaning other features)."""
    source = REPO / "heads" / "stories260K_dflash_tvd"
    theirs = heads.read_meta(source)
    _, _, committed = heads.load_heads(source, stories.cfg, stories.params)
    start = lambda meta: trainer.start_from(
        str(source),
        meta,
        heads.new_heads(meta, stories.cfg, stories.params)[1],
        stories.cfg,
        stories.params,
    )
    block8 = json.loads(json.dumps(theirs))
    block8["shape"]["block_size"] = 8
    jax.tree.map(np.testing.assert_array_equal, committed, start(block8))
    deeper = json.loads(json.dumps(theirs))
    deeper["shape"]["n_layers"] = 3
    grown, fresh = start(deeper), heads.new_heads(deeper, stories.cfg, stories.params)[1]
    kept = {**grown, "layers": {i: grown["layers"][i] for i in committed["layers"]}}
    jax.tree.map(np.testing.assert_array_equal, kept, committed)
    new_layer = grown["layers"][2]
    assert not np.any(new_layer["wo"]["weight"]) and not np.any(new_layer["w_down"]["weight"])
    drafted = dflash_block_outputs(stories, theirs, committed)
    depth = forward_depth(3)
    assert_close(dflash_block_outputs(stories, deeper, grown), drafted, dtype=np.float32, depth=depth)
    unsilenced = {**grown, "layers": {**grown["layers"], 2: fresh["layers"][2]}}
    assert_far(dflash_block_outputs(stories, deeper, unsilenced), drafted, dtype=np.float32, depth=depth)
    shallower = json.loads(json.dumps(theirs))
    shallower["shape"]["n_layers"] = 1
    with pytest.raises(TrainingConfigError, match="init_from=.* holds other heads .*'n_layers': 2"):
        start(shallower)
    other_taps = json.loads(json.dumps(block8))  # the same arrays, read from other target layers
    other_taps["shape"]["layers"] = [1, 2, 3]
    with pytest.raises(TrainingConfigError, match=r"arrays mean other things .* their \['layers'\] differ"):
        start(other_taps)


def test_sigterm_saves_the_current_step(target_dir, corpus, tmp_path):
    """A preempted run (SIGTERM) keeps every step it finished, with no periodic checkpoint due."""
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "train_heads.py",
            "--config=configs/medusa.py:smoke",
            f"--workdir={workdir}",
            f"--config.target={target_dir}",
            f"--config.data.cache={corpus}",
            "--config.train.steps=100000",
            "--config.train.checkpoint_every=100000",
            "--config.train.log_every=1",
        ],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 240
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    logged = len(metrics.read_text().splitlines())
    saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    assert (
        logged >= 3 and len(saved) == 1 and saved[0] in (logged, logged + 1)
    )  # signal between step and log


def test_the_draft_vocabulary_is_counted_on_the_training_rows_alone(target_dir, tmp_path):
    """EAGLE-3's reduced draft vocabulary: the held-out rows (the corpus's last, here spelling a word the training
    rows never use) do not enter its count."""
    source = tmp_path / "docs.txt"
    source.write_text("Tom and Lily went to the park to play.\n" * 60 + "Zyx qvzx jqwk!\n" * 10)
    config = smoke_config("eagle3", target_dir)
    config.data.source, config.data.heldout, config.heads.draft_vocab, config.train.steps = (
        str(source),
        8,
        24,
        1,
    )
    trainer.train(config, tmp_path / "work")
    draft_ids = json.loads((tmp_path / "work" / heads.META).read_text())["shape"]["draft_ids"]
    from specjax.models.loading import load_tokenizer

    tokenizer = load_tokenizer(target_dir / "tokenizer", 512)
    corpus = data.load_corpus(config, checkpoint.restore_model(target_dir), tokenizer, "A")
    train, heldout = corpus.tokens[:-8], corpus.tokens[-8:]
    unseen = set(np.unique(heldout)) - set(np.unique(train))
    assert unseen and not unseen & set(draft_ids)
    assert draft_ids == frequent_tokens(train, 24, 512)
    assert unseen & set(
        frequent_tokens(corpus.tokens, 24, 512)
    )  # the control: counted with the held-out rows


def test_feature_store_trains_like_online_features(target_dir, corpus, tmp_path):
    """EAGLE-3 with a reduced draft vocabulary: the store holds the tapped layers beside the final features, and
    the draft vocabulary is the corpus's most frequent tokens."""
    configs = [smoke_config("eagle3", target_dir, corpus) for _ in range(2)]
    for c in configs:
        c.train.steps, c.heads.layers, c.heads.draft_vocab, c.heads.unroll = 8, (0, 2, 4), 128, 3
    online, stored = configs
    stored.data.features, stored.data.store = "store", str(tmp_path / "store")
    trainer.train(online, tmp_path / "online")
    trainer.train(stored, tmp_path / "stored")
    manifest = json.loads((tmp_path / "store" / data.MANIFEST).read_text())
    assert manifest["bytes_per_token"] == 4 * 64 * 4 + 5  # 3 tapped layers, the final features, token, mask
    assert manifest["provenance"]["feature_layers"] == [0, 2, 4]
    assert manifest["rows"] == np.load(corpus).shape[1]
    # features stored once against features computed in each step's batch: the same values to float32 rounding
    depth = training_depth(stored.train.steps)
    assert_close(losses(tmp_path / "stored"), losses(tmp_path / "online"), dtype=np.float32, depth=depth)
    meta = json.loads((tmp_path / "stored" / heads.META).read_text())
    assert meta["shape"]["draft_ids"] == frequent_tokens(np.load(corpus)[0], 128, 512)
    stored.heads.layers = (1, 2, 4)  # the same store, other layers: refused
    with pytest.raises(files.ProvenanceError, match="built from another set of feature layers"):
        trainer.train(stored, tmp_path / "other")


def test_eight_devices_train_like_one(target_dir, corpus, tmp_path):
    """Runs in its own process: the device count is fixed when JAX starts."""
    env = cpu_env(8)
    script = REPO / "tests" / "sharded_training.py"
    out = subprocess.run(
        [sys.executable, str(script), str(target_dir), corpus, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["devices"] == 8
    for mesh in ("data8", "data4_model2"):
        assert len(runs[mesh]) == 8
        # sums over the data and model shards in another order
        assert_close(runs[mesh], runs["data1"], dtype=np.float32, depth=training_depth(8), err_msg=mesh)


def test_two_processes_train_like_one(target_dir, corpus, tmp_path, stories):
    """train_heads.py as 2 processes of 2 CPU devices (jax.distributed, gloo) against 1 process of 4: the same
    losses, one set of workdir records and logs, the same checkpoint, which restores onto one device."""

    def command(workdir):
        return [
            sys.executable, str(REPO / "train_heads.py"), "--config=configs/eagle.py:smoke", f"--workdir={workdir}",
            f"--config.target={target_dir}", f"--config.data.cache={corpus}", "--config.train.steps=6",
            "--config.train.log_every=1", "--config.train.batch_size=16", "--config.mesh.data=4",
        ]  # fmt: skip

    one = subprocess.run(
        command(tmp_path / "one"), env=cpu_env(4), capture_output=True, text=True, timeout=600
    )
    assert one.returncode == 0, one.stderr[-3000:]
    outs = run_processes(command(tmp_path / "two"), devices=2)
    summaries = [[line for line in out.splitlines() if line.startswith("step=")] for out in outs]
    assert len(summaries[0]) == 1 and summaries[0][0].startswith("step=6") and not summaries[1]  # process 0
    depth = training_depth(6)  # the gradients' sums across two processes in another order
    assert_close(losses(tmp_path / "two"), losses(tmp_path / "one"), dtype=np.float32, depth=depth)
    assert len(losses(tmp_path / "two")) == 6  # one log line per step: process 0 alone wrote them
    restored = [heads.load_heads(tmp_path / w, stories.cfg, stories.params)[2] for w in ("one", "two")]
    for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1]), strict=True):
        assert_close(a, b, dtype=np.float32, depth=depth)


def test_data_sources_and_order(tmp_path, stories):
    (tmp_path / "docs.txt").write_text("Once upon a time.\n\nThe cat sat.\n")
    (tmp_path / "docs.jsonl").write_text(
        '{"text": "Once upon a time."}\n{"prompt": "The cat", "response": " sat."}\n'
    )
    txt = data.read_documents(tmp_path / "docs.txt", stories.tokenizer)
    assert txt == [stories.tokenizer.encode("Once upon a time."), stories.tokenizer.encode("The cat sat.")]
    assert data.read_documents(tmp_path / "docs.jsonl", stories.tokenizer) == txt
    packed, mask = data.pack(txt * 10, 8)
    assert packed.shape == mask.shape == (sum(map(len, txt * 10)) // 8, 8)
    assert packed.ravel().tolist() == [t for d in txt * 10 for t in d][: packed.size]
    assert np.all(mask == 1)  # plain text: every token is trained
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected a JSON object with 'text'"):
        data.read_documents(tmp_path / "bad.jsonl", stories.tokenizer)
    # The order is a function of the position: epochs are permutations, batches straddle epochs.
    stream = np.concatenate([data.batch_indices(p, 4, 10, 0) for p in range(0, 20, 4)])
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    np.testing.assert_array_equal(data.batch_indices(6, 5, 10, 0), stream[6:11])


def test_clear_errors(target_dir, tmp_path, stories):
    """The library's errors; through the commands: test_bad_inputs (config keys) and test_pair (foreign heads)."""
    config = smoke_config("medusa", tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="target checkpoint .*nowhere not found .*specjax.convert"):
        trainer.train(config, tmp_path / "run")
    meta = heads.describe("medusa", {"num_heads": 2, "num_layers": 1}, stories.cfg.replace(vocab_size=1000))
    heads.write_meta(tmp_path / "foreign", meta)
    with pytest.raises(ValueError, match="trained for another target.*vocab_size.*1000, 512"):
        heads.load_heads(tmp_path / "foreign", stories.cfg, stories.params)
    with pytest.raises(CheckpointError, match="heads.json is missing or corrupt"):
        heads.load_heads(tmp_path / "empty", stories.cfg, stories.params)
    damaged = tmp_path / "damaged"
    shutil.copytree(REPO / "heads" / "stories260K_eagle", damaged)
    for f in (damaged / "checkpoints").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data files
            f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="cannot restore head parameters of step 2000 .* corrupt"):
        heads.load_heads(damaged, stories.cfg, stories.params)


def test_corpus_generation_says_how_far_it_is(stories, monkeypatch, caplog):
    """Self-distillation logs samples done of the total and the time left after each batch when lines may come
    that often, and the finished count; where lines may come only rarely, only the end (control)."""
    import logging

    target = (stories.cfg, stories.graphdef, stories.params)
    monkeypatch.setattr("specjax.cli.PROGRESS_S", 1e9)
    with caplog.at_level(logging.INFO):
        data.self_distill(*target, 1, 2, n_samples=5, max_len=4, temperature=1.0, seed=0, batch=2)
    assert [r.getMessage().split(",")[0] for r in caplog.records if "corpus" in r.getMessage()] == [
        "self-distilled corpus: 5/5 samples"
    ]
    caplog.clear()
    monkeypatch.setattr("specjax.cli.PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO):
        data.self_distill(*target, 1, 2, n_samples=5, max_len=4, temperature=1.0, seed=0, batch=2)
    lines = [r.getMessage() for r in caplog.records if "corpus" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == [
        f"self-distilled corpus: {n}/5 samples" for n in (2, 4, 5)
    ]
    assert lines[0].endswith(" left") and lines[-1].endswith("about 00:00 left")


def test_mixed_self_distillation_interleaves_rows_of_both_temperatures(stories, tmp_path):
    """data.mix_temperature adds as many documents at a second temperature, their rows alternating with the
    first's; the provenance names it only where set (caches built before it stay valid), and a text source
    refuses it."""
    from specjax.errors import TrainingConfigError
    from specjax.training.config import validate

    target = (stories.cfg, stories.graphdef, stories.params)
    config = smoke(base_config("dflash"))
    config.data.num_samples, config.data.sample_len, config.data.seq_len = 4, 48, 16

    def corpus(**change):
        c = config.copy_and_resolve_references()
        c.data.update(change)
        return data.load_corpus(c, target, stories.tokenizer, "A")

    sampled, greedy = corpus(), corpus(temperature=0.0)
    mixed = corpus(mix_temperature=0.0)
    n = min(len(sampled.tokens), len(greedy.tokens))
    assert n >= 2 and len(mixed.tokens) == len(sampled.tokens) + len(greedy.tokens)
    np.testing.assert_array_equal(mixed.tokens[: 2 * n : 2], sampled.tokens[:n])
    np.testing.assert_array_equal(mixed.tokens[1 : 2 * n : 2], greedy.tokens[:n])
    assert not np.array_equal(sampled.tokens[:n], greedy.tokens[:n])  # control: the two halves differ
    source = lambda c: data.corpus_provenance(c, "A")["source"]["self_distill"]
    assert "mix_temperature" not in source(config)
    config.data.mix_temperature = 0.25
    assert source(config)["mix_temperature"] == 0.25
    config.data.source = str(tmp_path / "docs.txt")
    (tmp_path / "docs.txt").write_text("Once upon a time.\n")
    with pytest.raises(
        TrainingConfigError, match="mix_temperature=0.25 mixes only self-distilled documents"
    ):
        validate(config)
    config.data.source = "self_distill"
    validate(config)
    for key in ("temperature", "mix_temperature"):  # greedy from BOS: one document, num_samples times
        greedy = config.copy_and_resolve_references()
        greedy.data[key] = 0.0
        with pytest.raises(TrainingConfigError, match=f"data.{key}=0.0 samples greedily"):
            validate(greedy)


def test_the_greedy_dflash_config_is_dflash_s_with_cold_documents_mixed_in():
    """configs/dflash_greedy.py trains configs/dflash.py's head on its corpus and as many documents at T = 0.25 (block
    positions weighted for B = 8)."""
    import runpy

    from specjax.training.config import flatten

    load = lambda name: flatten(runpy.run_path(str(REPO / "configs" / name))["get_config"]())
    sampled, greedy = load("dflash.py"), load("dflash_greedy.py")
    assert {k for k in sampled if sampled[k] != greedy[k]} == {
        "data.mix_temperature",
        "data.cache",
        "heads.decay",
    }
    assert (sampled["data.mix_temperature"], greedy["data.mix_temperature"]) == (-1.0, 0.25)


def test_the_tvd_dflash_config_fine_tunes_dflash_s_head_on_the_tvd_objective():
    """configs/dflash_tvd.py starts from the committed configs/dflash.py head (whose shape it keeps) and trains it on
    the TVD objective, on more documents, at a lower learning rate."""
    import runpy

    from specjax.training.config import flatten

    load = lambda name: flatten(runpy.run_path(str(REPO / "configs" / name))["get_config"]())
    base, tvd = load("dflash.py"), load("dflash_tvd.py")
    changed = {k: (base[k], tvd[k]) for k in base if base[k] != tvd[k]}
    assert set(changed) == {
        "train.init_from",
        "heads.divergence",
        "data.num_samples",
        "data.cache",
        "optimizer.lr",
        "optimizer.warmup_steps",
        "train.steps",
    }
    assert changed["train.init_from"] == ("", "heads/stories260K_dflash")
    assert changed["heads.divergence"] == ("forward_kl", "tvd")
    assert heads.read_meta(REPO / "heads" / "stories260K_dflash")["method"] == "dflash"


def test_progress_line_says_step_of_total_and_time_left(tmp_path):
    """A log line starts with the step out of the run's total and the time left at this run's pace so far: 10 of
    100 steps in 50 s leave about 7.5 minutes."""
    logger = trainer.Logger(tmp_path, step=0, end=100)
    try:
        logger.start -= 50.0
        assert logger.where(10) == "step 10/100 (10%), about 07:30 left"
        logger.start, logger.first = logger.start - 3600.0, 0  # past an hour: hours shown
        assert logger.where(10).endswith("about 09:07:30 left")
    finally:
        logger.close()
