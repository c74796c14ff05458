"""Lookahead decoding: pool, guesses, window and mask equal plain Python references; greedy == AR on the tiny
model and stories260K; a repetitive prompt accepts long drafts; bad settings fail before compile."""

import jax
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case

from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafters.lookahead import (
    Lookahead,
    LookaheadError,
    guesses,
    jacobi_step,
    lookahead_arrays,
    pool_insert,
)
from specjax.drafting import registry


def reference_insert(pool, stamp, clock, grams, valid):
    """`pool_insert` for one row, written plainly: skip known and repeated grams, append to a ring."""
    pool, stamp = [list(g) for g in pool], list(stamp)
    known = {tuple(g) for g, s in zip(pool, stamp) if s >= 0}
    for gram, ok in zip(grams, valid):
        if ok and tuple(gram) not in known:
            known.add(tuple(gram))
            pool[clock % len(pool)], stamp[clock % len(pool)] = list(gram), clock
            clock += 1
    return pool, stamp, clock


def test_pool_insert_and_guesses_equal_reference():
    rng = np.random.default_rng(0)
    batch, size, n, width, g = 16, 12, 3, 10, 3
    pool = np.full((batch, size, n), -1, np.int32)
    stamp = np.full((batch, size), -1, np.int32)
    clock = np.zeros(batch, np.int32)
    insert, guess = jax.jit(pool_insert), jax.jit(guesses, static_argnums=3)
    for step in range(6):  # several insertions: the rings fill and wrap
        grams = rng.integers(0, 3, (batch, width, n)).astype(np.int32)  # 3 tokens: many repeats
        valid = rng.random((batch, width)) < 0.8
        got = [np.asarray(x) for x in insert(pool, stamp, clock, grams, valid)]
        for b in range(batch):
            want = reference_insert(pool[b], stamp[b], int(clock[b]), grams[b], valid[b])
            assert got[0][b].tolist() == want[0] and got[1][b].tolist() == want[1], (step, b)
            assert got[2][b] == want[2]
        pool, stamp, clock = got
        pending = rng.integers(0, 4, batch).astype(np.int32)  # token 3 is never in the pool
        chains, found = (np.asarray(x) for x in guess(pool, stamp, pending, g))
        for b in range(batch):
            hits = sorted(
                (s, list(e[1:])) for e, s in zip(pool[b], stamp[b]) if s >= 0 and e[0] == pending[b]
            )
            want = [c for _, c in hits[::-1][:g]]
            want += [[int(pending[b])] * (n - 1)] * (g - len(want))
            assert chains[b].tolist() == want and found[b].sum() == min(len(hits), g)
    assert clock.max() > size  # the rings did wrap


def test_window_mask_and_jacobi_step():
    w, n, g = 3, 4, 2
    offsets, mask = lookahead_arrays(w, n, g)
    v = 1 + g * (n - 1)
    assert offsets.tolist()[:v] == [0, 1, 1, 2, 2, 3, 3] and mask.shape == (v + w * (n - 1),) * 2
    for i in range(w * (n - 1)):
        li, ji = divmod(i, w)
        assert offsets[v + i] == 1 + li + ji
        for k in range(w * (n - 1)):
            lk, jk = divmod(k, w)
            assert mask[v + i, v + k] == ((lk == 0 and jk <= ji) or (jk == ji and 1 <= lk <= li))
        assert mask[v + i, 0] and not mask[v + i, 1:v].any() and not mask[1:v, v + i].any()
    window = np.arange(2 * (n - 1) * w).reshape(2, n - 1, w)
    argmax = 100 + window
    grams, new = (np.asarray(x) for x in jacobi_step(window, argmax))
    for b in range(2):
        for j in range(w):  # column j's trajectory closed by the last level's argmax
            assert grams[b, j].tolist() == [*window[b, :, j], argmax[b, -1, j]]
    assert new[:, :-1].tolist() == window[:, 1:].tolist() and new[:, -1].tolist() == argmax[:, -1].tolist()


GREEDY = {
    "tiny": [Lookahead(2, 2, 1, 16), Lookahead(4, 4, 4), Lookahead(3, 5, 2, 32)],
    "stories": [Lookahead(5, 4, 5)],
}


@pytest.mark.parametrize(
    "model, drafter", [(m, d) for m, ds in GREEDY.items() for d in ds], ids=lambda x: str(x)
)
def test_greedy_equals_ar(model, drafter, stories):
    cfg, graphdef, params, prompts, spec, ar = greedy_case(model, stories)
    gen = speculative_generate(cfg, graphdef, params, drafter, None, prompts, spec)
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    assert gen.lengths.tolist() == [spec.max_new_tokens] * len(prompts)


def test_repetitive_prompt_accepts_long_drafts(stories):
    """A prompt repeating a phrase, plus two ordinary ones (the second a single word): greedy equals AR and the
    repetitive row drafts well."""
    texts = (
        "Tom said hi. Tom said hi. Tom said hi. Tom said hi. Tom said",
        "Lily",
        "The sun was hot and the",
    )
    prompts = [stories.tokenizer.encode(t) for t in texts]
    spec = GenerateSpec(48, eos_id=None)
    ar = np.asarray(generate(stories.cfg, stories.graphdef, stories.params, prompts, spec).tokens)
    gen = speculative_generate(
        stories.cfg, stories.graphdef, stories.params, Lookahead(5, 4, 5), None, prompts, spec
    )
    np.testing.assert_array_equal(np.asarray(gen.tokens), ar)
    tau = np.asarray(gen.stats.emitted) / np.asarray(gen.stats.row_rounds)
    print("lookahead W=5 N=4 G=5 tau per prompt:", tau.round(2).tolist())
    assert tau[0] > 1.5, tau


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(w=0), "window W=0 looks nowhere ahead; use W >= 1"),
        (dict(n=1), "n-gram size N=1 guesses nothing; use N >= 2"),
        (dict(g=0), "guess set G=0 verifies nothing; use G >= 1"),
        (
            dict(w=4, n=4, pool_size=7),
            "pool_size=7 cannot hold one round's n-grams; use pool_size >= W \\+ N = 8",
        ),
        (dict(w=2.5), "lookahead w must be an integer, got 2.5"),
    ],
)
def test_bad_settings(settings, message):
    with pytest.raises(LookaheadError, match=message):
        Lookahead(**settings)


def test_registry_build_and_errors_before_compile():
    entry = registry.get("lookahead")
    drafter, params = entry.build(None, entry.settings(window=3, guesses=2), 4, None, None)
    assert drafter == Lookahead(3, 5, 2) and params is None and drafter.shape.depth == 4
    with pytest.raises(LookaheadError, match="builds its own tree; drop --tree"):
        entry.build(None, entry.settings(), 2, object(), None)
    with pytest.raises(LookaheadError, match="N=1 guesses nothing"):
        entry.build(None, entry.settings(), 0, None, None)
    graphdef, params = TARGET
    with pytest.raises(ValueError, match="lookahead W=8 N=5 G=8 \\(65 tokens per pass\\) does not fit"):
        speculative_generate(
            TINY, graphdef, params, Lookahead(8, 5, 8), None, [[1] * 8], GenerateSpec(8, cache_size=64)
        )
