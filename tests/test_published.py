"""Published drafting heads: EAGLE-3 and Medusa checkpoints in their authors' layouts (SafeAILab/EAGLE cnets.py,
FasterDecoding/Medusa medusa_model.py) load into specjax heads that give the logits of the reference arithmetic,
and EAGLE-1/2 heads (whose layer has no input norm) written out here; export -> load is the identity; mismatched
heads and unsafe files are refused."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case
from safetensors.numpy import load_file, save_file
from tolerance import LAYER_DEPTH, assert_close, assert_far

from specjax import files, heads, published
from specjax.decoding import speculative_generate
from specjax.drafters.medusa import medusa_logits
from specjax.drafting.protocol import target_io
from specjax.drafting.trees import DynamicTree
from specjax.models.llama import causal_mask, init_cache
from specjax.models.weights import CheckpointError
from specjax.sampling import Sampler

H, V, T = TINY.dim, TINY.vocab_size, 6
EMBED = np.asarray(target_io(TINY, TARGET[1])["embed"], np.float64)
DRAFT = [
    0,
    3,
    4,
    10,
    17,
    40,
    41,
    96,
]  # a reduced draft vocabulary: target ids, increasing as EAGLE-3 writes them
A = "midlayer.self_attn."


def randn(rng, *shape, scale=0.3):
    return rng.normal(0, scale, shape).astype(np.float32)


def write(path, tensors, config, name):
    """A published head directory: `config.json` and the weights (`.bin`/`.pt` as torch.save writes them)."""
    path.mkdir(parents=True, exist_ok=True)
    if name.endswith(".safetensors"):
        save_file(tensors, str(path / name))
    else:
        import torch

        torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}, path / name)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def one_layer_config(cfg, architecture: str) -> dict:
    """config.json of a one-layer head for `cfg`, as the authors' training scripts write it."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
    }


def eagle3_checkpoint(rng, draft=DRAFT, layer_ids=(2, 1, 1), cfg=TINY):
    """(tensors, config.json) of an EAGLE-3 head as SafeAILab/EAGLE and SpecForge publish it."""
    d, f, q, kv = cfg.dim, cfg.hidden_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    norm = lambda: 1 + randn(rng, d)
    t = {
        "fc.weight": randn(rng, d, 3 * d),
        A + "q_proj.weight": randn(rng, q, 2 * d),
        A + "k_proj.weight": randn(rng, kv, 2 * d),
        A + "v_proj.weight": randn(rng, kv, 2 * d),
        A + "o_proj.weight": randn(rng, d, q),
        "midlayer.mlp.gate_proj.weight": randn(rng, f, d),
        "midlayer.mlp.up_proj.weight": randn(rng, f, d),
        "midlayer.mlp.down_proj.weight": randn(rng, d, f),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": randn(rng, len(draft) if draft else cfg.vocab_size, d),
    }
    if draft:  # as EAGLE's training writes them: d2t[i] = used_tokens[i] - i, t2d[j] = j in used_tokens
        t["d2t"] = np.asarray([tok - i for i, tok in enumerate(draft)], np.int64)
        t["t2d"] = np.asarray([j in draft for j in range(cfg.vocab_size)])
    config = one_layer_config(cfg, "LlamaForCausalLMEagle3") | {
        "draft_vocab_size": len(t["lm_head.weight"])
    }
    if layer_ids:
        config["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    return t, config


def medusa_checkpoint(rng, n_heads=3, n_layers=2, cfg=TINY):
    """(tensors, config.json) of Medusa-1 heads as FasterDecoding/Medusa saves `medusa_head.state_dict()`."""
    t = {}
    for i in range(n_heads):
        for j in range(n_layers):
            t[f"{i}.{j}.linear.weight"] = randn(rng, cfg.dim, cfg.dim)
            t[f"{i}.{j}.linear.bias"] = randn(rng, cfg.dim)
        t[f"{i}.{n_layers}.weight"] = randn(rng, cfg.vocab_size, cfg.dim)
    return t, {
        "medusa_num_heads": n_heads,
        "medusa_num_layers": n_layers,
        "base_model_name_or_path": "tiny",
    }


# --- the reference arithmetic (float64), from the papers' code ----------------------------------------------

# float32 against float64: the inputs rounded, the fusion or input projection, one decoder layer, the LM head
HEAD_DEPTH = 1 + 1 + LAYER_DEPTH + 1


def rms(x, w):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + TINY.norm_eps)


