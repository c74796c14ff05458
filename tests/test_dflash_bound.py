"""The DFlash ceiling (`experiments/dflash_bound.py`): the objective's optimum drafted and verified like a head."""

import numpy as np
import pytest

import experiments.tables  # noqa: F401 (defines --matmul_precision, unparsed: as where a worker ran test_tables)
from experiments import dflash_bound as bound
from experiments import harness

K = 4


@pytest.fixture(scope="module")
def greedy_contexts(stories):
    prompts = harness.prompts(stories.tokenizer, harness.STORY_OPENINGS, 2)
    return bound.contexts(stories, prompts, 0.0, 24, 8, K)


def test_the_optimum_of_a_greedy_corpus_is_the_greedy_chain(stories, greedy_contexts):
    """Intermediate tokens drawn greedily: every position's marginal peaks at the target's greedy chain, which
    greedy verification accepts whole; the same distributions a position late are refused (control)."""
    q = bound.marginals(stories, greedy_contexts, K, 0.0, n_paths=2)
    assert bound.greedy_tau(stories, greedy_contexts, q).tolist() == [1.0] * K
    late = np.concatenate([q[:, :1], q[:, :-1]], 1)  # position i drafts what position i - 1 should
    assert bound.greedy_tau(stories, greedy_contexts, late)[1] < 0.5


def test_sampled_acceptance_is_one_minus_the_total_variation(stories, greedy_contexts):
    """At position 1 a chain drawn from q is accepted with probability sum_x min(p(x), q(x)): the exact marginal
    (p itself) always, and a half-uniform mixture at its computed rate (binomial 4 sigma); the uniform draft far
    less (control)."""
    p = bound.marginals(stories, greedy_contexts, 1, 1.0, n_paths=1)
    assert bound.sampled_tau(stories, greedy_contexts, p, 32)[0] > 0.999
    mixed = 0.5 * p + 0.5 / p.shape[-1]
    rate = np.minimum(p, mixed).sum(-1).mean()
    n = len(greedy_contexts) * 256
    measured = bound.sampled_tau(stories, greedy_contexts, mixed, 256, seed=1)[0]
    assert abs(measured - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    uniform = np.full_like(p, 1 / p.shape[-1])
    assert bound.sampled_tau(stories, greedy_contexts, uniform, 32)[0] < rate - 0.2


def test_a_markov_tilt_follows_the_token_drafted_before(stories, greedy_contexts):
    """A Markov head's tilt acts on each position after the token drafted before it: a tilt towards each token's
    successor in the target's greedy chains turns the refused late distributions into the accepted chain; a zero
    tilt changes nothing (the same draws)."""
    ctx = greedy_contexts[:1]  # one chain: each of its tokens has one successor
    q = bound.marginals(stories, ctx, K, 0.0, n_paths=2)
    chains = [[c[-1], *d] for c, d in zip(ctx, q.argmax(-1))]
    successor = {a: b for chain in chains for a, b in zip(chain, chain[1:])}
    assert all(
        successor[a] == b for chain in chains for a, b in zip(chain, chain[1:])
    )  # one successor each
    vocab = q.shape[-1]
    toward = np.zeros((vocab, vocab))
    for a, b in successor.items():
        toward[a, b] = 50.0
    late = np.concatenate([q[:, :1], q[:, :-1]], 1)
    assert bound.greedy_tau(stories, ctx, late)[1] == 0.0
    assert bound.greedy_tau(stories, ctx, late, lambda prev: toward[prev]).tolist() == [1.0] * K
    zero = lambda prev: np.zeros((*np.shape(prev), vocab))
    mixed = 0.5 * q + 0.5 / vocab
    np.testing.assert_array_equal(
        bound.sampled_tau(stories, ctx, mixed, 16, tilt=zero), bound.sampled_tau(stories, ctx, mixed, 16)
    )


def test_the_acceptance_optimum_is_accepted_most_often():
    """`acceptance_optimum` maximises mean_n sum_x min(p_n(x), q(x)): no q on a fine grid of the simplex does better
    (3 tokens, 5 random paths, 6 contexts), the paths' mean (the forward KL's optimum) does worse on some (control),
    and where every path agrees q is that distribution."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(3, 0.5), size=(6, 5))[:, :, None]  # [C, N, k = 1, V]
    accepted = lambda q: np.minimum(p, q[:, None]).sum(-1).mean(1)[:, 0]  # [C]
    q = bound.acceptance_optimum(p)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-12)
    a, b = np.meshgrid(np.linspace(0, 1, 201), np.linspace(0, 1, 201))
    grid = np.stack([a, b, 1 - a - b], -1).reshape(-1, 3)
    grid = grid[grid[:, 2] >= 0]  # [G, 3]
    best = np.minimum(p[:, :, 0, None], grid).sum(-1).mean(1).max(-1)  # [C]
    assert np.all(accepted(q) >= best - 1e-12), (accepted(q), best)
    assert np.max(accepted(q) - accepted(p.mean(1))) > 0.01
    same = np.broadcast_to(p[:, :1], p.shape).astype(np.float32)  # as the target's softmax gives them
    np.testing.assert_allclose(bound.acceptance_optimum(same), same[:, 0], rtol=1e-6)
