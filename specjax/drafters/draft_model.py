"""A separate (smaller) Llama-family model that drafts autoregressively with its own KV cache."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from specjax.decoding.prefill import prefill
from specjax.drafting import registry
from specjax.drafting.protocol import KOrTree
from specjax.drafting.trees import DynamicTree, Tree
from specjax.errors import DrafterError
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward
from specjax.models.loading import load_model
from specjax.models.weights import build_params
from specjax.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class DraftModel(KOrTree):
    """Drafts with `sampler` (pass the target's, so p and q are warped alike); greedy drafts are
    deterministic proposals (`q_probs=None`)."""

    cfg: LlamaConfig
    graphdef: object
    k: int
    sampler: Sampler = Sampler()
    tree: Tree | DynamicTree | None = None  # propose this tree (top-k children per node) instead of a chain

    def validate(self, target_cfg: LlamaConfig) -> None:
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise DrafterError(
                f"draft model vocabulary ({self.cfg.vocab_size}) differs from the target's "
                f"({target_cfg.vocab_size}): the drafter must share the target's tokenizer"
            )

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        return prefill(self.cfg, self.graphdef, params, tokens_BP, lengths_B, cache_size)[1]

    def _step(self, params):
        def step(cache, tokens_BT, positions_BT, mask_BTW, ctx):
            logits, _, cache = forward(self.graphdef, params, tokens_BT, positions_BT, cache, mask_BTW)
            return logits, None, cache

        return step

    def propose(self, params, cache, seq_BS, n_tokens_B, key):
        # Re-read what the cache may lack, up to the pending token (`shape.reread` tokens). A chain's or a
        # static tree's cache lacks at most the last accepted draft token (never fed), so two tokens always
        # suffice; re-reading a token the cache holds rewrites its keys/values. Branch-free on purpose:
        # choosing 1 or 2 tokens with `lax.cond` made XLA copy the whole draft cache into and out of the
        # branch every round. A dynamic tree's cache keeps nothing of the tree.
        logits, cache = self._feed(params, cache, seq_BS, n_tokens_B, self.shape.reread)
        return self.shape.search(self._step(params), self.sampler, logits, None, n_tokens_B, cache, key)

    def _feed(self, params, cache, seq_BS, n_tokens_B, t: int):
        """Re-reads the last `t` tokens of each row (the pending one last): (its logits [B, V], cache)."""
        start = jnp.maximum(n_tokens_B - t, 0)
        positions = start[:, None] + jnp.arange(t)[None]
        tokens = jnp.take_along_axis(seq_BS, positions, axis=1)
        logits, _, cache = forward(
            self.graphdef, params, tokens, positions, cache.with_length(start), causal_mask(t)
        )
        last = jnp.take_along_axis(logits, (n_tokens_B - 1 - start)[:, None, None], axis=1)[:, 0]
        return last, cache.with_length(n_tokens_B)

    def commit(self, params, cache, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return self.shape.keep_path(cache, path_BD, n_accepted_B)


def truncated_target(cfg: LlamaConfig, params, n_layers: int, layers: tuple[int, ...] = ()):
    """(cfg, graphdef, params) of the target's first `n_layers` blocks (or of its `layers`, in order) with its
    embedding, final norm and head: a draft model that needs no training."""
    if not 1 <= n_layers <= cfg.n_layers:
        raise DrafterError(f"a truncated draft needs 1..{cfg.n_layers} layers, got {n_layers}")
    layers = layers or tuple(range(n_layers))
    pure = nnx.to_pure_dict(params)
    pure["layers"] = {i: pure["layers"][layer] for i, layer in enumerate(layers)}
    small = cfg.select_layers(layers)
    return (small, *build_params(small, pure))


@dataclasses.dataclass(frozen=True)
class DraftModelSettings:
    draft_model: str | None = None
    draft_layers: int = 1
    HELP = {
        "draft_model": "Draft model path or name (default: the target truncated to --draft_layers).",
        "draft_layers": "Layers of the truncated-target draft when --draft_model is not given.",
    }


def build(target, settings: DraftModelSettings, k: int, tree, sampler):
    """(DraftModel, its params): a model loaded from `settings.draft_model`, else the truncated target."""
    if settings.draft_model:
        draft = load_model(settings.draft_model, target.cfg.dtype)
        return DraftModel(draft.cfg, draft.graphdef, k, sampler, tree), draft.params
    cfg, graphdef, params = truncated_target(target.cfg, target.params, settings.draft_layers)
    return DraftModel(cfg, graphdef, k, sampler, tree), params


registry.register(registry.Entry("draft_model", DraftModelSettings, build, help=DraftModelSettings.HELP))
