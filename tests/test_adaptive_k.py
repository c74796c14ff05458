"""Adaptive draft length (`AdaptiveK`): each round's K chosen on device among a few compiled Ks. Greedy output
equals AR for every drafter, sampling stays exact (with a negative control), the choice follows the drafter's
acceptance along the text (its histogram of K), K = 0 is a plain AR round taken where drafting does not pay, and the
degenerate single-K case is the fixed-K loop."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import (
    RAGGED,
    SMALL,
    TARGET,
    Alternating,
    cli,
    greedy_case,
    peaked,
    run_cli,
    run_patched,
)

from specjax import acceptance, verify_exactness
from specjax.decoding import (
    AdaptiveK,
    GenerateSpec,
    SpecStats,
    compile_decode,
    generate,
    speculative,
    speculative_generate,
)
from specjax.decoding.jobs import prepare_speculative
from specjax.decoding.speculative import calibrate
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafters.lookahead import Lookahead
from specjax.drafting import registry
from specjax.drafting.layouts import Draft
from specjax.drafting.trees import Chain
from specjax.metrics import summarize
from specjax.sampling import Sampler

COSTS = (1.2, 1.4, 1.8, 2.6)  # round costs of K = 1, 2, 4, 8: a draft step costs a fifth of a verification
# The defaults: a slow estimate starting at the measured acceptance.
ADAPTIVE = AdaptiveK((1, 2, 4, 8), COSTS)
FAST = dict(decay=0.9, prior=0.6, prior_weight=0.5)  # an estimate of a few rounds: K changes often


def adaptive_spec(spec: GenerateSpec, adaptive: AdaptiveK = ADAPTIVE) -> GenerateSpec:
    return dataclasses.replace(spec, adaptive_k=adaptive)


def test_greedy_equals_ar_with_a_draft_model():
    """On stories260K: test_cli (a draft model) and the trained heads' test below."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    dcfg, dgraphdef, dparams = truncated_target(cfg, params, 1)
    gen = speculative_generate(
        cfg, graphdef, params, DraftModel(dcfg, dgraphdef, 8), dparams, prompts, adaptive_spec(spec)
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    k_hist = np.asarray(gen.stats.k_hist)
    assert k_hist.sum() == np.asarray(gen.stats.row_rounds).sum() and k_hist[[0, 3, 5, 6, 7]].sum() == 0


@pytest.mark.parametrize(
    "name, ks", [("eagle", (1, 2, 4, 8)), ("medusa", (1, 2, 4)), ("ngram", (1, 2, 4, 8))]
)
def test_greedy_equals_ar_with_heads_and_n_gram(stories, name, ks):
    """EAGLE's state (features of the last round, padded to the largest K) and Medusa's, across Ks; and n-gram's
    lookup (no state), a training-free drafter."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    entry = registry.get(name)
    drafter, dparams = entry.build(stories, entry.settings(), ks[-1], None, Sampler())
    adaptive = AdaptiveK(ks, COSTS[: len(ks)], **FAST)
    gen = speculative_generate(
        cfg, graphdef, params, drafter, dparams, prompts, adaptive_spec(spec, adaptive)
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert (np.asarray(gen.stats.k_hist)[list(ks)] > 0).sum() >= 2, gen.stats.k_hist  # K changed


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_ar_rounds_between_drafted_rounds_keep_the_drafters_state(stories, name):
    """The heads' state follows the tokens a K = 0 round commits: K = 8 and plain AR rounds in turn decode as AR."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("stories", stories)
    entry = registry.get(name)
    drafter, dparams = entry.build(stories, entry.settings(), 8, None, Sampler())
    adaptive = Alternating((0, 8), (1.0, 1.0), prior=0.6)
    gen = speculative_generate(
        cfg, graphdef, params, drafter, dparams, prompts, adaptive_spec(spec, adaptive)
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    k_hist = np.asarray(gen.stats.k_hist)
    assert k_hist[0] > 0 and k_hist[8] > 0 and k_hist.sum() == k_hist[0] + k_hist[8], k_hist
    assert summarize(gen.stats)["tau"] > 1.5  # the drafted rounds still get their drafts accepted


# --- the choice follows the acceptance along the text ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RightThenWrong:
    """Proposes the target's greedy continuation up to an absolute position per row, then wrong tokens. Params:
    (the greedy sequences [B, S], the first wrong position [B]); no state."""

    k: int

    @property
    def shape(self):
        return Chain(self.k)

    def with_k(self, k: int):
        return RightThenWrong(k)

    def validate(self, target_cfg):
        pass

    def init(self, params, tokens_BP, lengths_B, cache_size, feats_BPH):
        return jnp.zeros(())

    def propose(self, params, state, seq_BS, n_tokens_B, key):
        greedy_BS, wrong_from_B = params
        pos_BK = n_tokens_B[:, None] + jnp.arange(self.k)[None]
        right = jnp.take_along_axis(greedy_BS, jnp.minimum(pos_BK, greedy_BS.shape[1] - 1), axis=1)
        tokens = jnp.where(pos_BK < wrong_from_B[:, None], right, (right + 1) % TINY.vocab_size)
        return Draft(tokens, None, self.shape.layout(seq_BS.shape[0])), state

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state


@pytest.fixture
def right_then_wrong():
    build = lambda target, settings, k, tree, sampler: (RightThenWrong(k), None)
    entry = registry.register(registry.Entry("right_then_wrong", type("Settings", (), {}), build))
    yield entry
    del registry.DRAFTERS["right_then_wrong"]


def ar_and_greedy():
    """(spec of 64 greedy tokens, AR's tokens [B, 64], each row's prompt and AR continuation [B, 128], prompt lengths)
    on the tiny target: what `RightThenWrong` drafts from."""
    graphdef, params = TARGET
    spec = GenerateSpec(64, eos_id=None)
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, spec).tokens)
    greedy = np.zeros((len(RAGGED), 128), np.int32)
    for row, p in enumerate(RAGGED):
        greedy[row, : len(p) + 64] = p + ar[row].tolist()
    return spec, ar, greedy, np.array([len(p) for p in RAGGED])