def rope(x, theta):
    """Rotate-half RoPE (HF Llama, EAGLE) at positions 0..T-1; x [T, heads, D]."""
    d = x.shape[-1]
    angles = np.arange(len(x))[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None]
    cos, sin = (np.concatenate([fn(angles)] * 2, -1)[:, None] for fn in (np.cos, np.sin))
    return x * cos + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def silu(x):
    return x / (1 + np.exp(-x))


def reference_layer(t, config, prefix, attn_input, x):
    """A Llama decoder layer written out: causal attention over `attn_input` [T, *] added to the residual `x`
    [T, H], then the MLP on its post-attention norm."""
    g = lambda name: np.asarray(t[prefix + name], np.float64)
    nh, nkv, theta, n = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["rope_theta"],
        len(x),
    )
    hd = config["hidden_size"] // nh
    q = rope((attn_input @ g("self_attn.q_proj.weight").T).reshape(n, nh, hd), theta)
    k = rope((attn_input @ g("self_attn.k_proj.weight").T).reshape(n, nkv, hd), theta).repeat(
        nh // nkv, axis=1
    )
    v = (attn_input @ g("self_attn.v_proj.weight").T).reshape(n, nkv, hd).repeat(nh // nkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.where(np.tril(np.ones((n, n))), 0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, nh * hd) @ g("self_attn.o_proj.weight").T
    m = rms(x, g("post_attention_layernorm.weight"))
    return (
        x
        + (silu(m @ g("mlp.gate_proj.weight").T) * (m @ g("mlp.up_proj.weight").T))
        @ g("mlp.down_proj.weight").T
    )


def reference_eagle3(t, config, tokens, taps):
    """EAGLE-3's head on (token i + 1, tapped target layers i) at positions 0..T-1: target-vocabulary logits."""
    g = lambda name: np.asarray(t[name], np.float64)
    x = taps @ g("fc.weight").T
    inp = np.concatenate(
        [
            rms(EMBED[tokens], g("midlayer.input_layernorm.weight")),
            rms(x, g("midlayer.hidden_norm.weight")),
        ],
        -1,
    )
    x = reference_layer(t, config, "midlayer.", inp, x)
    draft_logits = rms(x, g("norm.weight")) @ g("lm_head.weight").T
    full = np.full((len(tokens), V), -np.inf)
    full[:, np.arange(draft_logits.shape[1]) + t.get("d2t", 0)] = draft_logits
    return full


def reference_medusa(t, config, feats):
    """Medusa's heads on final target features [T, H]: logits [T, heads, V]."""
    out = []
    for i in range(config["medusa_num_heads"]):
        x = feats
        for j in range(config["medusa_num_layers"]):
            x = x + silu(x @ t[f"{i}.{j}.linear.weight"].T + t[f"{i}.{j}.linear.bias"])
        out.append(x @ t[f"{i}.{config['medusa_num_layers']}.weight"].T)
    return np.stack(out, 1)


def specjax_eagle3(meta, graphdef, params, tokens, taps):
    d = heads.make_drafter(meta, graphdef, TINY, 2, Sampler())
    dparams = heads.drafter_params(meta, params, TINY, TARGET[1])
    n = len(tokens)
    feats = d.fuse(dparams, jnp.asarray(taps[None], jnp.float32))
    cache = init_cache(d.layer_cfg, 1, n)
    logits, _, _ = d.apply(
        dparams, jnp.asarray(tokens[None]), feats, jnp.arange(n)[None], cache, causal_mask(n)
    )
    return np.asarray(logits[0])


# --- loading ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, draft, layer_ids",
    [("model.safetensors", DRAFT, (2, 1, 1)), ("pytorch_model.bin", None, None)],
    ids=["bf16-safetensors-reduced-vocab", "torch-bin-full-vocab-default-layers"],
)
def test_eagle3_logits_equal_reference(tmp_path, name, draft, layer_ids):
    rng = np.random.default_rng(0)
    t, config = eagle3_checkpoint(rng, draft, layer_ids)
    if name.endswith(".safetensors"):  # as SpecForge saves them
        t = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in t.items()}
    else:  # a copy of the target's embedding, as EAGLE's own module holds one
        t["embed_tokens.weight"] = EMBED.astype(np.float32)
    meta, graphdef, params = published.load_published(
        write(tmp_path, t, config, name), "eagle3", TINY, TARGET[1]
    )
    assert meta["shape"] == {
        "layers": [1, 0, 0],
        "draft_ids": draft,
    }  # ids 2, 1, 1 = outputs of layers 1, 0, 0
    tokens, taps = rng.integers(0, V, T), rng.normal(0, 1, (T, 3 * H))
    want = reference_eagle3(t, config, tokens, taps)
    got = specjax_eagle3(meta, graphdef, params, tokens, taps)
    assert_close(got, want, dtype=jnp.float32, depth=HEAD_DEPTH)


