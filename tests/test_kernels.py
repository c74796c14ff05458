"""specjax's CPU kernel (`specjax.kernels`): built by make wherever a C++ compiler is; its product equals the
float64 product to float32 rounding for any rows, widths and ragged panels (a model laid out for it is
test_model_reference's); a build recorded for another source is refused."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from specjax import kernels

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a kernel for XLA CPU")
built = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler: the kernel is not built")


def test_built_where_a_compiler_is():
    """make builds it (a run without it would test XLA's products only, silently)."""
    assert kernels.available() or shutil.which("g++") is None


@built
@pytest.mark.parametrize(
    "rows, n_in, n_out", [(1, 64, 64), (3, 37, 172), (8, 64, 512), (9, 128, 96), (17, 40, 33)]
)
def test_product_equals_float64(rows, n_in, n_out):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32)
    got = jax.jit(kernels.packed_matmul, static_argnums=2)(x, kernels.pack(w), n_out)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.shape == (rows, n_out)
    # one sum of n_in products (a wrong row, column or panel is off by the values' size)
    assert_close(got, want, dtype=jnp.float32, depth=int(np.ceil(np.log2(n_in))))


@built
def test_a_stale_build_is_refused(tmp_path, monkeypatch):
    provenance = tmp_path / "packed_matmul.json"
    provenance.write_text(
        kernels.PROVENANCE.read_text().replace('"source_sha256": "', '"source_sha256": "0')
    )
    monkeypatch.setattr(kernels, "PROVENANCE", provenance)
    assert not kernels.available.__wrapped__()