def test_choice_follows_acceptance_along_the_text(right_then_wrong):
    graphdef, params = TARGET
    spec, ar, greedy, lengths = ar_and_greedy()
    drafter = right_then_wrong.build(None, None, 8, None, None)[0]
    hists, priors = {}, {}
    for phase, right_for, adaptive in [
        ("right", 1000, ADAPTIVE),
        ("wrong", 0, ADAPTIVE),
        ("right 24, then wrong", 24, AdaptiveK((1, 2, 4, 8), COSTS, **FAST)),
    ]:
        dparams = (jnp.asarray(greedy), jnp.asarray(lengths + right_for))
        job = adaptive_spec(spec, adaptive)
        tokens, padded, job = prepare_speculative(TINY, drafter, RAGGED, job)
        priors[phase] = calibrate(
            TINY, graphdef, params, drafter, dparams, tokens, padded, job
        ).adaptive_k.prior
        gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, job)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar, err_msg=phase)
        hists[phase] = np.asarray(gen.stats.k_hist)[[1, 2, 4, 8]]  # row-rounds (4 rows) at K = 1, 2, 4, 8
    # The defaults start from the acceptance of a few rounds at K = 8 (kept within [0.05, 0.95]): always right,
    # K = 8 from the first round, a shorter K only for a row's last tokens (at most two rounds of each row); always
    # wrong, K = 1 in every round (63: the first token comes with the prefill).
    assert priors["right"] == 0.95 and priors["wrong"] == 0.05, priors
    assert hists["right"][3] >= 6 * 4 and hists["right"][:3].sum() <= 2 * 4, hists
    assert hists["wrong"][0] == 63 * 4 and hists["wrong"][1:].sum() == 0, hists
    # A fast estimate, right for 24 tokens (about 3 rounds of 8), then wrong for the other 40: K = 8 until the
    # moving average of the acceptance falls (a few rounds of one token), then K = 1 (a token per round).
    assert hists["right 24, then wrong"][3] >= 2 * 4 and hists["right 24, then wrong"][0] >= 25 * 4, hists


# --- sampling is exact ------------------------------------------------------------------------------------


TOKENWISE_RESIDUAL = ("specjax.acceptance.rejection.residual", lambda p, q: p)


