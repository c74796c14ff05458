"""Speculative decoding with the draft-model drafter: greedy == AR, sampling is distributed as AR, stats add up."""

import math

import numpy as np
import pytest
from conftest import TINY
from helpers import (
    RAGGED,
    RANDOM_DRAFT_CFG,
    TARGET,
    greedy_case,
)
from tolerance import approx

from specjax import verify_exactness
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.metrics import summarize
from specjax.models.llama import init_params
from specjax.sampling import Sampler


def drafts(cfg, graphdef, params, k, sampler=Sampler()):  # noqa: B008 (a frozen dataclass)
    """(name, drafter, drafter params): a useless random model, a truncated target, the target itself."""
    random_cfg = RANDOM_DRAFT_CFG.replace(vocab_size=cfg.vocab_size)
    random_graphdef, random_params = init_params(random_cfg, seed=11)
    short_cfg, short_graphdef, short_params = truncated_target(cfg, params, 1)
    return [
        ("random", DraftModel(random_cfg, random_graphdef, k, sampler), random_params),
        ("truncated", DraftModel(short_cfg, short_graphdef, k, sampler), short_params),
        ("self", DraftModel(cfg, graphdef, k, sampler), params),
    ]


# K is independent of the model: the shortest chain on the tiny model, a long one (acceptance of every length) on
# the real one; chains of 3 and 4 on the tiny model are in test_stats_add_up and test_greedy_with_eos_matches_ar
@pytest.mark.parametrize("model, k", [("tiny", 1), ("stories", 5)])
def test_greedy_speculative_equals_greedy_ar(model, k, stories):
    cfg, graphdef, params, prompts, spec, ar = greedy_case(model, stories)
    taus = {}
    for name, drafter, dparams in drafts(cfg, graphdef, params, k):
        gen = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=f"{name} draft, K={k}")
        taus[name] = summarize(gen.stats)["tau"]
    full = 39 / math.ceil(39 / (k + 1))  # full rounds; the last one cut at 40
    assert taus["self"] == approx(full, dtype=np.float32, depth=2)  # counts, summed and divided
    assert taus["random"] < taus["self"]


def test_greedy_with_eos_matches_ar():
    graphdef, params = TARGET
    free = np.asarray(generate(TINY, graphdef, params, RAGGED, GenerateSpec(30, eos_id=None)).tokens)
    spec = GenerateSpec(30, eos_id=int(free[2, 6]))
    ar = generate(TINY, graphdef, params, RAGGED, spec)
    _, drafter, dparams = drafts(TINY, graphdef, params, 4)[1]
    gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))
    assert int(ar.lengths[2]) == 7


def test_stats_add_up():
    graphdef, params = TARGET
    k, rounds = 3, 5
    spec = GenerateSpec(1 + rounds * (k + 1), eos_id=None)  # self-draft: every round emits exactly K + 1
    gen = speculative_generate(TINY, graphdef, params, DraftModel(TINY, graphdef, k), params, RAGGED, spec)
    s, b = gen.stats, len(RAGGED)
    assert gen.lengths.tolist() == [spec.max_new_tokens] * b
    assert s.emitted.tolist() == (gen.lengths - 1).tolist() and s.row_rounds.tolist() == [rounds] * b
    assert s.accepted_hist.tolist() == [0] * k + [rounds * b]
    m = summarize(s)
    assert m["tau"] == k + 1 and m["draft_efficiency"] == 1.0 and m["alpha"].tolist() == [1.0] * k

    _, drafter, dparams = drafts(TINY, graphdef, params, k)[
        0
    ]  # random: partial acceptance, cut last rounds
    gen = speculative_generate(
        TINY, graphdef, params, drafter, dparams, RAGGED, GenerateSpec(37, eos_id=None)
    )
    s, hist = gen.stats, np.asarray(gen.stats.accepted_hist)
    assert hist.sum() == s.row_rounds.sum()
    assert np.asarray(s.accepted_at).sum() == (np.arange(k + 1) * hist).sum()
    assert s.reached_at[0] == hist.sum() and (np.diff(np.asarray(s.reached_at)) <= 0).all()
    untruncated = ((np.arange(k + 1) + 1) * hist).sum()
    assert s.emitted.sum() == (gen.lengths - 1).sum() <= untruncated <= s.emitted.sum() + k * len(RAGGED)
    assert summarize(s)["tau"] == approx(s.emitted.sum() / s.row_rounds.sum(), dtype=np.float32, depth=2)


