"""DFlash: greedy decoding equals AR for chains, static and dynamic trees with ragged prompts; sampled dynamic
trees pass verify_exactness (its negative control caught); the training loss's blocks compute exactly what
drafting computes at the same anchor (a block seeing later context would be caught); anchors respect the loss
mask; heads that do not fit a target are refused; the committed stories260K head drafts AR's tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case
from tolerance import assert_close, assert_far, forward_depth

from specjax import heads, verify_exactness
from specjax.decoding import generate, speculative_generate
from specjax.drafters.dflash import (
    DFlash,
    choose_anchors,
    dflash_block,
    dflash_extend,
    draft_config,
    greedy_tokens_per_round,
    paper_layers,
)
from specjax.drafting import registry
from specjax.drafting.layouts import best_length
from specjax.drafting.trees import DynamicTree, balanced
from specjax.errors import HeadsError
from specjax.metrics import summarize
from specjax.models.llama import init_cache
from specjax.sampling import Sampler
from specjax.training.losses import target_features

LAYERS = (1, 0)
OWN = [2, 1, 24]


def dflash(
    cfg,
    params,
    n_layers=2,
    block_size=4,
    seed=3,
    confidence=False,
    learned_masks=False,
    attention=None,
    markov=0,
):
    """(meta, graphdef, head params) of a fresh DFlash head (`attention`: its own heads; `markov`: a Markov head's
    rank); learned MASK embeddings and the Markov head's bias moved off their start."""
    shape = {"layers": list(LAYERS), "n_layers": n_layers, "block_size": block_size, "mask_token": 0}
    shape |= {"attention": attention} if attention else {}
    shape |= {"markov": markov} if markov else {}
    shape |= ({"confidence": True} if confidence else {}) | (
        {"learned_masks": True} if learned_masks else {}
    )
    meta = heads.describe("dflash", shape, cfg)
    graphdef, hparams = heads.new_heads(meta, cfg, params, seed)
    if learned_masks:
        noise = np.random.default_rng(seed).standard_normal(hparams["masks"].shape)
        hparams["masks"] = hparams["masks"] + jnp.asarray(noise, hparams["masks"].dtype)
    if markov:
        hparams["markov"]["out"] = jnp.asarray(
            20 * np.random.default_rng(seed).standard_normal((markov, cfg.vocab_size))
        )
    return meta, graphdef, hparams


def drafter(cfg, params, head, k, sampler=Sampler(), tree=None):  # noqa: B008 (frozen)
    meta, graphdef, hparams = head
    d = heads.make_drafter(meta, graphdef, cfg, k, sampler, tree)
    return d, heads.drafter_params(meta, hparams, cfg, params)


@pytest.mark.parametrize("markov", [0, 8])
def test_greedy_equals_ar(markov):
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    head = dflash(cfg, params, markov=markov)
    for tree in (None, balanced(2, 3), DynamicTree(3, 3, 8)):
        d, dparams = drafter(cfg, params, head, 3, tree=tree)
        gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=str(tree))


def test_dynamic_tree_sampling_is_exact():
    """One-sample chi-square against the enumerated target distribution, with the no-residual control caught (the
    chain's case, token-wise and block, is test_verification's, as every drafter's; greedy trees are
    test_greedy_equals_ar's)."""
    report = verify_exactness.verify("dflash", ("tokenwise",), tree="dynamic:2,2,4", greedy=False)
    assert report.passed, report.format()


