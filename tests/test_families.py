"""Every supported family reproduces transformers' PyTorch logits (prefill, cached steps, a ragged batch), each
family feature is load-bearing (switched off, the logits miss by far), MXFP4 experts dequantise as transformers
does, and speculative decoding stays exact on every family."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import assert_cached_steps_match
from tolerance import assert_close, assert_far, forward_depth

from specjax import acceptance, checkpoint, verify_exactness
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.decoding.prefill import prefill
from specjax.drafting import registry
from specjax.drafting.trees import parse_tree
from specjax.models.config import LlamaConfig
from specjax.models.llama import abstract_model, causal_mask, forward, init_cache, init_params
from specjax.models.loading import LoadedModel, tokenizer_files
from specjax.models.weights import build_params, mxfp4, params_from_hf, read_safetensors
from specjax.sampling import Sampler
from specjax.training import trainer
from specjax.training.config import base_config, smoke

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.25,  # peaked attention and logits of a few units: a wrong mask or scale shows
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = dict(sliding_window=4)  # shorter than the sequences compared
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
}
# (transformers config, a config change that switches one of the family's features off: the control)
FAMILIES = {
    "qwen3": ({}, dict(qk_norm=False)),
    "mistral": (WINDOW, dict(sliding_window=1000)),
    "qwen2": (dict(WINDOW, use_sliding_window=True, max_window_layers=1), dict(sliding_window=1000)),
    "phi3": (WINDOW, dict(sliding_window=1000)),
    "gemma2": (
        dict(WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
        dict(attn_softcap=None),
    ),
    "gemma3_text": (
        dict(WINDOW, layer_types=GEMMA3_LAYERS,
             rope_parameters=GEMMA3_ROPE),
        dict(local_rope_theta=None),
    ),
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2), dict(router="softmax_topk")),
    "qwen3_moe": (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
        dict(router="softmax_topk"),
    ),
    "gpt_oss": (
        dict(
            WINDOW,
            intermediate_size=64,  # MXFP4 packs 32 values a group
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters=YARN | {"original_max_position_embeddings": 16, "rope_theta": 150000.0},
        ),
        dict(attn_sinks=False),
    ),
}  # fmt: skip
SEQ = 12


def reference(family: str, tmp_path):
    """A random transformers model of the family (norms, biases and sinks perturbed), saved and read back."""
    torch.manual_seed(len(family))
    hf_cfg = transformers.AutoConfig.for_model(family, **{**BASE, **FAMILIES[family][0]})
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    cfg = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    return model, cfg, params_from_hf(cfg, read_safetensors(tmp_path))


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def without(cfg: LlamaConfig, params, **change):
    """(graphdef, params) of `cfg` changed, keeping the parameters the changed model still has."""
    changed = cfg.replace(**change)
    pure = nnx.to_pure_dict(params)
    keep = nnx.to_pure_dict(abstract_model(changed)[1])

    def pick(tree, like):
        return {k: pick(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}

    return changed, build_params(changed, pick(pure, keep))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    model, cfg, (graphdef, params) = reference(family, tmp_path)
    assert cfg.family == family
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, SEQ))
    expected = torch_logits(model, tokens)
    depth = forward_depth(cfg.n_layers) + 2  # a routed MLP adds its router and the mixing of experts
    positions = jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ))
    logits = forward(
        graphdef, params, jnp.asarray(tokens), positions, init_cache(cfg, 2, 32), causal_mask(SEQ)
    )[0]
    assert_close(logits, expected, dtype=jnp.float32, depth=depth)

    # step by step: a batch of 2 single-token rows (the experts' routed path)
    assert_cached_steps_match(cfg, graphdef, params, tokens, expected, depth)

    changed, control = without(cfg, params, **FAMILIES[family][1])
    off = forward(
        *control[:1],
        control[1],
        jnp.asarray(tokens),
        positions,
        init_cache(changed, 2, 32),
        causal_mask(SEQ),
    )
    assert_far(off[0], expected, dtype=jnp.float32, depth=depth)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_ragged_batch_matches_each_row_alone(family, tmp_path):
    """Rows of 11 and 6 prompt tokens prefilled together (right-padded), then one step each at its own position,
    give transformers' logits of each row alone: windows and RoPE follow each row's positions."""
    model, cfg, (graphdef, params) = reference(family, tmp_path)
    rows = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, SEQ))
    lengths = np.array([11, 6])
    padded = np.where(np.arange(SEQ)[None] < lengths[:, None], rows, 0)[:, : lengths.max()]
    last, cache, _ = prefill(cfg, graphdef, params, jnp.asarray(padded), jnp.asarray(lengths), 32)
    step, _, _ = forward(
        graphdef, params, jnp.asarray(rows[np.arange(2), lengths])[:, None], jnp.asarray(lengths)[:, None], cache,
        causal_mask(1),
    )  # fmt: skip
    depth = forward_depth(cfg.n_layers) + 2
    for b, n in enumerate(lengths):
        expected = torch_logits(model, rows[b : b + 1, : n + 1])[0]
        magnitude = np.abs(expected).max()
        assert_close(last[b], expected[n - 1], dtype=jnp.float32, depth=depth, magnitude=magnitude)
        assert_close(step[b, 0], expected[n], dtype=jnp.float32, depth=depth, magnitude=magnitude)


def test_mxfp4_dequantises_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
    np.testing.assert_array_equal(
        mxfp4(blocks, scales), theirs.numpy().transpose(0, 2, 1)
    )  # theirs: [E, in, out]


def test_identity_of_a_llama_ignores_the_family_fields():
    """Provenance records hash the config without the family fields that are off: a Llama's identity is what it was
    before the families were added, and switching a family feature on changes it."""
    cfg = LlamaConfig(vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32)
    record = cfg.identity_record()
    assert "family" not in record and record["dim"] == 16
    assert cfg.replace(qk_norm=True, family="qwen3").identity_record()["qk_norm"] is True


@pytest.mark.parametrize(
    "family, drafter, tree",
    [
        (
            "gpt_oss",
            "draft_model",
            "0;1;0,0;1,0",
        ),  # experts, sinks, windows: a static tree of the truncated target
        ("gpt_oss", "eagle3", "dynamic:2,3,5"),  # a dynamic tree of a (fresh) head on an MoE target
        ("gemma3_text", "draft_model", ""),  # Gemma's layer and local RoPE, a chain
        ("qwen3_moe", "medusa", "0;1;0,0;1,0"),
    ],
)
def test_speculative_decoding_is_exact_on_the_family(family, drafter, tree):
    """Sampled speculative decoding follows the target's exact distribution on a tiny random model of the family
    (chi-square, with its negative control caught), and greedy speculative decoding equals greedy decoding."""
    report = verify_exactness.verify(
        drafter, ("tokenwise",), model=f"tiny-{family}", tree=tree, samples=6000
    )
    assert report.passed, report.format()
    assert report.greedy_identical


@pytest.mark.parametrize("family", ["gemma2", "mistral", "mixtral", "qwen3"])  # the others: the test above
def test_greedy_speculation_equals_greedy_decoding(family):
    """On the families the sampled checks above leave out, a draft model's chain and an EAGLE-3 head's dynamic tree
    (windows the sequences outgrow, rollback and `compact` across them) reproduce greedy decoding token for
    token."""
    target = verify_exactness.tiny_target(0, verify_exactness.TINY_FAMILIES[family])
    rule = [acceptance.get("tokenwise")]
    for drafter, tree in (("draft_model", None), ("eagle3", parse_tree("dynamic:2,3,5"))):
        k = 3 if tree is None else tree.depth
        assert verify_exactness.greedy_identical(target, drafter, rule, k, tree, True, None, [1, 3], 0), (
            drafter
        )


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma 3 multimodal config.json gives its text model's config, and weights under the multimodal model's
    prefixes load as the text model's."""
    model, cfg, (_, params) = reference("gemma3_text", tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    outer = LlamaConfig.from_hf({"model_type": "gemma3", "text_config": text})
    assert outer == cfg
    tensors = read_safetensors(tmp_path)
    for prefix in ("model.language_model.", "language_model.model."):
        renamed = {prefix + name.removeprefix("model."): tensors[name] for name in tensors}
        _, loaded = params_from_hf(cfg, renamed)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def family_target(stories, tmp_path_factory):
    """`family_target(family)`: a tiny random target of the family with stories260K's tokenizer, saved as a specjax
    checkpoint for the trainer (one per family and module)."""
    made = {}

    def make(family: str) -> LoadedModel:
        if family not in made:
            cfg = verify_exactness.TINY_FAMILIES[family].replace(
                vocab_size=stories.cfg.vocab_size,
                max_seq_len=256,
                bos_id=stories.cfg.bos_id,
                eos_id=stories.cfg.eos_id,
            )
            graphdef, params = init_params(cfg, seed=0)
            folder = tmp_path_factory.mktemp(family) / "target"
            path = checkpoint.save_model(folder, cfg, params, tokenizer_files(stories.path))
            made[family] = LoadedModel(cfg, graphdef, params, stories.tokenizer, path)
        return made[family]

    return make


# Every trained head type on the gpt-oss-style target (experts, sinks, windows); on each other family the types
# whose inputs it changes: Gemma's scaled embeddings, (1 + w) final norm and soft-capped logits reach the heads
# that read the target's embedding and final features (EAGLE-3, DFlash, Medusa, EAGLE), the others differ below
# the features a head reads (q/k norms, windows, routed experts), so one or two types each.
HEAD_FAMILIES = [
    *(("gpt_oss", m) for m in ("medusa", "eagle", "eagle3", "dflash")),
    *(("gemma2", m) for m in ("eagle3", "dflash")),
    *(("gemma3_text", m) for m in ("medusa", "eagle")),
    ("qwen3", "eagle"),
    ("qwen3_moe", "eagle"),
    ("mixtral", "medusa"),
    ("mistral", "dflash"),
]


@pytest.mark.parametrize("family, method", HEAD_FAMILIES)
def test_heads_train_and_decode_on_the_family(family, method, family_target, tmp_path):
    """A trained head type trains on a target of the family (smoke run, finite losses), and the trained heads
    decode greedily to the target's own greedy tokens."""
    target = family_target(family)
    config = smoke(base_config(method))
    config.target, config.train.steps = str(target.path), 6
    summary = trainer.train(config, tmp_path)
    assert summary["step"] == 6 and np.isfinite(summary["loss"])
    entry = registry.get(method)
    drafter, dparams = entry.build(target, entry.settings(heads=str(tmp_path)), 3, None, Sampler())
    prompts = [[1, 40, 41, 42], [1, 7]]
    spec = GenerateSpec(12, Sampler(), eos_id=None)
    cfg, graphdef, params = target.cfg, target.graphdef, target.params
    ar = generate(cfg, graphdef, params, prompts, spec).tokens
    spec_tokens = speculative_generate(cfg, graphdef, params, drafter, dparams, prompts, spec).tokens
    np.testing.assert_array_equal(spec_tokens, ar)


def test_gpt_oss_mxfp4_experts_load_like_their_dequantised_values(tmp_path):
    """gpt-oss checkpoints store the experts' matrices as MXFP4 blocks and scales: loading them gives the same
    parameters as loading the dequantised matrices."""
    _, cfg, _ = reference("gpt_oss", tmp_path)
    tensors = dict(read_safetensors(tmp_path).items())
    rng = np.random.default_rng(2)
    quantised = dict(tensors)
    for name, (n_out, n_in) in {
        "gate_up_proj": (2 * cfg.expert_dim, cfg.dim),
        "down_proj": (cfg.dim, cfg.expert_dim),
    }.items():
        for i in range(cfg.n_layers):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks = rng.integers(0, 256, (cfg.n_experts, n_out, n_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 128, (cfg.n_experts, n_out, n_in // 32), dtype=np.uint8)
            del quantised[key]
            quantised[key + "_blocks"], quantised[key + "_scales"] = blocks, scales
            tensors[key] = mxfp4(blocks, scales).transpose(0, 2, 1)  # stored [E, in, out]
    _, from_blocks = params_from_hf(cfg, quantised)
    _, from_floats = params_from_hf(cfg, tensors)
    for a, b in zip(jax.tree.leaves(from_blocks), jax.tree.leaves(from_floats), strict=True):
        np.testing.assert_array_equal(a, b)
