"""Suffix decoding (`specjax.drafters.suffix`): the lookup on hand-made texts, the frequency tree, the store that
learns from finished outputs and keeps its provenance on disk, and greedy equality with AR on stories260K.
(`verify_exactness` over every drafter, in tests/test_verification.py, covers its sampled drafts with q.)"""

import json
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import GenerateSpec, compile_decode
from specjax.drafters import suffix
from specjax.errors import SuffixError
from specjax.runner import decode_texts


def lookup(store, row, k=3, max_match=4, occurrences=4):
    seq = jnp.asarray([row], jnp.int32)
    text, pending = suffix.searched_text(jnp.asarray(store, jnp.int32), seq, jnp.asarray([len(row)]))
    return suffix.occurrences_of_suffix(text, pending, 1, max_match, occurrences, k), text[0, pending]


def test_longest_match_its_most_recent_continuations_and_their_frequencies():
    store = [1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 7, 2, 3, 4, 6, -1]
    (n, cont, read, ends), last = lookup(store, [9, 1, 2, 3])
    assert int(n[0]) == 3  # "1 2 3" twice; "2 3" three times, but shorter
    assert read[0].tolist() == [True, True, False, False]
    assert ends[0, :2].tolist() == [7, 2]  # where the two matches end in the text, the latest first
    assert cont[0, :2].tolist() == [
        [5, -1, -1],
        [4, -1, -1],
    ]  # most recent first, cut at each document's end
    tokens, probs, _ = suffix.frequent_path(cont, read, last, 3)
    assert tokens[0].tolist() == [
        5,
        3,
        3,
    ]  # a tie: the more recent; then nothing follows: the pending token
    assert np.allclose(probs[0], [0.5, 0, 0])
    (n, cont, read, _), last = lookup([5, 6, -1, 5, 7, -1, 5, 6, -1], [2, 5], k=1)
    tokens, probs, _ = suffix.frequent_path(cont, read, last, 1)
    assert int(n[0]) == 1 and tokens[0, 0] == 6 and np.isclose(probs[0, 0], 2 / 3)  # the most frequent


def test_the_row_and_the_other_rows_are_searched_up_to_their_lengths():
    seq = jnp.asarray([[4, 5, 6, 4, 5, 0, 0], [8, 4, 5, 9, 9, 9, 9]], jnp.int32)
    text, pending = suffix.searched_text(jnp.full((2,), -1, jnp.int32), seq, jnp.asarray([5, 3]))
    assert text.tolist() == [[-1, -1, 4, 5, 6, 4, 5, -1, -1, -1, 8, 4, 5, -1, -1, -1, -1, -1]]
    n, cont, read, _ = suffix.occurrences_of_suffix(text, pending, 1, 4, 2, 2)
    # row 0 ("... 4 5"): its own earlier "4 5" (then 6, 4); row 1's "4 5" ends at its pending token: nothing follows
    assert n.tolist() == [2, 2] and cont[0, 0].tolist() == [6, 4] and not read[0, 1]
    assert cont[1, 0].tolist() == [6, 4]  # row 1 finds row 0's text
    many = jnp.concatenate(
        [seq, jnp.tile(seq[1:], (suffix.SHARED_ROWS, 1))]
    )  # beyond: each row its own text
    lengths = jnp.asarray([5] + [3] * (suffix.SHARED_ROWS + 1))
    text, pending = suffix.searched_text(jnp.full((2,), -1, jnp.int32), many, lengths)
    assert text.shape == (len(many), 2 + 8) and text[1].tolist() == [-1, -1, 8, 4, 5, -1, -1, -1, -1, -1]
    n, cont, read, _ = suffix.occurrences_of_suffix(text, pending, 1, 4, 2, 2)
    assert cont[0, 0].tolist() == [6, 4] and not read[1:].any()


def test_frequency_tree_keeps_the_most_probable_prefixes_parents_first():
    cont = jnp.asarray([[[5, 6, 7], [5, 6, 8], [5, 9, 1], [-1, -1, -1]]], jnp.int32)
    read = jnp.asarray([[True, True, True, False]])
    tokens, parent = suffix.frequency_tree(cont, read, jnp.asarray([3]), 4)
    # [5] 3/3, [5 6] 2/3, then the 1/3 prefixes shallow first: [5 9], [5 6 7] (the more recent of two)
    assert tokens[0].tolist() == [5, 6, 9, 7]
    assert parent[0].tolist() == [0, 0, 1, 1, 2]
    tokens, parent = suffix.frequency_tree(cont, read, jnp.asarray([3]), 8)  # more slots than prefixes
    assert tokens[0].tolist() == [5, 6, 9, 7, 8, 1, 3, 3] and parent[0].tolist() == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        0,
        0,
    ]


