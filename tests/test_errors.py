"""Bad input fails early with a message that names the problem and the fix."""

import json
import shutil

import numpy as np
import pytest
from conftest import STORIES, TINY

from specjax import errors
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
    with pytest.raises(errors.DecodingError, match="exceeds the model's context of 256"):
        generate(TINY, GRAPHDEF, PARAMS, [[1] * 200], GenerateSpec(100))


def test_prompt_beyond_explicit_cache():
    with pytest.raises(errors.DecodingError, match="does not fit the KV cache of 32 slots"):
        generate(TINY, GRAPHDEF, PARAMS, [[1] * 20], GenerateSpec(20, cache_size=32))


def test_empty_prompt():
    with pytest.raises(errors.DecodingError, match="at least one token"):
        generate(TINY, GRAPHDEF, PARAMS, [[1, 2], []], GenerateSpec(4))
    with pytest.raises(errors.DecodingError, match="prompt 1 is empty"):
        encode_prompts(None, ["hello", "  "])


def test_token_ids_outside_vocabulary():
    with pytest.raises(errors.DecodingError, match=r"\[0, 97\).*tokenizer does not belong"):
        generate(TINY, GRAPHDEF, PARAMS, [[1, 500]], GenerateSpec(4))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"model_type": "gpt2"},
            "model_type 'gpt2' is not supported; specjax runs llama, mistral, qwen2, qwen3",
        ),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "rope scaling 'dynamic' is not supported",
        ),
        (
            {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]},
            "dense layers",
        ),
        ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_architectures(change, message):
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf({**HF_CONFIG, **change})


def test_mistral_window_as_long_as_the_context_is_full_attention():
    for window in (None, HF_CONFIG["max_position_embeddings"]):
        cfg = LlamaConfig.from_hf({**HF_CONFIG, "model_type": "mistral", "sliding_window": window})
        assert (cfg.n_kv_heads, cfg.sliding_window, cfg.layer_types) == (4, None, ())
    cfg = LlamaConfig.from_hf({**HF_CONFIG, "model_type": "mistral", "sliding_window": 128})
    assert cfg.window(0) == 128 and cfg.layer_types == ("sliding",) * cfg.n_layers


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
    with pytest.raises(errors.SamplingError, match=message):
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
    with pytest.raises(CheckpointError, match="has 512 tokens but the model's vocabulary is 97"):
        load_tokenizer(tmp_path, 97)


def test_parameter_shape_mismatch():
    from flax import nnx

    from specjax.models.weights import build_params

    pure = nnx.to_pure_dict(PARAMS)
    pure["norm"]["weight"] = np.ones(7, np.float32)
    with pytest.raises(CheckpointError, match=r"norm/weight has shape \(7,\), the config needs \(32,\)"):
        build_params(TINY, pure)


def test_unknown_model_offline(offline_hub):
    with pytest.raises(errors.MissingInputError, match="could not be downloaded from the Hugging Face hub"):
        resolve("nobody/no-such-model")
    with pytest.raises(errors.MissingInputError, match="neither a local path nor a hub repository id"):
        resolve("./no/such/dir")


def test_default_model_resolution(monkeypatch, tmp_path, offline_hub):
    from specjax.models import loading

    monkeypatch.setenv("SPECJAX_MODELS", str(STORIES.parent))
    assert resolve() == STORIES
    monkeypatch.setenv(
        "SPECJAX_MODELS", str(tmp_path)
    )  # nowhere local: falls through to the hub, offline here
    monkeypatch.setattr(loading, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        errors.MissingInputError,
        match=r"stories260K/stories260K.bin, stories260K/tok512.model from "
        r"karpathy/tinyllamas",
    ):
        resolve()


def test_tree_wider_than_vocabulary():
    from specjax.decoding import speculative_generate
    from specjax.drafters.draft_model import DraftModel
    from specjax.drafting.trees import balanced

    wide = DraftModel(TINY, GRAPHDEF, 1, tree=balanced(TINY.vocab_size + 1, 1))
    with pytest.raises(
        errors.DecodingError, match=f"drafts {TINY.vocab_size + 1} candidates per node, more than"
    ):
        speculative_generate(TINY, GRAPHDEF, PARAMS, wide, PARAMS, [[1, 2]], GenerateSpec(4))


# --- the catalogue of typed errors (specjax.errors) ----------------------------------------------------

