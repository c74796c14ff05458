"""The function-preserving expansion (`specjax.expand`): the expanded target computes stories260K's
logits, decodes the same tokens, and its expanded heads draft the same tokens (the memory-bound benchmark's smoke
mode runs in test_tables)."""

import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import approx, assert_close, forward_depth

from specjax import expand
from specjax.models.llama import causal_mask, forward, init_cache

PROMPTS = ["Once upon a time, there was a dog named", "Lily wanted to", "Tom and his dog went to the park"]
E = expand.SMOKE  # extra heads, head_dim x 2, extra units, inserted layers: every part of the mapping


@pytest.fixture(scope="module")
def expanded(stories):
    return expand.expand(stories.cfg, stories.params, E)


def prompt_batch(stories):
    ids = [stories.tokenizer.encode(p) for p in PROMPTS]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    return jnp.asarray(tokens), [len(p) for p in ids]


def all_logits(cfg, graphdef, params, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, hidden, _ = forward(graphdef, params, tokens, positions, init_cache(cfg, b, 64), causal_mask(t))
    return logits, hidden.final


def test_expansion_shape_and_defaults(stories, expanded):
    cfg = expanded[0]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (128, 7, 16, 8, 16)
    assert cfg.norm_eps == approx(stories.cfg.norm_eps * stories.cfg.dim / 128, dtype=np.float64, depth=2)
    big = expand.Expansion().config(stories.cfg)  # the benchmark's default: memory-bound, 32 layers
    assert expand.weight_bytes(big) >= 8 * 32 * 2**20  # >= 8x the 32 MiB L3 it was chosen for
    per_layer = (big.num_params - big.vocab_size * big.dim - big.dim) / big.n_layers
    assert per_layer * 16 <= big.num_params
    assert expand.Expansion().original_layers(5) == (0, 6, 12, 19, 25)
    with pytest.raises(ValueError, match="n_layers=4 < the model's 5"):
        expand.Expansion(n_layers=4).config(stories.cfg)
    with pytest.raises(ValueError, match="not a multiple"):
        expand.Expansion(head_dim=12).config(stories.cfg)


def test_expanded_logits_equal_stories260k(stories, expanded):
    tokens, lengths = prompt_batch(stories)
    ref, ref_feats = all_logits(stories.cfg, stories.graphdef, stories.params, tokens)
    out, feats = all_logits(*expanded, tokens)
    depth = forward_depth(
        expanded[0].n_layers
    )  # float32 sums over padded and inserted terms in another order
    for row, n in enumerate(lengths):  # ragged: compare each row's real tokens
        assert_close(out[row, :n], ref[row, :n], dtype=jnp.float32, depth=depth)
        assert_close(
            feats[row, :n, : stories.cfg.dim], ref_feats[row, :n], dtype=jnp.float32, depth=depth - 1
        )
        assert (
            float(jnp.abs(feats[row, :n, stories.cfg.dim :]).max()) == 0.0
        )  # extra dims stay exactly zero


def test_truncated_original_is_stories260k_truncated(stories, expanded):
    from specjax.drafters.draft_model import truncated_target

    tokens, lengths = prompt_batch(stories)
    ref, _ = all_logits(*truncated_target(stories.cfg, stories.params, 2), tokens)
    out, _ = all_logits(*expand.truncated_original(*expanded[::2], E, stories.cfg.n_layers, 2), tokens)
    for row, n in enumerate(lengths):
        assert_close(out[row, :n], ref[row, :n], dtype=jnp.float32, depth=forward_depth(2))
    with pytest.raises(ValueError, match="is the target itself"):
        expand.truncated_original(*expanded[::2], E, stories.cfg.n_layers, stories.cfg.n_layers)


def test_expanded_heads_give_the_same_drafts(stories, expanded, trained_heads):
    from specjax.drafters.eagle import eagle_apply
    from specjax.drafters.medusa import medusa_logits
    from specjax.drafting.protocol import target_io

    tokens, lengths = prompt_batch(stories)
    _, feats = all_logits(stories.cfg, stories.graphdef, stories.params, tokens)
    _, big_feats = all_logits(*expanded, tokens)
    cfg, _, params = expanded

    meta, graphdef, hparams = trained_heads["medusa"]
    meta2, graphdef2, hparams2 = expand.expand_heads(meta, hparams, stories.cfg, cfg, params, E)
    assert meta2["target"]["dim"] == cfg.dim and meta2["shape"] == meta["shape"]
    ref = medusa_logits(graphdef, hparams, feats)
    out = medusa_logits(graphdef2, hparams2, big_feats)
    assert_close(out, ref, dtype=jnp.float32, depth=forward_depth(expanded[0].n_layers) + 2)  # + the heads
    for row, n in enumerate(lengths):  # the heads' top-3 candidates, as a tree drafts them
        np.testing.assert_array_equal(
            jnp.argsort(-out[row, :n], axis=-1)[..., :3], jnp.argsort(-ref[row, :n], axis=-1)[..., :3]
        )

    meta, graphdef, hparams = trained_heads["eagle"]
    meta2, graphdef2, hparams2 = expand.expand_heads(meta, hparams, stories.cfg, cfg, params, E)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def eagle_logits(layer_cfg, graphdef, p, target_cfg, target_params, f):
        io = {"head": p, **target_io(target_cfg, target_params)}
        cache = init_cache(layer_cfg, b, 64)
        return eagle_apply(graphdef, io, tokens, f, positions, cache, causal_mask(t))[0]

    ref = eagle_logits(
        stories.cfg.replace(n_layers=1), graphdef, hparams, stories.cfg, stories.params, feats
    )
    out = eagle_logits(cfg.replace(n_layers=1), graphdef2, hparams2, cfg, params, big_feats)
    for row, n in enumerate(lengths):  # the target's features, then one decoder layer and the LM head
        assert_close(
            out[row, :n], ref[row, :n], dtype=jnp.float32, depth=forward_depth(expanded[0].n_layers + 1)
        )


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_expanded_eagle_accepts_like_the_original(stories, expanded, trained_heads, method):
    """End to end: greedy EAGLE and EAGLE-3 chains on stories260K and on its expansion accept the same drafts
    (EAGLE-3's tapped layers move to where the original layers went)."""
    from specjax import heads
    from specjax.decoding import GenerateSpec, speculative_generate

    prompts = [stories.tokenizer.encode(p) for p in PROMPTS[:2]]
    spec = GenerateSpec(24, eos_id=None)
    if method == "eagle":
        meta, graphdef, hparams = trained_heads["eagle"]
    else:
        meta, graphdef, hparams = heads.load_heads(
            heads.COMMITTED / "stories260K_eagle3", stories.cfg, stories.params
        )
    big = expand.expand_heads(meta, hparams, stories.cfg, expanded[0], expanded[2], E)
    runs = []
    for (cfg, g, p), (m, hg, hp) in (
        ((stories.cfg, stories.graphdef, stories.params), (meta, graphdef, hparams)),
        (expanded, big),
    ):
        drafter = heads.make_drafter(m, hg, cfg, 3, spec.sampler)
        runs.append(
            speculative_generate(cfg, g, p, drafter, heads.drafter_params(m, hp, cfg, p), prompts, spec)
        )
    np.testing.assert_array_equal(runs[1].tokens, runs[0].tokens)
    np.testing.assert_array_equal(runs[1].stats.accepted_hist, runs[0].stats.accepted_hist)
    assert int(runs[0].stats.accepted_hist[1:].sum()) > 0  # the drafts were accepted, not only rejected