def test_a_markov_head_tilts_each_draft_by_the_token_before_it():
    """With a Markov head, draft token i is drawn from the plain head's distribution at position i tilted by the
    Markov bias of draft token i - 1 (of the pending token for i = 1): log q - log q_plain - bias is constant."""
    graphdef, params = TARGET
    meta, hgraph, hparams = dflash(TINY, params, markov=8)
    tokens = jnp.asarray(np.random.default_rng(5).integers(3, TINY.vocab_size, (2, 8)), jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    plain = hparams | {"markov": {**hparams["markov"], "out": jnp.zeros_like(hparams["markov"]["out"])}}

    def draft(hp):
        d, dparams = drafter(TINY, params, (meta, hgraph, hp), 3, Sampler(1.0))
        state = d.init(dparams, tokens[:, :6], jnp.full((2,), 6), 32, feats[:, :6])
        return d.propose(dparams, state, tokens, jnp.full((2,), 7), jax.random.key(1))[0]

    tilted, untilted = draft(hparams), draft(plain)
    previous = jnp.concatenate([tokens[:, 6:7], tilted.tokens[:, :-1]], 1)
    bias = jnp.take(hparams["markov"]["inp"], previous, axis=0) @ hparams["markov"]["out"]
    gap = jnp.log(tilted.q_probs) - jnp.log(untilted.q_probs) - bias
    spread = gap - jnp.mean(gap, -1, keepdims=True)
    scale = float(jnp.abs(jnp.log(tilted.q_probs)).max() + jnp.abs(bias).max())
    assert_close(spread, jnp.zeros_like(spread), dtype=jnp.float32, depth=4, magnitude=scale)
    assert float(jnp.abs(bias - jnp.mean(bias, -1, keepdims=True)).max()) > 1.0  # the bias does tilt


def test_paper_layers():
    """z-lab's rule: the middle layer for one draft layer, else spread evenly over layers 1 .. L - 3."""
    assert paper_layers(36, 1) == (18,)
    assert paper_layers(36, 5) == (1, 9, 17, 25, 33)
    assert paper_layers(5, 2) == (1, 2)


def test_anchors_follow_the_loss_mask():
    mask = np.zeros((3, 12), np.int32)
    mask[0, 5:9] = 1  # anchors 4..7 predict a token with loss mask 1
    mask[1] = 1  # anchors 1..10
    anchors, valid = choose_anchors(jax.random.key(0), jnp.asarray(mask), 6)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    assert sorted(anchors[0][valid[0]]) == [4, 5, 6, 7] and valid[0].sum() == 4
    assert valid[1].all() and len(set(anchors[1])) == 6 and set(anchors[1]) <= set(range(1, 11))
    assert not valid[2].any()


def test_greedy_tokens_per_round_stop_at_a_position_the_loss_mask_leaves_out():
    """Two blocks of 4: one agrees at positions 1, 2 and 4 with position 3 masked out, one agrees at 1 then
    misses: 1 + (2 + 1) / 2 tokens a round. The masked position's agreement is unknown: the run stops there
    (counting on past it, the old rule, gives 1 + (3 + 1) / 2); an uncounted block is left out."""
    hit = jnp.asarray([[[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]]], bool)
    counted = jnp.asarray([[[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]], bool)
    assert float(greedy_tokens_per_round(hit, counted)) == 2.5
    run_past_the_mask = jnp.cumprod(hit | ~counted, axis=-1) & counted  # the control: counts position 4
    assert float(1 + jnp.sum(run_past_the_mask) / 2) == 3.0


@pytest.fixture(scope="module")
def training_case():
    graphdef, params = TARGET
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, TINY.vocab_size, (2, 14)), jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    # the draft's own attention heads: 2 query heads of dim 24 sharing one key/value head (TINY's: 4 of 8, 2 of 8)
    meta, hgraph, hparams = dflash(
        TINY, params, block_size=4, confidence=True, learned_masks=True, attention=OWN, markov=4
    )
    return hgraph, heads.drafter_params(meta, hparams, TINY, params), feats, tokens


def drafted_logits(hgraph, dparams, feats, tokens, anchor, block_size, context=None):
    """The drafting path: the context before `anchor` written into the draft cache, then the block."""
    b = tokens.shape[0]
    n = len(LAYERS) * TINY.dim
    context = anchor if context is None else context
    cache = init_cache(draft_config(TINY, {"n_layers": 2, "attention": OWN}), b, 32)
    positions = jnp.broadcast_to(jnp.arange(context), (b, context))
    cache = dflash_extend(hgraph, dparams, feats[:, :context, :n], positions, cache).with_length(
        jnp.full((b,), context)
    )
    block = jnp.concatenate([tokens[:, anchor : anchor + 1], jnp.zeros((b, block_size - 1), jnp.int32)], 1)
    positions = jnp.broadcast_to(anchor + jnp.arange(block_size), (b, block_size))
    return dflash_block(hgraph, dparams, block, positions, cache)[0]


def test_a_shorter_chain_drafts_from_the_trained_block():
    """A head trained on blocks of 4 drafting k = 1 proposes what the whole block's first position is (k = 3's), not
    what a pass of k + 1 tokens gives (the masks attend to each other: a block of 2 drafts another distribution)."""
    import dataclasses

    graphdef, params = TARGET
    tokens = jnp.asarray([[5, 9, 3, 7, 2, 11]], jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    meta, hgraph, hparams = dflash(TINY, params, block_size=4)
    dparams = heads.drafter_params(meta, hparams, TINY, params)
    length = jnp.asarray([tokens.shape[1]])
    seq = jnp.zeros((1, 32), jnp.int32).at[:, : tokens.shape[1]].set(tokens)

    def first(drafter):  # the distribution of draft token 1
        state = drafter.init(dparams, tokens, length, 32, feats)
        return drafter.propose(dparams, state, seq, length, jax.random.key(0))[0].q_probs[0, 0]

    make = lambda k: heads.make_drafter(meta, hgraph, TINY, k, Sampler(1.0))
    assert make(1).block == make(3).block == 4 and make(5).block == 6
    whole = first(make(3))
    assert_close(first(make(1)), whole, dtype=jnp.float32, depth=forward_depth(2) + 2)
    assert_far(first(dataclasses.replace(make(1), block_size=0)), whole, dtype=jnp.float32)


def test_training_blocks_are_the_drafting_pass(training_case):
    """Each training block's logits equal the drafting pass at its anchor (context written to the cache, then
    the block), for several anchors at once; a block that also saw its anchor's own context feature differs."""
    from flax import nnx

    from specjax import precision

    hgraph, dparams, feats, tokens = training_case
    n, bs = len(LAYERS) * TINY.dim, 4
    anchors = jnp.asarray([[2, 5, 9], [1, 6, 10]])
    offsets = jnp.arange(bs)
    positions = anchors[:, :, None] + offsets
    block = jnp.where(offsets == 0, jnp.take_along_axis(tokens, anchors, 1)[:, :, None], 0)

    @precision.follows_params
    def trained(dparams):
        head = nnx.merge(hgraph, dparams["head"])
        x = head.blocks(head.embed(dparams["embed"], block), positions, feats[..., :n], anchors)
        return jnp.einsum("bntd,vd->bntv", x, dparams["unembed"])

    got = trained(dparams)
    depth = forward_depth(2) + 2  # the fusion and its norm
    for row in range(2):
        for j in range(3):
            a = int(anchors[row, j])
            want = drafted_logits(hgraph, dparams, feats, tokens, a, bs)[row]
            assert_close(got[row, j], want, dtype=jnp.float32, depth=depth)
    leaky = drafted_logits(hgraph, dparams, feats, tokens, 5, bs, context=6)[0]
    assert_far(got[0, 1], leaky, dtype=jnp.float32, depth=depth)


def test_loss_reaches_every_head_parameter(training_case):
    """The loss is finite, its greedy tau estimate within [1, B], and every head parameter (the confidence head's
    too) has a gradient."""
    from specjax.drafters.dflash import dflash_loss

    hgraph, dparams, feats, tokens = training_case
    mask = jnp.ones(tokens.shape, jnp.int32)

    def loss(p):
        return dflash_loss(
            hgraph, TINY.dim, p, feats, tokens, mask, jax.random.key(0), 3, 4, 4.0, "forward_kl", 0, 1.0
        )

    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(dparams)
    assert np.isfinite(float(value)) and 1.0 <= float(metrics["tau_greedy"]) <= 4.0
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads["head"]))