@pytest.mark.parametrize(
    "ks, costs, prior, new_tokens, first, then, then_at_least, rule, broken",
    [
        ((1, 3), (1.0, 1.02), 0.1, 8, 1, 3, 20_000, "tokenwise", TOKENWISE_RESIDUAL),
        ((0, 3), (1.0, 1.5), 0.99, 6, 3, 0, 1_000, "tokenwise", TOKENWISE_RESIDUAL),
        (
            (0, 3),
            (1.0, 1.5),
            0.99,
            6,
            3,
            0,
            1_000,
            "block",
            ("specjax.acceptance.block.block_residual", lambda w, p, q: p),
        ),
    ],
    ids=["1 then 3", "3 then AR rounds", "3 then AR rounds, block"],
)
def test_sampling_is_exact_while_k_changes(
    ks, costs, prior, new_tokens, first, then, then_at_least, rule, broken, monkeypatch
):
    """The first four tokens of 20000 decodes against the target's exact distribution (chi-square): every row
    drafts K = 1 in its first round (a pessimistic prior), then K = 3 (the measured acceptance is high, and with 7
    tokens left the batch's slowest rows need fewer rounds of 3); or K = 3
    (an optimistic prior: at 1.5 times an AR round's cost, rounds of K = 3 would end the 5 tokens of all 20000 rows
    in fewer AR rounds' time than 5 AR rounds), then plain AR rounds (K = 0: at the measured acceptance the batch's
    slowest rows would need about as many K = 3 rounds as AR rounds) in the rounds of the rows it leaves unfinished,
    verified token-wise or by block
    verification (whose K = 0 round has nothing to test and draws from the target's p)."""
    graphdef, params = peaked(SMALL, 0)
    dcfg, dgraphdef, dparams = truncated_target(SMALL, params, 1)
    sampler, n, prompt = Sampler(1.0), 20_000, [1, 3]
    exact = verify_exactness.target_distribution(SMALL, graphdef, params, prompt, sampler, 4)
    adaptive = AdaptiveK(ks, costs=costs, **FAST | dict(prior=prior))
    spec = GenerateSpec(
        new_tokens, sampler, eos_id=None, acceptance=acceptance.get(rule), adaptive_k=adaptive
    )
    drafter = DraftModel(dcfg, dgraphdef, 3, sampler)
    run = lambda: speculative_generate(
        SMALL, graphdef, params, drafter, dparams, [prompt] * n, spec, seed=2
    )
    first4 = lambda gen: np.asarray(gen.tokens)[:, :4]
    counts = lambda gen: np.bincount(verify_exactness.codes(first4(gen), 8), minlength=8**4)
    gen = run()
    k_hist = np.asarray(gen.stats.k_hist)
    assert k_hist[first] >= n and k_hist[then] >= then_at_least, k_hist  # every row starts at `first`
    assert k_hist.sum() == k_hist[first] + k_hist[then], k_hist
    assert summarize(gen.stats)["acceptance_rate"] < 0.97  # rejections happen
    assert verify_exactness.goodness_of_fit(counts(gen), exact) > 1e-3
    # Negative control: resampling from p instead of the residual must be caught by the same test.
    broken = run_patched(monkeypatch, *broken, run)
    assert verify_exactness.goodness_of_fit(counts(broken), exact) < 1e-6


def test_k0_is_an_ar_round_taken_where_drafts_do_not_pay(right_then_wrong):
    """K = 0 in the set is a round of the target's token alone: greedy output unchanged; with drafts always wrong
    (a K = 1 round costs more than the tokens it gains) every round is one, with drafts always right none is."""
    graphdef, params = TARGET
    spec, ar, greedy, lengths = ar_and_greedy()
    drafter = right_then_wrong.build(None, None, 8, None, None)[0]
    job = adaptive_spec(spec, AdaptiveK((0, 1, 8), (1.0, COSTS[0], COSTS[3])))
    for right_for, ar_rounds in ((0, 63 * 4), (1000, 0)):
        dparams = (jnp.asarray(greedy), jnp.asarray(lengths + right_for))
        gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, job)
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
        assert np.asarray(gen.stats.k_hist)[0] == ar_rounds, gen.stats.k_hist


