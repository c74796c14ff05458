"""A new drafter or acceptance rule is one registration, made here in the test file only: decoding with it
through the public API and the CLI entry function gives the AR greedy output token for token."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import RAGGED, TARGET, cli, run_cli

from specjax import acceptance
from specjax.acceptance import base as acceptance_base
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafting import registry
from specjax.drafting.layouts import Draft
from specjax.drafting.trees import Chain
from specjax.metrics import summarize


@dataclasses.dataclass(frozen=True)
class RepeatLast:
    """Proposes the pending token K times: no params, no state."""

    k: int

    @property
    def shape(self):
        return Chain(self.k)

    def validate(self, target_cfg):
        pass

    def init(self, params, tokens_BP, lengths_B, cache_size, feats_BPH):
        return jnp.zeros(())

    def propose(self, params, state, seq_BS, n_tokens_B, key):
        last = jnp.take_along_axis(seq_BS, (n_tokens_B - 1)[:, None], axis=1)
        tokens = jnp.repeat(last, self.k, axis=1)
        return Draft(tokens, None, self.shape.layout(seq_BS.shape[0])), state

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state


@dataclasses.dataclass(frozen=True)
class RepeatLastSettings:
    pass


@dataclasses.dataclass(frozen=True)
class GreedyAnew:
    """Greedy verification written from scratch: the first mismatch by argmin over the match mask."""

    name = "greedy_anew"
    lossless = True

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        target = jnp.argmax(logits_BKV, axis=-1)
        match = draft_BK == target[:, :-1]
        n = jnp.where(match.all(axis=1), draft_BK.shape[1], jnp.argmin(match, axis=1))
        return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement):
        raise NotImplementedError("chains only")


@pytest.fixture
def repeat_last():
    entry = registry.register(
        registry.Entry(
            "repeat_last", RepeatLastSettings, lambda target, s, k, tree, sampler: (RepeatLast(k), None)
        )
    )
    yield entry
    del registry.DRAFTERS["repeat_last"]


@pytest.fixture
def greedy_anew():
    acceptance.register(GreedyAnew)
    yield
    del acceptance_base.RULES["greedy_anew"]


SPEC = GenerateSpec(24, eos_id=None)


@pytest.mark.parametrize("k", [1, 3])
def test_registered_drafter_equals_ar(repeat_last, k):
    graphdef, params = TARGET
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, SPEC).tokens)
    drafter, dparams = registry.get("repeat_last").build(None, RepeatLastSettings(), k, None, None)
    gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, SPEC)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert summarize(gen.stats)["rounds"] < SPEC.max_new_tokens or k == 1  # it drafted something useful


def test_registered_rule_equals_builtin(greedy_anew):
    graphdef, params = TARGET
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, SPEC).tokens)
    drafter = RepeatLast(3)
    builtin = speculative_generate(TINY, graphdef, params, drafter, None, RAGGED, SPEC)
    spec = dataclasses.replace(SPEC, acceptance=acceptance.get("greedy_anew"))
    anew = speculative_generate(TINY, graphdef, params, drafter, None, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(anew.tokens), ar)
    np.testing.assert_array_equal(
        np.asarray(anew.stats.accepted_hist), np.asarray(builtin.stats.accepted_hist)
    )


def test_unknown_names_list_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown drafter 'nope'; choose one of \[" + re.escape(str(registry.names())[1:]),
    ):
        registry.get("nope")
    with pytest.raises(ValueError, match=r"unknown acceptance rule 'nope'; choose one of \[.*'tokenwise'"):
        acceptance.get("nope")


def test_registered_drafter_and_rule_through_the_cli(repeat_last, greedy_anew, capsys, stories):
    module = cli()
    module.define_drafter_flags()
    story = lambda out: out.split("\n|")[0]  # the printed text, before the timing table
    ar = run_cli(module, capsys)
    spec = run_cli(module, capsys, "--drafter=repeat_last", "--k=2", "--acceptance=greedy_anew")
    assert story(spec) == story(ar) and "Once upon a time" in story(ar)
    assert "K=2, acceptance greedy_anew: tau" in spec
    with pytest.raises(ValueError, match="--k needs a drafter"):
        run_cli(module, capsys, "--k=2")
    with pytest.raises(ValueError, match="--heads do not apply to --drafter=repeat_last"):
        run_cli(module, capsys, "--drafter=repeat_last", "--heads=x")