@pytest.mark.parametrize("name", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_medusa_logits_equal_reference(tmp_path, name):
    rng = np.random.default_rng(1)
    t, config = medusa_checkpoint(rng)
    meta, graphdef, params = published.load_published(
        write(tmp_path, t, config, name), "medusa", TINY, TARGET[1]
    )
    assert meta["shape"] == {"num_heads": 3, "num_layers": 2}
    feats = rng.normal(0, 1, (T, H))
    got = medusa_logits(
        graphdef, heads.drafter_params(meta, params, TINY, TARGET[1]), jnp.asarray(feats, jnp.float32)
    )
    # float32 against float64: the features rounded, 2 residual blocks (product, SiLU, add), the head's product
    assert_close(got, reference_medusa(t, config, feats), dtype=jnp.float32, depth=1 + 2 * 3 + 1)


# --- export -------------------------------------------------------------------------------------------------


def test_d2t_t2d_conversion():
    d2t, t2d = published.d2t_t2d([3, 5, 11], 12)
    assert d2t.tolist() == [3, 4, 9] and d2t.dtype == np.int64
    assert t2d.dtype == bool and np.flatnonzero(t2d).tolist() == [3, 5, 11]
    assert published.draft_ids_of(d2t, t2d, 12).tolist() == [3, 5, 11]
    with pytest.raises(CheckpointError, match="d2t and t2d of .* disagree"):
        published.draft_ids_of(d2t, ~t2d, 12)
    with pytest.raises(CheckpointError, match="outside the 12-token vocabulary or twice"):
        published.draft_ids_of([3, 4, 90], None, 12)


def test_export_then_load_is_identity(tmp_path):
    rng = np.random.default_rng(2)
    for method, shape in [
        ("eagle3", {"layers": [1, 0, 1], "draft_ids": DRAFT}),
        ("medusa", {"num_heads": 2, "num_layers": 2}),
    ]:
        meta = heads.describe(method, shape, TINY)
        _, params = heads.new_heads(meta, TINY, TARGET[1], seed=2)
        params = jax.tree.map(
            lambda x: x + randn(rng, *x.shape, scale=0.1), params
        )  # Medusa starts at zero
        dest = published.export_published(meta, params, tmp_path / method, TINY, base_model="tiny")
        loaded_meta, _, loaded = published.load_published(dest, method, TINY, TARGET[1])
        assert loaded_meta == meta
        jax.tree.map(np.testing.assert_array_equal, loaded, params)
        published.export_published(meta, params, dest, TINY)  # a previous export is replaced

    t = load_file(str(tmp_path / "eagle3/model.safetensors"))
    config = json.loads((tmp_path / "eagle3/config.json").read_text())
    assert t["d2t"].tolist() == [tok - i for i, tok in enumerate(DRAFT)] and t["d2t"].dtype == np.int64
    assert np.flatnonzero(t["t2d"]).tolist() == DRAFT and t["fc.weight"].shape == (H, 3 * H)
    assert t[A + "q_proj.weight"].shape == (H, 2 * H) and t["lm_head.weight"].shape == (len(DRAFT), H)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 1, 2] and config["draft_vocab_size"] == 8
    medusa = load_file(str(tmp_path / "medusa/medusa_lm_head.safetensors"))
    blocks = {f"{i}.{j}.linear.{p}" for i in range(2) for j in range(2) for p in ("weight", "bias")}
    assert set(medusa) == blocks | {"0.2.weight", "1.2.weight"}

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(files.DestinationError, match="not a published heads export written by specjax"):
        published.export_published(meta, params, foreign, TINY)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_eagle3_attention_biases_round_trip(tmp_path):
    """A Qwen2-style target's head (q/k/v biases) exports with attention_bias and loads back unchanged; a target
    whose layer has no such biases refuses them."""
    rng, cfg = np.random.default_rng(6), TINY.replace(qkv_bias=True)
    meta = heads.describe("eagle3", {"layers": [1, 0, 0], "draft_ids": None}, cfg)
    params = jax.tree.map(
        lambda x: x + randn(rng, *x.shape, scale=0.1), heads.new_heads(meta, cfg, TARGET[1])[1]
    )
    dest = published.export_published(meta, params, tmp_path / "qwen", cfg)
    config, t = json.loads((dest / "config.json").read_text()), load_file(str(dest / "model.safetensors"))
    assert (
        config["attention_bias"]
        and not t[A + "o_proj.bias"].any()
        and not t["d2t"].any()
        and t["t2d"].all()
    )
    _, _, loaded = published.load_published(dest, "eagle3", cfg, TARGET[1])
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    with pytest.raises(CheckpointError, match="has nonzero .*q_proj.bias .* cannot hold"):
        published.load_published(dest, "eagle3", TINY, TARGET[1])


