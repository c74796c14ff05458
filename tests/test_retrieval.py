"""Retrieval drafting (REST): suffix arrays and proposals equal plain Python references; greedy == AR (chains and
trees, tiny model and stories260K); sampling is exact (verify_exactness with its negative control); the datastore
carries its provenance (a changed corpus or another tokenizer is rebuilt or refused); bad settings fail early."""

import json

import jax
import numpy as np
import pytest
from conftest import STORIES_PROMPT, TINY
from helpers import RAGGED, TARGET

from specjax import datastore, files
from specjax.datastore import Datastore, DatastoreError, open_datastore, suffix_array
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.retrieval import Retrieval, RetrievalError, RetrievalSettings, retrieval_candidates
from specjax.drafting import registry
from specjax.metrics import summarize
from specjax.models.loading import LoadedModel


def reference(corpus, row, k, min_suffix, max_suffix, branches, occurrences):
    """The rule of `specjax.drafters.retrieval`, written plainly: (branches x k tokens, found flags)."""
    ext = lambda p: corpus[p] if p < len(corpus) else -1
    order = sorted(range(len(corpus)), key=lambda p: corpus[p:])
    for n in range(min(max_suffix, len(row)), min_suffix - 1, -1):
        occ = [p for p in order if corpus[p : p + n] == row[-n:]]
        if not occ:
            continue
        conts = [tuple(ext(p + n + t) for t in range(k)) for p in occ]
        sampled = {conts[j * len(occ) // occurrences] for j in range(occurrences)}
        ranked = sorted(sampled, key=lambda c: (-conts.count(c), c))[:branches]
        out = [[corpus[-1] if t < 0 else t for t in c] for c in ranked]
        found = [True] * len(out) + [False] * (branches - len(out))
        return out + [[row[-1]] * k] * (branches - len(out)), found
    return [[row[-1]] * k] * branches, [False] * branches


candidates = jax.jit(retrieval_candidates, static_argnums=(4, 5, 6, 7, 8))


def test_reference_examples():
    corpus = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9]
    assert reference(corpus, [5, 1, 2], 2, 1, 3, 1, 8) == ([[3, 1]], [True])  # "1 2 3 1" beats "1 2 4 1"
    assert reference(corpus, [5, 1, 2], 2, 1, 3, 2, 8) == ([[3, 1], [3, 9]], [True, True])  # distinct by 2
    assert reference(corpus, [7, 2, 3], 3, 1, 3, 1, 8) == ([[1, 2, 4]], [True])  # "2 3" (x2); "3 9 <end>"
    assert reference(corpus, [4, 3, 9], 2, 1, 3, 1, 8) == ([[9, 9]], [True])  # past the end: the last token
    assert reference(corpus, [5, 6], 2, 1, 2, 2, 8) == ([[6, 6], [6, 6]], [False, False])


@pytest.mark.parametrize("vocab", [2, 3, 7, 40])
def test_suffix_array_equals_sorting(vocab):
    rng = np.random.default_rng(vocab)
    for size in (1, 2, 5, 60, 300):
        corpus = rng.integers(0, vocab, size)
        want = sorted(range(size), key=lambda p: corpus[p:].tolist())
        assert suffix_array(corpus).tolist() == want
    assert suffix_array(np.zeros(17, int)).tolist() == list(range(16, -1, -1))  # a run: shorter first


@pytest.mark.parametrize(
    "k, min_suffix, max_suffix, branches, occurrences",
    [
        (1, 1, 1, 1, 4),
        (4, 1, 3, 1, 16),
        (3, 2, 5, 1, 8),
        (6, 1, 8, 1, 3),
        (4, 1, 3, 3, 16),
        (2, 2, 4, 4, 5),
    ],
)
def test_candidates_equal_reference(k, min_suffix, max_suffix, branches, occurrences):
    rng = np.random.default_rng(k * 1000 + min_suffix * 100 + max_suffix * 10 + branches)
    size, batch = 30, 24
    for vocab in (2, 4, 9):
        corpus = rng.integers(0, vocab, 120).tolist()  # one size: one compile
        store = Datastore.from_tokens(corpus)
        seq = rng.integers(0, 60, (batch, size))  # junk beyond each row's end: never read
        n_tokens = rng.integers(1, size + 1, batch)
        n_tokens[:3] = [1, 2, size]
        for b in range(batch):
            seq[b, : n_tokens[b]] = rng.integers(0, vocab + b % 2, n_tokens[b])  # b odd: unseen tokens too
        seq[-1, : n_tokens[-1]] = 100 + np.arange(n_tokens[-1])  # no match at all
        args = (
            store.tokens_R,
            store.suffix_R,
            seq,
            n_tokens,
            k,
            min_suffix,
            max_suffix,
            branches,
            occurrences,
        )
        tokens, found = candidates(*args)
        assert tokens.shape == (batch, branches, k) and tokens.dtype == np.int32
        for b in range(batch):
            row = seq[b, : n_tokens[b]].tolist()
            want = reference(corpus, row, k, min_suffix, max_suffix, branches, occurrences)
            assert (tokens[b].tolist(), found[b].tolist()) == want, (b, row, corpus)
        assert not np.asarray(found[-1]).any() and np.asarray(found[:, 0]).sum() >= 4  # matches occur


# --- decoding: greedy == AR, sampling exact ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_store():
    """A datastore of the tiny model's own greedy continuations (good drafts) and random tokens (useless)."""
    graphdef, params = TARGET
    spec = GenerateSpec(60, eos_id=None)
    own = np.asarray(generate(TINY, graphdef, params, [[1, 5], [1, 40, 41], [1, 7, 7]], spec).tokens)
    noise = np.random.default_rng(0).integers(0, TINY.vocab_size, 300)
    return Datastore.from_tokens(np.concatenate([own.reshape(-1), noise]))


DRAFTERS = [
    Retrieval(1),
    Retrieval(4),
    Retrieval(3, 2, 4),
    Retrieval(2, branches=3),
    Retrieval(4, branches=2),
]


@pytest.mark.parametrize("drafter", DRAFTERS, ids=str)
def test_greedy_equals_ar_tiny(drafter, tiny_store):
    graphdef, params = TARGET
    spec = GenerateSpec(40, eos_id=None)
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, spec).tokens)
    gen = speculative_generate(TINY, graphdef, params, drafter, Retrieval.params(tiny_store), RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert (
        summarize(gen.stats)["tau"] > 1.2
    )  # the datastore holds the model's own text: drafts are accepted


def test_useless_datastore_stays_exact():
    graphdef, params = TARGET
    spec = GenerateSpec(30, eos_id=None)
    ar = np.asarray(generate(TINY, graphdef, params, RAGGED, spec).tokens)
    store = Datastore.from_tokens(
        np.arange(3, 90)
    )  # no repeats: a match drafts the wrong counting sequence
    gen = speculative_generate(
        TINY, graphdef, params, Retrieval(3, branches=2), Retrieval.params(store), RAGGED, spec
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)


STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.\n"
    "One day, Lily saw a big red ball in the park. She ran to the ball and kicked it high.\n"
    "Tom was a happy boy. He liked to eat apples with his mom in the garden.\n"
)


