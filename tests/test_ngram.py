"""N-gram prompt lookup: proposals equal a plain Python reference; greedy == AR (chains and trees, tiny model and
stories260K); sampling is distributed as AR; bad settings fail before compile; the benchmark's smoke mode runs."""

import csv
import functools
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import STORIES_PROMPT, TINY
from helpers import (
    RAGGED,
    TARGET,
    greedy_case,
)

from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.ngram import NGram, NGramError, branch_tree, ngram_candidates

REPO = Path(__file__).parents[1]


def reference(row: list[int], k: int, min_ngram: int, max_ngram: int, branches: int):
    """The rule of `specjax.drafters.ngram`, written plainly: (branches x k tokens, found flags)."""
    n_tokens = len(row)
    ends = []  # match ends ranked by longest match, then most recent
    for n in range(max_ngram, min_ngram - 1, -1):
        for end in range(n_tokens - 2, n - 2, -1):
            if row[end - n + 1 : end + 1] == row[n_tokens - n :] and end not in ends:
                ends.append(end)
    out = []
    for end in ends:
        period = n_tokens - 1 - end
        continuation = [row[end + 1 + j % period] for j in range(k)]
        if continuation not in out:
            out.append(continuation)
        if len(out) == branches:
            break
    found = [True] * len(out) + [False] * (branches - len(out))
    return out + [[row[-1]] * k] * (branches - len(out)), found


candidates = jax.jit(ngram_candidates, static_argnums=(2, 3, 4, 5))


def test_reference_examples():
    assert reference([1, 2, 3, 1, 2], 4, 1, 3, 1) == ([[3, 1, 2, 3]], [True])  # "1 2" at 0..1, periodic
    assert reference([5, 6, 5, 6, 5, 6], 3, 1, 3, 2) == ([[5, 6, 5], [6, 6, 6]], [True, False])
    assert reference([7], 2, 1, 2, 1) == ([[7, 7]], [False])
    # longest n first: "3 4" matches at the start, the more recent "4" alone does not win
    assert reference([3, 4, 9, 4, 8, 3, 4], 2, 1, 2, 2) == ([[9, 4], [8, 3]], [True, True])


@pytest.mark.parametrize(
    "k, min_ngram, max_ngram, branches",
    [(1, 1, 1, 1), (4, 1, 3, 1), (3, 2, 4, 1), (8, 1, 2, 1), (4, 1, 3, 3), (2, 2, 3, 4), (5, 3, 3, 2)],
)
def test_candidates_equal_reference(k, min_ngram, max_ngram, branches):
    rng = np.random.default_rng(k * 100 + min_ngram * 10 + max_ngram + branches)
    size, batch = 40, 24
    seq = rng.integers(0, 50, (batch, size))  # junk beyond each row's end: never read
    n_tokens = rng.integers(1, size + 1, batch)
    n_tokens[:4] = [1, 2, 3, size]
    for b in range(batch):
        vocab = (2, 3, 5, 50)[b % 4]  # small vocabularies match often, a large one rarely
        seq[b, : n_tokens[b]] = rng.integers(0, vocab, n_tokens[b])
    seq[-1, : n_tokens[-1]] = 100 + np.arange(n_tokens[-1])  # all distinct: no match
    tokens, found = candidates(seq, n_tokens, k, min_ngram, max_ngram, branches)
    assert tokens.shape == (batch, branches, k) and tokens.dtype == np.int32
    for b in range(batch):
        want, want_found = reference(seq[b, : n_tokens[b]].tolist(), k, min_ngram, max_ngram, branches)
        assert tokens[b].tolist() == want and found[b].tolist() == want_found, (b, seq[b, : n_tokens[b]])
    assert not np.asarray(found[-1]).any()
    assert np.asarray(found).any(axis=0)[0]  # the random histories do exercise matches


def test_tree_layout_is_branches_of_chains():
    tree = branch_tree(3, 2)
    assert tree.size == 7 and tree.depth == 2
    assert tree.arrays.parent.tolist() == [0, 0, 0, 0, 1, 2, 3]  # depth 2 nodes follow their branch
    drafter = NGram(2, branches=3)
    assert drafter.tree == tree and drafter.shape.cache_slots == 7
    assert NGram(4).tree is None and NGram(4).shape.cache_slots == 5
    seq = np.array(
        [[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 0]]
    )  # "1 2" followed by 3, 4 and 5 (most recent first)
    draft, _ = drafter.propose(None, drafter.init(None, seq, np.array([11]), 16), seq, np.array([11]), None)
    assert draft.tokens.tolist() == [[5, 4, 3, 1, 1, 1]] and draft.q_probs is None


