"""specjax's CPU kernels (`specjax.kernels`): built by make wherever a C++ compiler is; the product equals the
float64 product to float32 rounding for any rows, widths and ragged panels (a model laid out for it is
test_model_reference's), attention equals float64 attention for any heads, tokens and masks (a model running it:
every model test on the CPU), for this host's vectors and for AVX2's (where the host runs AVX2); a build recorded for
other sources or another CPU is refused."""

import platform
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from specjax import kernels
from specjax.errors import UsageError

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a kernel for XLA CPU")
built = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler: the kernel is not built")
runs_avx2 = platform.machine() == "x86_64" and " avx2 " in Path("/proc/cpuinfo").read_text().replace(
    "\n", " "
)


@pytest.fixture(scope="module", params=["specjax", "avx2"])
def build(request, tmp_path_factory):
    """The build make made (this host's widest vectors), and one for AVX2 (8 lanes, 16 registers: other blocking)."""
    if request.param == "avx2":
        if not (runs_avx2 and shutil.which("g++")):
            pytest.skip("the host does not run AVX2 code, or has no compiler")
        library = tmp_path_factory.mktemp("avx2") / "avx2.so"
        kernels.compile_library(library, "x86-64-v3")
        kernels.register(library, "avx2")
    return request.param


def test_built_where_a_compiler_is():
    """make builds it (a run without it would test XLA's products only, silently)."""
    assert kernels.available() or shutil.which("g++") is None


@built
@pytest.mark.parametrize(
    "rows, n_in, n_out",
    [(1, 64, 64), (3, 37, 172), (7, 48, 40), (8, 64, 512), (13, 128, 96), (16, 96, 80), (31, 40, 33)],
)
def test_product_equals_float64(build, rows, n_in, n_out):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32)
    got = jax.jit(kernels.packed_matmul, static_argnums=(2, 3))(x, kernels.pack(w, build), n_out, build)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.shape == (rows, n_out)
    # one sum of n_in products (a wrong row, column or panel is off by the values' size)
    assert_close(got, want, dtype=jnp.float32, depth=int(np.ceil(np.log2(n_in))))


@built
@pytest.mark.parametrize(
    "b, kv, g, t, slots, d",
    [(1, 8, 2, 1, 192, 32), (1, 8, 2, 8, 192, 32), (3, 2, 3, 5, 40, 20), (2, 1, 1, 4, 17, 64)],
)
def test_attention_equals_float64(build, b, kv, g, t, slots, d):
    """Masked slots, slots past every token's last visible one, and a token that sees none (XLA's softmax over
    scores all at the float minimum: the uniform average of every slot's value)."""
    rng = np.random.default_rng(slots)
    q, k, v = (
        rng.standard_normal(shape) for shape in ((b * kv, g * t, d), (b * kv, slots, d), (b * kv, d, slots))
    )
    visible = rng.random((b, t, slots)) < 0.5
    visible[:, :, slots // 2 :] = False
    visible[-1, -1] = False
    scale = d**-0.5
    got = jax.jit(kernels.decode_attention, static_argnums=(4, 5))(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.asarray(visible), scale, build
    )
    seen = np.repeat(visible, kv, axis=0)[:, np.arange(g * t) % t]  # [b * kv, g * t, slots]
    scores = np.where(seen, np.einsum("xrd,xsd->xrs", q, k) * scale, np.finfo(np.float32).min)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("xrs,xds->xrd", probs / probs.sum(-1, keepdims=True), v)
    assert np.allclose(want[-1, -1], v[-1].mean(-1))  # the blind token's row
    # scores (a sum of d products), softmax, then a sum over the slots
    assert_close(got, want, dtype=jnp.float32, depth=int(np.ceil(np.log2(d * slots))) + 2)


@built
@pytest.mark.parametrize("rows", [2, 16])  # one row at a time; the rows in the vector lanes
def test_a_masked_slot_whose_key_is_not_finite_is_ignored(build, rows):
    """A masked slot adds nothing to any row's attention, even where its key holds NaN or inf (as XLA's masked
    scores): the output is the one without that slot. The control: the same slot visible gives NaN."""
    rng = np.random.default_rng(2)
    q, k, v = (
        np.asarray(rng.standard_normal(s), np.float32) for s in ((1, rows, 16), (1, 12, 16), (1, 16, 12))
    )
    k[0, 1, 3], k[0, 5] = np.nan, np.inf
    visible = np.zeros((1, rows, 12), bool)
    visible[:, :, [0, 2, 6]] = True  # slots 1 and 5 masked for every token, below the last visible slot
    call = jax.jit(kernels.decode_attention, static_argnums=(4, 5))
    got = np.asarray(call(*map(jnp.asarray, (q, k, v, visible)), 0.25, build))
    keep = [0, 2, 6]
    scores = np.einsum("rd,sd->rs", q[0], k[0, keep]) * 0.25
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("rs,ds->rd", probs / probs.sum(-1, keepdims=True), v[0][:, keep])
    assert_close(got[0], want, dtype=jnp.float32, depth=8)
    visible[:, :, 1] = True
    assert np.isnan(np.asarray(call(*map(jnp.asarray, (q, k, v, visible)), 0.25, build))).all()


@built
def test_a_packed_layer_promotes_lower_precision_inputs_as_its_plain_layer():
    """A float32 layer packed for the kernel takes bfloat16 rows (a float32 head on a bfloat16 target's
    features) and gives what the plain layer gives: float32, the same values."""
    from flax import nnx

    from specjax.models.llama import Linear, PackedLinear

    plain = Linear(40, 24, True, jnp.float32, nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 40)), jnp.bfloat16)
    want, got = plain(x), PackedLinear(plain)(x)
    assert want.dtype == got.dtype == jnp.float32
    assert_close(got, want, dtype=jnp.float32, depth=6)


