"""Distilled draft models (DistillSpec): divergences against numpy, a copy of the target has nothing to learn,
training lowers the divergence and raises held-out acceptance, resuming is exact, the exported draft loads like
any model and drafts exactly, bad configs are refused before anything is written."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import compile_training_once
from tolerance import approx, assert_close, assert_far, forward_depth, tolerance

from specjax import checkpoint
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters import distill
from specjax.drafting.registry import trained
from specjax.drafting.trees import parse_tree
from specjax.metrics import summarize
from specjax.models.llama import init_params, sequence_logits
from specjax.models.loading import load_model, tokenizer_files
from specjax.training import divergences, losses, trainer
from specjax.training.config import TrainingConfigError, base_config, smoke


def np_divergence(name, target, draft, temperature, beta):
    def softmax(x):
        x = x / temperature
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(target.astype(np.float64)), softmax(draft.astype(np.float64))
    kl = lambda a, b: np.sum(a * np.log(a / b), -1)
    m = beta * p + (1 - beta) * q
    return {
        "forward_kl": kl(p, q),
        "reverse_kl": kl(q, p),
        "jsd": beta * kl(p, m) + (1 - beta) * kl(q, m),
        "tvd": 0.5 * np.abs(p - q).sum(-1),
    }[name]


DIVERGENCE_DEPTH = 8


@pytest.mark.parametrize("name", divergences.DIVERGENCES)
def test_divergence_equals_numpy_with_temperature_and_a_masked_position(name):
    rng = np.random.default_rng(0)
    target, draft = (rng.normal(0, 3, (2, 5, 11)).astype(np.float32) for _ in range(2))
    mask = np.ones((2, 5), np.float32)
    mask[1, 2] = 0
    draft[1, 2] += 1e4  # a masked position may hold anything
    got = divergences.divergence(name, jnp.asarray(target), jnp.asarray(draft), 0.7, 0.3)
    want = np_divergence(name, target, draft, 0.7, 0.3)
    keep = mask == 1
    # float32 against float64: the temperature, two log-softmaxes (max, exp, sum, log), the mixture, the
    # product and the sum over the vocabulary; then the masked mean
    depth = DIVERGENCE_DEPTH
    assert_close(np.asarray(got)[keep], want[keep], dtype=jnp.float32, depth=depth)
    mean = losses.masked_mean(got, jnp.asarray(mask))
    want_mean = approx(want[keep].mean(), dtype=jnp.float32, depth=depth + 2, magnitude=want.max())
    assert float(mean) == want_mean
    other = divergences.divergence(name, jnp.asarray(target), jnp.asarray(draft), 1.0, 0.3)
    # the temperature matters
    assert_far(np.asarray(other)[keep], want[keep], dtype=jnp.float32, depth=depth)


@pytest.fixture(scope="module")
def target_dir(stories, tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "stories260K"
    checkpoint.save_model(path, stories.cfg, stories.params, tokenizer_files(stories.path))
    return path


def test_on_policy_rows_keep_the_mask_of_the_tokens_they_continue():
    """The rows rewritten by the draft's own continuations keep their first tokens' mask (a user turn's zeros stay
    out of the loss) and mask what follows their end; the other rows are unchanged."""
    c = smoke(base_config("distill"))
    c.heads.n_layers, c.data.on_policy_fraction = 1, 0.5
    graphdef, draft = init_params(distill.draft_config(distill.sizes(c.heads), TINY), seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, TINY.vocab_size, (4, 32)), jnp.int32)
    mask = np.ones((4, 32), np.int32)
    mask[:, 1:3] = 0  # a user turn inside the first 32 // 8 tokens
    new_tokens, new_mask = distill.on_policy(
        graphdef, TINY, {"draft": draft}, tokens, jnp.asarray(mask), jax.random.key(0), c
    )
    new_tokens, new_mask = np.asarray(new_tokens), np.asarray(new_mask)
    np.testing.assert_array_equal(new_mask[:2, :4], [[0, 0, 0, 1]] * 2)  # position 0 (BOS) as before
    assert (new_tokens[:2, 4:] != np.asarray(tokens)[:2, 4:]).any()  # the rows were rewritten
    np.testing.assert_array_equal(new_mask[2:], mask[2:])
    np.testing.assert_array_equal(new_tokens[2:], np.asarray(tokens)[2:])


def test_exact_copy_of_the_target_has_zero_divergence_and_gradient():
    cfg, (graphdef, target_params) = TINY, init_params(TINY, 1)
    h = base_config("distill").heads
    h.n_layers, h.dim, h.n_heads, h.n_kv_heads, h.hidden_dim = 2, cfg.dim, cfg.n_heads, cfg.n_kv_heads, 64
    h.init = "layers:0,1"
    heads = trained("distill")
    shape = heads.shape_of(h, cfg, None)
    draft_graphdef, params = heads.init(shape, cfg, target_params, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
    mask = jnp.ones_like(tokens).at[1, 5].set(0)

    @jax.jit
    def all_divergences(params, target_params):
        feats = losses.target_features(cfg, graphdef, target_params, tokens)
        full = heads.drafter_params(shape, params, cfg, target_params)
        out = {
            "scale": jnp.abs(jnp.einsum("btd,vd->btv", feats[..., -cfg.dim :], full["target_head"])).max()
        }
        for name in divergences.DIVERGENCES:
            h.divergence = name

            def loss(p):
                full = heads.drafter_params(shape, p, cfg, target_params)
                return heads.loss(draft_graphdef, cfg, full, feats, tokens, mask, None, h)

            (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
            out[name] = (value, metrics["alpha_T0"], optax_norm(grads))
        return out

    copy = all_divergences(params, target_params)
    params["layers"][1]["wo"]["weight"] += 0.1  # a draft that differs: every divergence and gradient > 0
    differs = all_divergences(params, target_params)
    # Draft and target compute the same logits in other orders: they differ by rounding of the forward at the
    # logits' magnitude. TVD moves with that difference, the KLs and JSD with its square, so every divergence
    # is below the logits' rounding; each gradient is below rounding at the magnitude of the gradient a real
    # difference gives.
    depth = forward_depth(cfg.n_layers) + DIVERGENCE_DEPTH
    value_bound = tolerance(jnp.float32, depth, float(copy["scale"]))[1]
    for name in divergences.DIVERGENCES:
        (value, alpha_t0, grad), (value1, _, grad1) = copy[name], differs[name]
        assert float(alpha_t0) == 1.0 and abs(float(value)) <= value_bound, name
        assert float(grad) <= tolerance(jnp.float32, depth, float(grad1))[1], name
        assert float(value1) > 10 * value_bound, name  # the control is far above the bound


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree)))


def config_for(target_dir, corpus=""):
    c = smoke(base_config("distill"))
    c.target = str(target_dir)
    c.heads.n_layers, c.heads.init = 1, "layers:0"
    c.data.num_samples, c.data.sample_len, c.data.cache = 40, 40, corpus
    c.data.heldout, c.data.on_policy_fraction = 8, 0.25
    c.optimizer.lr = 3e-3
    c.train.steps, c.train.checkpoint_every, c.train.log_every = 12, 4, 4
    return c


def metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained_run(target_dir, tmp_path_factory):
    """A smoke distillation (12 steps, a quarter on-policy) and the target's parameters before and after."""
    root = tmp_path_factory.mktemp("distill")
    config = config_for(target_dir, str(root / "corpus.npy"))
    seen = {}
    real_load = trainer.load_target

    def spy(config, mesh):
        seen["target"], tok = real_load(config, mesh)
        seen["before"] = jax.tree.map(np.array, seen["target"][2])
        return seen["target"], tok

    trainer.load_target = spy
    try:
        trainer.train(config, root / "straight")
    finally:
        trainer.load_target = real_load
    return config, root, seen


