"""Layer-skip self-speculation: greedy == AR over skip sets, K and a tree (tiny model and stories260K); sampling
passes `verify_exactness` with its negative control; the draft reads the target's own arrays and KV cache (its
committed slots untouched; a first-k set drafts as with a cache of its own); bad sets are clear errors before any
model work; the skip-set search and the CLI."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import RAGGED, cli, greedy_case, run_cli

from specjax import verify_exactness
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.decoding.jobs import job_key, pad_prompts
from specjax.decoding.prefill import prefill
from specjax.drafters import layer_skip
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.layer_skip import (
    LayerSkipError,
    LayerSkipSettings,
    format_layers,
    layer_skip_drafter,
    parse_layers,
    search_layers,
    skip_model,
)
from specjax.drafting import registry
from specjax.drafting.trees import parse_tree
from specjax.metrics import summarize
from specjax.models.llama import init_params
from specjax.models.loading import LoadedModel
from specjax.sampling import Sampler

TINY4 = TINY.replace(n_layers=4)


@pytest.fixture(scope="module")
def tiny4():
    """A random 4-layer target, its greedy AR output on the ragged prompts and the spec."""
    graphdef, params = init_params(TINY4, seed=3)
    spec = GenerateSpec(40, eos_id=None)
    return graphdef, params, spec, np.asarray(generate(TINY4, graphdef, params, RAGGED, spec).tokens)


@pytest.fixture(scope="module")
def stories_case(stories):
    return greedy_case("stories", stories)


def tau(gen) -> float:
    return summarize(gen.stats)["tau"]


def test_parse_and_format_layers():
    assert parse_layers("0-3", 5) == (0, 1, 2, 3)
    assert parse_layers("0,1,2,5", 8) == (0, 1, 2, 5)
    assert parse_layers(" 4 , 0-1", 5) == (0, 1, 4)  # sorted: the draft runs layers in the target's order
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 12))
        layers = tuple(sorted(rng.choice(n, int(rng.integers(1, n)), replace=False).tolist()))
        assert parse_layers(format_layers(layers), n) == layers
    assert format_layers((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize(
    "layers, message",
    [
        ("", "layers='' selects no layer; list the layers the draft runs"),
        ("0-9", "layer 9 is out of range for a 4-layer target; use layers 0..3"),
        ("1,1", "lists layer 1 twice; list each layer once"),
        ("0-2,2-3", "lists layer 2 twice; list each layer once"),
        ("0-3", "keeps all 4 layers, so the draft would be the target itself; skip at least one layer"),
        ("3-1", "the range '3-1' runs backwards; write 1-3"),
        ("0,-1", "'-1' is not a layer or a range; write layers like 0-3 or 0,1,2,5"),
        ("first", "'first' is not a layer or a range"),
        (2, "layers must be a string like '0-3' or '0,1,2,5', got 2; pass e.g. layers='0-2'"),
    ],
)
def test_bad_layers_fail_before_any_model_work(layers, message, tiny4, monkeypatch):
    def model_work(*args, **kwargs):
        raise AssertionError("model work before validation")

    for name in ("skip_model", "generate", "truncated_target"):
        monkeypatch.setattr(layer_skip, name, model_work)
    target = LoadedModel(TINY4, tiny4[0], tiny4[1], None, None)
    with pytest.raises(LayerSkipError, match=message):
        registry.get("layer_skip").build(target, LayerSkipSettings(layers), 3, None, Sampler())


@pytest.mark.parametrize("layers", [None, "0", "auto"])
def test_one_layer_target_is_refused(layers, monkeypatch):
    monkeypatch.setattr(layer_skip, "generate", None)  # 'auto' must refuse before decoding calibration text
    one = TINY.replace(n_layers=1)
    target = LoadedModel(one, None, None, None, None)
    with pytest.raises(
        LayerSkipError, match="the target has 1 layer: layer-skip drafting needs at least 2"
    ):
        registry.get("layer_skip").build(target, LayerSkipSettings(layers), 2, None, Sampler())


def test_draft_reads_the_targets_own_arrays(tiny4):
    graphdef, params, _, _ = tiny4
    drafter, dparams = layer_skip_drafter(TINY4, params, (1, 3), 2, Sampler())
    assert drafter.cfg.n_layers == 2 and drafter.layers == (1, 3)
    target_leaves = {id(x): x for x in jax.tree.leaves(params)}
    assert all(id(x) in target_leaves for x in jax.tree.leaves(dparams))  # no copy of any parameter
    for i, layer in enumerate((1, 3)):  # draft layer i is the target's layer layers[i], the very arrays
        assert (
            dparams["layers"][i]["wqkv"]["weight"].get_value()
            is params["layers"][layer]["wqkv"]["weight"].get_value()
        )
    assert dparams["embed"]["embedding"].get_value() is params["embed"]["embedding"].get_value()
    buffers = lambda tree: {x.unsafe_buffer_pointer(): x.nbytes for x in jax.tree.leaves(tree)}
    target_bytes = sum(buffers(params).values())
    assert sum((buffers(params) | buffers(dparams)).values()) == target_bytes  # no extra parameter bytes


@pytest.mark.parametrize(
    "layers, k, tree",
    [((0,), 1, ""), ((1, 3), 5, ""), ((0, 2, 3), 3, "balanced_2x3")],
)
def test_greedy_equals_ar_tiny(layers, k, tree, tiny4):
    graphdef, params, spec, ar = tiny4
    drafter, dparams = layer_skip_drafter(TINY4, params, layers, k, Sampler(), parse_tree(tree))
    gen = speculative_generate(TINY4, graphdef, params, drafter, dparams, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert gen.lengths.tolist() == [spec.max_new_tokens] * len(RAGGED)


@pytest.mark.parametrize("layers, k", [((0, 1, 3, 4), 4)])
def test_greedy_equals_ar_stories(layers, k, stories_case):
    cfg, graphdef, params, prompts, spec, ar = stories_case
    drafter, dparams = layer_skip_drafter(cfg, params, layers, k, Sampler())
    gen = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    if layers == (0, 1, 3, 4):
        assert tau(gen) > 1.8  # skipping layer 2 keeps most of stories260K's predictions


def test_draft_reads_and_writes_the_targets_cache_beyond_its_committed_slots(tiny4):
    graphdef, params, _, _ = tiny4
    drafter, dparams = layer_skip_drafter(TINY4, params, (1, 3), 3, Sampler())
    tokens, lengths = pad_prompts(RAGGED)
    _, cache, _ = prefill(TINY4, graphdef, params, tokens, lengths, 32)
    seq = np.zeros((len(RAGGED), 32), np.int32)
    seq[:, : tokens.shape[1]] = tokens
    seq[np.arange(len(RAGGED)), lengths] = 7  # the pending token
    state = drafter.init(dparams, tokens, lengths, 32)
    draft, state, after = drafter.propose(
        dparams, state, jnp.asarray(seq), jnp.asarray(lengths + 1), job_key(0), target_cache=cache
    )
    assert state == () and draft.tokens.shape == (len(RAGGED), 3)  # no state of its own
    np.testing.assert_array_equal(after.length, cache.length)
    heads = cache.k[0].shape[0] // len(RAGGED)
    for layer in range(TINY4.n_layers):
        for b, n in enumerate(lengths):
            rows = slice(b * heads, (b + 1) * heads)
            old, new = np.asarray(cache.k[layer][rows]), np.asarray(after.k[layer][rows])
            np.testing.assert_array_equal(new[:, :n], old[:, :n])  # the committed slots untouched
            written = not np.array_equal(
                new[:, n : n + 3], old[:, n : n + 3]
            )  # pending + 2 fed draft tokens
            assert written == (layer in (1, 3)), (layer, b)  # by the kept layers only


@pytest.mark.parametrize("layers", [(0, 1, 2), (0, 1, 3, 4)])
def test_shared_cache_drafts_as_the_skip_model_with_its_own_cache_where_that_is_exact(layers, stories_case):
    """A first-k set reads exactly the keys/values it would compute: the same rounds as the skip model drafting
    with its own cache. After a skipped layer it reads the target's (a different draft, here a better one)."""
    cfg, graphdef, params, prompts, spec, ar = stories_case
    shared, shared_params = layer_skip_drafter(cfg, params, layers, 4, Sampler())
    small, small_graphdef, small_params = skip_model(cfg, params, layers)
    own = DraftModel(small, small_graphdef, 4, Sampler())
    gens = [
        speculative_generate(cfg, graphdef, params, d, p, prompts, spec)
        for d, p in ((shared, shared_params), (own, small_params))
    ]
    for gen in gens:
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    hists = [np.asarray(gen.stats.depth_accepted) for gen in gens]
    if layers == (0, 1, 2):
        np.testing.assert_array_equal(*hists)
    else:
        assert tau(gens[0]) > tau(gens[1])


