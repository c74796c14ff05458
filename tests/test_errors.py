"""Bad input fails early with a message that names the problem and the fix."""

import json
import shutil

import numpy as np
import pytest
from conftest import STORIES, TINY

from specjax.checkpoint import restore_model, save_model
from specjax.decoding import GenerateSpec, generate
from specjax.models.config import ConfigError, LlamaConfig
from specjax.models.llama import init_params
from specjax.models.loading import load_model, load_tokenizer, resolve
from specjax.models.weights import CheckpointError, read_llama2c
from specjax.runner import encode_prompts
from specjax.sampling import Sampler

GRAPHDEF, PARAMS = init_params(TINY)
HF_CONFIG = json.loads((STORIES / "config.json").read_text()) if STORIES else {}


def test_prompt_plus_new_tokens_beyond_context():
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        generate(TINY, GRAPHDEF, PARAMS, [[1] * 200], GenerateSpec(100))


def test_prompt_beyond_explicit_cache():
    with pytest.raises(ValueError, match="does not fit the KV cache of 32 slots"):
        generate(TINY, GRAPHDEF, PARAMS, [[1] * 20], GenerateSpec(20, cache_size=32))


def test_empty_prompt():
    with pytest.raises(ValueError, match="at least one token"):
        generate(TINY, GRAPHDEF, PARAMS, [[1, 2], []], GenerateSpec(4))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(None, ["hello", "  "])


def test_token_ids_outside_vocabulary():
    with pytest.raises(ValueError, match=r"\[0, 97\).*tokenizer does not belong"):
        generate(TINY, GRAPHDEF, PARAMS, [[1, 500]], GenerateSpec(4))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; specjax runs llama, mistral, qwen2"),
        ({"model_type": "mistral", "sliding_window": 128}, "needs sliding-window attention"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_architectures(change, message):
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf({**HF_CONFIG, **change})


def test_mistral_without_window_is_accepted():
    cfg = LlamaConfig.from_hf({**HF_CONFIG, "model_type": "mistral", "sliding_window": None})
    assert cfg.n_kv_heads == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_k=-3), "top_k must be a non-negative integer"),
    ],
)
def test_invalid_sampling_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**kwargs)


def test_invalid_dtype():
    with pytest.raises(ConfigError, match="dtype 'float8' is not supported"):
        TINY.replace(dtype="float8")


def test_missing_weight_file(tmp_path):
    shutil.copy(STORIES / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(str(tmp_path))


def test_corrupt_safetensors_names_the_file(tmp_path):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / f, tmp_path)
    (tmp_path / "model.safetensors").write_bytes((STORIES / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        load_model(str(tmp_path))


def test_truncated_llama2c_checkpoint(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes((STORIES / "llama2c/stories260K.bin").read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.bin has 1056440 bytes, its header implies 1056540"):
        read_llama2c(bad)


def test_corrupt_orbax_checkpoint(tmp_path, stories):
    path = save_model(tmp_path / "ckpt", stories.cfg, stories.params)
    for f in (path / "params").rglob("*"):
        if f.is_file() and "ocdbt" in str(f):
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        restore_model(path)


def test_missing_orbax_params(tmp_path, stories):
    path = save_model(tmp_path / "ckpt", stories.cfg, stories.params)
    shutil.rmtree(path / "params")
    with pytest.raises(CheckpointError, match=r"cannot restore parameters from .*params"):
        restore_model(path)


def test_tokenizer_vocab_mismatch(tmp_path):
    shutil.copy(STORIES / "tokenizer.json", tmp_path)
    shutil.copy(STORIES / "tokenizer_config.json", tmp_path)
    with pytest.raises(ValueError, match="has 512 tokens but the model's vocabulary is 97"):
        load_tokenizer(tmp_path, 97)


def test_parameter_shape_mismatch():
    from flax import nnx

    from specjax.models.weights import build_params

    pure = nnx.to_pure_dict(PARAMS)
    pure["norm"]["weight"] = np.ones(7, np.float32)
    with pytest.raises(CheckpointError, match=r"norm/weight has shape \(7,\), the config needs \(32,\)"):
        build_params(TINY, pure)


def test_unknown_model_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face hub"):
        resolve("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="neither a local path nor a hub repository id"):
        resolve("./no/such/dir")


def test_default_model_resolution(monkeypatch, tmp_path):
    from specjax.models import loading

    monkeypatch.setenv("SPECJAX_MODELS", str(STORIES.parent))
    assert resolve() == STORIES
    monkeypatch.setenv(
        "SPECJAX_MODELS", str(tmp_path)
    )  # nowhere local: falls through to the hub, offline here
    monkeypatch.setattr(loading, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        FileNotFoundError,
        match=r"stories260K/stories260K.bin, stories260K/tok512.model from "
        r"karpathy/tinyllamas",
    ):
        resolve()


def test_tree_wider_than_vocabulary():
    from specjax.decoding import speculative_generate
    from specjax.drafters.draft_model import DraftModel
    from specjax.trees import balanced

    wide = DraftModel(TINY, GRAPHDEF, 1, tree=balanced(TINY.vocab_size + 1, 1))
    with pytest.raises(ValueError, match=f"drafts {TINY.vocab_size + 1} candidates per node, more than"):
        speculative_generate(TINY, GRAPHDEF, PARAMS, wide, PARAMS, [[1, 2]], GenerateSpec(4))