@pytest.fixture(scope="module")
def stories_case(stories, tmp_path_factory):
    """(drafter, params, prompts, spec, AR tokens) for stories260K with a datastore built by the CLI from a few
    sentences and the model's own greedy continuations of other prompts."""
    spec = GenerateSpec(40, eos_id=None)
    own = [stories.tokenizer.encode(t) for t in (STORIES_PROMPT, "Lily went", "The sun was")]
    texts = np.asarray(generate(stories.cfg, stories.graphdef, stories.params, own, spec).tokens)
    corpus = tmp_path_factory.mktemp("stories") / "stories.txt"
    lines = [
        p + stories.tokenizer.decode(t.tolist())
        for p, t in zip((STORIES_PROMPT, "Lily went", "The sun was"), texts)
    ]
    corpus.write_text(STORY + "\n".join(line.replace("\n", " ") for line in lines) + "\n")
    assert datastore.main([f"--corpus={corpus}", f"--model={stories.path}", f"--out={corpus}.ds"]) == 0
    entry = registry.get("retrieval")
    drafters = [entry.build(stories, RetrievalSettings(datastore=f"{corpus}.ds"), 4, None, None)]
    drafters.append(entry.build(stories, RetrievalSettings(corpus=str(corpus), branches=3), 3, None, None))
    prompts = [stories.tokenizer.encode(t) for t in (STORIES_PROMPT, "Lily", "The sun was hot and the")]
    ar = np.asarray(generate(stories.cfg, stories.graphdef, stories.params, prompts, spec).tokens)
    return drafters, prompts, spec, ar