def test_the_loss_tilts_position_i_by_the_datas_token_before_it():
    """A Markov head that puts +50 on each token's successor in the data makes the cross-entropy against the data
    vanish: position i is tilted after the data's token a + i - 1 (the anchor at i = 1); towards the successor's
    successor (off by one) it costs about 50."""
    from specjax.drafters.dflash import dflash_loss

    graphdef, params = TARGET
    v = TINY.vocab_size
    order = np.random.default_rng(6).permutation(np.arange(3, v))[:28]
    tokens = jnp.asarray(order.reshape(2, 14), jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    mask = jnp.ones(tokens.shape, jnp.int32)
    meta, hgraph, hparams = dflash(TINY, params, markov=v)

    def loss(steps):
        out = np.zeros((v, v), np.float32)
        for row in order.reshape(2, 14):
            out[row[:-steps], row[steps:]] = 50.0
        hp = hparams | {"markov": {"inp": jnp.eye(v), "out": jnp.asarray(out)}}
        dparams = heads.drafter_params(meta, hp, TINY, params)
        args = (jax.random.key(0), 3, 4, 4.0, "cross_entropy", 0, 1.0)
        return float(dflash_loss(hgraph, TINY.dim, dparams, feats, tokens, mask, *args)[0])

    assert loss(1) < 1e-3
    assert loss(2) > 10.0


def test_learned_masks_are_the_block_inputs(training_case):
    """A head's learned MASK embeddings are its block's inputs after the anchor: at their start (the target's
    embedding of mask_token) it drafts what the same head without them drafts; moved, it drafts otherwise."""
    hgraph, dparams, feats, tokens = training_case
    plain_meta, plain_graph, _ = dflash(
        TINY, TARGET[1], block_size=4, confidence=True, attention=OWN, markov=4
    )
    plain = dparams | {"head": {k: v for k, v in dparams["head"].items() if k != "masks"}}
    start = dparams | {"head": dparams["head"] | {"masks": jnp.tile(dparams["embed"][:1], (3, 1))}}
    depth = forward_depth(2) + 2
    want = drafted_logits(plain_graph, plain, feats, tokens, 5, 4)
    assert_close(drafted_logits(hgraph, start, feats, tokens, 5, 4), want, dtype=jnp.float32, depth=depth)
    assert_far(drafted_logits(hgraph, dparams, feats, tokens, 5, 4), want, dtype=jnp.float32, depth=depth)


def test_learned_masks_bound_the_draft(training_case):
    """A head with learned MASK embeddings drafts at most its block's B - 1 tokens (in every K adaptive K may
    choose), and z-lab's layout, which has one MASK, refuses it."""
    from specjax.drafters import dflash_zlab
    from specjax.errors import DrafterError

    graphdef, params = TARGET
    meta, hgraph, hparams = dflash(TINY, params, block_size=4, learned_masks=True)
    d, _ = drafter(TINY, params, (meta, hgraph, hparams), 3)
    with pytest.raises(DrafterError, match="k=4 is longer than this DFlash head's block of 4"):
        d.with_k(4)
    with pytest.raises(HeadsError, match="learned a MASK embedding per block position"):
        dflash_zlab.published_files(meta, jax.tree.map(np.asarray, hparams), TINY)


def test_head_for_another_target_is_refused():
    graphdef, params = TARGET
    head = dflash(TINY, params)
    d, _ = drafter(TINY, params, head, 3)
    with pytest.raises(HeadsError, match="DFlash head was built for a target"):
        d.validate(TINY.replace(dim=48))
    trained = registry.trained("dflash")
    with pytest.raises(HeadsError, match="heads.layers"):  # a context layer the target lacks
        trained.shape_of(trained.settings(layers=(5,)), TINY, None)
    with pytest.raises(HeadsError, match="n_heads=3 is not a multiple of heads.n_kv_heads=2"):
        trained.shape_of(trained.settings(layers=(1,), n_heads=3), TINY, None)  # TINY's 2 key/value heads
    own = trained.shape_of(trained.settings(layers=(1,), head_dim=16), TINY, None)
    assert own["attention"] == [TINY.n_heads, TINY.n_kv_heads, 16]
    assert "attention" not in trained.shape_of(trained.settings(layers=(1,), n_heads=4), TINY, None)


def test_committed_head_drafts_ar_tokens(stories):
    """The committed stories260K head (`make heads`): AR's tokens from its whole block, its confidence-sized
    rounds and its dynamic tree, and its drafts are accepted (a fresh head's are not: tau about 1)."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    entry = registry.get("dflash")
    for k, tree, confidence in ((7, None, False), (15, None, True), (6, DynamicTree(8, 6, 48), False)):
        d, dparams = entry.build(stories, entry.settings(confidence=confidence), k, tree, Sampler())
        gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
        assert summarize(gen.stats)["tau"] > 1.6, (k, tree, confidence)


# --- the confidence head: each round verifies the prefix it expects to pay ------------------------------------


class VaryingChoice(DFlash):
    """A confidence-sized drafter whose choice varies from round to round with the block (whatever the head's
    scores), so the tests see every branch of the compiled round."""

    def gains(self, confidence_BK2):
        choice = (jnp.sum(jnp.abs(confidence_BK2)) * 1e3).astype(jnp.int32) % len(self.verify_lengths)
        rows = confidence_BK2.shape[0]
        return jnp.broadcast_to(
            jax.nn.one_hot(choice, len(self.verify_lengths)), (rows, len(self.verify_lengths))
        )


def confident(cfg, params, seed=3):
    """make(k, sampler, tree) -> (VaryingChoice drafter, params) of a fresh head with a confidence head."""
    shape = {"layers": list(LAYERS), "n_layers": 1, "block_size": 4, "mask_token": 0, "confidence": True}
    meta = heads.describe(
        "dflash", shape | {"markov": 4}, cfg
    )  # the confidence head reads the Markov embedding
    graphdef, hparams = heads.new_heads(meta, cfg, params, seed)
    hparams["markov"]["out"] = 5 * jax.random.normal(jax.random.key(seed), hparams["markov"]["out"].shape)

    def make(k, sampler, tree=None):
        d = heads.make_drafter(meta, graphdef, cfg, k, sampler, tree)
        fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
        return VaryingChoice(**fields), heads.drafter_params(meta, hparams, cfg, params)

    return make


def test_the_choice_maximises_expected_tokens_per_cost():
    """The verified length maximises the live rows' mean expected tokens per cost; a row that has ended does not
    size the round (here it would: both rows together choose 7 tokens, the second alone 2)."""
    d = DFlash(TINY, None, 7, Sampler(), has_confidence=True, verify_cost=0.1)
    assert d.verify_lengths == (2, 4, 7)
    p = np.array([[0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [0.9, 0.8, 0.1, 0.5, 0.5, 0.5, 0.5]])
    cases = [([0], [True], 0), ([1], [True], 0), ([0, 1], [True, True], 0), ([1], [True], 1)]
    cases.append(([0, 1], [False, True], 0))
    chosen = []
    for rows, live, sampler_column in cases:
        conf = np.zeros((len(rows), 7, 2), np.float32)
        conf[..., sampler_column] = np.log(p[rows] / (1 - p[rows]))  # logits of p
        sampler = Sampler() if sampler_column == 0 else Sampler(1.0)
        gains_BM = dataclasses.replace(d, sampler=sampler).gains(jnp.asarray(conf))
        choice = int(best_length(gains_BM, jnp.asarray(live)))
        counted = [r for r, alive in zip(rows, live) if alive]
        gains = [
            np.mean(1 + np.cumsum(np.cumprod(p[counted], 1), 1)[:, m - 1]) / (1 + 0.1 * m)
            for m in (2, 4, 7)
        ]
        assert choice == int(np.argmax(gains)), (rows, live, gains)
        chosen.append(d.verify_lengths[choice])
    assert chosen[2] == 7 and chosen[4] == 2  # the control: live, the first row would make it 7
    assert dataclasses.replace(d, confidence=False).verify_lengths == ()
    assert dataclasses.replace(d, tree=balanced(2, 7)).verify_lengths == ()  # trees verify whole


def test_confidence_sized_rounds_equal_ar():
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    d, dparams = confident(cfg, params)(7, Sampler())
    gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    chosen = np.flatnonzero(gen.stats.k_hist)  # rounds by verified length
    np.testing.assert_array_equal(chosen, [2, 4, 7])


class FirstRowLong(DFlash):
    """The first row rates the longest verified length best, the others the shortest (by less)."""

    def gains(self, confidence_BK2):
        m = len(self.verify_lengths)
        first = jnp.arange(confidence_BK2.shape[0])[:, None] == 0
        return jnp.where(first, jax.nn.one_hot(m - 1, m), 0.1 * jax.nn.one_hot(0, m))


def test_a_row_that_has_ended_does_not_size_the_round():
    """Greedy, the first row ends at an EOS the others emit later: while it is live every round verifies the
    length it rates best (the longest), after it ended the shortest, which the others rate best."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    first_at = lambda row, t: next((i for i, x in enumerate(row) if x == t), len(row))
    eos = next(int(t) for t in ar[0, 2:] if all(first_at(r, t) > first_at(ar[0], t) + 8 for r in ar[1:]))
    spec = dataclasses.replace(spec, eos_id=eos)
    d, dparams = confident(cfg, params)(7, Sampler())
    d = FirstRowLong(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)})
    gen = speculative_generate(cfg, graphdef, params, d, dparams, prompts, spec)
    np.testing.assert_array_equal(gen.tokens, generate(cfg, graphdef, params, prompts, spec).tokens)
    by_length = np.asarray(gen.stats.k_hist)
    first_row_rounds = int(np.asarray(gen.stats.row_hist)[0].sum())
    assert by_length[7] == len(prompts) * first_row_rounds and by_length[2] > 0
    assert by_length.sum() == by_length[2] + by_length[7]


