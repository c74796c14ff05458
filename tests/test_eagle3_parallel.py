"""Parallel EAGLE-3 (head shape "parallel": one pass drafts K tokens, depths 2..K from MASK slots): greedy decoding
equals AR on chains and trees; sampled drafts are exact (the check's control caught); the training loss's per-slot
logits at an anchor are the drafting pass at that anchor, which the drafter computes for rows at different offsets
(a MASK slot seeing the next anchor's true feature is caught); heads without the key load as sequential heads, a
parallel head has no published layout, and its expansion drafts the same distributions."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case
from tolerance import LAYER_DEPTH, assert_close, assert_far

from specjax import expand, heads, precision, published, verify_exactness
from specjax.decoding import speculative_generate
from specjax.drafters.eagle import layer_config
from specjax.drafters.eagle3 import Eagle3Training, eagle3_apply, eagle3_loss, eagle3_unrolled, head_shape
from specjax.drafting import registry
from specjax.drafting.trees import DynamicTree, balanced
from specjax.errors import HeadsError, TrainingConfigError
from specjax.models.llama import causal_mask, init_cache
from specjax.sampling import Sampler
from specjax.training import config as training_config
from specjax.training.losses import target_features

K, LAYERS = 3, (1, 0)
# the fusion, one decoder layer, the LM head, a softmax: the training pass and the drafting pass round differently
DEPTH = 1 + LAYER_DEPTH + 2


def parallel_head(cfg, target_params, seed=3, draft_ids=None):
    """(meta, graphdef, head params) of a fresh parallel head."""
    shape = {"layers": list(LAYERS), "draft_ids": draft_ids, "parallel": True}
    meta = heads.describe("eagle3", shape, cfg)
    return (meta, *heads.new_heads(meta, cfg, target_params, seed))


def drafter(cfg, target_params, head, k, sampler, tree=None):
    meta, graphdef, hparams = head
    d = heads.make_drafter(meta, graphdef, cfg, k, sampler, tree)
    return d, heads.drafter_params(meta, hparams, cfg, target_params)


@pytest.fixture(scope="module")
def head():
    return parallel_head(TINY, TARGET[1])


def test_greedy_equals_ar(head):
    """A fresh head on the tiny target (its drafts are rejected): a chain, a static and a dynamic tree."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    for tree in (None, balanced(2, K), DynamicTree(3, K, 8)):
        d, dparams = drafter(cfg, params, head, K, Sampler(), tree)
        assert d.parallel
        gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=str(tree))


