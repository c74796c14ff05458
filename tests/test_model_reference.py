"""The decoder reproduces transformers' PyTorch logits (prefill and cached step-by-step decoding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import assert_cached_steps_match
from tolerance import assert_close, forward_depth

from specjax import precision
from specjax.models.config import LlamaConfig
from specjax.models.llama import (
    InOutLinear,
    Linear,
    causal_mask,
    forward,
    in_out_layout,
    init_cache,
    init_params,
    multi_row_layout,
    rope_angles,
)
from specjax.models.weights import params_from_hf, read_safetensors

CONFIGS = {
    "llama_gqa_tied": LlamaConfig(
        vocab_size=101,
        dim=48,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        hidden_dim=80,
        tie_embeddings=True,
        max_seq_len=64,
    ),
    "llama_mha_untied_bias": LlamaConfig(
        vocab_size=89,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        hidden_dim=64,
        qkv_bias=True,
        o_bias=True,
        rope_theta=500.0,
        max_seq_len=64,
    ),
    "llama3_rope_scaling_head_dim": LlamaConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        hidden_dim=48,
        head_dim=16,
        rope_theta=500000.0,
        rope_llama3_scaling=(8.0, 1.0, 4.0, 16),
        max_seq_len=64,
    ),
    "qwen2_bias_gqa": LlamaConfig(
        vocab_size=70,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=40,
        qkv_bias=True,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=64,
        family="qwen2",
    ),
}
SEQ = 12


def torch_reference(cfg: LlamaConfig, tmp_path, seed: int):
    """A random transformers model of this config, saved as safetensors and read back by specjax."""
    torch.manual_seed(seed)
    hf = cfg.to_hf()
    hf_cfg = transformers.AutoConfig.for_model(**hf)
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    assert hf_cfg.model_type == ("qwen2" if cfg.qkv_bias and not cfg.o_bias else "llama")
    return model, LlamaConfig.from_hf(hf_cfg.to_dict()), read_safetensors(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    model, cfg, tensors = torch_reference(CONFIGS[name], tmp_path, seed=len(name))
    assert cfg == CONFIGS[name]
    graphdef, params = params_from_hf(cfg, tensors)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, SEQ))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()

    positions = jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ))
    logits, hidden, _ = forward(
        graphdef, params, jnp.asarray(tokens), positions, init_cache(cfg, 2, 32), causal_mask(SEQ)
    )
    depth = forward_depth(cfg.n_layers)  # PyTorch's float32 kernels round in another order than XLA's
    assert_close(logits, expected, dtype=jnp.float32, depth=depth)

    assert_cached_steps_match(
        cfg, graphdef, params, tokens, expected, depth
    )  # step by step through the cache


def test_hidden_taps_match_transformers(tmp_path):
    cfg = CONFIGS["qwen2_bias_gqa"]
    model, cfg, tensors = torch_reference(cfg, tmp_path, seed=1)
    graphdef, params = params_from_hf(cfg, tensors)
    tokens = np.arange(SEQ)[None] % cfg.vocab_size
    with torch.no_grad():
        states = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    _, hidden, _ = forward(
        graphdef,
        params,
        jnp.asarray(tokens),
        jnp.arange(SEQ)[None],
        init_cache(cfg, 1, 16),
        causal_mask(SEQ),
        taps=(0, 1),
    )
    for layer in (0, 1):  # HF's hidden_states[i + 1] is the output of layer i
        want = states[layer + 1].numpy()
        assert_close(hidden.taps[layer], want, dtype=jnp.float32, depth=forward_depth(layer + 1))
    assert_close(hidden.final, states[-1].numpy(), dtype=jnp.float32, depth=forward_depth(cfg.n_layers))


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    cfg = CONFIGS["llama_gqa_tied"]
    model, cfg, single = torch_reference(cfg, tmp_path / "single", seed=3)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    sharded = read_safetensors(tmp_path / "sharded")
    assert sorted(sharded) == sorted(single)
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name])


def test_bfloat16_forward_tracks_float32(tmp_path):
    model, cfg, tensors = torch_reference(CONFIGS["qwen2_bias_gqa"], tmp_path, seed=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, SEQ)))
    out = {}
    for dtype in ("float32", "bfloat16"):
        c = cfg.replace(dtype=dtype)
        graphdef, params = params_from_hf(c, tensors)
        assert jax.tree.leaves(params)[0].dtype == jnp.dtype(dtype)
        out[dtype] = np.asarray(
            forward(
                graphdef, params, tokens, jnp.arange(SEQ)[None], init_cache(c, 1, 16), causal_mask(SEQ)
            )[0]
        )
    # bfloat16's rounding against float32's, one stage per layer (measured: 1 bfloat16 unit of the logits' scale)
    assert_close(out["bfloat16"], out["float32"], dtype=jnp.bfloat16, depth=cfg.n_layers)
    assert (out["bfloat16"].argmax(-1) == out["float32"].argmax(-1)).mean() > 0.8


def test_rope_lookup_matches_the_angles_and_is_nan_beyond_its_table():
    """The looked-up cos/sin equal those of the float32 angles to one float32 rounding; a position past the table is
    NaN, never a silently wrong rotation."""
    inv = tuple(float(f) for f in CONFIGS["llama3_rope_scaling_head_dim"].inv_freq())
    positions = jnp.arange(300)[None]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    cos, sin = rope_angles(inv, positions, 300)
    assert_close(cos, jnp.cos(angles), dtype=jnp.float32, magnitude=1.0)  # float64 rounded vs XLA's float32
    assert_close(sin, jnp.sin(angles), dtype=jnp.float32, magnitude=1.0)
    beyond = rope_angles(inv, jnp.array([[299, 300]]), 300)
    assert all(np.isfinite(t[0, 0]).all() and np.isnan(t[0, 1]).all() for t in beyond)


@pytest.mark.parametrize("in_out", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 6, 40])
@pytest.mark.parametrize("n_out", [64, 63])
def test_linear_matches_one_matrix_product(rows, n_out, in_out):
    """`Linear` (one blocked matrix-vector product per row, one blocked product, or one plain product as the rows
    grow; a matrix whose rows the blocks do not divide unblocked) and `InOutLinear` (its weight stored [in, out])
    compute x @ W.T + b as numpy does in float64, to float32 rounding."""
    layer = Linear(40, n_out, True, jnp.float32, nnx.Rngs(0))
    layer.bias[...] = jnp.linspace(-1, 1, n_out)
    layer = InOutLinear(layer) if in_out else layer
    assert layer.weight.shape == ((40, n_out) if in_out else (n_out, 40))
    x = jax.random.normal(jax.random.key(1), (rows, 1, 40))
    want = np.asarray(x, np.float64) @ np.asarray(layer.matrix(), np.float64).T + np.asarray(
        layer.bias[...]
    )
    # float32 against float64: the product's rounding (a blocked sum over 40 terms) and the bias add
    got = jax.jit(precision.follows_params(lambda x: layer(x)))(
        x
    )  # a layer alone: the dtype rule, as in a model
    assert_close(got, want, dtype=jnp.float32, depth=2)


@pytest.mark.parametrize("layout", [in_out_layout, multi_row_layout])
@pytest.mark.parametrize("name", ["llama_mha_untied_bias", "llama_gqa_tied"])
def test_multi_row_layouts_are_the_same_function(name, layout):
    """The model with its linear layers stored [in, out], or packed for specjax's CPU kernel where it is built
    (what `compile_decode` runs on CPU for passes of several rows), gives the original's logits to float32
    rounding, over 1 and several tokens."""
    cfg = CONFIGS[name]
    graphdef, params = init_params(cfg, seed=3)
    g2, p2 = layout(graphdef, params)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, cfg.vocab_size)
    for t in (1, 7):
        pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        run = lambda g, p: forward(g, p, tokens[:, :t], pos, init_cache(cfg, 2, 16), causal_mask(t))[0]
        assert_close(
            run(g2, p2), run(graphdef, params), dtype=jnp.float32, depth=forward_depth(cfg.n_layers)
        )