def test_training_lowers_the_divergence_raises_heldout_alpha_and_leaves_the_target(trained_run):
    config, root, seen = trained_run
    log = metrics(root / "straight")
    assert log[-1]["eval_loss"] < 0.8 * log[0]["eval_loss"], log
    assert log[-1]["eval_alpha_T1"] > log[0]["eval_alpha_T1"] + 0.05, log
    assert log[-1]["eval_alpha_T0"] > log[0]["eval_alpha_T0"], log
    after = jax.tree.map(np.array, seen["target"][2])
    jax.tree.map(np.testing.assert_array_equal, seen["before"], after)


def test_kill_and_resume_equals_uninterrupted(trained_run, stories, monkeypatch):
    config, root, _ = trained_run
    compile_training_once(monkeypatch)
    trainer.train(config, root / "resumed", stop_at=6)
    trainer.train(config, root / "resumed")
    load = lambda run: distill.heads.load_heads(root / run, stories.cfg, stories.params)[2]
    if jax.default_backend() == "cpu":  # its scatter-adds sum in one order: bit-identical
        jax.tree.map(np.testing.assert_array_equal, load("straight"), load("resumed"))
    else:  # a GPU's embedding gradient (a scatter-add) sums in a varying order: each step rounds differently
        steps = config.train.steps
        same = lambda a, b: assert_close(
            b, a, dtype=jnp.float32, depth=steps, magnitude=float(np.abs(a).max())
        )
        jax.tree.map(same, load("straight"), load("resumed"))


