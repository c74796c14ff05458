"""EAGLE-3: greedy decoding equals AR and sampling is exact with the full and a reduced draft vocabulary (chains,
static and dynamic trees); a target token outside the draft vocabulary is never proposed and still sampled with
its exact probability; the training-time test's loss and gradient equal the drafting computation written out
anchor by anchor (and detached or target features would be caught); heads that do not fit a target are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case
from tolerance import LAYER_DEPTH, assert_close, assert_far

from specjax import heads, precision, published, verify_exactness
from specjax.decoding import GenerateSpec, speculative_generate
from specjax.drafters.eagle import layer_config
from specjax.drafters.eagle3 import (
    eagle3_apply,
    eagle3_loss,
    frequent_tokens,
    paper_layers,
)
from specjax.drafting import registry
from specjax.drafting.trees import DynamicTree, balanced
from specjax.metrics import summarize
from specjax.models.llama import init_cache
from specjax.models.weights import CheckpointError
from specjax.sampling import Sampler
from specjax.training.losses import target_features

# float32 rounding stages of the EAGLE-3 loss: the fusion, one decoder layer, the LM head, the target's softmax
# against the log-softmax, the sums; the unrolled loss runs that twice; a gradient is the way back through them
LOSS_DEPTH = 1 + LAYER_DEPTH + 1 + 4

REDUCED = list(range(0, TINY.vocab_size, 2))  # the even ids: 49 of 97


def eagle3(cfg, params, draft_ids=None, layers=(1, 0), seed=3):
    """(meta, graphdef, head params) of a fresh EAGLE-3 head."""
    meta = heads.describe("eagle3", {"layers": list(layers), "draft_ids": draft_ids}, cfg)
    return (meta, *heads.new_heads(meta, cfg, params, seed))


def drafter(cfg, params, head, k, sampler, tree=None):
    meta, graphdef, hparams = head
    d = heads.make_drafter(meta, graphdef, cfg, k, sampler, tree)
    return d, heads.drafter_params(meta, hparams, cfg, params)


def test_greedy_equals_ar_with_a_reduced_vocabulary():
    """A head drafting in a reduced vocabulary, on a static and a dynamic tree. (The full vocabulary's greedy chains
    and trees: the trained head's test below and test_refill's EAGLE-3 rounds.)"""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    head = eagle3(cfg, params, REDUCED)
    for tree in (balanced(2, 3), DynamicTree(3, 3, 8)):
        d, dparams = drafter(cfg, params, head, tree.depth, Sampler(), tree)
        gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=str(tree))


def test_greedy_equals_ar_trained(stories):
    """The committed stories260K head: AR's tokens on its dynamic tree, and it drafts useful tokens."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    d, dparams = registry.get("eagle3").build(
        stories, registry.get("eagle3").settings(), 6, DynamicTree(8, 6, 48), Sampler()
    )
    gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert summarize(gen.stats)["tau"] > 3.0


# --- the reduced draft vocabulary ---------------------------------------------------------------------------


def test_vocab_maps_round_trip():
    """The published d2t (target id - draft id) and t2d (in the draft vocabulary) maps and back."""
    d2t, t2d = published.d2t_t2d([3, 5, 11], 12)
    assert (np.arange(3) + d2t).tolist() == [3, 5, 11]
    assert np.flatnonzero(t2d).tolist() == [3, 5, 11]
    assert published.draft_ids_of(d2t, t2d, 12).tolist() == [3, 5, 11]
    tokens = np.array([[5, 5, 9, 1], [9, 9, 2, 5]])  # 5 and 9: three each; ties go to the lower id
    assert frequent_tokens(tokens, 3, 12) == [1, 5, 9]
    assert paper_layers(32) == (1, 15, 28) and paper_layers(5) == (1, 1, 1)


def test_out_of_vocabulary_tokens_are_never_proposed():
    graphdef, params = TARGET
    head = eagle3(TINY, params, REDUCED)
    outside = np.setdiff1d(np.arange(TINY.vocab_size), REDUCED)
    seq = jnp.asarray(np.random.default_rng(0).integers(3, TINY.vocab_size, (4, 24)), jnp.int32)
    feats = target_features(TINY, graphdef, params, seq, (1, 0))
    for tree in (None, DynamicTree(3, 3, 8)):
        d, dparams = drafter(TINY, params, head, 3, Sampler(1.0), tree)
        state = d.init(dparams, seq[:, :8], jnp.full((4,), 8), 64, feats[:, :8])
        draft, _ = jax.jit(d.propose)(dparams, state, seq, jnp.full((4,), 9), jax.random.key(1))
        assert not np.isin(np.asarray(draft.tokens), outside).any()
        if (
            tree is None
        ):  # a sampled chain carries the distributions it drew from (a dynamic tree takes top-k)
            assert float(jnp.max(draft.q_probs[..., outside])) == 0.0
            sums = jnp.sum(draft.q_probs, -1)  # a softmax (exp, sum, divide), summed again
            assert_close(sums, np.ones(sums.shape), dtype=jnp.float32, depth=4)