def test_confidence_sized_sampling_is_exact(monkeypatch):
    """Token-wise and block verification of chains whose verified length changes from round to round pass
    verify_exactness, their controls caught."""
    entry = registry.Entry(
        "dflash_sized",
        registry.get("dflash").settings,
        None,
        example=lambda target, k, tree, sampler: confident(target.cfg, target.params)(k, sampler, tree),
    )
    monkeypatch.setitem(registry.DRAFTERS, "dflash_sized", entry)
    report = verify_exactness.verify("dflash_sized", ("tokenwise", "block"), k=3, greedy=False)
    assert report.passed, report.format()  # greedy: test_confidence_sized_rounds_equal_ar


def test_a_sampled_round_verifies_a_length_chosen_from_its_context_alone():
    """With a Markov head the confidence of position i + 1 reads the token before it. A length chosen from the
    sampled tokens would verify a token more often where the head trusts it (the output then leans towards such
    tokens); the confidence reads the block's greedy path instead, so at T = 1 every key drafts different tokens and
    verifies the same length. The control: the same head's choice from the sampled tokens changes with the key."""
    from flax import nnx

    graphdef, params = TARGET
    meta, hgraph, hparams = dflash(TINY, params, markov=8, confidence=True)
    # a sampled position's confidence near 0 or 1, set by the token before it alone
    weight = np.zeros(hparams["confidence"]["weight"].shape, np.float32)
    weight[1, TINY.dim :] = 300 * np.random.default_rng(0).standard_normal(8)
    hparams["confidence"]["weight"] = jnp.asarray(weight)
    d, dparams = drafter(TINY, params, (meta, hgraph, hparams), 7, Sampler(1.0))
    assert d.verify_lengths == (2, 4, 7)
    tokens = jnp.asarray([[5, 9, 3, 7, 2, 11, 4]], jnp.int32)
    feats = target_features(TINY, graphdef, params, tokens, LAYERS)
    state = d.init(dparams, tokens[:, :6], jnp.full((1,), 6), 32, feats[:, :6])
    n = jnp.full((1,), 7)
    block = jnp.concatenate([tokens[:, 6:], jnp.zeros((1, d.block - 1), jnp.int32)], 1)
    x = dflash_block(d.graphdef, dparams, block, 6 + jnp.arange(d.block)[None], state.cache)[1][:, 1:8]
    head = nnx.merge(d.graphdef, dparams["head"])
    chosen, from_samples, drafts = set(), set(), set()
    for seed in range(24):
        draft = d.propose(dparams, state, tokens, n, jax.random.key(seed))[0]
        chosen.add(int(best_length(draft.scores, jnp.ones(1, bool))))
        drafts.add(tuple(np.asarray(draft.tokens[0]).tolist()))
        sampled = jnp.concatenate([tokens[:, 6:], draft.tokens[:, :-1]], 1)
        from_samples.add(int(best_length(d.gains(head.acceptance(x, sampled)), jnp.ones(1, bool))))
    assert len(drafts) > 12 and len(chosen) == 1
    assert len(from_samples) > 1  # the control


