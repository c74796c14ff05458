"""Tree speculation: tree specs, the sibling rule's exactness, greedy tree == AR, sampled trees distributed as AR."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import (
    RAGGED,
    SMALL,
    TARGET,
    first_three,
    greedy_case,
    peaked,
    run_patched,
    two_sample_pvalue,
)
from tolerance import assert_close, assert_far

from specjax.acceptance.rejection import sibling_step, tree_sampling
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafting.layouts import TreeLayout
from specjax.drafting.trees import PRESETS, DynamicTree, Tree, TreeError, balanced, chain
from specjax.metrics import summarize
from specjax.sampling import Sampler

DYNAMIC = [DynamicTree(2, 3, 6), DynamicTree(4, 4, 16)]
V = 5


# --- tree specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_mask_is_exactly_the_ancestors(name):
    tree = PRESETS[name]
    arr = tree.arrays
    nodes = [()] + list(tree.paths)
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            assert arr.mask[i, j] == (a[: len(b)] == b), (a, b)  # brute force: b is a prefix of a
    assert (arr.parent[1:] < np.arange(1, tree.size)).all()  # parents come first
    for i, p in enumerate(nodes[1:], start=1):
        assert [nodes[k] for k in arr.ancestors[i][: len(p)]] == [p[:d] for d in range(1, len(p) + 1)]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layout_from_parents_matches_static_arrays(name):
    tree = PRESETS[name]
    a = tree.arrays
    dynamic = TreeLayout.from_parents(jnp.asarray(a.parent)[None], tree.depth, a.children.shape[1])
    static = tree.layout(1)
    for got, want in zip(jax.tree.leaves(dynamic), jax.tree.leaves(static), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_invalid_dynamic_tree():
    with pytest.raises(TreeError, match="total_tokens <= 10"):
        DynamicTree(2, 3, 11)


def test_presets_shapes():
    assert chain(4).is_chain() and chain(4).depth == 4 and chain(4).size == 5
    assert balanced(2, 3).size == 1 + 2 + 4 + 8
    medusa = PRESETS["medusa60"]
    widths = [len(level) for level in medusa.arrays.levels]
    fan_out = (medusa.arrays.children >= 0).sum(1)
    assert medusa.size == 61 and fan_out[0] == 10 == fan_out.max()  # the root has the most candidates
    assert widths[2:] == sorted(widths[2:], reverse=True)  # narrowing with depth


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "at least one node"),
        ([[0], [0, 0], [0, 0]], r"duplicate path \[0, 0\]"),
        ([[0], [1, 0]], r"path \[1, 0\] has no parent: add \[1\]"),
        ([[0], [2]], r"path \[2\] skips a sibling: add \[1\]"),
        ([[0], [-1]], "ranks >= 0"),
    ],
)
def test_invalid_tree_specs(paths, message):
    with pytest.raises(TreeError, match=message):
        Tree(tuple(map(tuple, paths)))


def test_tree_beyond_the_cache():
    graphdef, params = TARGET
    drafter = DraftModel(TINY, graphdef, 4, tree=balanced(3, 4))  # 121 nodes
    with pytest.raises(ValueError, match="a tree of 121 nodes does not fit"):
        speculative_generate(
            TINY, graphdef, params, drafter, params, [[1, 2]], GenerateSpec(20, cache_size=128)
        )


# --- the sibling rule, exactly -------------------------------------------------------------------------


def random_dist(rng, zeros=1):
    p = rng.gamma(0.7, size=V)
    p[rng.choice(V, zeros, replace=False)] = 0
    return p / p.sum()


def one_level_distribution(p, q, m, scheme, renormalise=True):
    """Exact output distribution of one tree level with m sibling candidates, by enumerating every
    ordered candidate list and every accept/reject outcome with the library's `sibling_step`."""
    out = np.zeros(V)
    if scheme == "deterministic":  # the m best draft tokens, each a point mass
        lists = [(tuple(np.argsort(-q, kind="stable")[:m]), 1.0)]
    elif scheme == "with_replacement":
        lists = [(xs, np.prod([q[x] for x in xs])) for xs in itertools.product(range(V), repeat=m)]
    else:  # without replacement: sequential draws from q with drawn tokens removed
        lists = []
        for xs in itertools.permutations(range(V), m):
            w, rest = 1.0, q.copy()
            for x in xs:
                w *= rest[x] / rest.sum() if rest.sum() > 0 else 0.0
                rest[x] = 0
            lists.append((xs, w))
    for xs, weight in lists:
        if weight == 0:
            continue
        p_cur, q_cur, reach = jnp.array([p]), jnp.array([q]), 1.0
        for x in xs:
            q_x = jax.nn.one_hot(jnp.array([x]), V) if scheme == "deterministic" else q_cur
            a, p_rej, q_rej = sibling_step(p_cur, q_x, jnp.array([x]), scheme == "without_replacement")
            a = float(a[0])
            out[x] += weight * reach * a
            reach *= 1 - a
            p_cur = p_rej
            if scheme != "deterministic" and renormalise:
                q_cur = q_rej
        out += weight * reach * np.asarray(p_cur[0])
    return out