def test_export_loads_everywhere_with_the_same_logits_and_drafts_exactly(trained_run, target_dir, stories):
    import torch
    import transformers

    config, root, _ = trained_run
    dest = distill.export_model(root / "straight", root / "export", target_dir)
    draft = load_model(str(dest))
    meta, graphdef, params = distill.heads.load_heads(root / "straight", stories.cfg, stories.params)
    tokens = jnp.asarray([stories.tokenizer.encode("Once upon a time, there was a girl named Lily.")])
    cfg = distill.draft_config(meta["shape"], stories.cfg)
    ours = np.asarray(sequence_logits(cfg, graphdef, params, tokens))
    loaded = np.asarray(sequence_logits(draft.cfg, draft.graphdef, draft.params, tokens))
    np.testing.assert_array_equal(loaded, ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dest, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(tokens))).logits.numpy()
    # PyTorch's float32 kernels round in another order than XLA's
    assert_close(theirs, ours, dtype=jnp.float32, depth=forward_depth(cfg.n_layers))
    assert draft.tokenizer.encode("Lily") == stories.tokenizer.encode("Lily")

    prompts = [stories.tokenizer.encode(t) for t in ("Once upon a time", "Lily saw a")]
    spec = GenerateSpec(24, eos_id=None)
    ar = np.asarray(generate(stories.cfg, stories.graphdef, stories.params, prompts, spec).tokens)
    for tree in (None, parse_tree("0;1;0,0;1,0")):
        k = 3 if tree is None else tree.depth
        drafter = distill.DistilledDraft(draft.cfg, draft.graphdef, k, tree=tree)
        gen = speculative_generate(
            stories.cfg, stories.graphdef, stories.params, drafter, {"draft": draft.params}, prompts, spec
        )
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("heads.vocab_size", 500, "differs from the target's vocabulary of 512"),
        ("heads.init", "layers:0,7", "names layers [7] that the target lacks"),
        ("heads.dim", 32, "a draft of other widths cannot copy them"),
        ("heads.divergence", "kl", "heads.divergence='kl' must be one of"),
        ("data.on_policy_fraction", 1.5, "data.on_policy_fraction=1.5 must be in [0, 1]"),
    ],
)
def test_bad_drafts_are_refused_before_anything_is_written(key, value, message, target_dir, tmp_path):
    config = config_for(target_dir)
    section, name = key.split(".")
    if (key, value) == ("heads.init", "layers:0,7"):
        config.heads.n_layers = 2
    setattr(config[section], name, value)
    with pytest.raises(TrainingConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        trainer.train(config, tmp_path / "run")
    assert "\n" not in str(err.value)
    assert not [p for p in (tmp_path / "run").glob("*") if p.name != ".lock"]


def test_a_library_call_copying_layers_the_target_lacks_is_refused():
    """`init` (as `heads.new_heads` calls it, without the trainer's config check) names the missing layers."""
    h = base_config("distill").heads
    h.n_layers, h.dim, h.n_heads, h.n_kv_heads, h.init = (
        2,
        TINY.dim,
        TINY.n_heads,
        TINY.n_kv_heads,
        "layers:0,5",
    )
    heads = trained("distill")
    with pytest.raises(TrainingConfigError, match=r"names layers \[5\] that the target lacks") as err:
        heads.init(heads.shape_of(h, TINY, None), TINY, init_params(TINY, 1)[1], 0)
    assert "\n" not in str(err.value)


def test_a_draft_larger_than_the_target_is_allowed_with_a_warning_naming_the_cost(stories, caplog):
    h = base_config("distill").heads
    h.n_layers, h.dim, h.hidden_dim, h.init = 6, 128, 344, "scratch"
    with caplog.at_level(logging.WARNING):
        distill.check(h, stories.cfg)
    assert "cannot be faster than decoding the target alone" in caplog.text
    assert "target passes" in caplog.text


def test_the_committed_draft_decodes_as_ar(stories):
    """The committed draft (`heads/stories260K_distill`) decodes greedily as AR, token for token, and agrees with
    the target (tau well above 1). That its samples are exact is the draft model's rule, which
    `verify_exactness` checks with its control (test_verification: a good draft is rarely rejected, so its
    control would need 20,000 samples here)."""
    from specjax.heads import COMMITTED

    draft = load_model(str(COMMITTED / "stories260K_distill"))
    prompts = [stories.tokenizer.encode(t) for t in ("Once upon a time", "Lily saw a")]
    spec = GenerateSpec(32, eos_id=None)
    ar = np.asarray(generate(stories.cfg, stories.graphdef, stories.params, prompts, spec).tokens)
    drafter = distill.DistilledDraft(draft.cfg, draft.graphdef, 4)
    gen = speculative_generate(
        stories.cfg, stories.graphdef, stories.params, drafter, {"draft": draft.params}, prompts, spec
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert summarize(gen.stats)["tau"] > 2.0
