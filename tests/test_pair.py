"""The pair check (`specjax.pair`): every kind of mismatch between a draft and a target is one line naming both
sides' values; matching pairs pass; the CLI ends a mismatch with one error line; run_decode and the trainer refuse a
mismatched pair before loading the target's weights or compiling anything."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from children import child_env
from helpers import cli, run_cli
from safetensors.numpy import save_file

from specjax import checkpoint, heads, pair, published
from specjax.errors import PairError
from specjax.models.config import SUPPORTED_MODEL_TYPES
from specjax.models.loading import tokenizer_files
from specjax.training import trainer
from specjax.training.config import base_config, smoke

REPO = Path(__file__).parents[1]
NAME = "stories260K"


def refused(stories, draft, *needles, cfg=None, tokenizer=None):
    """The one-line PairError of `draft` against stories260K (or `cfg`), checked to name every needle."""
    with pytest.raises(PairError) as caught:
        pair.check_pair(cfg or stories.cfg, tokenizer or stories.tokenizer, draft, NAME)
    message = str(caught.value)
    assert "\n" not in message and "; " in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def model_dir(stories, folder: Path, **changes) -> Path:
    """A draft model directory: stories260K's config.json with `changes` and its tokenizer (no weights: the check
    reads none)."""
    folder.mkdir()
    config = json.loads((stories.path / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(config))
    for file in tokenizer_files(stories.path):
        shutil.copy(file, folder)
    return folder


def dflash_dir(folder: Path, **config) -> Path:
    """A z-lab DFlash head as the check reads it: config.json and tensor names of the layout."""
    folder.mkdir()
    hf = {"hidden_size": 64, "vocab_size": 512, "num_target_layers": 5, "dflash_config": {}} | config
    (folder / "config.json").write_text(json.dumps(hf))
    tensors = {"hidden_norm.weight": np.zeros(64, np.float32)}
    save_file(
        tensors | {"layers.0.self_attn.q_norm.weight": np.zeros(8, np.float32)},
        folder / "model.safetensors",
    )
    return folder


class Respelled:
    """stories260K's tokenizer with one token spelled otherwise, or other special ids."""

    def __init__(self, tok, token=None, text="", **ids):
        self.tok, self.token, self.text = tok, token, text
        self.vocab_size, self.bos_id, self.eos_id = tok.vocab_size, tok.bos_id, tok.eos_id
        self.__dict__.update(ids)

    def decode(self, ids):
        return self.text if list(ids) == [self.token] else self.tok.decode(ids)


@pytest.fixture(scope="module")
def eagle3_export(stories, tmp_path_factory):
    """The committed stories260K EAGLE-3 heads in the EAGLE-3 authors' layout."""
    meta, _, params = heads.load_heads(REPO / "heads" / "stories260K_eagle3", stories.cfg, stories.params)
    dest = tmp_path_factory.mktemp("published") / "eagle3"
    return published.export_published(meta, params, dest, stories.cfg)


