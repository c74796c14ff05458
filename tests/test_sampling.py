"""The fast sampling primitives against plain numpy references: first-maximum argmax, blocked inverse CDF."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import argmax, inverse_cdf


def test_argmax_matches_numpy_including_ties():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 1000)).astype(np.float32)
    x[0, :, 7] = x[0, :, 900] = 10.0  # a tie: the first index wins, as in numpy
    x[1] = -np.inf
    x[1, :, 999] = 0.0
    got = np.asarray(argmax(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.argmax(-1))
    assert (got[0] == 7).all() and (got[1] == 999).all()


def reference_inverse_cdf(p, u):
    """numpy float64: the first token whose CDF passes u * total."""
    cdf = np.cumsum(p.astype(np.float64), -1)
    return np.array([np.searchsorted(c, ui * c[-1], side="right") for c, ui in zip(cdf, u)])


@pytest.mark.parametrize("vocab", [5, 127, 128, 129, 512, 4000])
def test_inverse_cdf_is_exact_and_never_picks_zero_mass(vocab):
    rng = np.random.default_rng(vocab)
    p = rng.random((2000, vocab)) ** 6
    p[:, rng.random(vocab) < 0.3] = 0  # holes, some of them whole blocks' worth at small vocabularies
    p[:, -1] = 0  # and a zero at the end, where rounding would land
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    u = rng.random(2000).astype(np.float32)
    u[:5] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 1e-7, 0.999999]
    got = np.asarray(inverse_cdf(jnp.asarray(p), jnp.asarray(u)))
    assert (p[np.arange(2000), got] > 0).all()
    # float32 sums may differ from float64 ones by an ulp, which can move a boundary draw to a neighbour
    assert (got == reference_inverse_cdf(p, u)).mean() > 0.999


def test_inverse_cdf_block_sizes_agree_and_a_shifted_cdf_is_caught():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(1000, 0.3), size=500).astype(np.float32)
    u = rng.random(500).astype(np.float32)
    ref = reference_inverse_cdf(p, u)
    for block in (16, 128, 1000, 1024):
        np.testing.assert_array_equal(np.asarray(inverse_cdf(jnp.asarray(p), jnp.asarray(u), block)), ref)
    shifted = np.roll(p, 1, axis=-1)  # negative control: the same test sees a CDF that is off by one token
    assert (np.asarray(inverse_cdf(jnp.asarray(shifted), jnp.asarray(u))) != ref).mean() > 0.5