def k_hists_by_plain_cost(right_then_wrong, right_for: int, plain_costs) -> dict:
    """{plain cost: row-rounds by K} of greedy jobs on the tiny target drafting from AR's tokens, right for each
    row's first `right_for` tokens (K in 0, 1, 8 at costs 1.0, 1.2, 2.6, prior 0.6); each gives AR's tokens."""
    graphdef, params = TARGET
    spec, ar, greedy, lengths = ar_and_greedy()
    dparams = (jnp.asarray(greedy), jnp.asarray(lengths + right_for))
    drafter = right_then_wrong.build(None, None, 8, None, None)[0]
    hists = {}
    for plain_cost in plain_costs:
        adaptive = AdaptiveK((0, 1, 8), (1.0, 1.2, 2.6), prior=0.6, plain_cost=plain_cost)
        gen = speculative_generate(
            TINY, graphdef, params, drafter, dparams, RAGGED, adaptive_spec(spec, adaptive)
        )
        np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
        hists[plain_cost] = np.asarray(gen.stats.k_hist).tolist()
    return hists


def test_a_job_runs_plain_where_a_plain_round_wins_from_its_start(right_then_wrong):
    """At a prior of 0.6, K = 1 (1.6 tokens for 1.2) beats a K = 0 round (1 for 1), so the loop drafts (its drafts
    are always right); a plain round at half a K = 0 round's cost (2 tokens per unit) beats every K at the start, so
    the whole job runs plain, K = 0 in every row-round. Greedy output is AR's both ways; a plain cost above the
    K = 0 round's changes nothing."""
    hists = k_hists_by_plain_cost(right_then_wrong, 1000, (None, 0.5, 1.5))
    assert hists[0.5] == [63 * 4] + [0] * 8, hists
    # drafted: the accepted drafts leave fewer than two thirds of the plain job's row-rounds
    assert hists[None] == hists[1.5] and sum(hists[None]) < 63 * 4 * 2 / 3, hists


def test_a_job_turns_plain_where_its_acceptance_falls_below_what_a_plain_round_pays(right_then_wrong):
    """Drafts right for each row's first 8 tokens, then wrong. At a prior of 0.6, K = 1 (1.6 tokens for 1.2) beats a
    plain round at 0.9, so the job drafts; once the measured acceptance makes a plain round beat the K = 1 the loop
    would still draft (a K = 0 round, 1 for 1, is worse than both), it runs plain to its end. Without a plain round,
    or with one that costs a K = 0 round's (where the loop would sooner run K = 0 rounds, keeping the drafter in step),
    it drafts K = 1 longer. Greedy output is AR's every way."""
    hists = k_hists_by_plain_cost(right_then_wrong, 8, (None, 0.9, 1.0))
    drafted = {plain_cost: sum(hist[1:]) for plain_cost, hist in hists.items()}
    assert drafted[None] == drafted[1.0] > drafted[0.9] > 0, drafted


def test_a_plain_round_samples_as_a_k0_round():
    """Sampled, a plain job (the drafter idle) gives exactly the tokens of a job whose every round is K = 0 (the
    drafter kept in step), whose exactness the chi-square test above covers: the same target pass and rule with the
    same keys; the plain cost is measured beside the Ks' (positive) where K = 0 is in the set, and not otherwise."""
    graphdef, params = TARGET
    dcfg, dgraphdef, dparams = truncated_target(TINY, params, 1)
    spec = GenerateSpec(24, Sampler(1.0), eos_id=None)
    drafter = DraftModel(dcfg, dgraphdef, 3, spec.sampler)
    tokens = {}
    for name, plain_cost in (("K = 0 rounds", None), ("plain", 1e-3)):
        adaptive = AdaptiveK((0, 3), (1.0, 100.0), prior=0.5, plain_cost=plain_cost)
        job = adaptive_spec(spec, adaptive)
        gen = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, job, seed=3)
        assert np.asarray(gen.stats.k_hist).tolist() == [23 * 4, 0, 0, 0]
        tokens[name] = np.asarray(gen.tokens)
    np.testing.assert_array_equal(tokens["plain"], tokens["K = 0 rounds"])
    assert len(np.unique(tokens["plain"])) > 10  # sampled, not a constant
    for ks, measured in (((0, 3), True), ((1, 3), False)):
        tokens_BP, lengths, job = prepare_speculative(
            TINY, drafter, RAGGED, adaptive_spec(spec, AdaptiveK(ks))
        )
        args = (TINY, graphdef, params, drafter, dparams, tokens_BP, lengths)
        calibrated = calibrate(*args, job, rounds=2, repeats=1).adaptive_k
        assert (calibrated.plain_cost is not None) == measured, calibrated
        assert calibrated.plain_cost is None or calibrated.plain_cost > 0


