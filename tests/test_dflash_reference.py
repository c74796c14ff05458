"""specjax's DFlash against z-lab's reference (PyPI dflash 0.1.0, `dflash.model`): a specjax head exported in z-lab's
layout (`specjax.drafters.dflash_zlab`) loads into the reference's DFlashDraftModel, which drafts the same per-position
logits over the same context, each through its own stories260K target (a head tapping the layers in another order
is caught); the reference's `dflash_generate` over the transformers stories260K emits the same greedy tokens as
specjax's speculative decoding, round by round with the same acceptance lengths; export -> load is the identity, the
file is not taken for an EAGLE-1/2 head, and what specjax's head cannot represent is refused."""

import dataclasses
import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import HEADS, STORIES_PROMPT
from tolerance import assert_close, assert_far, forward_depth

from specjax import heads, published
from specjax.decoding import GenerateSpec, speculative_generate
from specjax.drafters import dflash_zlab
from specjax.drafters.dflash import DFlash, dflash_block, dflash_extend, draft_config
from specjax.drafting import registry
from specjax.errors import HeadsError
from specjax.models.llama import init_cache
from specjax.models.weights import CheckpointError
from specjax.sampling import Sampler
from specjax.training.losses import target_features

# the reference calls the transformers target with the argument transformers 5.24 renamed
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
LAYERS = [2, 0]  # two taps (fc [H, 2H], as an EAGLE-1/2 fc), out of order
B = 8
N_NEW = 64


@pytest.fixture(scope="module", autouse=True)
def zlab_layout():
    """The dflash head type with z-lab's published layout (registered here until dflash.py registers it), and torch
    on one thread (this small model's products ran 400 times slower on two threads of a busy 2-core machine)."""
    entry = registry.get("dflash")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        if entry.heads.published is None:
            layout = registry.Published(
                weights=("model.safetensors", "pytorch_model.bin"),
                tensors="fc + hidden_norm + layers.*.self_attn.q_norm",
                owns=dflash_zlab.owns,
                load=dflash_zlab.load_published_heads,
                files=dflash_zlab.published_files,
            )
            trained = dataclasses.replace(entry.heads, published=layout)
            mp.setitem(registry.DRAFTERS, "dflash", dataclasses.replace(entry, heads=trained))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(stories):
    """(dflash.model, the transformers stories260K in float32)."""
    from dflash import model as zlab
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(stories.path), dtype=torch.float32).eval()
    return zlab, target