SIBLING_DEPTH = (
    5  # p and q rounded, the ratio, the residual's difference and normalisation, q's renormalisation
)


@pytest.mark.parametrize("scheme", ["deterministic", "with_replacement", "without_replacement"])
@pytest.mark.parametrize("seed", range(3))
def test_sibling_rule_output_distribution_is_p(scheme, seed):
    rng = np.random.default_rng(seed)
    p, q = random_dist(rng), random_dist(rng)
    for m in (1, 2, 3):  # m siblings: m float32 steps of ratio, residual and normalisations
        assert_close(one_level_distribution(p, q, m, scheme), p, dtype=jnp.float32, depth=SIBLING_DEPTH * m)


def test_sibling_rule_negative_control_without_renormalising_q():
    rng = np.random.default_rng(1)
    p, q = random_dist(rng), random_dist(rng)
    broken = one_level_distribution(p, q, 3, "without_replacement", renormalise=False)
    assert_far(broken, p, dtype=jnp.float32, depth=SIBLING_DEPTH * 3)


def test_tree_sampling_one_level_frequencies():
    """tree_sampling itself, on a one-level tree of 3 sampled siblings, emits first tokens distributed as p."""
    rng = np.random.default_rng(4)
    p, q = random_dist(rng), random_dist(rng)
    n, tree = 100_000, Tree(((0,), (1,), (2,)))
    scores = jnp.log(jnp.asarray(q, jnp.float32)) + jax.random.gumbel(jax.random.key(0), (n, V))
    draft = jax.lax.top_k(scores, 3)[1].astype(jnp.int32)  # without replacement
    p_b = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 4, V))
    q_b = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 3, V))
    layout = tree.layout(n)
    n_acc, nxt, path = tree_sampling(jax.random.key(1), layout, draft, q_b, p_b, without_replacement=True)
    first = np.where(
        np.asarray(n_acc) == 1, np.asarray(draft)[np.arange(n), np.asarray(path[:, 0]) - 1], np.asarray(nxt)
    )
    np.testing.assert_allclose(np.bincount(first, minlength=V) / n, p, atol=4 * np.sqrt(0.25 / n))


# --- end to end ------------------------------------------------------------------------------------------