# --- refusals -----------------------------------------------------------------------------------------------


def eagle3_edit(tensors=(), config=(), drop=(), **kw):
    """An EAGLE-3 checkpoint (`eagle3_checkpoint(**kw)`) with tensors replaced (name -> fn(tensors, rng)),
    config entries replaced and tensors or config entries dropped."""

    def make(rng):
        t, c = eagle3_checkpoint(rng, **kw)
        t |= {k: fn(t, rng) for k, fn in dict(tensors).items()}
        c |= dict(config)
        for k in drop:
            (t if k in t else c).pop(k)
        return t, c

    return make


MISMATCHES = {  # name: (method, checkpoint maker, message)
    "eagle3-hidden-size": (
        "eagle3",
        eagle3_edit(cfg=TINY.replace(dim=16)),
        "hidden size 16, the target has 32",
    ),
    "eagle3-vocab": (
        "eagle3",
        eagle3_edit(cfg=TINY.replace(vocab_size=50), draft=[1, 2]),
        "vocabulary of 50, the target has 97",
    ),
    "eagle3-t2d-length": (
        "eagle3",
        eagle3_edit({"t2d": lambda t, r: t["t2d"][:50]}),
        r"vocabulary \(t2d\) of 50",
    ),
    "eagle3-lm-head-rows": (
        "eagle3",
        eagle3_edit(
            {"lm_head.weight": lambda t, r: randn(r, 120, H)}, drop=["draft_vocab_size"], draft=None
        ),
        "lm_head rows 120 for a 97-token target",
    ),
    "eagle3-as-medusa": (
        "medusa",
        eagle3_edit(),
        "holds eagle3 heads, not medusa heads; pass method='eagle3'",
    ),
    "medusa-as-eagle3": (
        "eagle3",
        medusa_checkpoint,
        "holds medusa heads, not eagle3 heads; pass method='medusa'",
    ),
    "medusa-hidden-size": (
        "medusa",
        lambda r: medusa_checkpoint(r, cfg=TINY.replace(dim=16)),
        "hidden size 16, the target has 32",
    ),
    "medusa-vocab": (
        "medusa",
        lambda r: medusa_checkpoint(r, cfg=TINY.replace(vocab_size=50)),
        r"vocabulary \(output rows\) of 50",
    ),
    "embedding-as-layer": (
        "eagle3",
        eagle3_edit(layer_ids=(0, 1, 2)),
        r"fuses target layer inputs \[0, 1, 2\]",
    ),
    "rope": ("eagle3", eagle3_edit(config={"rope_theta": 5e5}), "RoPE theta 500000.0"),
    "missing-tensor": ("eagle3", eagle3_edit(drop=["norm.weight"]), "has no tensor 'norm.weight'"),
    "missing-d2t": ("eagle3", eagle3_edit(drop=["d2t"]), "8-token draft vocabulary but no d2t"),
    "own-embedding": (
        "eagle3",
        eagle3_edit({"embed_tokens.weight": lambda t, r: randn(r, V, H)}),
        "unlike the target's embedding",
    ),
    "missing-config": (
        "eagle3",
        lambda r: (eagle3_checkpoint(r)[0], None),
        "config.json is missing or corrupt",
    ),
}