def test_a_batch_waits_for_its_slowest_row():
    """At an acceptance of 0.75, K = 4 at 2.8 times an AR round's cost gains 3.05 tokens a round: it pays for one
    row with 32 tokens left (10.96 rounds, 30.7 AR rounds' time, exact batch model) but not for two rows (33.4 > 32:
    the batch waits for its slower row), so K = 0 from batch 2 on, as the exact model says; with a long queue
    behind the rows, K = 4 again."""
    adaptive = AdaptiveK((0, 4), (1.0, 2.8), prior=0.75)
    pick = jax.jit(lambda counts, left: adaptive.pick(counts, left, adaptive.measured()))
    counts = jnp.zeros((2, 4))
    assert [int(pick(counts, jnp.full(b, 32))) for b in (1, 2, 4, 16)] == [1, 0, 0, 0]
    assert int(pick(counts, jnp.array([32, 0, 0, 0]))) == 1  # rows that are done do not count
    # a queue behind the rows (slots refilled as they end: 200 tokens more each) is work the slowest row no longer
    # holds up: K = 4 pays again
    assert int(pick(counts, jnp.full(4, 32 + 200))) == 1


def test_near_a_rows_end_the_rounds_are_counted_exactly():
    """EAGLE-3's round costs on the expanded target at batch 1 (K = 4: 0.0288 s, K = 7: 0.0391 s), acceptance 0.95:
    with 7 tokens left K = 7 ends the row in 1.30 rounds (0.051 s) and K = 4 in 2.11 (0.061 s), so K = 7; the
    renewal approximation (1.53 and 1.97 rounds) chose K = 4, which cost the batch table's policy a round at every
    row's end. With 2 left both end in 1.05 rounds: the cheaper K = 4."""
    adaptive = AdaptiveK((4, 7), (0.0288, 0.0391), prior=0.95)
    pick = jax.jit(lambda counts, left: adaptive.pick(counts, left, adaptive.measured()))
    counts = jnp.zeros((2, 7))
    assert [int(pick(counts, jnp.array([m]))) for m in (2, 5, 7, 8, 16, 31)] == [0, 0, 1, 1, 1, 1]


def test_one_k_is_the_fixed_k_loop():
    """Sampled, adaptive over K in {3} gives the fixed K = 3 loop's tokens and statistics exactly."""
    graphdef, params = TARGET
    dcfg, dgraphdef, dparams = truncated_target(TINY, params, 1)
    spec = GenerateSpec(24, Sampler(1.0), eos_id=None)
    drafter = DraftModel(dcfg, dgraphdef, 3, spec.sampler)
    fixed = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, spec, seed=5)
    one = adaptive_spec(spec, AdaptiveK((3,), (1.0,)))
    adaptive = speculative_generate(TINY, graphdef, params, drafter, dparams, RAGGED, one, seed=5)
    np.testing.assert_array_equal(np.asarray(adaptive.tokens), np.asarray(fixed.tokens))
    for field in ("row_rounds", "emitted", "depth_accepted"):
        np.testing.assert_array_equal(getattr(adaptive.stats, field), getattr(fixed.stats, field))


def test_statistics_with_adaptive_k():
    """alpha_i counts only the rounds that proposed position i: rounds of K = 1 never reach position 2."""
    stats = SpecStats.zeros(2, 3)
    stats = stats.record(
        jnp.array([True, True]), jnp.array([2, 2]), jnp.array([1, 1]), 1
    )  # K = 1, accepted
    stats = stats.record(
        jnp.array([True, False]), jnp.array([1, 0]), jnp.array([0, 0]), 3
    )  # K = 3, rejected
    assert np.asarray(stats.k_hist).tolist() == [0, 2, 0, 1]
    assert np.asarray(stats.accepted_hist).tolist() == [1, 2, 0, 0]
    assert np.asarray(stats.reached_at).tolist() == [
        3,
        0,
        0,
    ]  # position 2 was never proposed after a success
    assert np.asarray(stats.accepted_at).tolist() == [2, 0, 0]


