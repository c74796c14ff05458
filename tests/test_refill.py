"""Slots refilled inside the compiled loop (`specjax.decoding.refill`): every prompt's greedy output is its output
decoded alone, AR and speculative; the loop runs exactly the steps of the slot schedule
(`analysis.refill_schedule`); sampled outputs follow AR's distribution (and a refill that reuses one key for every
first token is caught)."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import N_SAMPLES, SMALL, Alternating, first_three, peaked, two_sample_pvalue

from specjax import analysis
from specjax.decoding import AdaptiveK, GenerateSpec, generate, refill
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafting import registry
from specjax.errors import DecodingError
from specjax.runner import decode_texts
from specjax.sampling import Sampler

TEXTS = [
    "Once upon a time",
    "Tom had a red ball",
    "Lily",
    "One day, a little bird",
    "The sun",
    "A cat sat",
    "Sam",
]


@pytest.fixture(scope="module")
def story_job(stories):
    """Seven prompts of mixed lengths, stopping at a common token (standing in for EOS, which stories260K reaches
    later) or 40 tokens, and their greedy outputs decoded together (a ragged batch decodes each row as alone:
    tests/test_decode.py)."""
    prompts = [stories.tokenizer.encode(t) for t in TEXTS]
    cfg, graphdef, params = stories.cfg, stories.graphdef, stories.params
    free = np.asarray(generate(cfg, graphdef, params, prompts, GenerateSpec(40, eos_id=None)).tokens)
    spec = GenerateSpec(40, Sampler(), eos_id=int(np.bincount(free.ravel()).argmax()))
    ar = generate(cfg, graphdef, params, prompts, spec)
    return prompts, spec, np.asarray(ar.tokens), np.asarray(ar.lengths)


@pytest.mark.parametrize("budgets", [None, [40, 12, 25, 40, 7, 30, 18]])
def test_ar_refill_decodes_each_prompt_as_alone_in_the_scheduled_steps(budgets, stories, story_job):
    """With each prompt's own token budget too: its output is its output alone, cut at the budget."""
    prompts, spec, tokens, lengths = story_job
    assert len(set(lengths.tolist())) > 2  # rows end at different times: slots are refilled mid-run
    if budgets is not None:
        lengths = np.minimum(lengths, budgets)
        tokens = np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, 0)
    cfg, graphdef, params = stories.cfg, stories.graphdef, stories.params
    served = refill.serve(cfg, graphdef, params, prompts, spec, slots=3, budgets=budgets)
    np.testing.assert_array_equal(np.asarray(served.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(served.lengths), lengths)
    # the loop runs the slot schedule: each prompt's last token in the round the schedule says (the model of
    # `specjax.analysis`, exact for known lengths)
    rounds, ends = analysis.refill_schedule(lengths - 1, 3)
    assert int(served.rounds) == rounds and np.asarray(served.end_rounds).tolist() == ends.tolist()
    # batch after batch would take the sum of each batch's longest row
    assert int(served.rounds) < sum(max(lengths[i : i + 3]) - 1 for i in range(0, len(prompts), 3))


@pytest.mark.parametrize(
    "method, k, adaptive",
    [
        ("draft_model", 3, None),
        ("eagle3", 4, Alternating((0, 4), (1.0, 1.0), prior=0.6)),
        ("eagle3", 4, AdaptiveK((0, 4), (1.0, 1.0), prior=0.6, plain_cost=0.2)),
    ],
    ids=["draft_model", "eagle3 adaptive K", "eagle3 plain"],
)
def test_speculative_refill_decodes_each_prompt_as_alone(method, k, adaptive, stories, story_job):
    """A draft model (its own cache in the drafter state) and an EAGLE-3 head (the target's features) with adaptive
    K (one round a step at the K chosen, here K = 0 and K = 4 in turn: its K = 4 rounds draft as a fixed K; or, at a
    plain round's cost that beats both, a plain job), prompts with token budgets of their own: each slot's drafter
    state is replaced with its new prompt's, and each prompt's output is its output alone."""
    prompts, spec, tokens, lengths = story_job
    entry = registry.get(method)
    drafter, dparams = entry.build(stories, entry.settings(), k, None, Sampler())
    cfg, graphdef, params = stories.cfg, stories.graphdef, stories.params
    budgets = [40, 12, 25, 40, 7, 30, 18]
    lengths = np.minimum(lengths, budgets)
    tokens = np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, 0)
    job = dataclasses.replace(spec, adaptive_k=adaptive)
    served = refill.serve(cfg, graphdef, params, prompts, job, 3, drafter, dparams, budgets=budgets)
    np.testing.assert_array_equal(np.asarray(served.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(served.lengths), lengths)
    assert int(served.stats.emitted.sum()) == int(lengths.sum()) - len(prompts)  # first tokens from prefill
    assert int(np.max(served.end_rounds)) == int(
        served.rounds
    )  # the last prompt's last token ends the loop
    if adaptive is not None:
        k_hist = np.asarray(served.stats.k_hist)
        drafted = 0 if adaptive.plain_cost else k_hist[4]
        assert k_hist[0] > 0 and (k_hist[4] > 0) == (drafted > 0), k_hist
        assert k_hist.sum() == k_hist[0] + drafted, k_hist


def test_a_refilled_prompt_is_prefilled_at_the_narrowest_width_that_holds_it(stories, monkeypatch):
    """Prompts of 33, 3, 17, 25 and 9 tokens in a buffer 40 wide: refilled slots prefill at 16, 24 or 40 tokens
    (17 and 25 just past a width); AR and EAGLE-3 (its head reads the prefill's features) decode each prompt as
    alone. Control: widths that stop at 24 cut the longer prompts, and the outputs change."""
    story = stories.tokenizer.encode("Once upon a time, there was a little girl named Lily. " * 4)
    prompts = [story[:n] for n in (33, 3, 17, 25, 9)]
    assert refill.prefill_widths(40) == (16, 24, 40)
    cfg, graphdef, params = stories.cfg, stories.graphdef, stories.params
    spec = GenerateSpec(12, Sampler(), eos_id=None)
    alone = np.asarray(generate(cfg, graphdef, params, prompts, spec).tokens)
    entry = registry.get("eagle3")
    drafter, dparams = entry.build(stories, entry.settings(), 3, None, Sampler())
    for d, dp in ((None, None), (drafter, dparams)):
        served = refill.serve(cfg, graphdef, params, prompts, spec, 2, d, dp)
        np.testing.assert_array_equal(np.asarray(served.tokens), alone)
    monkeypatch.setattr(refill, "prefill_widths", lambda width: (16, 24))
    refill.ar_serve_compiled.clear_cache()
    cut = np.asarray(refill.serve(cfg, graphdef, params, prompts, spec, 2).tokens)
    assert (cut[2:] != alone[2:]).any(axis=1).tolist() == [False, True, False]  # 25 tokens cut to 24
    refill.ar_serve_compiled.clear_cache()


def test_sampled_refill_is_distributed_as_ar_and_a_shared_key_is_caught(monkeypatch):
    graphdef, params = peaked(SMALL, 0)
    sampler = Sampler(1.0)
    prompts, spec = [[1, 3]] * N_SAMPLES, GenerateSpec(3, sampler, eos_id=None)
    ar = first_three(generate(SMALL, graphdef, params, prompts, spec, seed=1).tokens)
    dcfg, dgraphdef, dparams = truncated_target(SMALL, params, 1)
    drafter = DraftModel(dcfg, dgraphdef, 2, sampler)
    for d, dp in ((None, None), (drafter, dparams)):
        served = refill.serve(SMALL, graphdef, params, prompts, spec, 2048, d, dp, seed=2)
        assert two_sample_pvalue(ar, first_three(served.tokens)) > 1e-3
    # negative control: every prompt's first token drawn with the same key
    monkeypatch.setattr(
        refill,
        "first_tokens",
        lambda s, key, prompts_B, logits, n: jax.vmap(lambda lg: s.sample(key, lg))(logits),
    )
    refill.ar_serve_compiled.clear_cache()
    broken = refill.serve(SMALL, graphdef, params, prompts, spec, 2048, seed=2)
    assert two_sample_pvalue(ar, first_three(broken.tokens)) < 1e-6


def test_a_prompts_first_sampled_token_is_the_same_whichever_slot_serves_it():
    """At T = 1 a prompt's first token does not depend on the number of slots (nor on which prompts open the job
    beside it); its later tokens do (the rounds' uniforms are the slots'), which the control shows."""
    graphdef, params = peaked(SMALL, 0)
    prompts, spec = [[1, 3], [2], [1, 3], [4, 1, 2], [1, 3]], GenerateSpec(3, Sampler(1.0), eos_id=None)
    served = [
        np.asarray(refill.serve(SMALL, graphdef, params, prompts, spec, s, seed=4).tokens) for s in (1, 3)
    ]
    np.testing.assert_array_equal(served[0][:, 0], served[1][:, 0])
    assert len({tuple(row) for row in served[0][:, 0:1]}) > 1  # the prompts' first tokens differ
    assert (served[0][:, 1:] != served[1][:, 1:]).any()  # the control


def test_refill_errors():
    graphdef, params = peaked(SMALL, 0)
    with pytest.raises(DecodingError, match="batch_size=0"):
        refill.serve(SMALL, graphdef, params, [[1, 3]], GenerateSpec(3), 0)
    with pytest.raises(
        DecodingError, match="one per prompt \\(2\\), each in 1..max_new_tokens=3; got 2 in 1..4"
    ):
        refill.serve(SMALL, graphdef, params, [[1, 3], [1]], GenerateSpec(3), 2, budgets=[1, 4])
    shared = {"row": np.zeros((4, 3)), "odd": np.zeros((3, 2))}
    one = {"row": np.zeros((1, 3)), "odd": np.zeros((1, 2))}
    with pytest.raises(DecodingError, match="does not lead with the batch axis"):
        refill.put_row(shared, one, 0, 4)


def test_decode_texts_with_refill_gives_the_batch_after_batch_texts(stories):
    """`run_decode.py --refill`: the same texts as decoding batch after batch; a mesh or a drafter that learns between
    batches is refused."""
    spec = GenerateSpec(12, Sampler(), eos_id=stories.cfg.eos_id)
    batches = decode_texts(stories, TEXTS[:5], spec, batch_size=2)
    refilled = decode_texts(stories, TEXTS[:5], spec, batch_size=2, refill=True)
    assert refilled.texts == batches.texts and refilled.new_tokens == batches.new_tokens == 60
    with pytest.raises(DecodingError, match="--refill runs on one device"):
        decode_texts(stories, TEXTS, spec, batch_size=2, mesh=object(), refill=True)
    entry = registry.get("suffix")
    suffix, params = entry.build(stories, entry.settings(), 4, None, Sampler())
    with pytest.raises(DecodingError, match="learns between batches"):
        decode_texts(stories, TEXTS, spec, 0, 2, suffix, params, refill=True)


def test_batch_table_predicts_ar_rounds_exactly_in_both_modes(stories, story_job):
    """`make tables --sections=batch`'s runs (experiments.batch_table): batch after batch and refilled give the same
    greedy outputs, each request's end round, and AR's rounds as the model predicts them from the lengths (the
    prediction's rounds are exact for AR; for a drafter they are expectations)."""
    from experiments import batch_table

    prompts, spec, tokens, lengths = story_job
    target = (stories.cfg, stories.graphdef, stories.params)
    runs = {
        mode: build(target, prompts, spec, 3, None, None)() for mode, build in batch_table.BUILD.items()
    }
    cost = dict(step=1.0, prefill=10.0, refills=400.0)
    for mode, run in runs.items():
        np.testing.assert_array_equal(run.tokens, tokens)
        rounds, seconds = batch_table.predicted_seconds("AR", mode, run, 3, 0, cost)
        assert rounds == run.rounds and run.ends.max() == run.rounds
        prefills = -(-len(prompts) // 3) * 10.0 if mode == "batch after batch" else 10.0 + 400.0
        assert seconds == rounds + prefills
        assert batch_table.prefill_seconds(mode, len(prompts), 3, cost) == prefills
    bab, refilled = runs["batch after batch"], runs["refill"]
    assert (
        bab.ends.tolist()[:3] == (lengths[:3] - 1).tolist()
    )  # the first batch's rows end with their tokens
    assert refilled.rounds < bab.rounds and refilled.ends.mean() < bab.ends.mean()


def test_batch_table_predicts_each_requests_rounds_from_its_own_acceptance():
    """A batch of a request whose drafts are always accepted (5 tokens a round: 2 rounds for 10 tokens) and one whose
    drafts never are (10 rounds) ends after exactly 10 rounds; the pooled acceptance (the control) predicts fewer."""
    from types import SimpleNamespace

    from experiments import batch_table

    hist = np.array([[0, 0, 0, 0, 2], [10, 0, 0, 0, 0]])  # rounds by draft tokens accepted, K = 4
    run = batch_table.Run(
        np.zeros((2, 11)), np.array([11, 11]), 10, np.array([2, 10]), SimpleNamespace(row_hist=hist), hist
    )
    cost = dict(head=0.0, verify=1.0, prefill=0.0, refills=0.0)
    own = {
        mode: batch_table.predicted_seconds("eagle3", mode, run, 2, 4, cost, None, hist)
        for mode in ("batch after batch", "refill")
    }
    assert own["batch after batch"] == (10.0, 10.0) and own["refill"] == (10.0, 10.0)
    assert batch_table.predicted_seconds("eagle3", "refill", run, 1, 4, cost, None, hist)[0] == 12.0
    pooled, _ = batch_table.predicted_seconds("eagle3", "batch after batch", run, 2, 4, cost)
    assert pooled < 9.5