@pytest.mark.parametrize("method, make, match", MISMATCHES.values(), ids=MISMATCHES)
def test_mismatches_are_refused(tmp_path, method, make, match):
    tensors, config = make(np.random.default_rng(3))
    name = "model.safetensors" if "fc.weight" in tensors else "medusa_lm_head.safetensors"
    with pytest.raises(CheckpointError, match=match) as err:
        published.load_published(write(tmp_path, tensors, config, name), method, TINY, TARGET[1])
    assert "\n" not in str(err.value)


def test_missing_weights_and_unknown_files_are_refused(tmp_path):
    with pytest.raises(
        CheckpointError, match="holds none of medusa_lm_head.safetensors / medusa_lm_head.pt"
    ):
        published.load_published(tmp_path, "medusa", TINY, TARGET[1])
    write(tmp_path, {"something.weight": np.zeros(3, np.float32)}, {}, "model.safetensors")
    with pytest.raises(CheckpointError, match="holds no published head tensors"):
        published.load_published(tmp_path, "eagle3", TINY, TARGET[1])


def eagle12_checkpoint(rng, bias=True, cfg=TINY):
    """(tensors, config.json) of an EAGLE-1/2 head as SafeAILab/EAGLE (cnets1.py) saves it: no input_layernorm."""
    d, f, q, kv = cfg.dim, cfg.hidden_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    a = "layers.0.self_attn."
    t = {
        "fc.weight": randn(rng, d, 2 * d),
        a + "q_proj.weight": randn(rng, q, d),
        a + "k_proj.weight": randn(rng, kv, d),
        a + "v_proj.weight": randn(rng, kv, d),
        a + "o_proj.weight": randn(rng, d, q),
        "layers.0.mlp.gate_proj.weight": randn(rng, f, d),
        "layers.0.mlp.up_proj.weight": randn(rng, f, d),
        "layers.0.mlp.down_proj.weight": randn(rng, d, f),
        "layers.0.post_attention_layernorm.weight": 1 + randn(rng, d),
    }
    if bias:
        t["fc.bias"] = randn(rng, d)
    return t, one_layer_config(cfg, "LlamaForCausalLM")


def reference_eagle12(t, config, tokens, feats):
    """EAGLE-1/2's head on (token i + 1, final feature i): predicted features through the target's LM head."""
    g = lambda name: np.asarray(t[name], np.float64)
    x = np.concatenate([EMBED[tokens], feats], -1) @ g("fc.weight").T + (
        g("fc.bias") if "fc.bias" in t else 0
    )
    x = reference_layer(t, config, "layers.0.", x, x)  # no input norm
    return x @ np.asarray(target_io(TINY, TARGET[1])["unembed"], np.float64).T