def fresh_head(cfg, params, layers=LAYERS, attention=None):
    """(meta, graphdef, params) of a fresh head (`attention`: its own heads) whose matrices are scaled up and norms
    varied (drafts far from uniform)."""
    shape = {"layers": list(layers), "n_layers": 2, "block_size": B, "mask_token": 0}
    shape |= {"attention": attention} if attention else {}
    meta = heads.describe("dflash", shape, cfg)
    graphdef, p = heads.new_heads(meta, cfg, params, 1)
    vary = lambda x: 1 + 0.3 * jnp.sin(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
    return meta, graphdef, jax.tree.map(lambda x: 3 * x if x.ndim == 2 else x * vary(x), p)


@pytest.fixture(scope="module")
def exported(stories, tmp_path_factory):
    """(meta, graphdef, params, directory) of a fresh head and its export in z-lab's layout."""
    meta, graphdef, p = fresh_head(stories.cfg, stories.params)
    where = published.export_published(meta, p, tmp_path_factory.mktemp("zlab") / "head", stories.cfg)
    return meta, graphdef, p, where


def load_reference(zlab, where):
    return zlab.DFlashDraftModel.from_pretrained(str(where), dtype=torch.float32).eval()


@pytest.mark.parametrize("attention", [None, [4, 2, 16]])
def test_reference_drafts_the_same_logits(stories, reference, exported, tmp_path, attention):
    """Every block position's logits over a 12-token context: the reference (its transformers target's hidden
    states, its draft) against specjax's (`dflash_extend` + `dflash_block`), for a head with the target's attention
    heads and one with its own (which loads back as it was written); a head reading the taps in the other order
    misses them."""
    zlab, target = reference
    meta, graphdef, p, where = exported
    cfg = stories.cfg
    if attention:
        meta, graphdef, p = fresh_head(cfg, stories.params, attention=attention)
        where = published.export_published(meta, p, tmp_path / "head", cfg)
        loaded, _, q = published.load_published(where, "dflash", cfg, stories.params)
        assert loaded == meta
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), q, p)
    tokens = stories.tokenizer.encode("Once upon a time there was a little dog named")
    n = len(tokens) - 1
    block = [tokens[n]] + [meta["shape"]["mask_token"]] * (B - 1)

    model = load_reference(zlab, where)
    with torch.inference_mode():
        hidden = target(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
        context = zlab.extract_context_feature(hidden, model.target_layer_ids)
        noise = zlab._raw_input_embeddings(target, torch.tensor([block]))
        x = model(target_hidden=context, noise_embedding=noise, position_ids=torch.arange(n + B)[None])
        want = model.compute_logits(x, zlab._output_head(target))[0].numpy()

    def ours(layers):
        feats = target_features(
            cfg, stories.graphdef, stories.params, jnp.asarray([tokens[:n]]), tuple(layers)
        )
        m = heads.describe("dflash", {**meta["shape"], "layers": list(layers)}, cfg)
        dparams = heads.drafter_params(m, p, cfg, stories.params)
        cache = init_cache(draft_config(cfg, m["shape"]), 1, 32)
        taps = feats[..., : len(layers) * cfg.dim]
        cache = dflash_extend(graphdef, dparams, taps, jnp.arange(n)[None], cache).with_length(
            jnp.array([n])
        )
        return dflash_block(graphdef, dparams, jnp.asarray([block]), n + jnp.arange(B)[None], cache)[0][0]

    # two implementations of the target, then the fusion and its norm, then the draft
    depth = forward_depth(cfg.n_layers) + 2 + forward_depth(2)
    assert_close(ours(LAYERS), want, dtype=jnp.float32, depth=depth)
    assert_far(ours(LAYERS[::-1]), want, dtype=jnp.float32, depth=depth)


class Recording(DFlash):
    """A DFlash drafter that reports each round's accepted draft tokens and the row's token count after it."""

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        jax.debug.callback(_record, n_tokens_B, n_accepted_B, ordered=True)
        return super().commit(params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH)


ROUNDS: list = []


def _record(n_tokens, n_accepted):
    ROUNDS.append((int(n_tokens[0]), int(n_accepted[0])))


def generate_head(stories, where):
    """(meta, graphdef, params) of the committed head (`make heads`) without its confidence head (which reads the
    draft detached: the same drafts) and its Markov head (which z-lab's layout cannot hold: the block pass's own
    drafts), else of a fresh one, written to `where` in z-lab's layout. z-lab's id of the
    target's last layer reads transformers' final normed features, not that layer's output, which specjax taps:
    a head tapping it is written with other ids, and the reference reads its taps from the layers' outputs
    (forward hooks; for the other layers the same as `hidden_states[id + 1]`)."""
    cfg, committed = stories.cfg, HEADS / "stories260K_dflash"
    if committed.exists():
        meta, _, p = heads.load_heads(committed, cfg, stories.params)
        apart = ("confidence", "markov")
        meta = {**meta, "shape": {k: v for k, v in meta["shape"].items() if k not in apart}}
        p = {k: v for k, v in p.items() if k not in apart}
    else:
        meta, _, p = fresh_head(cfg, stories.params)
    shape = meta["shape"]
    written = {**meta, "shape": {**shape, "layers": list(range(len(shape["layers"])))}}
    last = max(shape["layers"]) == cfg.n_layers - 1
    published.export_published(written if last else meta, p, where, cfg)
    return (meta, heads.new_heads(meta, cfg, stories.params)[0], p), last


def test_reference_generates_the_same_rounds(stories, reference, tmp_path, monkeypatch):
    """Greedy, 64 new tokens after the README's prompt: the same tokens, and the same draft tokens accepted in every
    round whose block fits before the end (the reference drafts a shorter block there, specjax a full one whose
    acceptance is cut)."""
    zlab, target = reference
    cfg = stories.cfg
    (meta, graphdef, p), last = generate_head(stories, tmp_path / "head")
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # return_stats: torch.cuda.synchronize
    handles = []
    if last:
        outputs = {}
        for i in meta["shape"]["layers"]:
            hook = lambda module, args, out, i=i: outputs.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
            handles.append(target.model.layers[i].register_forward_hook(hook))
        read = lambda hidden, ids: torch.cat([outputs[i] for i in meta["shape"]["layers"]], -1)
        monkeypatch.setattr(zlab, "extract_context_feature", read)
    prompt = stories.tokenizer.encode(STORIES_PROMPT)
    try:
        model = load_reference(zlab, tmp_path / "head")
        got = zlab.dflash_generate(model, target, torch.tensor([prompt]), N_NEW, None, return_stats=True)
    finally:
        for handle in handles:
            handle.remove()
    ref_tokens = got.output_ids[0, len(prompt) :].tolist()

    block = meta["shape"]["block_size"]
    d = heads.make_drafter(meta, graphdef, cfg, block - 1, Sampler())
    d = Recording(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)})
    ROUNDS.clear()
    gen = speculative_generate(
        cfg,
        stories.graphdef,
        stories.params,
        d,
        heads.drafter_params(meta, p, cfg, stories.params),
        [prompt],
        GenerateSpec(N_NEW, eos_id=None),
    )
    assert np.asarray(gen.tokens)[0].tolist() == ref_tokens

    ours, emitted = [], 1  # (tokens emitted before the round, draft tokens accepted) of its full rounds
    for n_tokens, n_accepted in ROUNDS:
        if N_NEW - emitted >= block:
            ours.append((emitted, n_accepted))
        emitted = n_tokens - len(prompt)
    theirs, emitted = [], 1
    for produced in got.acceptance_lengths:
        if N_NEW - emitted >= block:
            theirs.append((emitted, produced - 1))
        emitted += produced
    assert ours == theirs and len(ours) >= (N_NEW - block) // block
    if (
        HEADS / "stories260K_dflash"
    ).exists():  # not vacuous: rounds that accepted one draft token and several
        accepted = {min(n, 2) for _, n in ours}
        assert {1, 2} <= accepted, ours