@built
def test_a_rows_attention_ignores_the_other_rows(build):
    """With query rows in the vector lanes (16 rows: 8 tokens x 2 heads per kv head), a token's output has the same
    bits whatever the other tokens ask and see: their queries and masks changed, one seeing slots past its own."""
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 16, 32), (2, 64, 32), (2, 32, 64))
    )
    visible = rng.random((1, 8, 64)) < 0.5
    visible[:, :, 36], visible[:, :, 37:] = True, False  # the last visible slot inside a vector of slots
    others = rng.random((1, 8, 64)) < 0.5
    others[:, 0] = visible[:, 0]
    q_others = q.at[:, 1:8].set(jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.float32))
    call = jax.jit(kernels.decode_attention, static_argnums=(4, 5))
    a = np.asarray(call(q, k, v, jnp.asarray(visible), 0.2, build))
    b = np.asarray(call(q_others.at[:, 9:16].set(q_others[:, 1:8]), k, v, jnp.asarray(others), 0.2, build))
    assert others[0, 1:, 37:].any() and np.array_equal(a[:, [0, 8]], b[:, [0, 8]])
    assert not np.array_equal(a[:, 1], b[:, 1])  # the others' rows did change


@built
def test_attention_is_differentiable_as_xla_attention():
    """A head trained on the CPU differentiates the kernel: its derivatives are those of XLA's attention."""
    rng = np.random.default_rng(0)
    shapes = ((4, 6, 16), (4, 20, 16), (4, 16, 20))
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
    visible = jnp.asarray(rng.random((2, 3, 20)) < 0.5)
    loss = lambda f: lambda q, k, v: (f(q, k, v, visible, 0.25) ** 2).sum()
    got = jax.grad(loss(kernels.decode_attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(kernels.reference_attention), argnums=(0, 1, 2))(q, k, v)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@built
@pytest.mark.parametrize(
    "key, why",
    [
        ("source_sha256", "built from other sources"),
        ("cpu", "built for another CPU"),
        ("cpu_features_sha256", "built for a CPU with other features"),
    ],
)
def test_a_stale_build_is_refused(key, why, tmp_path, monkeypatch):
    """A build from other sources, for another CPU, or for a CPU with other instructions (however alike the two CPUs'
    names: a virtual machine may call a Zen 1 and a Zen 5 both "AMD EPYC") is not used: make builds it again."""
    assert kernels.stale() is None
    provenance = tmp_path / "specjax_cpu.json"
    provenance.write_text(kernels.PROVENANCE.read_text().replace(f'"{key}": "', f'"{key}": "0'))
    monkeypatch.setattr(kernels, "PROVENANCE", provenance)
    assert why in kernels.stale()
    assert not kernels.available.__wrapped__()


@built
def test_panels_are_two_vectors_wide(build):
    """AVX2's panels are 16 columns (6 rows' accumulators and a panel row fit its 16 registers); a W packed for
    another width is refused, naming the fix."""
    if build == "avx2":
        assert kernels.PANELS["avx2"] == 16
    width = kernels.PANELS[build]
    x = jnp.ones((2, 8), jnp.float32)
    wrong = jnp.ones((1, 8, 2 * width), jnp.float32)
    with pytest.raises(UsageError, match=rf"panels of {2 * width} columns.*kernels.pack\(w, '{build}'\)"):
        kernels.packed_matmul(x, wrong, 2 * width, build)


@built
def test_multiply_add_peak_counts_the_work_it_times():
    """The peak's time grows with its multiply-adds (a loop the compiler dropped would take none), and its rate stays
    below that of two vector multiply-add units at 6 GHz (work counted several times over would pass it)."""
    lanes = kernels.PANELS["specjax"] // 2
    short, long = (kernels.fma_peak_gflops(1, n, runs=3) for n in (1_000_000, 8_000_000))
    assert 0.5 < long / short < 2
    assert 0 < long < lanes * 2 * 2 * 6.0


@built
def test_one_row_decoding_runs_the_packed_product(monkeypatch):
    """AR at batch 1 runs the model packed for the kernel, as the verify passes do (XLA's [out, in] one-row pass took
    1.23x the packed one on a Zen 4 EPYC), and decodes the tokens the [out, in] model decodes."""
    from conftest import TINY

    from specjax.decoding import GenerateSpec, compile_decode
    from specjax.decoding import compile as compile_module
    from specjax.models.llama import init_params

    graphdef, params = init_params(TINY, seed=3)
    prompts, spec = [[5, 17, 42, 8]], GenerateSpec(12, eos_id=None)
    laid_out = []
    layout = compile_module.multi_row_layout
    monkeypatch.setattr(compile_module, "multi_row_layout", lambda g, p: laid_out.append(1) or layout(g, p))
    packed = compile_decode(TINY, graphdef, params, prompts, spec)[0](prompts).tokens
    assert laid_out == [1]
    monkeypatch.setattr(compile_module, "uses_multi_row_layout", lambda several_rows: several_rows)
    plain = compile_decode(TINY, graphdef, params, prompts, spec)[0](prompts).tokens
    assert laid_out == [1]
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))