@pytest.mark.parametrize(
    "name, bias",
    [("pytorch_model.bin", True), ("model.safetensors", False)],
    ids=["torch-bin", "safetensors-no-fc-bias"],
)
def test_eagle12_logits_equal_reference(tmp_path, name, bias):
    rng = np.random.default_rng(4)
    t, config = eagle12_checkpoint(rng, bias)
    t["embed_tokens.weight"] = EMBED.astype(np.float32)  # EAGLE's module holds a copy of the target's
    meta, graphdef, params = published.load_published(
        write(tmp_path, t, config, name), "eagle", TINY, TARGET[1]
    )
    assert meta["shape"] == {"input_norm": False}
    d = heads.make_drafter(meta, graphdef, TINY, 2, Sampler())
    dparams = heads.drafter_params(meta, params, TINY, TARGET[1])
    tokens, feats = rng.integers(0, V, T), rng.normal(0, 1, (T, H))
    logits, _, _ = d.apply(
        dparams,
        jnp.asarray(tokens[None]),
        jnp.asarray(feats[None], jnp.float32),
        jnp.arange(T)[None],
        init_cache(d.layer_cfg, 1, T),
        causal_mask(T),
    )
    want = reference_eagle12(t, config, tokens, feats)
    assert_close(logits[0], want, dtype=jnp.float32, depth=HEAD_DEPTH)
    # a control: the same weights through specjax's own (normalising) layer give other logits
    own = heads.describe("eagle", {}, TINY)
    normed = heads.make_drafter(own, heads.new_heads(own, TINY, TARGET[1])[0], TINY, 2, Sampler())
    params_normed = {**params, "layer": {**params["layer"], "attn_norm": {"weight": jnp.ones(H)}}}
    other, _, _ = normed.apply(
        heads.drafter_params(own, params_normed, TINY, TARGET[1]),
        jnp.asarray(tokens[None]),
        jnp.asarray(feats[None], jnp.float32),
        jnp.arange(T)[None],
        init_cache(d.layer_cfg, 1, T),
        causal_mask(T),
    )
    assert_far(other[0], want, dtype=jnp.float32, depth=HEAD_DEPTH)
    # export -> load is the identity; specjax's own EAGLE heads (which normalise) have no such layout
    dest = published.export_published(meta, params, tmp_path / "export", TINY)
    assert "layers.0.input_layernorm.weight" not in load_file(str(dest / "model.safetensors"))
    loaded_meta, _, loaded = published.load_published(dest, "eagle", TINY, TARGET[1])
    assert loaded_meta == meta
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    with pytest.raises(ValueError, match="this EAGLE head cannot be exported to the published layout"):
        published.export_published(own, heads.new_heads(own, TINY, TARGET[1])[1], tmp_path / "out", TINY)


def test_published_eagle12_head_decodes_exactly(tmp_path):
    """Greedy decoding with a loaded EAGLE-1/2 head (random weights) gives AR's tokens, chain and dynamic tree."""
    cfg, graphdef, params, prompts, spec, ar = greedy_case("tiny", None)
    t, config = eagle12_checkpoint(np.random.default_rng(7))
    path = write(tmp_path, t, config, "model.safetensors")
    meta, hgraph, hparams = published.load_published(path, "eagle", cfg, params)
    for tree in (None, DynamicTree(3, 3, 8)):
        d = heads.make_drafter(meta, hgraph, cfg, 3, Sampler(), tree)
        out = speculative_generate(
            cfg, graphdef, params, d, heads.drafter_params(meta, hparams, cfg, params), prompts, spec
        )
        np.testing.assert_array_equal(np.asarray(out.tokens), ar)


def test_torch_files_need_torch(tmp_path, monkeypatch):
    t, config = medusa_checkpoint(np.random.default_rng(5), 1, 1)
    write(tmp_path, t, config, "medusa_lm_head.pt")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # as if torch were not installed
    with pytest.raises(
        CheckpointError, match="needs torch: install torch, or convert the file to safetensors"
    ):
        published.load_published(tmp_path, "medusa", TINY, TARGET[1])


@pytest.mark.parametrize(
    "method, edit, match",
    [
        ("eagle", lambda t, c: (t, c | {"hidden_size": 16}), "hidden size 16, the target has 32"),
        (
            "eagle",
            lambda t, c: (t | {"layers.0.input_layernorm.weight": np.ones(H, np.float32)}, c),
            "has a layers.0.input_layernorm",
        ),
        ("eagle", lambda t, c: (t, c | {"add_para_norm": True}), "HASS's extra norms"),
        ("eagle3", lambda t, c: (t, c), "holds eagle heads, not eagle3 heads; pass method='eagle'"),
    ],
    ids=["hidden-size", "input-layernorm", "hass", "as-eagle3"],
)
def test_foreign_eagle12_heads_are_refused(tmp_path, method, edit, match):
    t, config = edit(*eagle12_checkpoint(np.random.default_rng(8)))
    with pytest.raises(CheckpointError, match=match):
        published.load_published(write(tmp_path, t, config, "pytorch_model.bin"), method, TINY, TARGET[1])
