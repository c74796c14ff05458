"""Suffix decoding with an EAGLE fallback (`specjax.drafters.hybrid`): greedy equals AR with each row's draft
taken from the store where it expects enough accepted tokens and from EAGLE elsewhere; bad pairings are refused.
Sampled, with the store's frequencies as q, its exactness and control are test_verification's verify_exactness case."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import TINY
from helpers import RAGGED, TARGET

from specjax import heads
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.hybrid import Hybrid
from specjax.drafters.suffix import Suffix, empty_store
from specjax.drafting import registry
from specjax.errors import DrafterError
from specjax.sampling import Sampler

K = 3


def eagle(cfg, params, sampler, k=K):
    meta = heads.describe("eagle", {}, cfg)
    graphdef, hparams = heads.new_heads(meta, cfg, params, seed=3)
    return heads.make_drafter(meta, graphdef, cfg, k, sampler), heads.drafter_params(
        meta, hparams, cfg, params
    )


def hybrid(cfg, params, sampler, stored, threshold, frequencies=False, decay=0.8, prior=1.0):
    """(drafter, params): the store holds the `stored` sequences; EAGLE (random heads) falls back."""
    suffix = Suffix(K, cfg.vocab_size, frequencies=frequencies)
    fallback, fparams = eagle(cfg, params, sampler)
    store = suffix.absorb(empty_store(256), stored)
    return Hybrid(suffix, fallback, threshold, decay, prior), {"suffix": store, "fallback": fparams}


def per_row_tau(gen) -> np.ndarray:
    return np.asarray(gen.stats.emitted) / np.asarray(gen.stats.row_rounds)


def test_greedy_equals_ar_and_each_row_drafts_from_the_better_source():
    graphdef, params = TARGET
    spec = GenerateSpec(40, eos_id=None)
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, spec).tokens)
    # row 0's output, 3 times: the store expects 2.25 of its K = 3 tokens
    stored = [RAGGED[0] + ar[0].tolist()] * 3
    drafter, dparams = hybrid(TINY, params, Sampler(), stored, threshold=2.0)
    gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    fallback, fparams = eagle(TINY, params, Sampler())
    alone = speculative_generate(TINY, graphdef, params, fallback, fparams, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(alone.tokens), ar)
    tau, eagle_tau = per_row_tau(gen), per_row_tau(alone)
    # every round of row 0 drafted from the store
    assert tau[0] == pytest.approx(39 / np.ceil(39 / (K + 1)))
    assert max(eagle_tau) < 1.5  # random heads: EAGLE alone rarely gets a token accepted
    # the other rows match row 0's text and their own once EAGLE has shown it accepts little
    assert min(tau[1:]) > 1.5
    # control: a fallback assumed to accept more than K (a memory of about 1,000 rounds) keeps the store out
    never, nparams = hybrid(TINY, params, Sampler(), stored, threshold=K + 1, decay=0.999)
    gen = speculative_generate(TINY, graphdef, params, never, nparams, RAGGED, spec)
    np.testing.assert_array_equal(per_row_tau(gen), eagle_tau)
    # a store that starts from a low prior (0.01 x 2.25 expected tokens) waits until EAGLE's record of 2 (weighing
    # the last round 0.2) has fallen below 0.0225, about 20 rounds: row 0 drafts from EAGLE first, then from the store
    late, lparams = hybrid(TINY, params, Sampler(), stored, threshold=2.0, prior=0.01)
    gen = speculative_generate(TINY, graphdef, params, late, lparams, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert eagle_tau[0] < per_row_tau(gen)[0] < tau[0]


class Fallback:
    """EAGLE as the hybrid's fallback, counting the rounds it only caught up (`catch_up=True`) or without its
    `catch_up` (`catch_up=False`: it drafts every round)."""

    def __init__(self, eagle, catch_up: bool):
        self.eagle, self.caught_up = eagle, []
        if catch_up:
            self.catch_up = self.counted_catch_up

    def __getattr__(self, name):
        if name == "catch_up":
            raise AttributeError(name)
        return getattr(self.eagle, name)

    def counted_catch_up(self, *args):
        jax.debug.callback(lambda: self.caught_up.append(1))
        return self.eagle.catch_up(*args)


# sampled: a fallback taken to accept almost nothing, for long, so that the store drafts wherever it has a match (the
# random heads' near-uniform q matches the random target's near-uniform p at T = 1: they accept much)
@pytest.mark.parametrize("temperature, threshold, decay", [(0.0, 2.0, 0.8), (1.0, 0.01, 0.999)])
def test_rounds_the_store_drafts_alone_skip_the_fallbacks_search_and_change_nothing(
    temperature, threshold, decay
):
    graphdef, params = TARGET
    sampler = Sampler(temperature)
    spec = GenerateSpec(40, sampler, eos_id=None)
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, GenerateSpec(40, eos_id=None)).tokens)
    stored = [prompt + out.tolist() for prompt, out in zip(RAGGED, ar)] * 3  # every row's greedy text
    drafter, dparams = hybrid(TINY, params, sampler, stored, threshold, temperature > 0, decay)
    runs = {}
    for catch_up in (True, False):
        fallback = Fallback(drafter.fallback, catch_up)
        gen = speculative_generate(
            TINY,
            graphdef,
            params,
            dataclasses.replace(drafter, fallback=fallback),
            dparams,
            RAGGED,
            spec,
            7,
        )
        runs[catch_up] = gen, len(fallback.caught_up)
    (skipping, caught_up), (drafting, none) = runs[True], runs[False]
    assert caught_up > 0 and none == 0
    np.testing.assert_array_equal(np.asarray(skipping.tokens), np.asarray(drafting.tokens))
    np.testing.assert_array_equal(per_row_tau(skipping), per_row_tau(drafting))
    if not temperature:
        np.testing.assert_array_equal(np.asarray(skipping.tokens), ar)


def test_the_store_starts_trusted_when_greedy_and_at_the_sampled_prior_when_sampling(stories):
    entry = registry.get("hybrid")
    build = lambda sampler: entry.build(stories, entry.settings(), 4, None, sampler)[0].prior
    assert (build(Sampler()), build(Sampler(1.0))) == (1.0, entry.settings().sampled_store_prior)


def test_bad_pairings_are_refused():
    graphdef, params = TARGET
    fallback, _ = eagle(TINY, params, Sampler(), k=K + 1)
    with pytest.raises(DrafterError, match="drafts chains of one K"):
        Hybrid(Suffix(K, TINY.vocab_size), fallback)
    with pytest.raises(DrafterError, match="drafts chains of one K"):
        Hybrid(Suffix(K + 1, TINY.vocab_size, nodes=4), fallback)
    with pytest.raises(DrafterError, match="threshold=0"):
        Hybrid(Suffix(K + 1, TINY.vocab_size), fallback, threshold=0)
    with pytest.raises(DrafterError, match="prior=0"):
        Hybrid(Suffix(K + 1, TINY.vocab_size), fallback, prior=0)