def test_acceptance_statistics_are_unbiased_where_rounds_are_cut():
    """Rounds of K = 4 i.i.d. verdicts (a = 0.6), each cut by a token budget of 1..5 drawn apart from them:
    `SpecStats.record` and `summarize` estimate a and every alpha_i within 4 standard errors. The control, the
    same rounds counted as if only an accepted position after the cut were censored (its rejections counted),
    reads a far lower rate. With adaptive K, draft efficiency divides by each round's own K."""
    import jax.numpy as jnp

    from specjax.decoding.speculative import SpecStats

    rng, n, a, k = np.random.default_rng(0), 40_000, 0.6, 4
    verdicts = rng.random((n, k)) < a
    n_acc = np.where(verdicts.all(1), k, np.argmin(verdicts, 1))
    n_emit = np.minimum(n_acc + 1, rng.integers(1, k + 2, n))
    stats = SpecStats.zeros(n, k).record(jnp.ones(n, bool), jnp.asarray(n_emit), jnp.asarray(n_acc), k)
    m = summarize(stats)
    reached = np.asarray(stats.reached_at)
    assert np.all(np.abs(m["alpha"] - a) < 4 * np.sqrt(a * (1 - a) / reached)), m["alpha"]
    se = math.sqrt(a * (1 - a) / reached.sum())
    assert abs(m["acceptance_rate"] - a) < 4 * se
    kept = np.minimum(n_acc, n_emit)
    counted_rejections = np.sum((kept == n_acc) & (n_acc < k))
    assert kept.sum() / (kept.sum() + counted_rejections) < a - 10 * se  # the control

    one = SpecStats.zeros(n, 8).record(jnp.ones(n, bool), jnp.full(n, 2), jnp.ones(n, jnp.int32), 1)
    assert summarize(one)["draft_efficiency"] == 1.0  # K = 1 rounds of a loop whose largest K is 8


# --- statistical exactness, end to end --------------------------------------------------------------


# Warped sampling (top-k and top-p): the target's exact distribution of the first tokens against the samples of a
# draft-model chain, with the broken rule (the next token from p, not the residual) caught in the same run; at
# temperature 1 without warping: test_verification's verify_exactness of every drafter
def test_speculative_sampling_with_top_k_and_top_p_is_exact():
    report = verify_exactness.verify(
        "draft_model", ("tokenwise",), sampler=Sampler(0.9, top_k=5, top_p=0.9), greedy=False
    )
    assert report.passed, report.format()
    assert 0.2 < report.draft_efficiency < 0.95, report.format()  # the test exercises rejections


# A drafter sampling at another temperature than the target's (sharper or flatter drafts): still exact, since the rules
# read the q each draft was drawn from; a draft temperature of 1 is the target's sampler itself
@pytest.mark.parametrize("draft_temperature", [0.5, 2.0])
def test_sampling_at_another_draft_temperature_is_exact(draft_temperature, monkeypatch):
    sampler, built = Sampler(0.9, top_k=5), []
    build = verify_exactness.build_drafter
    monkeypatch.setattr(verify_exactness, "build_drafter", lambda *a: built.append(a[4]) or build(*a))
    assert sampler.drafting(draft_temperature) == Sampler(0.9 * draft_temperature, top_k=5)
    assert sampler.drafting(1.0) == sampler and Sampler().drafting(draft_temperature).greedy
    with pytest.raises(
        ValueError, match=r"draft temperature must be > 0 \(1: the target's own\), got 0.0; pass"
    ):
        sampler.drafting(0.0)
    report = verify_exactness.verify(
        "draft_model",
        ("tokenwise", "block"),
        sampler=sampler,
        draft_temperature=draft_temperature,
        greedy=False,
    )
    assert report.passed, report.format()
    assert built == [Sampler(0.9 * draft_temperature, top_k=5)]  # the drafter drew at the draft temperature


# --- errors -------------------------------------------------------------------------------------------


def test_errors_before_compile():
    graphdef, params = TARGET
    with pytest.raises(ValueError, match="K \\(draft tokens per round\\) must be an integer >= 1, got 0"):
        speculative_generate(
            TINY, graphdef, params, DraftModel(TINY, graphdef, 0), params, RAGGED, GenerateSpec(8)
        )
    with pytest.raises(ValueError, match="K=8 does not fit"):
        speculative_generate(
            TINY,
            graphdef,
            params,
            DraftModel(TINY, graphdef, 8),
            params,
            [[1] * 10],
            GenerateSpec(20, cache_size=32),
        )
    other = RANDOM_DRAFT_CFG.replace(vocab_size=50)
    with pytest.raises(ValueError, match=r"draft model vocabulary \(50\) differs from the target's \(97\)"):
        speculative_generate(
            TINY, graphdef, params, DraftModel(other, None, 2), None, RAGGED, GenerateSpec(8)
        )
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        speculative_generate(
            TINY, graphdef, params, DraftModel(TINY, graphdef, 2), params, [[1] * 250], GenerateSpec(20)
        )
