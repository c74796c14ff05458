"""vLLM's speculators format (`specjax.speculators_format`) against the speculators library itself (PyPI speculators
0.9.0, its model classes as the peer): specjax heads exported in the format load in the library's Eagle3DraftModel /
DFlashDraftModel with the draft logits they have in specjax (the committed stories260K EAGLE-3 head, a trained
workdir's export, among them); checkpoints the library writes, or converts from the EAGLE-3 and z-lab layouts, load
in specjax with the same logits and parameters and decode exactly through `--heads`; bad checkpoints are refused in
one line. No network: the targets' verifier directories are written here (the real stories260K is one already)."""

import json
from importlib.util import find_spec

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET, greedy_case
from safetensors.numpy import load_file, save_file
from tolerance import LAYER_DEPTH, assert_close, assert_far, forward_depth

from specjax import files, heads, published, speculators_format
from specjax.decoding import speculative_generate
from specjax.drafters.dflash import dflash_block, dflash_extend
from specjax.drafting import registry
from specjax.drafting.protocol import target_io
from specjax.errors import CheckpointError, HeadsError
from specjax.models.llama import causal_mask, init_cache, init_params
from specjax.sampling import Sampler

torch = pytest.importorskip("torch")

# The library is imported where a test uses it: importing it takes 5.6 s, which every worker collecting the suite
# paid. transformers 5.24 warns of an argument the library's decoder layers still pass, torch of a decorator the
# library uses on import.
pytestmark = [
    pytest.mark.skipif(find_spec("speculators") is None, reason="the speculators library is not installed"),
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
T = 7  # tokens drafted from
DRAFT = [0, 3, 4, 10, 17, 40, 41, 96]  # a reduced draft vocabulary of TINY's 97 tokens
HEAD_DEPTH = 1 + 1 + LAYER_DEPTH + 1  # fc, input norms, the layer, final norm and LM head


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread (small products on two threads of a busy 2-core machine ran far slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_verifier(path, cfg, params):
    """A Hugging Face target directory as the library reads its verifier: config.json, embedding, LM head, norm."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf() | {"architectures": ["LlamaForCausalLM"]}))
    io = target_io(cfg, params)
    norm = np.asarray(params["norm"]["weight"])
    tensors = {
        "model.embed_tokens.weight": io["embed"],
        "lm_head.weight": io["unembed"],
        "model.norm.weight": norm,
    }
    save_file(
        {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
        str(path / "model.safetensors"),
    )
    return path


@pytest.fixture(scope="module")
def tiny_verifier(tmp_path_factory):
    return write_verifier(tmp_path_factory.mktemp("verifier") / "tiny", TINY, TARGET[1])


def noisy(meta, cfg, params, seed):
    """Fresh heads of `meta` with every array moved off its initial value."""
    rng = np.random.default_rng(seed)
    fresh = heads.new_heads(meta, cfg, params, seed)[1]
    return jax.tree.map(lambda x: x + rng.normal(0, 0.1, x.shape).astype(x.dtype), fresh)


def library_model(method: str, path):
    """The library's model ("eagle3" or "dflash") of a speculators directory, its attention on torch's SDPA (not
    flex attention's uncompiled CPU fallback)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model_class, config_class = {
        "eagle3": (Eagle3DraftModel, Eagle3SpeculatorConfig),
        "dflash": (DFlashDraftModel, DFlashSpeculatorConfig),
    }[method]
    config = config_class.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "sdpa"
    return model_class.from_pretrained(str(path), config=config).eval()


def library_eagle3_logits(model, tokens, taps):
    """Draft-vocabulary logits [T, N] of the library's first draft step at (tokens[i], taps[i]), position i."""
    seen = {}
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.setdefault("logits", out))
    with torch.no_grad():
        model(
            hidden_states=torch.from_numpy(np.asarray(taps, np.float32))[None],
            input_ids=torch.from_numpy(np.asarray(tokens))[None],
            document_ids=torch.zeros(1, len(tokens), dtype=torch.long),
            position_ids=torch.arange(len(tokens))[None],
            ttt_steps=1,
        )
    hook.remove()
    return seen["logits"][0].numpy()


def specjax_eagle3_logits(meta, graphdef, params, cfg, target_params, tokens, taps):
    """specjax's draft logits at the draft vocabulary [T, N] for the same inputs."""
    d = heads.make_drafter(meta, graphdef, cfg, 2, Sampler())
    dparams = heads.drafter_params(meta, params, cfg, target_params)
    n = len(tokens)
    feats = d.fuse(dparams, jnp.asarray(taps[None], jnp.float32))
    cache = init_cache(d.layer_cfg, 1, n)
    logits, _, _ = d.apply(
        dparams, jnp.asarray(tokens[None]), feats, jnp.arange(n)[None], cache, causal_mask(n)
    )
    return np.asarray(logits[0])[:, np.asarray(dparams["draft_ids"])]


def inputs(cfg, n_taps, seed, n=T):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, n), rng.normal(0, 1, (n, n_taps * cfg.dim)).astype(np.float32)


