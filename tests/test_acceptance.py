"""Exactness of the acceptance rules, by enumeration over small vocabularies (no sampling noise)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, assert_far

from specjax.acceptance.greedy import first_rejection, greedy_chain
from specjax.acceptance.rejection import acceptance_probs, residual, speculative_sampling

STEP_DEPTH = 4  # float32: p and q rounded, the ratio p/q, the residual's difference and its normalisation

V = 5


def random_dist(rng, shape, zeros=1):
    p = rng.gamma(0.7, size=shape + (V,))
    p[..., rng.choice(V, zeros, replace=False)] = 0  # supports differ, as with top-k / top-p
    return p / p.sum(-1, keepdims=True)


def one_step_distribution(p, q, resample=residual):
    """Exact output distribution of one chain step (K=1): sum over draft x of q(x) [a(x) d_x + (1 - a(x)) r]."""
    out = np.zeros(V)
    for x in range(V):
        q_x = np.eye(V)[x] if q is None else q
        weight = 1.0 if q is None else q[x]
        if weight == 0:
            continue
        a = float(
            acceptance_probs(
                jnp.array([[x]]), None if q is None else jnp.array([[q]]), jnp.array([[p, p]])
            )[0, 0]
        )
        r = np.asarray(resample(jnp.array([p]), jnp.array([q_x])))[0]
        out += weight * (a * np.eye(V)[x] + (1 - a) * r)
        if q is None:
            break  # a point mass: only draft token x = 0 is ever proposed
    return out


@pytest.mark.parametrize("seed", range(5))
def test_one_step_output_distribution_is_p(seed):
    rng = np.random.default_rng(seed)
    p, q = random_dist(rng, ()), random_dist(rng, ())
    assert_close(one_step_distribution(p, q), p, dtype=jnp.float32, depth=STEP_DEPTH)
    assert_close(
        one_step_distribution(p, None), p, dtype=jnp.float32, depth=STEP_DEPTH
    )  # deterministic proposal


def test_one_step_negative_control_resampling_from_p():
    rng = np.random.default_rng(0)
    p, q = random_dist(rng, ()), random_dist(rng, ())
    broken = one_step_distribution(p, q, resample=lambda p, q: p)
    assert_far(broken, p, dtype=jnp.float32, depth=STEP_DEPTH)


def test_two_position_chain_joint_distribution():
    """Joint of the first two emitted tokens for K=2, with target and draft conditionals on the first token.

    When a round emits one token, the second comes from the next round, which is exact by the one-step test."""
    rng = np.random.default_rng(7)
    p1, q1 = random_dist(rng, ()), random_dist(rng, ())
    p2, q2 = random_dist(rng, (V,)), random_dist(rng, (V,))  # [first token, V]
    joint = np.zeros((V, V))
    for x1, x2 in itertools.product(range(V), range(V)):
        w = q1[x1] * q2[x1, x2]
        if w == 0:
            continue
        draft = jnp.array([[x1, x2]])
        q = jnp.array([[q1, q2[x1]]])
        a1, a2 = np.asarray(acceptance_probs(draft, q, jnp.array([[p1, p2[x1], p2[x1]]])))[0]
        r1 = np.asarray(residual(jnp.array([p1]), jnp.array([q1])))[0]
        r2 = np.asarray(residual(jnp.array([p2[x1]]), jnp.array([q2[x1]])))[0]
        joint[x1, x2] += w * a1 * a2
        joint[x1] += w * a1 * (1 - a2) * r2
        joint += w * (1 - a1) * r1[:, None] * p2
    assert_close(joint, p1[:, None] * p2, dtype=jnp.float32, depth=2 * STEP_DEPTH)  # two chained steps


def test_sampled_rule_matches_its_exact_distribution():
    """speculative_sampling itself (random draws) follows the enumerated distribution: rows of one batch."""
    rng = np.random.default_rng(3)
    p, q = random_dist(rng, ()), random_dist(rng, ())
    n = 200_000
    draft = jax.random.categorical(jax.random.key(0), jnp.log(jnp.asarray(q)), shape=(n,))[:, None]
    p_b = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 2, V))
    q_b = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, V))
    n_acc, nxt = speculative_sampling(jax.random.key(1), draft.astype(jnp.int32), q_b, p_b)
    first = np.where(np.asarray(n_acc) == 1, np.asarray(draft[:, 0]), np.asarray(nxt))
    freq = np.bincount(first, minlength=V) / n
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))


def test_greedy_chain_and_first_rejection():
    assert first_rejection(jnp.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])).tolist() == [2, 0, 4]
    logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 0], [3, 1, 4, 0]]), V)  # target argmax per position
    n, nxt = greedy_chain(jnp.array([[3, 1, 2], [3, 1, 4]]), logits)
    assert n.tolist() == [2, 3] and nxt.tolist() == [4, 0]


def test_sample_probs_frequencies_and_support():
    from specjax.sampling import sample_probs

    p = np.array([0.1, 0.0, 0.5, 0.0, 0.4])
    n = 200_000
    x = np.asarray(sample_probs(jax.random.key(0), jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, V))))
    freq = np.bincount(x, minlength=V) / n
    assert freq[1] == 0 and freq[3] == 0
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))
