"""A trained head type defined here, in one module with one registration (`heads.register`), is found by the
trainer's loss, expands with the target (`specjax.expand`), exports to and loads from its published layout
(`specjax.published`) and is built by the drafter registry, with no other module edited; without the registration
each of them refuses it."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET
from tolerance import approx

from specjax import heads, published
from specjax.drafting import registry
from specjax.drafting.protocol import target_io, target_signature
from specjax.expand import Expansion, expand_heads
from specjax.training import losses, trainer

V, D = TINY.vocab_size, TINY.dim
EXPANSION = Expansion(dim=2 * D, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, hidden_dim=128)


@dataclasses.dataclass(frozen=True)
class ToySettings:
    temperature: float = 2.0
    RULES = {}


@dataclasses.dataclass(frozen=True)
class ToyDrafter:  # what the registry's builder returns; decoding with it is not the point here
    k: int
    shape: tuple


def toy_logits(params, feats_BTH):
    """The toy head: the target's LM head over the feature scaled per dim, plus a bias per token."""
    return jnp.einsum("bth,vh->btv", feats_BTH * params["scale"], params["unembed"]) + params["bias"]


def toy_loss(graphdef, cfg, params, feats, tokens, mask, key, h):
    logits = toy_logits(params, feats[:, :-1]) / h.temperature
    loss = losses.masked_mean(losses.cross_entropy(logits, tokens[:, 1:]), mask[:, 1:])
    return loss, {"loss": loss}


def load_toy(config, tensors, where, cfg, target_params):
    meta = heads.describe("toy", {}, cfg)
    graphdef, fresh = heads.new_heads(meta, cfg, target_params)
    get = published.getter(tensors, where)
    return (
        meta,
        graphdef,
        published.fill(fresh, {"bias": get("toy.bias", (V,)), "scale": get("toy.scale", (D,))}),
    )


TOY = registry.TrainedHeads(
    settings=ToySettings,
    init=lambda shape, cfg, target_params, seed: (
        None,
        {"bias": jax.random.normal(jax.random.key(seed), (cfg.vocab_size,)), "scale": jnp.ones(cfg.dim)},
    ),
    drafter_params=lambda shape, params, cfg, target_params: params | target_io(cfg, target_params),
    drafter=lambda shape, graphdef, cfg, k, sampler, tree: ToyDrafter(k, tuple(shape)),
    loss=toy_loss,
    shape_of=lambda h, cfg, tokens: {},
    expand=lambda shape, p, ex, expansion, cfg: (
        {**p, "scale": ex.pad(p["scale"], (expansion.dim,))},
        shape,
    ),
    published=registry.Published(
        weights=("toy_head.safetensors",),
        tensors="toy.*",
        owns=lambda t: "toy.bias" in t,
        load=load_toy,
        files=lambda meta, p, cfg, base: (
            {"toy.bias": p["bias"], "toy.scale": p["scale"]},
            {"vocab_size": V},
        ),
    ),
)


@pytest.fixture
def toy(monkeypatch):
    registry.names()  # the built-in drafters first, then a private copy of the registry for this test
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))
    heads.register("toy", TOY)  # the one registration
    return registry.DRAFTERS


def test_a_head_type_registered_once_trains_expands_exports_and_builds(toy, tmp_path):
    assert "toy" in registry.head_methods()
    meta = heads.describe("toy", {}, TINY)
    graphdef, params = heads.new_heads(meta, TINY, TARGET[1], seed=3)

    # the trainer's loss finds the head type's loss and its drafter params
    tokens = jnp.asarray([[1, 5, 9, 2, 7], [1, 40, 41, 42, 3]])
    mask = jnp.asarray([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    config = types.SimpleNamespace(heads=ToySettings())
    feats = jax.random.normal(jax.random.key(0), (2, 5, D))  # as a feature store holds them
    loss, _ = trainer.loss_fn(meta, config, graphdef, (TINY, *TARGET))(
        params, TARGET[1], tokens, mask, feats, None
    )
    logits = np.asarray(toy_logits(params | target_io(TINY, TARGET[1]), feats)[:, :-1] / 2.0, np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    expected = (nll * np.asarray(mask)[:, 1:]).sum() / np.asarray(mask)[:, 1:].sum()
    # halving, the log-softmax (max, exp, sum, log) and the masked mean
    assert float(loss) == approx(expected, dtype=jnp.float32, depth=6)

    # expansion: the head type's own rule, the meta follows the wide target
    wide = EXPANSION.config(TINY)
    meta2, _, params2 = expand_heads(meta, params, TINY, wide, None, EXPANSION)
    assert meta2 == {"method": "toy", "shape": {}, "target": target_signature(wide)}
    np.testing.assert_array_equal(params2["scale"], np.r_[np.ones(D), np.zeros(D)])
    np.testing.assert_array_equal(params2["bias"], params["bias"])

    # its published layout: exported, found by its tensor names, loaded back, built by the registry's builder
    out = published.export_published(meta, params, tmp_path / "toy", TINY)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "specjax_export.json",
        "toy_head.safetensors",
    ]
    assert published.kind_of(published.read_tensors(out / "toy_head.safetensors")) == "toy"
    meta3, _, params3 = published.load_published(out, "toy", TINY, TARGET[1])
    assert meta3 == meta
    jax.tree.map(np.testing.assert_array_equal, params3, params)
    target = types.SimpleNamespace(cfg=TINY, params=TARGET[1])
    drafter, dparams = registry.get("toy").build(target, heads.HeadsSettings(heads=str(out)), 3, None, None)
    assert drafter == ToyDrafter(3, ())
    np.testing.assert_array_equal(dparams["unembed"], target_io(TINY, TARGET[1])["unembed"])

    # negative control: the same calls without the registration
    del toy["toy"]
    with pytest.raises(ValueError, match="'toy' is not a drafter with trained heads"):
        heads.describe("toy", {}, TINY)
    with pytest.raises(
        ValueError, match="cannot expand heads of method 'toy'; expandable: dflash, eagle, eagle3, medusa"
    ):
        expand_heads(meta, params, TINY, wide, None, EXPANSION)
    with pytest.raises(ValueError, match="unknown published head method 'toy'"):
        published.load_published(out, "toy", TINY, TARGET[1])
    assert published.kind_of(published.read_tensors(out / "toy_head.safetensors")) is None
