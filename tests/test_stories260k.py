"""The real stories260K checkpoint reproduces its reference outputs, from every format specjax reads."""

import jax
import numpy as np
import pytest
from conftest import STORIES, STORIES_PROMPT, STORIES_PROMPT_REFERENCE, STORIES_REFERENCE_IDS

from specjax.checkpoint import restore_model, save_model
from specjax.decoding import GenerateSpec, generate
from specjax.models.llama import causal_mask, forward, init_cache
from specjax.models.loading import load_model, tokenizer_files


def greedy(model, prompt_ids, n):
    gen = generate(model.cfg, model.graphdef, model.params, [prompt_ids], GenerateSpec(n, eos_id=None))
    return np.asarray(gen.tokens[0]).tolist()


@pytest.fixture(scope="module")
def llama2c():
    return load_model(str(STORIES / "llama2c"))


@pytest.mark.parametrize("source", ["hf", "llama2c"])
def test_reference_outputs(source, stories, llama2c):
    model = stories if source == "hf" else llama2c
    assert greedy(model, [model.cfg.bos_id], 64) == STORIES_REFERENCE_IDS
    prompt = model.tokenizer.encode(STORIES_PROMPT)
    assert model.tokenizer.decode(prompt + greedy(model, prompt, 40)) == STORIES_PROMPT_REFERENCE


def test_tokenizers_agree(stories, llama2c):
    from specjax.tokenizer import SentencePieceTokenizer

    text = 'Tom said, "Héllo!"\nThe end. 123'
    sentencepiece = SentencePieceTokenizer(STORIES / "tokenizer.model")
    assert stories.tokenizer.encode(text) == llama2c.tokenizer.encode(text) == sentencepiece.encode(text)
    assert sentencepiece.decode(sentencepiece.encode(text)[1:]) == text
    ids = stories.tokenizer.encode(text)
    assert stories.tokenizer.decode(ids) == llama2c.tokenizer.decode(ids) == text


def test_orbax_round_trip(stories, tmp_path):
    path = save_model(tmp_path / "ckpt", stories.cfg, stories.params, tokenizer_files(stories.path))
    cfg, graphdef, params = restore_model(path)
    assert cfg == stories.cfg
    for a, b in zip(jax.tree.leaves(stories.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.array([[1, 403, 407, 261]])
    run = lambda g, p: forward(g, p, tokens, np.arange(4)[None], init_cache(cfg, 1, 8), causal_mask(4))[0]
    np.testing.assert_array_equal(
        np.asarray(run(graphdef, params)), np.asarray(run(stories.graphdef, stories.params))
    )
    reloaded = load_model(str(path))  # the directory is a model path like any other, tokenizer included
    assert greedy(reloaded, [1], 16) == STORIES_REFERENCE_IDS[:16]


def test_orbax_restore_onto_sharding(stories, tmp_path):
    path = save_model(tmp_path / "ckpt", stories.cfg, stories.params)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    _, _, params = restore_model(path, shardings=lambda tree: jax.tree.map(lambda _: sharding, tree))
    assert all(leaf.sharding == sharding for leaf in jax.tree.leaves(params))


def test_transformers_missing_torch_notice_is_dropped_and_other_messages_pass(stories):
    """Without PyTorch (hidden from the child: `children.child_env`), loading stories260K's config and tokenizer
    prints nothing of transformers'; importing transformers alone there prints the notice (the control); other
    messages pass."""
    import logging
    import subprocess
    import sys

    from children import child_env

    from specjax.hf_import import import_transformers

    load = f"from specjax.models.loading import load_model; load_model({str(stories.path)!r})"
    quiet, control = (
        subprocess.run(
            [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
        )
        for code in (load, "import transformers")
    )
    assert "PyTorch was not found" in control.stderr
    assert "PyTorch was not found" not in quiet.stderr and "transformers" not in quiet.stderr

    import_transformers()
    library, seen = logging.getLogger("transformers"), []
    handler = logging.Handler()
    handler.emit = seen.append
    library.addHandler(handler)
    try:
        library.warning("PyTorch was not found. Models won't be available and only tokenizers, ...")
        library.warning("a real warning")
    finally:
        library.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["a real warning"]


def test_jax_backend_probe_note_is_dropped_and_its_warnings_pass():
    """The CLIs drop JAX's INFO note that a backend it probed for is missing ("Unable to initialize backend 'tpu'"),
    and keep that logger's warnings and its other notes."""
    import logging

    from specjax.cli import not_a_backend_probe

    record = lambda level, text: logging.LogRecord(
        "jax._src.xla_bridge", level, __file__, 1, text, None, None
    )
    assert not not_a_backend_probe(
        record(logging.INFO, "Unable to initialize backend 'tpu': INTERNAL: ...")
    )
    assert not_a_backend_probe(record(logging.WARNING, "Unable to initialize backend 'cuda': ..."))
    assert not_a_backend_probe(record(logging.INFO, "another note"))