def test_chain_tree_equals_chain():
    graphdef, params = TARGET
    short = truncated_target(TINY, params, 1)
    spec = GenerateSpec(30, eos_id=None)
    as_chain = speculative_generate(
        TINY, graphdef, params, DraftModel(short[0], short[1], 3), short[2], RAGGED, spec
    )
    as_tree = speculative_generate(
        TINY, graphdef, params, DraftModel(short[0], short[1], 3, tree=chain(3)), short[2], RAGGED, spec
    )
    np.testing.assert_array_equal(np.asarray(as_tree.tokens), np.asarray(as_chain.tokens))
    for a, b in zip(jax.tree.leaves(as_chain.stats), jax.tree.leaves(as_tree.stats), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_greedy_tree_speculation_equals_ar():
    """Every tree shape with the truncated draft and with the self-draft, on the tiny model (trees of trained heads
    on stories260K: test_heads, test_eagle3)."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    short = truncated_target(cfg, params, 1)
    # chain4 is a chain: test_chain_tree_equals_chain pins it to the chain loop
    shapes = [(n, t) for n, t in PRESETS.items() if n != "chain4"] + [(str(d), d) for d in DYNAMIC]
    for name, tree in shapes:
        for dcfg, dgraphdef, dparams in (short, (cfg, graphdef, params)):
            drafter = DraftModel(dcfg, dgraphdef, tree.depth, tree=tree)
            gen = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec)
            np.testing.assert_array_equal(
                np.asarray(gen.tokens), ar, err_msg=f"{name}, {dcfg.n_layers} layers"
            )
            if isinstance(tree, Tree) and dcfg is cfg:  # a self-draft's static tree holds the argmax path
                assert summarize(gen.stats)["tau"] > 0.9 * min(tree.depth + 1, 39)


# warped sampling on a dynamic tree; a static tree at temperature 1, below, with the sibling control
@pytest.mark.parametrize("sampler", [Sampler(0.9, top_k=5, top_p=0.9)], ids=["topk_topp"])
def test_sampled_dynamic_tree_is_distributed_as_ar(sampler):
    graphdef, params = peaked(SMALL, 0)
    dgraphdef, dparams = peaked(SMALL.replace(n_layers=1), 5)
    prompts, spec = [[1, 3]] * 20_000, GenerateSpec(3, sampler, eos_id=None)
    ar = first_three(generate(SMALL, graphdef, params, prompts, spec, seed=1).tokens)
    drafter = DraftModel(SMALL.replace(n_layers=1), dgraphdef, 2, sampler, tree=DynamicTree(2, 2, 4))
    gen = speculative_generate(SMALL, graphdef, params, drafter, dparams, prompts, spec, seed=2)
    assert np.asarray(gen.stats.accepted_hist)[:-1].sum() > 1000
    assert two_sample_pvalue(ar, first_three(gen.tokens)) > 1e-3


@pytest.mark.parametrize("sampler", [Sampler(1.0)], ids=["plain"])
def test_sampled_tree_speculation_is_distributed_as_ar(sampler, monkeypatch):
    graphdef, params = peaked(SMALL, 0)
    dcfg = SMALL.replace(n_layers=1)
    dgraphdef, dparams = peaked(dcfg, 5)  # an unrelated draft: siblings are often all rejected
    prompts, spec = [[1, 3]] * 20_000, GenerateSpec(3, sampler, eos_id=None)
    ar = first_three(generate(SMALL, graphdef, params, prompts, spec, seed=1).tokens)
    drafter = DraftModel(dcfg, dgraphdef, 2, sampler, tree=balanced(2, 2))
    gen = speculative_generate(SMALL, graphdef, params, drafter, dparams, prompts, spec, seed=2)
    assert (
        np.asarray(gen.stats.accepted_hist)[:-1].sum() > 1000
    )  # whole levels get rejected: residuals are used
    assert two_sample_pvalue(ar, first_three(gen.tokens)) > 1e-3

    # Negative control: no renormalisation of q after a rejected sibling must be caught by the same test.
    real_step = sibling_step
    broken = run_patched(
        monkeypatch,
        "specjax.acceptance.rejection.sibling_step",
        lambda p, q, x, without: real_step(p, q, x, False),
        lambda: speculative_generate(SMALL, graphdef, params, drafter, dparams, prompts, spec, seed=2),
    )
    assert two_sample_pvalue(ar, first_three(broken.tokens)) < 1e-6