def test_greedy_equals_ar_with_accepted_drafts(stories):
    """The committed stories260K head's weights with fresh MASK slots: its first draft token is often accepted, so
    rounds start from a re-read of several slots, and decoding still equals AR."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    meta, hgraph, hparams = heads.load_heads(heads.COMMITTED / "stories260K_eagle3", cfg, params)
    meta = heads.describe("eagle3", {**meta["shape"], "parallel": True}, cfg)
    hgraph, fresh = heads.new_heads(meta, cfg, params)
    hparams = {**fresh, **hparams}
    d, dparams = drafter(cfg, params, (meta, hgraph, hparams), K, Sampler())
    gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert int(np.asarray(gen.stats.accepted_hist)[1:].sum()) > 0


def test_sampling_is_exact(monkeypatch):
    """verify_exactness on its enumerable target: chains of 2 (the pending token's slot and a MASK slot) pass the
    chi-square test, and its control (no residual) is caught."""

    def example(
        target, k, tree, sampler
    ):  # the LM head redrawn small, as eagle3's example: drafts get rejected
        meta, graphdef, hparams = parallel_head(target.cfg, target.params, seed=1)
        w = hparams["lm_head"]["weight"]
        hparams["lm_head"]["weight"] = 0.25 * jax.random.normal(jax.random.key(1), w.shape, w.dtype)
        return drafter(target.cfg, target.params, (meta, graphdef, hparams), k, sampler, tree)

    entry = registry.Entry("eagle3_parallel", registry.get("eagle3").settings, None, example=example)
    monkeypatch.setitem(registry.DRAFTERS, "eagle3_parallel", entry)
    report = verify_exactness.verify("eagle3_parallel", ("tokenwise",), k=2, greedy=False)  # greedy: above
    assert report.passed, report.format()


# --- training against drafting ------------------------------------------------------------------------------


@precision.follows_params
def fused(graphdef, dparams, taps):
    from flax import nnx

    return nnx.merge(graphdef, dparams["head"]).fuse(taps)


def drafted_by_hand(graphdef, dparams, feats, tokens, anchor, context, target_cfg=TINY):
    """Draft-vocabulary logits [B, K, N] of the drafting pass at `anchor`: slots 0..context-1 committed with the
    target's features, then the block [(token anchor + 1, feature anchor), MASK x (K - 1)] at positions anchor..,
    causal (context = anchor: what drafting sees)."""
    cfg, b = layer_config(target_cfg), tokens.shape[0]
    f = fused(graphdef, dparams, feats[..., : -cfg.dim])
    cache = init_cache(cfg, b, 32)
    if context:
        positions = jnp.broadcast_to(jnp.arange(context), (b, context))
        _, _, cache = eagle3_apply(
            graphdef,
            dparams,
            tokens[:, 1 : context + 1],
            f[:, :context],
            positions,
            cache,
            causal_mask(context),
        )
        cache = cache.with_length(jnp.full((b,), context))
    block_tokens = jnp.pad(tokens[:, anchor + 1 : anchor + 2], ((0, 0), (0, K - 1)))
    block_feats = jnp.pad(f[:, anchor : anchor + 1], ((0, 0), (0, K - 1), (0, 0)))
    positions = jnp.broadcast_to(anchor + jnp.arange(K), (b, K))
    masked = jnp.broadcast_to(jnp.arange(K) > 0, (b, K))
    logits, _, _ = eagle3_apply(
        graphdef, dparams, block_tokens, block_feats, positions, cache, causal_mask(K), masked
    )
    return logits


@pytest.fixture(scope="module")
def training_case(head):
    graphdef, params = TARGET
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, TINY.vocab_size, (2, 10)), jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    meta, hgraph, hparams = head
    dparams = heads.drafter_params(meta, hparams, TINY, params)
    unrolled = eagle3_unrolled(hgraph, dparams, feats[..., : -TINY.dim], tokens, K)  # [K, B, T - 1, N]
    return hgraph, dparams, feats, tokens, unrolled


def test_training_slots_are_the_drafting_pass(training_case):
    hgraph, dparams, feats, tokens, unrolled = training_case
    for anchor in (0, 4, tokens.shape[1] - 2):
        want = drafted_by_hand(hgraph, dparams, feats, tokens, anchor, anchor)
        assert_close(unrolled[:, :, anchor].swapaxes(0, 1), want, dtype=jnp.float32, depth=DEPTH)
    # control: MASK slots that also see the next anchor's true slot
    leaky = drafted_by_hand(hgraph, dparams, feats, tokens, 4, 6)
    assert_far(unrolled[1:, :, 4].swapaxes(0, 1), leaky[:, 1:], dtype=jnp.float32, depth=DEPTH)


def test_the_drafter_drafts_the_training_slots(head, training_case):
    """The drafter's one pass (the last round re-read up to the pending token, then the MASK slots) gives each depth
    the distribution the training slots give at that anchor, for rows that accepted 0 and 2 tokens last round."""
    hgraph, dparams, feats, tokens, unrolled = training_case
    d, _ = drafter(TINY, TARGET[1], head, K, Sampler(1.0))
    p, accepted = 4, np.array([0, 2])
    state = d.init(dparams, tokens[:, :p], jnp.full((2,), p), 32, feats[:, :p])
    # the last round's features: at the pending token, then at K accepted tokens (rows use 0 and 2 of them)
    state = state.replace(feats=feats[:, p - 1 : p + K])
    n_tokens = jnp.asarray(p + 1 + accepted)
    draft, _ = jax.jit(d.propose)(dparams, state, tokens, n_tokens, jax.random.key(0))
    anchors = p - 1 + accepted  # the pending token's slot
    want = jax.nn.softmax(unrolled[:, np.arange(2), anchors].swapaxes(0, 1), -1)
    assert_close(draft.q_probs, want, dtype=jnp.float32, depth=DEPTH + 2)


def test_the_loss_trains_the_mask_slots(training_case):
    hgraph, dparams, feats, tokens, _ = training_case
    loss = lambda hp: eagle3_loss(
        hgraph, layer_config(TINY), {**dparams, "head": hp}, feats, tokens, jnp.ones_like(tokens), K, 0.8
    )
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(dparams["head"])
    assert np.isfinite(value) and set(metrics) >= {"ce_0", "ce_1", "ce_2"}
    assert float(jnp.abs(grad["mask_embed"]).max()) > 0 and float(jnp.abs(grad["mask_feature"]).max()) > 0


# --- heads on disk ------------------------------------------------------------------------------------------


def test_sequential_heads_load_and_parallel_heads_refuse_the_published_layout(stories, head, tmp_path):
    entry = registry.get("eagle3")
    meta = heads.read_meta(heads.COMMITTED / "stories260K_eagle3")
    assert "parallel" not in meta["shape"]
    d, _ = entry.build(stories, entry.settings(), 4, None, Sampler())
    assert not d.parallel
    assert "parallel" not in head_shape(Eagle3Training(layers=(0,)), TINY, None)

    meta, _, hparams = head
    with pytest.raises(HeadsError, match="parallel EAGLE-3 head .* has no published EAGLE-3 layout"):
        published.export_published(meta, hparams, tmp_path / "hub", TINY)
    assert not (tmp_path / "hub").exists()


def test_config_file():
    path = Path(__file__).parents[1] / "configs/eagle3_parallel.py"
    spec = importlib.util.spec_from_file_location("eagle3_parallel_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("", "smoke"):
        c = module.get_config(name)
        training_config.validate(c)
        h = Eagle3Training(**{**c.heads.to_dict(), "layers": tuple(c.heads.layers)})
        assert head_shape(h, TINY.replace(n_layers=5), None)["parallel"] is True
    with pytest.raises(
        TrainingConfigError, match="heads.unroll=1 trains none of a parallel head's MASK slots"
    ):
        registry.trained("eagle3").check(Eagle3Training(parallel=True, unroll=1), TINY)


def test_expanded_head_drafts_the_same_distributions(head):
    """`expand_heads` pads the MASK vectors with zeros: the expanded head's drafting pass gives the same logits."""
    graphdef, params = TARGET
    e = expand.Expansion(dim=64, n_layers=3, n_heads=8, n_kv_heads=4, head_dim=8, hidden_dim=80)
    cfg2, graphdef2, params2 = expand.expand(TINY, params, e)
    meta, hgraph, hparams = head
    meta2, hgraph2, hparams2 = expand.expand_heads(meta, hparams, TINY, cfg2, params2, e)
    assert meta2["shape"]["parallel"] is True
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, TINY.vocab_size, (2, 8)), jnp.int32)
    runs = []
    for cfg, g, p, hm, hg, hp in (
        (TINY, graphdef, params, meta, hgraph, hparams),
        (cfg2, graphdef2, params2, meta2, hgraph2, hparams2),
    ):
        feats = target_features(cfg, g, p, tokens, tuple(hm["shape"]["layers"]))
        dparams = heads.drafter_params(hm, hp, cfg, p)
        runs.append(drafted_by_hand(hg, dparams, feats, tokens, 5, 5, cfg))
    assert_close(runs[1], runs[0], dtype=jnp.float32, depth=DEPTH + 3 * LAYER_DEPTH)