DRAFTERS = [NGram(1, 1, 1), NGram(3), NGram(5, 2, 4), NGram(2, branches=3), NGram(4, 1, 2, branches=2)]


@pytest.mark.parametrize("drafter", DRAFTERS, ids=str)
@pytest.mark.parametrize("model", ["tiny", "stories"])
def test_greedy_equals_ar(model, drafter, stories):
    cfg, graphdef, params, prompts, spec, ar = greedy_case(model, stories)
    gen = speculative_generate(cfg, graphdef, params, drafter, None, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert gen.lengths.tolist() == [spec.max_new_tokens] * len(prompts)


@functools.cache
def grounded_case(stories):
    """A ragged stories260K batch whose first prompt is a story the model then retells (input-grounded)."""
    story = "Once upon a time, there was a dog named Max. Max loved to play with his toys and run around. "
    story += "One day, Max saw a big box in the grass.\n" + STORIES_PROMPT
    prompts = [stories.tokenizer.encode(t) for t in (story, "Lily", "The sun was hot and the")]
    spec = GenerateSpec(40, eos_id=None)
    return (
        prompts,
        spec,
        np.asarray(generate(stories.cfg, stories.graphdef, stories.params, prompts, spec).tokens),
    )


@pytest.mark.parametrize("drafter", [NGram(4), NGram(4, branches=3)], ids=str)
def test_grounded_prompt_accepts_long_drafts(drafter, stories):
    prompts, spec, ar = grounded_case(stories)
    gen = speculative_generate(stories.cfg, stories.graphdef, stories.params, drafter, None, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    tau_rows = np.asarray(gen.stats.emitted) / np.asarray(gen.stats.row_rounds)
    assert tau_rows[0] > 1.5, tau_rows  # the retold story is drafted from the prompt


def test_greedy_with_eos_matches_ar():
    graphdef, params = TARGET
    free = np.asarray(generate(TINY, graphdef, params, RAGGED, GenerateSpec(30, eos_id=None)).tokens)
    spec = GenerateSpec(30, eos_id=int(free[2, 6]))
    ar = generate(TINY, graphdef, params, RAGGED, spec)
    gen = speculative_generate(TINY, graphdef, params, NGram(4), None, RAGGED, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(k=0), "n-gram k=0 drafts nothing; use k >= 1"),
        (dict(k=2, min_ngram=0), "n-gram min_ngram=0 matches nothing; use min_ngram >= 1"),
        (
            dict(k=2, min_ngram=3, max_ngram=2),
            "max_ngram=2 is below min_ngram=3; use max_ngram >= min_ngram",
        ),
        (dict(k=2, branches=0), "n-gram branches=0 proposes nothing; use branches >= 1"),
        (dict(k=2.5), "n-gram k must be an integer, got 2.5; pass a whole number"),
    ],
)
def test_bad_settings(settings, message):
    with pytest.raises(NGramError, match=message):
        NGram(**settings)


def test_tree_too_big_for_the_cache_fails_before_compile():
    graphdef, params = TARGET
    with pytest.raises(ValueError, match="a tree of 33 nodes does not fit"):
        speculative_generate(
            TINY, graphdef, params, NGram(8, branches=4), None, [[1] * 8], GenerateSpec(8, cache_size=32)
        )


def test_bench_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench_drafters", "--smoke", f"--results={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "bench_drafters_smoke.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))  # after the stamp
    assert list(rows[0]) == [
        "drafter",
        "setting",
        "T",
        "tau",
        "tau_grounded",
        "tau_free",
        "draft_eff",
        "tok_s",
        "speedup",
        "hf_tau",
        "hf_tok_s",
        "tau_vs_hf",
        "tok_s_vs_hf",
    ]
    assert [r["drafter"] for r in rows] == ["none (AR)", "ngram", "quantized"]  # T = 1
    assert all(float(r["tau"]) >= 1 for r in rows)