# --- specjax -> speculators ---------------------------------------------------------------------------------


def test_trained_head_exports_to_the_library(stories, tmp_path):
    """The committed stories260K EAGLE-3 head (a training workdir's export) written in the format: the library's
    Eagle3DraftModel, with the real stories260K as its verifier, drafts the logits specjax does; read back, the head
    is the same."""
    meta, graphdef, params = heads.load_heads(
        heads.COMMITTED / "stories260K_eagle3", stories.cfg, stories.params
    )
    dest = speculators_format.export(
        meta, params, tmp_path / "eagle3", stories.cfg, stories.params, str(stories.path)
    )
    config = json.loads((dest / "config.json").read_text())
    assert (
        config["speculators_model_type"] == "eagle3"
        and config["draft_vocab_size"] == stories.cfg.vocab_size
    )
    assert config["eagle_aux_hidden_state_layer_ids"] == [j + 1 for j in meta["shape"]["layers"]]
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(stories.path),
        "architectures": ["LlamaForCausalLM"],
    }
    assert "d2t" not in load_file(
        str(dest / "model.safetensors")
    )  # the whole vocabulary: no maps, as the library

    tokens, taps = inputs(stories.cfg, 3, 0)
    model = library_model("eagle3", dest)
    want = library_eagle3_logits(model, tokens, taps)
    got = specjax_eagle3_logits(meta, graphdef, params, stories.cfg, stories.params, tokens, taps)
    assert_close(got, want, dtype=jnp.float32, depth=HEAD_DEPTH)

    loaded_meta, _, loaded = heads.load_external(dest, "eagle3", stories.cfg, stories.params)
    assert loaded_meta == meta
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    speculators_format.export(
        meta, params, dest, stories.cfg, stories.params
    )  # a previous export is replaced


def test_reduced_vocabulary_head_exports_to_the_library(tiny_verifier, tmp_path):
    """A head with a reduced draft vocabulary: its d2t/t2d maps are the library's, its logits the same (and not
    those of the taps in the other order)."""
    meta = heads.describe("eagle3", {"layers": [1, 0], "draft_ids": DRAFT}, TINY)
    graphdef, params = heads.new_heads(meta, TINY, TARGET[1])[0], noisy(meta, TINY, TARGET[1], 1)
    dest = speculators_format.export(
        meta, params, tmp_path / "reduced", TINY, TARGET[1], str(tiny_verifier)
    )
    model = library_model("eagle3", dest)
    assert torch.flatten(torch.nonzero(model.t2d)).tolist() == DRAFT
    assert (torch.arange(len(DRAFT)) + model.d2t).tolist() == DRAFT
    tokens, taps = inputs(TINY, 2, 1)
    want = library_eagle3_logits(model, tokens, taps)
    got = specjax_eagle3_logits(meta, graphdef, params, TINY, TARGET[1], tokens, taps)
    assert_close(got, want, dtype=jnp.float32, depth=HEAD_DEPTH)
    swapped = np.concatenate(np.split(taps, 2, axis=1)[::-1], axis=1)  # the taps in the other order: caught
    far = specjax_eagle3_logits(meta, graphdef, params, TINY, TARGET[1], tokens, swapped)
    assert_far(far, want, dtype=jnp.float32, depth=HEAD_DEPTH)