@built
def test_a_drafters_layers_run_packed_as_the_targets():
    """`decoding_layout` packs a drafter's own linear layers as it packs the target's: a DFlash head's (its
    params["head"]) and a draft model's (its params). The packed DFlash job decodes AR's greedy tokens, and params
    handed to its `run` later (the plain ones here) are laid out as the compiled ones were: the same tokens."""
    from types import SimpleNamespace

    from conftest import TINY
    from flax import nnx

    from specjax.decoding import GenerateSpec, compile_decode
    from specjax.decoding.compile import decoding_layout
    from specjax.drafters.dflash import tiny_example
    from specjax.drafters.draft_model import DraftModel
    from specjax.models.llama import PackedLinear, init_params
    from specjax.sampling import Sampler

    graphdef, params = init_params(TINY, seed=3)
    dflash, dparams = tiny_example(SimpleNamespace(cfg=TINY, params=params), 3, None, Sampler(0.0))
    draft = DraftModel(TINY, graphdef, 2)
    packed = lambda g, w: sum(type(node) is PackedLinear for _, node in nnx.iter_graph(nnx.merge(g, w)))
    for drafter, own, weights in ((dflash, dparams, lambda p: p["head"]), (draft, params, lambda p: p)):
        *_, laid, laid_params = decoding_layout(graphdef, params, drafter, own, False)
        assert packed(drafter.graphdef, weights(own)) == 0 < packed(laid.graphdef, weights(laid_params))
    assert (
        laid_params is not params and packed(graphdef, params) == 0
    )  # copies: the given ones are unchanged
    prompts, spec = [[5, 17, 42, 8], [3, 9]], GenerateSpec(12, eos_id=None)
    ar = compile_decode(TINY, graphdef, params, prompts, spec)[0](prompts).tokens
    run = compile_decode(TINY, graphdef, params, prompts, spec, dflash, dparams)[0]
    np.testing.assert_array_equal(np.asarray(run(prompts).tokens), np.asarray(ar))
    np.testing.assert_array_equal(np.asarray(run(prompts, drafter_params=dparams).tokens), np.asarray(ar))