def edited(source: Path, dest: Path, **changes) -> Path:
    """A copy of a published head with its config.json changed."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text()) | changes
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    "draft, says",
    [
        ("heads/stories260K_eagle3", "eagle3 heads"),
        ("heads/stories260K_dflash", "reading target layers [0, 2, 4]"),
        ("heads/stories260K_medusa", "medusa heads"),
        ("heads/stories260K_distill", "draft model"),  # an exported distilled draft
        ("../shared/models/stories260K/llama2c/stories260K.bin", "draft model"),  # another tokenizer format
    ],
)
def test_matching_pairs_pass(stories, draft, says):
    report = str(pair.check_pair(stories.cfg, stories.tokenizer, REPO / draft, NAME))
    assert report.startswith("ok: ") and says in report and "fits stories260K (llama, 5 layers" in report
    assert "\n" not in report


def test_published_heads_pass_and_their_mismatches_name_both_sides(stories, eagle3_export, tmp_path):
    report = str(pair.check_pair(stories.cfg, None, eagle3_export, NAME))
    assert "published eagle3 head" in report and "[0, 2, 4]" in report
    refused(
        stories, edited(eagle3_export, tmp_path / "h", hidden_size=128), "hidden_size 128", NAME + " 64"
    )
    refused(
        stories, edited(eagle3_export, tmp_path / "v", vocab_size=1000), "vocab_size 1000", NAME + " 512"
    )
    far = edited(eagle3_export, tmp_path / "l", eagle_aux_hidden_state_layer_ids=[1, 3, 9])
    refused(stories, far, "reads target layers [0, 2, 8]", "ids [1, 3, 9]", "has 5 (0..4)")
    ok = dflash_dir(tmp_path / "dflash", dflash_config={"target_layer_ids": [1, 3]})
    assert "published dflash head" in str(pair.check_pair(stories.cfg, None, ok, NAME))
    refused(stories, dflash_dir(tmp_path / "d1", num_target_layers=32), "num_target_layers 32", NAME + " 5")
    refused(stories, dflash_dir(tmp_path / "d2", target_layer_ids=[1, 5]), "target layers [1, 5]", "has 5")


def test_heads_for_another_target_or_its_layers_are_refused(stories, tmp_path):
    foreign = heads.describe(
        "medusa", {"num_heads": 2, "num_layers": 1}, stories.cfg.replace(vocab_size=1000)
    )
    heads.write_meta(tmp_path / "foreign", foreign)
    refused(
        stories, tmp_path / "foreign", "trained for another target", "vocab_size 1000 in heads.json, 512"
    )
    deep = heads.describe("eagle3", {"layers": [0, 2, 7], "draft_ids": None}, stories.cfg)
    heads.write_meta(tmp_path / "deep", deep)
    refused(stories, tmp_path / "deep", "eagle3 heads", "reads target layers [0, 2, 7]", "has 5 (0..4)")


def test_draft_models_need_the_vocabulary_tokenizer_and_a_supported_family(stories, tmp_path):
    refused(stories, model_dir(stories, tmp_path / "big", vocab_size=1000), "1000-token", "512-token")
    model = pair.read_model(stories.path)
    respelled = Respelled(stories.tokenizer, 100, "zebra")
    draft = pair.ModelDraft(pair.Model(model.path, model.cfg, respelled))
    refused(
        stories,
        draft,
        "another tokenizer",
        "token 100 is 'zebra' in the draft's",
        repr(stories.tokenizer.decode([100])),
    )
    draft = pair.ModelDraft(pair.Model(model.path, model.cfg, Respelled(stories.tokenizer, eos_id=3)))
    refused(stories, draft, "eos_id 3 in the draft's, 2 in the target's")
    gpt2 = pair.ModelDraft(pair.Model(model.path, model.cfg.replace(family="gpt2"), stories.tokenizer))
    refused(stories, gpt2, "is a 'gpt2' model", ", ".join(SUPPORTED_MODEL_TYPES))
    refused(
        stories, model.path, "the target stories260K is a 'gpt2'", cfg=stories.cfg.replace(family="gpt2")
    )
    qwen = pair.ModelDraft(pair.Model(model.path, model.cfg.replace(family="qwen3"), stories.tokenizer))
    assert "another family" in str(pair.check_pair(stories.cfg, stories.tokenizer, qwen, NAME))


def test_the_cli_prints_one_line(stories, tmp_path, capsys):
    assert pair.main(["--target", NAME, "--draft", str(REPO / "heads" / "stories260K_eagle3")]) == 0
    assert capsys.readouterr().out.strip().startswith("ok: eagle3 heads")
    foreign = heads.describe("eagle", {}, stories.cfg.replace(dim=128))
    heads.write_meta(tmp_path / "foreign", foreign)
    args = ["--target", NAME, "--draft", str(tmp_path / "foreign")]
    out = subprocess.run(
        [sys.executable, "-m", "specjax.pair", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and not out.stdout, out
    assert (
        lines[-1].startswith("error: the eagle heads in") and "dim 128 in heads.json, 64 in" in lines[-1]
    ), lines
    assert "Traceback" not in out.stderr


def test_run_decode_refuses_a_mismatched_pair_before_loading_or_compiling(
    stories, tmp_path, capsys, monkeypatch
):
    module = cli()

    def never(*args, **kwargs):
        raise AssertionError("run_decode loaded or compiled before refusing the pair")

    monkeypatch.setattr(module, "load_model", never)
    monkeypatch.setattr(module, "decode_texts", never)
    heads.write_meta(tmp_path / "foreign", heads.describe("eagle", {}, stories.cfg.replace(n_heads=4)))
    with pytest.raises(PairError, match="n_heads 4 in heads.json, 8 in stories260K"):
        run_cli(module, capsys, "--drafter=eagle", f"--heads={tmp_path / 'foreign'}")
    big = model_dir(stories, tmp_path / "big", vocab_size=1000)
    with pytest.raises(PairError, match="1000-token vocabulary, the target stories260K a 512-token"):
        run_cli(module, capsys, "--drafter=draft_model", f"--draft_model={big}")


def test_the_trainer_refuses_to_resume_heads_of_another_target(stories, tmp_path):
    target = tmp_path / "target"
    checkpoint.save_model(target, stories.cfg, stories.params, tokenizer_files(stories.path))
    config = smoke(base_config("medusa"))
    config.target = str(target)
    workdir = tmp_path / "run"
    heads.write_meta(
        workdir, heads.describe("medusa", {"num_heads": 2, "num_layers": 1}, stories.cfg.replace(dim=32))
    )
    with pytest.raises(PairError, match="trained for another target.*dim 32 in heads.json, 64 in"):
        trainer.train(config, workdir)
    assert sorted(p.name for p in workdir.iterdir() if not p.name.startswith(".")) == ["heads.json"]