# a set that skips layer 0 (the default, the first half, is test_verification's verify_exactness case)
@pytest.mark.parametrize("layers", ["1"])
def test_sampling_passes_verify_exactness(layers, monkeypatch):
    entry = registry.get("layer_skip")
    monkeypatch.setitem(
        registry.DRAFTERS,
        "layer_skip",
        dataclasses.replace(entry, settings=lambda: LayerSkipSettings(layers)),
    )
    report = verify_exactness.verify("layer_skip", ("tokenwise",), samples=4000)
    print(report.format())
    assert report.rules[0].verdict(report.alpha) == "PASS", report.format()  # and its control was caught
    assert report.greedy_identical and 0.1 < report.draft_efficiency < 0.95, report.format()


def test_search_picks_the_best_set_per_size(stories):
    cfg, prompts = stories.cfg, layer_skip.calibration_prompts(stories)
    share = lambda m: m / cfg.n_layers
    search = search_layers(cfg, stories.graphdef, stories.params, prompts, 4, cost=share)
    assert [len(c.layers) for c in search.candidates] == [4, 3, 2, 1]
    assert search.chosen == max(search.candidates, key=lambda c: c.speedup)
    assert search.chosen.layers == (0, 1, 3, 4)  # layer 2 matters least (tau 2.6 at K=4, prefix 0-3: 2.0)
    # backward elimination (no size searched exhaustively): each set is the previous one less one layer, and
    # no set agrees better than the exhaustive best of its size
    nested = search_layers(cfg, stories.graphdef, stories.params, prompts, 4, cost=share, exhaustive=0)
    for bigger, smaller in itertools.pairwise(nested.candidates):
        assert set(smaller.layers) < set(bigger.layers)
    assert nested.candidates[0] == search.candidates[0]
    assert all(e.agreement >= n.agreement for e, n in zip(search.candidates, nested.candidates))


def test_cli_auto_search_decodes_as_ar(stories, capsys, monkeypatch):
    module = cli()
    ar = run_cli(module, capsys)
    out = run_cli(module, capsys, "--drafter=layer_skip", "--layers=auto", "--k=3")
    chosen = out.split("layer_skip chose --layers=")[1].split("\n")[0]
    parse_layers(chosen, stories.cfg.n_layers)
    story = lambda text: text.split("--- ")[1].split("\n|")[0]
    assert story(out) == story(ar) and "K=3, acceptance tokenwise: tau" in out
    monkeypatch.setattr(module, "decode_texts", None)  # a bad set must fail before decoding
    with pytest.raises(LayerSkipError, match="layer 7 is out of range for a 5-layer target"):
        run_cli(module, capsys, "--drafter=layer_skip", "--layers=0-7")