def test_a_round_may_draft_fewer_tokens_than_the_round_before_accepted():
    """No floor: after a row accepted 5 of 8, costs favouring K = 1 choose K = 1 (EAGLE re-reads K_max + 1)."""
    adaptive = AdaptiveK((1, 2, 4, 8), (1.0, 10.0, 10.0, 10.0), prior=0.6)
    left = jnp.array([40, 40])
    estimate = adaptive.observe(
        adaptive.zeros(left, adaptive.measured()), 8, jnp.array([5, 8]), jnp.array([True, True]), left
    )
    assert int(adaptive.choose(estimate)) == 0


def test_round_costs_are_timed_again_with_more_rounds_where_noise_hid_them(monkeypatch):
    """On a clock where a call without rounds costs more than `rounds` rounds more (noise), `measure` times more
    rounds per call rather than keep a cost <= 0; a cost no number of rounds shows takes the least one measured, and
    every K costs alike where none showed."""
    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])

    def run(per_round):  # a call: 1 s, 1.5 s without rounds, then its rounds
        def call(measured):
            rounds = int(measured.rounds)
            clock[0] += (1.5 if rounds == 0 else 1.0) + rounds * per_round[int(measured.forced)]

        return call

    adaptive = AdaptiveK((1, 2, 4), prior=0.5)
    measured = speculative.measure(adaptive, run((0.01, 0.02, 0.04)), rounds=8, repeats=3)
    expected = (0.01 - 0.5 / 128, 0.02 - 0.5 / 128, 0.04 - 0.5 / 128)
    assert measured.costs == pytest.approx(expected)  # K = 1's cost shows at 128 rounds, not 8 or 32
    measured = speculative.measure(adaptive, run((0.0, 0.02, 0.04)), rounds=8, repeats=3)
    assert measured.costs == pytest.approx((expected[1], expected[1], expected[2]))
    assert speculative.measure(adaptive, run((0.0, 0.0, 0.0)), rounds=8, repeats=3).costs == (1.0, 1.0, 1.0)


def test_one_call_without_rounds_a_repeat_serves_every_k(monkeypatch):
    """The call running no rounds (the prefill and the call's overhead) is the same program's same work whatever the
    K: `measure` times it once a repeat and takes it from every K's and the plain round's calls."""
    clock, without = [0.0], []
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])
    per_round = {0: 0.03, 1: 0.04, 2: 0.05}  # by index into ks (0, 1, 2); a plain round 0.02

    def call(measured):
        rounds, plain = int(measured.rounds), float(measured.plain_cost) == 0.0
        without.append(rounds == 0)
        clock[0] += 0.1 + rounds * (0.02 if plain else per_round[int(measured.forced)])

    measured = speculative.measure(AdaptiveK((0, 1, 2), prior=0.5), call, rounds=8, repeats=3)
    assert measured.costs == pytest.approx((0.03, 0.04, 0.05))
    assert measured.plain_cost == pytest.approx(0.02)
    # the prior's call, then a repeat: one call without rounds, one per K and one plain
    assert sum(without) == 3 and len(without) == 1 + 3 * 5


def test_rounds_that_take_less_than_half_a_call_without_rounds_are_timed_again_with_more(monkeypatch):
    """A call's noise grows with its length: where its fixed part (the prefill) is 1 s, 8 rounds of 0.02 s (0.16 s)
    are timed again with 32 (0.64 s) and no more; beside a fixed part of 0.1 s (the control), 8 rounds are enough."""
    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])

    def rounds_timed(fixed: float) -> set:
        seen = set()

        def call(measured):
            rounds = int(measured.rounds)
            seen.add(rounds)
            clock[0] += fixed + rounds * (0.02, 0.03)[int(measured.forced)]

        costs = speculative.measure(AdaptiveK((1, 2), prior=0.5), call, rounds=8, repeats=3).costs
        assert costs == pytest.approx((0.02, 0.03))
        return seen

    assert rounds_timed(1.0) == {0, 8, 32}
    assert rounds_timed(0.1) == {0, 8}