@pytest.mark.parametrize("attention, markov", [(None, 0), ([4, 2, 16], 0), (None, 8)])
def test_expanded_head_drafts_the_same_distributions(stories, attention, markov):
    """On the function-preserving expansion of stories260K (`specjax.expand`), the expanded head's block
    logits, Markov biases and confidence scores equal the original's (its per-head norms see the wide heads), for a
    head with the target's attention heads, one with its own (kept as they are) and one with a Markov head; a head
    of the target's heads expanded as a plain target layer (query and key rows unscaled for the norms over the wider
    heads) does not."""
    from flax import nnx

    from specjax import expand

    e = expand.SMOKE
    big = expand.expand(stories.cfg, stories.params, e)
    shape = {"layers": [0, 2, 4], "n_layers": 2, "block_size": 8, "mask_token": 0, "confidence": True}
    shape |= ({"attention": attention} if attention else {}) | ({"markov": markov} if markov else {})
    meta = heads.describe("dflash", shape | {"learned_masks": True}, stories.cfg)
    graphdef, hparams = heads.new_heads(meta, stories.cfg, stories.params, 1)
    # drafts far from uniform, learned MASK embeddings and the Markov head off their start
    hparams = jax.tree.map(lambda x: 3 * x + 0.1 if x.ndim == 2 else x, hparams)
    big_head = expand.expand_heads(meta, hparams, stories.cfg, big[0], big[2], e)
    tokens = jnp.asarray([stories.tokenizer.encode("Once upon a time there was a little dog")], jnp.int32)
    n = tokens.shape[1] - 1

    def block_logits(cfg, graphdef_, params_, head):
        m, hg, hp = head
        feats = target_features(cfg, graphdef_, params_, tokens, tuple(m["shape"]["layers"]))
        dparams = heads.drafter_params(m, hp, cfg, params_)
        cache = init_cache(draft_config(cfg, m["shape"]), 1, 32)
        taps = feats[:, :n, : 3 * cfg.dim]
        cache = dflash_extend(hg, dparams, taps, jnp.arange(n)[None], cache).with_length(jnp.array([n]))
        block = jnp.concatenate([tokens[:, n:], jnp.zeros((1, 7), jnp.int32)], 1)
        logits, x = dflash_block(hg, dparams, block, n + jnp.arange(8)[None], cache)
        head = nnx.merge(hg, dparams["head"])
        return jnp.concatenate([logits + head.bias(block), head.acceptance(x, block)], -1)

    small = block_logits(stories.cfg, stories.graphdef, stories.params, (meta, graphdef, hparams))
    wide = block_logits(big[0], big[1], big[2], big_head)
    depth = forward_depth(big[0].n_layers) + forward_depth(2)
    assert_close(
        wide, small, dtype=jnp.float32, depth=depth
    )  # the biased logits, then the confidence head's
    if attention:
        return
    plain = jax.tree.map(lambda x: x, big_head[2])
    for layer in plain["layers"].values():  # the layer as `Expander.block` makes it, norms only padded
        layer["k_norm"]["weight"] = jnp.ones_like(layer["k_norm"]["weight"])
    assert_far(
        block_logits(big[0], big[1], big[2], (big_head[0], big_head[1], plain)),
        small,
        dtype=jnp.float32,
        depth=depth,
    )