def test_export_then_load_is_the_identity(stories, exported):
    meta, _, p, where = exported
    t = published.read_tensors(where / "model.safetensors")
    assert published.kind_of(t) == "dflash"  # not an EAGLE-1/2 head (fc [H, 2H]: two taps)
    assert registry.trained("eagle").published.owns(t) is False
    loaded, _, q = published.load_published(where, "dflash", stories.cfg, stories.params)
    assert loaded == meta
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), q, p)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"output_multiplier": 2.0}, "sets output_multiplier=2.0"),
        ({"dflash_config": {"input_embedding_scale": 8.0}}, "sets input_embedding_scale=8.0"),
        ({"final_logit_softcapping": 30.0}, "sets final_logit_softcapping=30.0"),
        ({"is_causal": True}, "sets is_causal=true"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window draft layers"),
        ({"conv_kernel_size": 4, "architectures": ["DFlash2DraftModel"]}, "is a DFlash2 head"),
        ({"dflash_config": {"target_layer_ids": [4, 0]}}, "final normed features"),
        ({"num_target_layers": 6}, "target layers \\(num_target_layers\\) 6"),
        ({"rms_norm_eps": 1e-6}, "norm_eps"),
    ],
)
def test_what_the_head_cannot_hold_is_refused(stories, exported, tmp_path, change, message):
    _, _, _, where = exported
    head = tmp_path / "head"
    shutil.copytree(where, head)
    config = json.loads((head / "config.json").read_text())
    config |= {k: config.get(k, {}) | v if k == "dflash_config" else v for k, v in change.items()}
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as err:
        published.load_published(head, "dflash", stories.cfg, stories.params)
    assert "\n" not in str(err.value)


def test_a_head_with_a_markov_head_is_not_exported(stories, tmp_path):
    meta, _, p = fresh_head(stories.cfg, stories.params)
    with pytest.raises(HeadsError, match="Markov head"):
        published.export_published(
            meta | {"shape": meta["shape"] | {"markov": 4}}, p, tmp_path / "head", stories.cfg
        )
    assert not (tmp_path / "head").exists()


def test_a_head_tapping_the_last_layer_is_not_exported(stories, tmp_path):
    meta, _, p = fresh_head(stories.cfg, stories.params, layers=[0, stories.cfg.n_layers - 1])
    with pytest.raises(HeadsError, match="final normed features"):
        published.export_published(meta, p, tmp_path / "head", stories.cfg)