def dflash_head(seed=2):
    shape = {"layers": [0], "n_layers": 2, "block_size": 4, "mask_token": 5}
    meta = heads.describe("dflash", shape, TINY)
    graphdef, _ = heads.new_heads(meta, TINY, TARGET[1])
    return meta, graphdef, noisy(meta, TINY, TARGET[1], seed)


def specjax_dflash_logits(meta, graphdef, params, tokens, taps):
    """Logits [B, V] of the block [tokens[n], MASK x (B - 1)] over the context of n = len(taps) positions."""
    n, b = len(taps), meta["shape"]["block_size"]
    dparams = heads.drafter_params(meta, params, TINY, TARGET[1])
    cache = init_cache(TINY.replace(n_layers=meta["shape"]["n_layers"]), 1, 32)
    cache = dflash_extend(graphdef, dparams, jnp.asarray(taps[None]), jnp.arange(n)[None], cache)
    block = jnp.asarray([[tokens[n]] + [meta["shape"]["mask_token"]] * (b - 1)])
    return np.asarray(
        dflash_block(graphdef, dparams, block, n + jnp.arange(b)[None], cache.with_length(jnp.array([n])))[
            0
        ][0]
    )


def library_dflash_logits(model, tokens, taps):
    """The library's logits [B, V] of the block anchored at position n = len(taps) (the only position in its loss
    mask, so its one anchor), which sees the context before it."""
    from speculators.losses import resolve_loss_config

    n, b = len(taps), model.block_size
    length = n + b + 1  # the library anchors no block in the last block_size positions
    hidden = np.concatenate([taps, np.zeros((length - n, taps.shape[1]), np.float32)])
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, n] = 1
    seen = {}
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.setdefault("logits", out))
    with torch.no_grad():
        model(
            hidden_states=torch.from_numpy(hidden)[None],
            input_ids=torch.from_numpy(np.asarray(tokens[:length]))[None],
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, length, TINY.dim),
            document_ids=torch.zeros(1, length, dtype=torch.long),
            max_anchors=1,
            loss_config=resolve_loss_config("kl_div", "eager"),  # (its default, fused, needs Triton)
        )
    hook.remove()
    return seen["logits"][0].numpy()