def test_sampled_chain_draws_from_the_frequencies_it_reports_as_q():
    cont = jnp.asarray([[[5, 6], [5, 7], [4, 6], [5, 6]]] * 12, jnp.int32)  # 12 rows, one per uniform
    read = jnp.ones((12, 4), bool)
    u = (jnp.arange(12)[:, None] + 0.5) / 12 * jnp.ones((1, 2))
    tokens, _, q = suffix.frequent_path(cont, read, jnp.zeros(12, jnp.int32), 2, u, 10)
    first = tokens[:, 0].tolist()
    assert Fraction(first.count(5), 12) == Fraction(3, 4) and Fraction(first.count(4), 12) == Fraction(1, 4)
    assert np.allclose(q[0, 0], np.eye(10)[5] * 0.75 + np.eye(10)[4] * 0.25)
    after5 = [int(t) for f, t in zip(first, tokens[:, 1].tolist()) if f == 5]
    assert sorted(set(after5)) == [
        6,
        7,
    ]  # drawn among the occurrences that agreed on 5: 6 twice as often as 7
    row = first.index(5)
    assert np.allclose(q[row, 1], np.eye(10)[6] * 2 / 3 + np.eye(10)[7] / 3)


# the store's distributions for hand-made texts: each token's recorded (ids, probabilities) of the token after it
RECORDED = {
    (1, 2, 7): ([[2, 4], [7, 9], [0, 1]], [[0.5, 0.5], [0.6, 0.4], [0.5, 0.5]]),
    (1, 3, 8): ([[3, 2], [8, 1], [0, 1]], [[0.75, 0.25], [0.5, 0.5], [0.5, 0.5]]),
}


def recording(tokens):
    ids, probs = RECORDED[tuple(tokens)]
    return np.asarray(ids, np.int32), np.log(np.asarray(probs, np.float32))


def test_sampled_chain_draws_from_the_recorded_distributions_it_reports_as_q():
    """q at each depth is the mean over the continuations that agree so far of the store's recorded distribution
    (warped by the sampler: T = 0.5 squares and renormalises) or, for a continuation in the row's own text, a point
    mass on it; tokens are drawn from that q."""
    from specjax.sampling import Sampler

    drafter = suffix.Suffix(2, 10, frequencies=True, distributions=2, sampler=Sampler(0.5), score=recording)
    store = drafter.absorb(suffix.empty_store(8, 2), [[1, 2, 7], [1, 3, 8]])
    assert store["store"].tolist() == [1, 2, 7, -1, 1, 3, 8, -1]
    assert store["next_ids"][:5].tolist() == [[2, 4], [7, 9], [0, 1], [-1, -1], [3, 2]]
    row = [1, 5, 1]  # "1" is followed by 2 and 3 in the store, by 5 in the row
    seq = jnp.asarray([row], jnp.int32)
    text, pending = suffix.searched_text(store["store"], seq, jnp.asarray([3]))
    n, cont, read, ends = suffix.occurrences_of_suffix(text, pending, 1, 4, 4, 2)
    dists = suffix.continuation_distributions(store, ends, cont, drafter.sampler)
    rows = 30
    grow = lambda a: jnp.broadcast_to(a, (rows, *a.shape[1:]))
    u = (jnp.arange(rows)[:, None] + 0.5) / rows * jnp.ones((1, 2))
    tokens, _, q = suffix.frequent_path(
        grow(cont), grow(read), jnp.full(rows, 1), 2, u, 10, tuple(grow(d) for d in dists)
    )
    # (0.5, 0.5) stays; (0.75, 0.25) at T = 0.5 is (0.9, 0.1); the row's 5 is a point mass
    expected = {2: (0.5 + 0.1) / 3, 3: 0.9 / 3, 4: 0.5 / 3, 5: 1 / 3}
    assert np.allclose(q[0, 0], [expected.get(t, 0) for t in range(10)])
    first = tokens[:, 0].tolist()
    assert {t: first.count(t) for t in set(first)} == {2: 6, 3: 9, 4: 5, 5: 10}  # 30 x q, by inverse CDF
    # after 2, only the first document agrees: its recorded (0.6, 0.4) over 7, 9 at T = 0.5; a token no
    # continuation took (4) leaves no evidence: the pending token, a point mass
    two, four = first.index(2), first.index(4)
    assert np.allclose(q[two, 1], np.eye(10)[7] * 0.36 / 0.52 + np.eye(10)[9] * 0.16 / 0.52)
    assert tokens[four, 1] == 1 and np.allclose(q[four, 1], np.eye(10)[1])


