"""Medusa and EAGLE drafting: greedy == AR (untrained and trained heads, chains and trees), sampling is
distributed as AR, EAGLE's incremental state equals a recomputation from scratch, heads for another target
are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import (
    TARGET,
    greedy_case,
)
from tolerance import LAYER_DEPTH, assert_close

from specjax import heads
from specjax.decoding import GenerateSpec, speculative_generate
from specjax.drafters.eagle import Eagle, eagle_apply, init_eagle, layer_config
from specjax.drafters.medusa import Medusa
from specjax.drafting.protocol import target_io
from specjax.drafting.trees import DynamicTree, balanced
from specjax.metrics import summarize
from specjax.models.llama import causal_mask, init_cache
from specjax.sampling import Sampler
from specjax.training.losses import target_features

TREES = {"chain": None, "tree": balanced(2, 3), "dynamic": DynamicTree(3, 3, 8)}


def head_drafters(cfg, params, sampler, meta_params):
    """(name, drafter, drafter params) for each method x tree shape, from `{method: (meta, graphdef, params)}`."""
    out = []
    for method, (meta, graphdef, hparams) in meta_params.items():
        for shape, tree in TREES.items():
            if method == "medusa" and shape == "dynamic":
                continue
            k = 3 if tree is None else tree.depth
            drafter = heads.make_drafter(meta, graphdef, cfg, k, sampler, tree)
            out.append((f"{method} {shape}", drafter, heads.drafter_params(meta, hparams, cfg, params)))
    return out


def fresh_heads(cfg, params):
    metas = {
        "medusa": heads.describe("medusa", {"num_heads": 4, "num_layers": 1}, cfg),
        "eagle": heads.describe("eagle", {}, cfg),
    }
    return {m: (meta, *heads.new_heads(meta, cfg, params, seed=3)) for m, meta in metas.items()}


def test_greedy_equals_ar_untrained():
    """Random heads on the tiny model (stories260K's shapes are covered by its trained heads below)."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    for name, drafter, dparams in head_drafters(cfg, params, Sampler(), fresh_heads(cfg, params)):
        gen = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=name)


def test_greedy_equals_ar_trained(stories, trained_heads):
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    taus = {}
    for name, drafter, dparams in head_drafters(cfg, params, Sampler(), trained_heads):
        gen = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=name)
        taus[name] = summarize(gen.stats)["tau"]
    assert taus["eagle dynamic"] > 1.3, taus  # trained heads do draft useful tokens


def test_eagle_state_matches_recomputation():
    """Propose/commit over rounds with random acceptance: the distribution the head drafts its first token
    from equals the head run from scratch over (token i + 1, true feature i) for the whole sequence."""
    graphdef, params = TARGET
    rng = np.random.default_rng(0)
    seq = jnp.asarray(rng.integers(3, TINY.vocab_size, (2, 40)), jnp.int32)
    feats = target_features(TINY, graphdef, params, seq)
    hgraph, hparams = init_eagle(TINY, seed=5)
    dparams = {"head": hparams, **target_io(TINY, params)}
    k, prompt = 3, 8
    drafter = Eagle(layer_config(TINY), hgraph, k, Sampler(1.0))
    state = drafter.init(dparams, seq[:, :prompt], jnp.array([prompt, 5]), 64, feats[:, :prompt])
    n = seq.shape[1] - 1  # from scratch, causally: slot i holds (token i + 1, feature i)
    scratch, _, _ = eagle_apply(
        hgraph,
        dparams,
        seq[:, 1:],
        feats[:, :-1],
        jnp.broadcast_to(jnp.arange(n), (2, n)),
        init_cache(layer_config(TINY), 2, n),
        causal_mask(n),
    )
    propose, commit = jax.jit(drafter.propose), jax.jit(drafter.commit)
    n_tokens = jnp.array([prompt + 1, 6])
    for round_ in range(6):
        draft, state = propose(dparams, state, seq, n_tokens, jax.random.key(round_))
        root = jnp.take_along_axis(scratch, (n_tokens - 2)[:, None, None], axis=1)[
            :, 0
        ]  # predicts after pending
        # the same head's logits computed in another batch, then a softmax
        assert_close(draft.q_probs[:, 0], jax.nn.softmax(root), dtype=jnp.float32, depth=LAYER_DEPTH + 5)
        accepted = jnp.asarray(rng.integers(0, k + 1, 2))
        start = n_tokens - 1  # the round's pending token
        feats_BDH = jnp.take_along_axis(feats, (start[:, None] + jnp.arange(k + 1))[:, :, None], axis=1)
        n_tokens = n_tokens + accepted + 1
        state = commit(dparams, state, accepted, n_tokens, None, feats_BDH)


def test_heads_for_another_target_are_refused():
    graphdef, params = TARGET
    fresh = fresh_heads(TINY, params)
    other = TINY.replace(vocab_size=50, dim=16)
    for _name, drafter, dparams in head_drafters(TINY, params, Sampler(), fresh):
        with pytest.raises(ValueError, match="train (heads|a head) for this target"):
            speculative_generate(other, None, None, drafter, dparams, [[1, 2]], GenerateSpec(4))
    with pytest.raises(ValueError, match="Medusa with 4 heads drafts 1..4 tokens deep; got k=5"):
        Medusa(None, 4, 97, 32, 5)
    with pytest.raises(ValueError, match="Medusa drafts static trees only"):
        Medusa(None, 4, 97, 32, 3, DynamicTree(2, 3, 4))