@pytest.mark.parametrize("which", [0, 1], ids=["chain", "tree"])
def test_greedy_equals_ar_stories(which, stories, stories_case):
    drafters, prompts, spec, ar = stories_case
    drafter, dparams = drafters[which]
    gen = speculative_generate(
        stories.cfg, stories.graphdef, stories.params, drafter, dparams, prompts, spec
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    tau_rows = np.asarray(gen.stats.emitted) / np.asarray(gen.stats.row_rounds)
    assert tau_rows[0] > 1.5, tau_rows  # the first prompt's continuation is in the datastore


# --- the datastore's files and provenance ------------------------------------------------------------------


class CharTokenizer:
    """A character tokenizer: ids 3.. for bytes (a foreign tokenizer to stories260K's)."""

    vocab_size, bos_id, eos_id = 259, 1, 2

    def encode(self, text):
        return [1] + [3 + b for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")


def test_changed_corpus_is_rebuilt_or_refused(tmp_path, stories):
    tok = stories.tokenizer
    corpus = tmp_path / "c.txt"
    corpus.write_text(STORY)
    first = open_datastore("", str(corpus), tok)  # built beside the corpus
    assert (tmp_path / "c.txt.datastore" / "manifest.json").exists()
    assert first.tokens_R.tolist() == [t for line in STORY.splitlines() for t in tok.encode(line)]
    assert open_datastore("", str(corpus), tok).manifest == first.manifest  # reused as it is
    corpus.write_text(STORY.replace("Lily", "Mia"))
    with pytest.raises(
        files.ProvenanceError, match="c.txt, which has changed since; rebuild it: pass --corpus="
    ):
        open_datastore(str(tmp_path / "c.txt.datastore"), "", tok)
    rebuilt = open_datastore("", str(corpus), tok)
    assert rebuilt.manifest["provenance"] != first.manifest["provenance"]
    assert tok.encode("Mia")[1] in rebuilt.tokens_R and rebuilt.tokens_R.tolist() != first.tokens_R.tolist()
    assert open_datastore(str(tmp_path / "c.txt.datastore"), "", tok).manifest == rebuilt.manifest
    with pytest.raises(files.ProvenanceError, match="built with another tokenizer than the target's"):
        open_datastore(str(tmp_path / "c.txt.datastore"), "", CharTokenizer())
    again = open_datastore("", str(corpus), CharTokenizer())  # with the corpus: rebuilt for that tokenizer
    assert again.tokens_R[:2].tolist() == CharTokenizer().encode("O") and again.tokens_R.max() > 100


def test_modified_missing_and_foreign_datastores(tmp_path, stories):
    tok = stories.tokenizer
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": line}) for line in STORY.splitlines()))
    out = tmp_path / "ds"
    datastore.build(corpus, tok, out)
    np.save(out / "tokens.npy", np.zeros(3, np.int32))
    with pytest.raises(DatastoreError, match="was modified since it was built; build it with `python -m"):
        open_datastore(str(out), "", tok)
    assert open_datastore(str(out), str(corpus), tok).tokens_R.size > 3  # with the corpus: rebuilt
    with pytest.raises(
        DatastoreError, match="nowhere does not exist; build it with `python -m specjax.datastore"
    ):
        open_datastore(str(tmp_path / "nowhere"), "", tok)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(files.DestinationError, match="is not a datastore written by specjax"):
        open_datastore(str(foreign), str(corpus), tok)
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1
    with pytest.raises(DatastoreError, match="is not a specjax datastore"):
        open_datastore(str(foreign), "", tok)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(k=0), "retrieval k=0 must be >= 1"),
        (dict(k=2, min_suffix=0), "retrieval min_suffix=0 must be >= 1"),
        (dict(k=2, min_suffix=3, max_suffix=2), "max_suffix=2 is below min_suffix=3; use max_suffix >="),
        (
            dict(k=2, branches=4, occurrences=3),
            "occurrences=3 cannot give branches=4 distinct continuations",
        ),
        (dict(k=2.5), "retrieval k must be an integer, got 2.5; pass a whole number"),
    ],
)
def test_bad_settings(settings, message):
    with pytest.raises(RetrievalError, match=message):
        Retrieval(**settings)


def test_build_errors_before_any_compile(stories, tmp_path, capsys):
    entry = registry.get("retrieval")
    with pytest.raises(DatastoreError, match="needs a datastore; pass --datastore=DIR"):
        entry.build(stories, RetrievalSettings(), 4, None, None)
    with pytest.raises(DatastoreError, match="missing.txt does not exist; pass --corpus=FILE"):
        entry.build(stories, RetrievalSettings(corpus=str(tmp_path / "missing.txt")), 4, None, None)
    with pytest.raises(RetrievalError, match="max_suffix=1 is below min_suffix=2"):
        entry.build(stories, RetrievalSettings(min_suffix=2, max_suffix=1), 4, None, None)
    with pytest.raises(RetrievalError, match="builds its own tree; drop --tree and set --branches"):
        entry.build(stories, RetrievalSettings(), 2, Retrieval(2, branches=2).shape, None)
    tiny = LoadedModel(TINY, *TARGET, None, tmp_path)
    with pytest.raises(DatastoreError, match="this target has no tokenizer"):
        entry.build(tiny, RetrievalSettings(datastore=str(tmp_path)), 4, None, None)
    foreign = tmp_path / "chars.txt"
    foreign.write_text("x" * 600)
    datastore.build(foreign, CharTokenizer(), tmp_path / "chars.ds")
    with pytest.raises(files.ProvenanceError, match="another tokenizer"):
        entry.build(stories, RetrievalSettings(datastore=str(tmp_path / "chars.ds")), 4, None, None)
    assert datastore.main([f"--corpus={tmp_path / 'nope.txt'}", f"--model={stories.path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: corpus ") and err.endswith("(.txt or .jsonl)") and "\n" not in err