def test_the_recorded_distributions_keep_pace_with_the_tokens_on_disk(tmp_path):
    drafter = suffix.Suffix(
        2, 10, frequencies=True, distributions=2, store=str(tmp_path / "store"), provenance="t", target_id="m",
        score=recording,
    )  # fmt: skip
    params = drafter.absorb(suffix.empty_store(6, 2), [[1, 2, 7]])
    params = drafter.absorb(params, [[1, 3, 8]])  # full: the oldest token and its distribution go together
    assert params["store"].tolist() == [7, -1, 1, 3, 8, -1]
    assert params["next_ids"].tolist() == [[0, 1], [-1, -1], [3, 2], [8, 1], [0, 1], [-1, -1]]
    assert (
        np.allclose(np.exp(params["next_logp"][2]), [0.75, 0.25])
        and np.isneginf(params["next_logp"][1]).all()
    )
    load = lambda *a: suffix.load_store(tmp_path / "store", *a, target_id="m")
    again = load(6, "t", 2)
    assert all((np.asarray(again[k]) == np.asarray(params[k])).all() for k in params)
    assert load(4, "t", 1)["next_ids"].tolist() == [[3], [8], [0], [-1]]  # the newest rows, the top columns
    assert load(6, "t", 3)["next_ids"][2].tolist() == [3, 2, -1]
    assert set(load(6, "t")) == {"store"}
    # a store saved without distributions: each token's is a point mass on the token that followed it
    suffix.save_store(tmp_path / "tokens", {"store": np.asarray([4, 5, 6, -1], np.int32)}, "t")
    plain = suffix.load_store(tmp_path / "tokens", 4, "t", 2)
    assert plain["next_ids"].tolist() == [[5, -1], [6, -1], [-1, -1], [-1, -1]]
    assert plain["next_logp"][:2, 0].tolist() == [0.0, 0.0] and np.isneginf(plain["next_logp"][2:]).all()
    with pytest.raises(SuffixError, match="holds another target's distributions; pass another --store"):
        suffix.load_store(tmp_path / "store", 6, "t", 2, target_id="other")
    assert set(suffix.load_store(tmp_path / "store", 6, "t", target_id="other")) == {"store"}  # its tokens
    np.save(tmp_path / "store/next_logp.npy", np.zeros((6, 2), np.float32))
    with pytest.raises(SuffixError, match="was modified since it was written"):
        load(6, "t", 2)


def test_next_token_distributions_are_the_target_s_top_tokens(stories):
    from specjax.models.llama import causal_mask, forward, init_cache
    from tests.tolerance import assert_close, forward_depth

    tokens = stories.tokenizer.encode("Once upon a time there was")
    ids, logp = suffix.next_token_distributions(stories, 5, tokens)  # a pass padded to 128 tokens
    t = len(tokens)
    cache = init_cache(stories.cfg, 1, t)
    logits, _, _ = forward(stories.graphdef, stories.params, jnp.asarray([tokens]), jnp.arange(t)[None], cache,
                           causal_mask(t))  # fmt: skip
    full = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    assert ids.shape == (t, 5) and (np.argsort(-full, axis=1)[:, 0] == ids[:, 0]).all()
    assert_close(
        logp, np.take_along_axis(full, ids, 1), dtype=jnp.float32, depth=forward_depth(stories.cfg.n_layers)
    )


def test_a_sampled_run_records_its_target_s_distributions_in_the_store(stories, tmp_path):
    from specjax.drafting import registry
    from specjax.models.store import identity
    from specjax.sampling import Sampler

    settings = suffix.SuffixSettings(
        store=str(tmp_path / "s"), store_tokens=512, frequencies=True, distributions=4
    )
    drafter, params = registry.get("suffix").build(stories, settings, 4, None, Sampler(0.7))
    spec = GenerateSpec(16, eos_id=None, sampler=Sampler(0.7))
    decode_texts(stories, ["Lily went to the park"], spec, 0, 1, drafter, params)
    manifest = json.loads((tmp_path / "s/manifest.json").read_text())
    assert manifest["provenance"]["target"] == identity(stories.path, stories.cfg, stories.params)
    # a later run reads them
    _, again = registry.get("suffix").build(stories, settings, 4, None, Sampler(0.7))
    tokens = again["store"][again["store"] >= 0].tolist()
    ids, logp = suffix.next_token_distributions(stories, 4, tokens)
    held = np.asarray(again["store"]) >= 0
    assert (np.asarray(again["next_ids"])[held] == ids).all() and np.allclose(
        np.asarray(again["next_logp"])[held], logp
    )


