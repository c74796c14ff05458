"""Suffix decoding (`specjax.drafters.suffix`): the lookup on hand-made texts, the frequency tree, the store that
learns from finished outputs and keeps its provenance on disk, and greedy equality with AR on stories260K.
(`verify_exactness` over every drafter, in tests/test_verification.py, covers its sampled drafts with q.)"""

import json
from fractions import Fraction

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