def test_reduced_vocabulary_sampling_is_exact(monkeypatch):
    """On verify_exactness's enumerable target (V = 8) with a draft vocabulary of 4 tokens: the joint
    distribution of 3 tokens passes the chi-square test with its control caught, greedy equals AR, and the
    tokens outside the draft vocabulary (most of the target's mass here) come out with their exact marginal
    probability."""
    target = verify_exactness.tiny_target()
    cfg, ids = target.cfg, [0, 4, 5, 7]  # without token 2, the target's likeliest at both positions

    def example(target, k, tree, sampler):  # q: uniform over the draft vocabulary (the LM head zeroed)
        meta, graphdef, hparams = eagle3(target.cfg, target.params, ids, seed=1)
        hparams["lm_head"]["weight"] = jnp.zeros_like(hparams["lm_head"]["weight"])
        return drafter(target.cfg, target.params, (meta, graphdef, hparams), k, sampler, tree)

    entry = registry.Entry("eagle3_reduced", registry.get("eagle3").settings, None, example=example)
    monkeypatch.setitem(registry.DRAFTERS, "eagle3_reduced", entry)
    report = verify_exactness.verify("eagle3_reduced", ("tokenwise",), tree="dynamic:2,2,4")
    assert report.passed and report.greedy_identical, report.format()

    sampler, n = Sampler(1.0), 10_000
    d, dparams = example(target, 2, None, sampler)
    spec = GenerateSpec(3, sampler, eos_id=None)
    gen = speculative_generate(cfg, target.graphdef, target.params, d, dparams, [[1, 3]] * n, spec, seed=4)
    assert 0.05 < summarize(gen.stats)["draft_efficiency"] < 0.95  # drafts are accepted and rejected
    exact = verify_exactness.target_distribution(cfg, target.graphdef, target.params, [1, 3], sampler, 3)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), ids)
    for position in (1, 2):  # emitted by speculative rounds
        p = exact.reshape((cfg.vocab_size,) * 3).sum(axis=tuple(a for a in range(3) if a != position))
        p_out = p[outside].sum() / p.sum()
        seen = np.isin(np.asarray(gen.tokens)[:, position], outside).mean()
        assert p_out > 0.1 and abs(seen - p_out) < 4 * np.sqrt(p_out * (1 - p_out) / n), (
            position,
            seen,
            p_out,
        )


# --- training-time test -------------------------------------------------------------------------------------


@precision.follows_params  # the reference's own products at the weights' precision, as the library's
def unrolled_by_hand(params, graphdef, feats, tokens, step_weight, step1_input):
    """The unroll-2 loss as drafting computes it, anchor by anchor: the head reads slots 0..i with the target's
    features, then one more step at position i + 1 on `step1_input(its output, i)`, seeing slots 0..i and itself;
    step j's cross-entropy is against the target's distribution of token i + j + 2."""
    cfg = layer_config(TINY)
    b, t, width = feats.shape
    taps, final = feats[..., : width - cfg.dim], feats[..., width - cfg.dim :]
    target_probs = jax.nn.softmax(jnp.einsum("btd,vd->btv", final, params["unembed"]), -1)
    fused = eagle3_fuse(graphdef, params, taps)
    ces = [[], []]
    for i in range(t - 1):
        cache = init_cache(cfg, b, t + 1)
        positions = jnp.broadcast_to(jnp.arange(i + 1), (b, i + 1))
        logits, out, cache = eagle3_apply(
            graphdef,
            params,
            tokens[:, 1 : i + 2],
            fused[:, : i + 1],
            positions,
            cache,
            jnp.tril(jnp.ones((i + 1, i + 1), bool)),
        )
        ces[0].append(-jnp.sum(target_probs[:, i + 1] * jax.nn.log_softmax(logits[:, i]), -1))
        if i + 2 <= t - 1:
            logits1, _, _ = eagle3_apply(
                graphdef,
                params,
                tokens[:, i + 2 : i + 3],
                step1_input(out[:, i : i + 1], i),
                jnp.full((b, 1), i + 1),
                cache.with_length(jnp.full((b,), i + 1)),
                jnp.ones((1, 1), bool),
            )
            ces[1].append(-jnp.sum(target_probs[:, i + 2] * jax.nn.log_softmax(logits1[:, 0]), -1))
    return jnp.mean(jnp.stack(ces[0])) + step_weight * jnp.mean(jnp.stack(ces[1]))


@precision.follows_params
def eagle3_fuse(graphdef, params, taps):
    from flax import nnx

    return nnx.merge(graphdef, params["head"]).fuse(taps)


@pytest.fixture(scope="module")
def training_case():
    graphdef, params = TARGET
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, TINY.vocab_size, (2, 6)), jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, (1, 0))
    meta, hgraph, hparams = eagle3(TINY, params)
    return hgraph, heads.drafter_params(meta, hparams, TINY, params), feats, tokens