def test_distributions_need_a_target_and_sampled_drafts():
    from specjax.drafting import registry
    from specjax.sampling import Sampler
    from specjax.verify_exactness import tiny_target

    with pytest.raises(SuffixError, match="no target scores them; build the drafter with its target"):
        suffix.Suffix(4, 50, frequencies=True, distributions=4)
    with pytest.raises(
        SuffixError, match="--distributions=4 sets the q of drafts drawn from the store; add --freq"
    ):
        registry.get("suffix").build(
            tiny_target(), suffix.SuffixSettings(distributions=4), 4, None, Sampler(1.0)
        )


def test_store_keeps_the_newest_tokens_and_its_provenance(tmp_path):
    drafter = suffix.Suffix(2, 50, store=str(tmp_path / "store"), provenance="tok-a")
    params = drafter.absorb(suffix.empty_store(8), [[1, 2, 3]])
    assert params["store"].tolist() == [-1, -1, -1, -1, 1, 2, 3, -1]
    params = drafter.absorb(params, [[4, 5, 6, 7]])
    assert params["store"].tolist() == [2, 3, -1, 4, 5, 6, 7, -1]  # full: the oldest went first
    assert suffix.load_store(tmp_path / "store", 8, "tok-a")["store"].tolist() == params["store"].tolist()
    assert suffix.load_store(tmp_path / "store", 4, "tok-a")["store"].tolist() == [
        5,
        6,
        7,
        -1,
    ]  # the newest
    assert suffix.load_store(tmp_path / "none", 3, "tok-a")["store"].tolist() == [-1, -1, -1]
    with pytest.raises(SuffixError, match="written with another tokenizer; pass another --store"):
        suffix.load_store(tmp_path / "store", 8, "tok-b")
    np.save(tmp_path / "store/tokens.npy", np.arange(8, dtype=np.int32))
    with pytest.raises(SuffixError, match="was modified since it was written"):
        suffix.load_store(tmp_path / "store", 8, "tok-a")
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("mine")
    with pytest.raises(SuffixError, match="is not a suffix store"):
        suffix.load_store(tmp_path / "other", 8, "tok-a")
    with pytest.raises(Exception, match="other"):  # never replaces a folder it did not write
        suffix.save_store(tmp_path / "other", {"store": np.zeros(4, np.int32)}, "tok-a")
    assert (tmp_path / "other/notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "store/manifest.json").read_text())["capacity"] == 8


def test_settings_errors_name_the_fix():
    with pytest.raises(SuffixError, match="max_match=2 is below min_match=3"):
        suffix.Suffix(4, 50, min_match=3, max_match=2)
    with pytest.raises(SuffixError, match="nodes=40 exceeds the 4 x 8"):
        suffix.Suffix(8, 50, occurrences=4, nodes=40)
    with pytest.raises(SuffixError, match="spec_factor > 0"):
        suffix.Suffix(4, 50, spec_factor=0)


@pytest.mark.parametrize("nodes", [0, 12])
def test_greedy_equals_ar_and_the_store_learns_from_outputs(stories, nodes):
    tok = stories.tokenizer
    prompts = [tok.encode("Once upon a time"), tok.encode("Tom had a red ball and")]
    spec = GenerateSpec(48, eos_id=None)
    ar, _ = compile_decode(stories.cfg, stories.graphdef, stories.params, prompts, spec)
    reference = np.asarray(ar(prompts).tokens)
    drafter, params = suffix.Suffix(8, stories.cfg.vocab_size, nodes=nodes), suffix.empty_store(2048)
    run, _ = compile_decode(stories.cfg, stories.graphdef, stories.params, prompts, spec, drafter, params)
    taus = []
    for _ in range(2):
        gen = run(prompts, 0, params)
        assert (np.asarray(gen.tokens) == reference).all()
        taus.append(float(np.sum(gen.stats.emitted) / np.sum(gen.stats.row_rounds)))
        params = drafter.absorb(params, [p + t for p, t in zip(prompts, np.asarray(gen.tokens).tolist())])
    # the second time each output is in the store: whole rounds accepted (a chain verifies at most K = 8 + 1)
    assert taus[0] < 2.5 and taus[1] > 6, taus


def test_runs_learn_across_batches_and_keep_the_store(stories, tmp_path):
    from specjax.datastore import tokenizer_identity
    from specjax.drafting import registry
    from specjax.sampling import Sampler

    settings = suffix.SuffixSettings(store=str(tmp_path / "store"), store_tokens=1024)
    drafter, params = registry.get("suffix").build(stories, settings, 6, None, Sampler())
    texts = ["Lily went to the park"] * 2
    report = decode_texts(stories, texts, GenerateSpec(40, eos_id=None), 0, 1, drafter, params)
    ar = decode_texts(stories, texts, GenerateSpec(40, eos_id=None), 0, 1)
    assert report.texts == ar.texts
    first, second = (float(np.sum(s.emitted) / np.sum(s.row_rounds)) for s in report.stats)
    assert second > 2 * first  # batch 2 drafted from batch 1's output
    saved = suffix.load_store(tmp_path / "store", 1024, tokenizer_identity(stories.tokenizer))["store"]
    assert int(jnp.sum(saved >= 0)) == 2 * (len(stories.tokenizer.encode(texts[0])) + 40)
    _, again = registry.get("suffix").build(
        stories, settings, 6, None, Sampler()
    )  # a later run starts from it
    assert again["store"].tolist() == saved.tolist()


def test_a_corpus_fills_the_store_at_start_and_a_full_store_keeps_its_newest_tokens(stories, tmp_path):
    """`--suffix_corpus`: each line a document, tokenized, ended by -1 in the store; a store smaller than the
    corpus keeps its newest tokens. (The frequency tree's drafts are point masses on a tree of parents, whose
    sampling every dynamic tree's exactness test checks; its greedy decoding is checked above.)"""
    from specjax.drafting import registry

    corpus = tmp_path / "stories.txt"
    corpus.write_text("Once upon a time\n\nLily went to the park\n")
    docs = [stories.tokenizer.encode(t) for t in ("Once upon a time", "Lily went to the park")]
    held = docs[0] + [-1] + docs[1] + [-1]
    build = lambda n: registry.get("suffix").build(
        stories, suffix.SuffixSettings(nodes=6, suffix_corpus=str(corpus), store_tokens=n), 4, None, None
    )
    drafter, params = build(len(held) + 3)
    assert params["store"].tolist() == [-1] * 3 + held and drafter.nodes == 6
    assert build(len(held) - 2)[1]["store"].tolist() == held[2:]


def test_reference_replay_finds_the_longest_path_the_output_continues():
    from experiments.suffix_reference import accepted, replay

    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 2]  # 5 -> 7 -> 8 and 6 under the root
    assert [accepted(tokens, parents, t) for t in ([5, 7, 8, 1], [6, 7], [5, 8], [9])] == [3, 1, 1, 0]
    # each round keeps what the draft continues and one token more: 3 rounds for 5 tokens, then 1 with a store
    speculate = lambda prompt, done, store: ([5, 7, 8], [-1, 0, 1]) if store else ([], [])
    assert replay([([1], [2, 3, 4]), ([1], [5, 7, 8, 9])], True, speculate, lambda *a: True) == (1 + 4) / 2