def test_dflash_head_exports_to_the_library(tiny_verifier, tmp_path):
    """A DFlash head written in the format: the library's DFlashDraftModel (its embedding and LM head the verifier's)
    drafts a block with the logits specjax does; read back, the head is the same."""
    meta, graphdef, params = dflash_head()
    dest = speculators_format.export(meta, params, tmp_path / "dflash", TINY, TARGET[1], str(tiny_verifier))
    config = json.loads((dest / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [1] and config["mask_token_id"] == 5
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    model = library_model("dflash", dest)
    tokens, taps = inputs(TINY, 1, 3, n=12)
    taps = taps[:6]
    want = library_dflash_logits(model, tokens, taps)
    got = specjax_dflash_logits(meta, graphdef, params, tokens, taps)
    # the fusion and its norm, two draft layers, the LM head
    assert_close(got, want, dtype=jnp.float32, depth=2 + forward_depth(2))

    loaded_meta, _, loaded = heads.load_external(dest, "dflash", TINY, TARGET[1])
    assert loaded_meta == meta
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


# --- speculators -> specjax ---------------------------------------------------------------------------------


def library_eagle3(verifier, seed=4, draft=DRAFT):
    """A random Eagle3DraftModel of TINY's shape as the library builds one for training (its embedding the
    target's, a reduced vocabulary)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{k: v for k, v in TINY.head_layers(1).to_hf().items() if k != "model_type"})
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(draft),
        eagle_aux_hidden_state_layer_ids=[2, 1],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(verifier), architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config).eval()
    t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
    t2d[draft] = True
    model.load_vocab_mappings(t2d, torch.tensor(draft) - torch.arange(len(draft)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if "norm" in name else 0) + 0.3 * torch.randn(p.shape, generator=gen))
        model.embed_tokens.weight.copy_(torch.tensor(np.asarray(target_io(TINY, TARGET[1])["embed"])))
    return model


def test_library_checkpoint_loads_and_decodes(tiny_verifier, tmp_path):
    """A checkpoint the library saves (`save_pretrained`) loads in specjax with the library's draft logits, and as
    `--heads` decodes exactly (greedy speculative = greedy AR)."""
    model = library_eagle3(tiny_verifier)
    model.save_pretrained(str(tmp_path / "lib"))
    meta, graphdef, params = heads.load_external(tmp_path / "lib", "eagle3", TINY, TARGET[1])
    assert meta["shape"] == {"layers": [1, 0], "draft_ids": DRAFT}
    tokens, taps = inputs(TINY, 2, 4)
    want = library_eagle3_logits(model, tokens, taps)
    assert_close(
        specjax_eagle3_logits(meta, graphdef, params, TINY, TARGET[1], tokens, taps),
        want,
        dtype=jnp.float32,
        depth=HEAD_DEPTH,
    )

    cfg, tgraph, tparams, prompts, spec, ar = greedy_case("tiny", None)
    entry = registry.get("eagle3")
    target = type("Target", (), {"cfg": cfg, "params": tparams})
    drafter, dparams = entry.build(target, entry.settings(heads=str(tmp_path / "lib")), 3, None, Sampler())
    out = speculative_generate(cfg, tgraph, tparams, drafter, dparams, prompts, spec)
    np.testing.assert_array_equal(np.asarray(out.tokens), ar)


def test_library_conversions_load_as_the_originals(tiny_verifier, tmp_path):
    """The library's converters from the EAGLE-3 layout and from z-lab's DFlash layout: specjax reads each
    converted checkpoint as the same head as the original."""
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    # three taps: the converter's model fuses three (their ids repeat here, which only its training refuses)
    meta = heads.describe("eagle3", {"layers": [1, 0, 1], "draft_ids": DRAFT}, TINY)
    original = published.export_published(meta, noisy(meta, TINY, TARGET[1], 5), tmp_path / "eagle3", TINY)
    Eagle3Converter().convert(
        original,
        tmp_path / "eagle3_spec",
        str(tiny_verifier),
        validate=False,
        eagle_aux_hidden_state_layer_ids=[2, 1, 2],
    )
    dmeta, _, dparams = dflash_head(6)
    zlab = published.export_published(dmeta, dparams, tmp_path / "zlab", TINY)
    DFlashConverter().convert(zlab, tmp_path / "dflash_spec", str(tiny_verifier), validate=False)
    for method, src, converted in [("eagle3", original, "eagle3_spec"), ("dflash", zlab, "dflash_spec")]:
        want_meta, _, want = heads.load_external(src, method, TINY, TARGET[1])
        got_meta, _, got = heads.load_external(tmp_path / converted, method, TINY, TARGET[1])
        assert got_meta == want_meta
        jax.tree.map(np.testing.assert_array_equal, got, want)


# --- refusals -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tiny_verifier, tmp_path_factory):
    """An exported EAGLE-3 speculators checkpoint for TINY."""
    meta = heads.describe("eagle3", {"layers": [1, 0], "draft_ids": DRAFT}, TINY)
    dest = tmp_path_factory.mktemp("good") / "eagle3"
    return speculators_format.export(
        meta, noisy(meta, TINY, TARGET[1], 7), dest, TINY, TARGET[1], str(tiny_verifier)
    )


def edited(src, dest, config=(), drop=()):
    """A copy of the checkpoint `src` with config.json entries changed and tensors dropped."""
    dest.mkdir()
    c = json.loads((src / "config.json").read_text())
    for key, value in dict(config).items():
        *path, last = key.split(".")
        node = c
        for part in path:
            node = node[part]
        node[last] = value
    (dest / "config.json").write_text(json.dumps(c))
    t = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    save_file(t, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize(
    "edit, target_cfg, error, match",
    [
        (
            {},
            TINY.replace(dim=48, hidden_dim=96),
            CheckpointError,
            "is a head for hidden size 32, the target has 48: use a head trained for this target",
        ),
        (
            {},
            TINY.replace(vocab_size=101),
            CheckpointError,
            "is a head for a vocabulary of 97, the target has 101: use a head trained",
        ),
        (
            {"drop": ["layers.0.mlp.down_proj.weight"]},
            TINY,
            CheckpointError,
            "has no tensor 'layers.0.mlp.down_proj.weight': the file is incomplete; download it again",
        ),
        (
            {"config": {"speculators_model_type": "mtp"}},
            TINY,
            CheckpointError,
            "speculators 'mtp' model, which specjax does not read .*; pass a speculators eagle3 or dflash",
        ),
        (
            {"config": {"norm_output": True}},
            TINY,
            CheckpointError,
            "sets norm_output=true .* use a head trained without norm_output",
        ),
        (
            {"config": {"transformer_layer_config.model_type": "qwen3"}},
            TINY,
            CheckpointError,
            "has a qwen3 draft layer .* use a head with a llama draft layer",
        ),
    ],
    ids=["hidden-size", "vocabulary", "missing-weight", "unknown-type", "extra-norm", "qwen3-layer"],
)
def test_bad_checkpoints_are_refused(good, tmp_path, edit, target_cfg, error, match):
    path = edited(good, tmp_path / "bad", **edit)
    params = TARGET[1] if target_cfg is TINY else init_params(target_cfg, seed=0)[1]
    with pytest.raises(error, match=match) as caught:
        heads.load_external(path, "eagle3", target_cfg, params)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"config": {"draft_vocab_size": 8}},
            "has a 8-token draft vocabulary, which specjax's heads cannot represent; specjax's DFlash head drafts",
        ),
        (
            {"config": {"sample_from_anchor": True}},
            "sets sample_from_anchor=true, .* drafts after the anchor",
        ),
        (
            {"config": {"aux_hidden_state_layer_ids": None}},
            "has aux_hidden_state_layer_ids=None, not the target",
        ),
    ],
    ids=["reduced-vocabulary", "from-anchor", "no-layer-ids"],
)
def test_bad_dflash_checkpoints_are_refused(tiny_verifier, tmp_path, edit, match):
    meta, _, params = dflash_head()
    good = speculators_format.export(meta, params, tmp_path / "good", TINY, TARGET[1], str(tiny_verifier))
    with pytest.raises(CheckpointError, match=match):
        heads.load_external(edited(good, tmp_path / "bad", **edit), "dflash", TINY, TARGET[1])


def test_other_method_and_foreign_destination_are_refused(good, tmp_path):
    with pytest.raises(
        HeadsError, match="is a speculators eagle3 checkpoint, not dflash heads; pass --drafter=eagle3"
    ):
        heads.load_external(good, "dflash", TINY, TARGET[1])
    meta = heads.describe("medusa", {"num_heads": 2, "num_layers": 1}, TINY)
    with pytest.raises(
        HeadsError, match="medusa heads have no speculators format; export eagle3, dflash heads"
    ):
        speculators_format.export(
            meta, heads.new_heads(meta, TINY, TARGET[1])[1], tmp_path / "m", TINY, TARGET[1]
        )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    meta = heads.describe("eagle3", {"layers": [1, 0], "draft_ids": None}, TINY)
    with pytest.raises(files.DestinationError):
        speculators_format.export(meta, heads.new_heads(meta, TINY, TARGET[1])[1], foreign, TINY, TARGET[1])
    assert (foreign / "notes.txt").read_text() == "mine"


def test_sharded_checkpoint_loads_as_one_file(good, tmp_path):
    """Shards listed in model.safetensors.index.json (as save_pretrained writes a large head) read as one file; a
    missing shard is named."""
    tensors = load_file(str(good / "model.safetensors"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((good / "config.json").read_text())
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    want = heads.load_external(good, "eagle3", TINY, TARGET[1])
    got = heads.load_external(sharded, "eagle3", TINY, TARGET[1])
    assert got[0] == want[0]
    jax.tree.map(np.testing.assert_array_equal, got[2], want[2])
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, listed in .* is missing"):
        heads.load_external(sharded, "eagle3", TINY, TARGET[1])