def test_unroll_one_is_the_teacher_forced_loss(training_case):
    """With one step, the loss is EAGLE-1's teacher-forced cross-entropy: every anchor reads the target's
    features and predicts the next token."""
    hgraph, dparams, feats, tokens = training_case
    cfg, n = layer_config(TINY), tokens.shape[1] - 1
    loss, _ = eagle3_loss(
        hgraph, cfg, dparams, feats, tokens, jnp.ones_like(tokens), unroll=1, step_weight=0.8
    )
    taps, final = feats[..., : -cfg.dim], feats[..., -cfg.dim :]
    logits, _, _ = eagle3_apply(
        hgraph,
        dparams,
        tokens[:, 1:],
        eagle3_fuse(hgraph, dparams, taps[:, :-1]),
        jnp.broadcast_to(jnp.arange(n), (2, n)),
        init_cache(cfg, 2, n),
        jnp.tril(jnp.ones((n, n), bool)),
    )
    unembedded = precision.follows_params(lambda f, w: jnp.einsum("btd,vd->btv", f, w))
    target = jax.nn.softmax(unembedded(final[:, 1:], dparams["unembed"]), -1)
    expected = jnp.mean(-jnp.sum(target * jax.nn.log_softmax(logits), -1))
    assert_close(loss, expected, dtype=jnp.float32, depth=LOSS_DEPTH)


def test_unrolled_gradient_flows_through_the_heads_own_features(training_case):
    hgraph, dparams, feats, tokens = training_case
    cfg = layer_config(TINY)
    head_params = dparams["head"]
    with_head = lambda hp: {**dparams, "head": hp}

    def by_hand(step1_input):  # compiled whole: op by op, each anchor's shapes compile anew
        loss = lambda hp: unrolled_by_hand(with_head(hp), hgraph, feats, tokens, 0.8, step1_input)
        return jax.jit(jax.value_and_grad(loss))(head_params)

    loss, grad = jax.jit(
        jax.value_and_grad(
            lambda hp: eagle3_loss(
                hgraph, cfg, with_head(hp), feats, tokens, jnp.ones_like(tokens), unroll=2, step_weight=0.8
            )[0]
        )
    )(head_params)
    ref_loss, ref_grad = by_hand(lambda out, i: out)
    depth = 2 * LOSS_DEPTH  # two unrolled steps, each leaf's gradient at its own magnitude
    assert_close(loss, ref_loss, dtype=jnp.float32, depth=depth)
    jax.tree.map(lambda a, b: assert_close(a, b, dtype=jnp.float32, depth=2 * depth), grad, ref_grad)
    # controls, at the largest leaf's magnitude: a detached feature, or the target's feature in place of the head's
    # own (teacher forcing; it moves the loss by only 4e-5 of itself), change the gradient
    flat = lambda tree: np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    _, detached = by_hand(lambda out, i: jax.lax.stop_gradient(out))
    assert_far(flat(detached), flat(grad), dtype=jnp.float32, depth=2 * depth)
    true_feature = lambda out, i: eagle3_fuse(hgraph, dparams, feats[:, i + 1 : i + 2, : -cfg.dim])
    _, swapped = by_hand(true_feature)
    assert_far(flat(swapped), flat(grad), dtype=jnp.float32, depth=2 * depth)


# --- heads that do not fit ----------------------------------------------------------------------------------


def test_heads_for_another_target_are_refused():
    graphdef, params = TARGET
    head = eagle3(TINY, params, layers=(1, 0))
    d, dparams = drafter(TINY, params, head, 3, Sampler())
    with pytest.raises(ValueError, match=r"fuses layers \[1, 0\] but the target has 1 layers"):
        speculative_generate(TINY.replace(n_layers=1), None, None, d, dparams, [[1, 2]], GenerateSpec(4))
    with pytest.raises(ValueError, match="train a head for this target"):
        speculative_generate(TINY.replace(dim=16), None, None, d, dparams, [[1, 2]], GenerateSpec(4))


def test_a_published_export_decodes_like_the_committed_head(stories, tmp_path, offline_hub):
    """`--heads=DIR` with the committed head exported in the EAGLE-3 authors' layout (specjax.published) drafts
    the same tokens as the committed head; a hub id that cannot be downloaded is a clear error."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    entry = registry.get("eagle3")
    meta, _, hparams = heads.load_heads(heads.COMMITTED / "stories260K_eagle3", cfg, params)
    published.export_published(meta, hparams, tmp_path / "hub_layout", cfg)
    runs = []
    for source in (None, str(tmp_path / "hub_layout")):
        d, dparams = entry.build(stories, entry.settings(heads=source), 4, None, Sampler())
        gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
        runs.append((np.asarray(gen.tokens), summarize(gen.stats)["tau"]))
    np.testing.assert_array_equal(runs[0][0], ar)
    np.testing.assert_array_equal(runs[1][0], ar)
    assert runs[0][1] == runs[1][1]
    with pytest.raises(CheckpointError, match="could not be downloaded from the Hugging Face hub"):
        entry.build(stories, entry.settings(heads="no-such-org/no-such-head"), 4, None, Sampler())