@pytest.mark.parametrize("nodes", [0, 12])
def test_replay_of_greedy_outputs_counts_the_rounds_decoding_takes(stories, nodes):
    """Replaying a greedy output through specjax's drafter (experiments.suffix_reference) takes the rounds that
    speculative decoding took, with the prefill's token given and the store learning between requests."""
    from experiments.suffix_reference import specjax_replay

    prompt = stories.tokenizer.encode("Lily went to the park")
    spec = GenerateSpec(24, eos_id=None)
    drafter, params = suffix.Suffix(8, stories.cfg.vocab_size, nodes=nodes), suffix.empty_store(65_536)
    run, _ = compile_decode(stories.cfg, stories.graphdef, stories.params, [prompt], spec, drafter, params)
    taus, requests = [], []
    for _ in range(2):
        gen = run([prompt], 0, params)
        output = np.asarray(gen.tokens)[0].tolist()
        taus.append(int(gen.stats.emitted[0]) / int(gen.stats.row_rounds[0]))
        # decoding's rounds start after the prefill's token
        requests.append((prompt + output[:1], output[1:]))
        params = drafter.absorb(params, [prompt + output])
    assert taus[1] > 3 * taus[0]
    assert specjax_replay(stories, requests, True, nodes) == pytest.approx(np.mean(taus), abs=1e-12)