ERROR_HOMES = {  # module: the errors it raises and re-exports (one class, one home: specjax.errors)
    "specjax.cli": ["UsageError"],
    "specjax.files": ["FileSafetyError", "DestinationError", "ProvenanceError", "LockedError"],
    "specjax.models.config": ["ConfigError"],
    "specjax.models.weights": ["CheckpointError"],
    "specjax.models.quantize": ["QuantizationError"],
    "specjax.training.config": ["TrainingConfigError"],
    "specjax.training.data": ["DataError"],
    "specjax.training.chat": ["ChatDataError"],
    "specjax.training.trainer": ["NonFiniteLossError"],
    "specjax.datastore": ["DatastoreError"],
    "specjax.results": ["ResultsError"],
    "specjax.sharding": ["MeshError"],
    "specjax.drafting.trees": ["TreeError"],
    "specjax.drafters.retrieval": ["RetrievalError"],
    "specjax.drafters.ngram": ["NGramError"],
    "specjax.drafters.lookahead": ["LookaheadError"],
    "specjax.drafters.layer_skip": ["LayerSkipError"],
    "specjax.drafters.suffix": ["SuffixError"],
}


def test_every_error_is_a_documented_specjax_error_and_keeps_its_builtin():
    import importlib
    import inspect

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 25
    for cls in classes:
        assert issubclass(cls, errors.SpecjaxError) and cls.__doc__, cls
        if (
            cls is not errors.SpecjaxError
        ):  # a notebook's `except ValueError` (or FileNotFoundError) still works
            assert issubclass(cls, ValueError | FileNotFoundError | RuntimeError), cls
    assert not issubclass(errors.NonFiniteLossError, ValueError)
    for module, names in ERROR_HOMES.items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is getattr(errors, name), (module, name)


BUILTIN_RAISE = r"raise (ValueError|TypeError|KeyError|RuntimeError|FileNotFoundError|FileExistsError)\("
ALLOWED_BUILTIN = {
    "specjax/drafting/trees.py": 1
}  # a programming error, not a user's: a search tree has no layout


def test_the_library_raises_no_bare_builtin_for_a_users_mistake():
    import re
    from pathlib import Path

    root = Path(errors.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        n = len(re.findall(BUILTIN_RAISE, path.read_text()))
        if n:
            found[str(path.relative_to(root.parent))] = n
    assert found == ALLOWED_BUILTIN


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: Sampler(temperature=1.0, top_p=0.0), "SamplingError"),
        (lambda: __import__("specjax.drafting.registry").drafting.registry.get("nope"), "DrafterError"),
        (lambda: __import__("specjax.acceptance").acceptance.get("nope"), "SamplingError"),
        (lambda: __import__("specjax.drafting.trees").drafting.trees.chain(0), "TreeError"),
        (
            lambda: __import__("specjax.decoding.adaptive").decoding.adaptive.AdaptiveK.parse("2,1"),
            "DrafterError",
        ),
        (lambda: encode_prompts(None, []), "DecodingError"),
        (lambda: TINY.replace(dtype="float8"), "ConfigError"),
    ],
)
def test_library_errors_are_typed(call, error):
    with pytest.raises(getattr(errors, error)) as caught:
        call()
    assert isinstance(caught.value, errors.SpecjaxError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "xla_flags, backend, refused",
    [
        ("--xla_gpu_deterministic_ops=true", "gpu", True),
        ("--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops", "gpu", True),
        ("--xla_gpu_deterministic_ops=True", "gpu", True),
        (
            "--xla_gpu_deterministic_ops=true --xla_gpu_enable_scatter_determinism_expander=false",
            "gpu",
            False,
        ),
        ("--xla_gpu_deterministic_ops=false", "gpu", False),
        ("--xla_gpu_deterministic_ops=true", "cpu", False),  # a CPU's scatters are not rewritten
        ("", "gpu", False),
    ],
)
def test_xla_flags_that_misplace_dropped_writes_on_a_gpu_are_refused(xla_flags, backend, refused):
    from specjax.cli import refuse_unsafe_xla_flags

    if refused:
        with pytest.raises(errors.UsageError, match="scatter_determinism_expander=false"):
            refuse_unsafe_xla_flags(xla_flags, backend)
    else:
        refuse_unsafe_xla_flags(xla_flags, backend)


def test_every_command_checks_its_xla_flags_before_it_starts(monkeypatch, capsys):
    import jax

    from specjax import cli

    ran = []
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(SystemExit):
        cli.guarded(ran.append)(["prog"])
    assert not ran and "error: XLA_FLAGS sets --xla_gpu_deterministic_ops=true" in capsys.readouterr().err
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    cli.guarded(ran.append)(["prog"])
    assert ran == [["prog"]]