def test_a_plain_round_timed_above_a_k0_round_costs_a_k0_round(monkeypatch):
    """A plain round is a K = 0 round without the drafter's call: timed above one (the machine's noise: at batch 16
    it made a job that should run plain run K = 0 rounds, which start the drafter in every refilled slot), it takes
    the K = 0 round's cost; timed below, its own."""
    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])

    def run(plain_round):
        def call(measured):
            rounds, plain = int(measured.rounds), float(measured.plain_cost) == 0.0
            clock[0] += 1.0 + rounds * (plain_round if plain else (0.03, 0.05)[int(measured.forced)])

        return call

    adaptive = AdaptiveK((0, 1), prior=0.5)
    assert speculative.measure(adaptive, run(0.035), rounds=8, repeats=3).plain_cost == pytest.approx(0.03)
    assert speculative.measure(adaptive, run(0.02), rounds=8, repeats=3).plain_cost == pytest.approx(0.02)


# --- errors -----------------------------------------------------------------------------------------------


def test_errors_before_compile():
    graphdef, params = TARGET
    spec = adaptive_spec(GenerateSpec(8))
    with pytest.raises(ValueError, match=r"build the drafter as a chain of the largest K \(k=8\), not K=4"):
        speculative_generate(TINY, graphdef, params, DraftModel(TINY, graphdef, 4), params, RAGGED, spec)
    with pytest.raises(ValueError, match="Lookahead cannot change its draft length per round"):
        speculative_generate(TINY, graphdef, params, Lookahead(), None, RAGGED, spec)
    with pytest.raises(ValueError, match="adaptive K chooses draft lengths: give a drafter"):
        compile_decode(TINY, graphdef, params, RAGGED, spec)
    with pytest.raises(ValueError, match="increasing distinct integers >= 0"):
        AdaptiveK((4, 2))
    with pytest.raises(ValueError, match="needs a K >= 1 besides 0"):
        AdaptiveK((0,))
    with pytest.raises(ValueError, match="one positive round cost per K"):
        AdaptiveK((1, 2), costs=(1.0,))
    with pytest.raises(ValueError, match="cannot read adaptive K '1,x'"):
        AdaptiveK.parse("1,x")
    assert AdaptiveK.parse("1,2,4") == AdaptiveK((1, 2, 4))


def test_cli(capsys, stories):
    """`--adaptive_k` decodes with the round costs timed before the loop and prints the histogram of K. With neither
    --k nor --tree, a drafter that can change its K runs the default policy (K in 0, 1, 2, 4; `--compare_ar` decodes
    AR without it); --k fixes K; a drafter that cannot change its K drafts K = 4 chains."""
    module = cli()
    ar = run_cli(module, capsys)
    story = ar.split("\n|")[0]
    out = run_cli(module, capsys, "--drafter=draft_model", "--draft_layers=4", "--adaptive_k=1,2")
    assert out.split("\n|")[0] == story
    assert "adaptive K in {1, 2} (row-rounds by K [0, " in out
    out = run_cli(module, capsys, "--drafter=draft_model", "--draft_layers=4", "--compare_ar")
    assert out.split("\n|")[0] == story and "speedup over AR" in out
    rounds = re.search(r"adaptive K in \{0, 1, 2, 4\} \(row-rounds by K \[(.*)\]\)", out)
    assert sum(map(int, rounds.group(1).split(","))) > 0
    out = run_cli(module, capsys, "--drafter=draft_model", "--draft_layers=4", "--k=4")
    assert out.split("\n|")[0] == story and "\nK=4, acceptance" in out and "adaptive" not in out
    out = run_cli(module, capsys, "--drafter=lookahead")
    assert out.split("\n|")[0] == story and "N=5" in out and "adaptive" not in out
    with pytest.raises(ValueError, match="--adaptive_k chooses each round's K itself: drop --k and --tree"):
        run_cli(module, capsys, "--drafter=draft_model", "--adaptive_k=1,2", "--k=2")
