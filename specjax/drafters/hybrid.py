"""Suffix decoding with a fallback (SuffixDecoding's hybrid with EAGLE): each round, each row drafts the suffix
store's chain where the store expects at least `threshold` of its tokens accepted, and the fallback drafter's
chain (EAGLE-3, a draft model, ...) elsewhere.

The choice reads only the store's most-frequent paths (`Suffix.scored`), never a token the fallback sampled nor
the target, so each row's draft is drawn from the distribution its q states and every acceptance rule stays exact.
The fallback drafts every round (its state follows the committed tokens whichever draft they came from), so a
round costs the fallback's draft, the store's lookup and one verification.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.suffix import Suffix
from specjax.drafting.layouts import ChainLayout, Draft
from specjax.drafting.protocol import feature_taps
from specjax.drafting.trees import Chain
from specjax.errors import DrafterError


@struct.dataclass
class HybridState:
    suffix: object
    fallback: object
    suffix_rounds: jax.Array  # [B] rounds whose draft came from the store


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Drafter: the store's chain (`suffix`) where it expects >= `threshold` accepted tokens, else `fallback`'s
    chain of the same K. Params: `{"suffix": the store, "fallback": the fallback's params}`."""

    suffix: Suffix
    fallback: object
    threshold: float = 2.0

    def __post_init__(self):
        k = self.suffix.k
        if self.suffix.nodes or self.fallback.shape != Chain(k):
            raise DrafterError(
                f"the suffix hybrid drafts chains of one K: got the store's {self.suffix.shape.describe()} and "
                f"the fallback's {self.fallback.shape.describe()}; give both chains of K={k}"
            )
        if getattr(self.fallback, "reads_target_cache", False):
            raise DrafterError(
                "the suffix hybrid cannot fall back on a drafter that reads the target's cache"
            )
        if not self.threshold > 0:
            raise DrafterError(f"suffix hybrid threshold={self.threshold}; pass expected tokens > 0")

    @property
    def shape(self):
        return Chain(self.suffix.k)

    @property
    def feature_taps(self) -> tuple[int, ...]:
        return feature_taps(self.fallback)

    def validate(self, target_cfg) -> None:
        self.suffix.validate(target_cfg)
        self.fallback.validate(target_cfg)

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH):
        return HybridState(
            self.suffix.init(params["suffix"], tokens_BP, lengths_B, cache_size, feats_BPH),
            self.fallback.init(params["fallback"], tokens_BP, lengths_B, cache_size, feats_BPH),
            jnp.zeros(lengths_B.shape, jnp.int32),
        )

    def propose(self, params, state: HybridState, seq_BS, n_tokens_B, key):
        key_suffix, key_fallback = jax.random.split(key)
        stored, expected_B = self.suffix.scored(params["suffix"], seq_BS, n_tokens_B, key_suffix)
        drawn, fallback_state = self.fallback.propose(
            params["fallback"], state.fallback, seq_BS, n_tokens_B, key_fallback
        )
        use_B = expected_B >= self.threshold
        tokens = jnp.where(use_B[:, None], stored.tokens, drawn.tokens)
        q = None
        if stored.q_probs is not None or drawn.q_probs is not None:
            as_q = lambda d: (
                jax.nn.one_hot(d.tokens, self.suffix.vocab_size) if d.q_probs is None else d.q_probs
            )
            q = jnp.where(use_B[:, None, None], as_q(stored), as_q(drawn))
        draft = Draft(tokens, q, ChainLayout(self.suffix.k))
        return draft, HybridState(state.suffix, fallback_state, state.suffix_rounds + use_B)

    def commit(self, params, state: HybridState, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        fallback = self.fallback.commit(
            params["fallback"], state.fallback, n_accepted_B, n_tokens_B, path_BD, feats_BDH
        )
        return state.replace(fallback=fallback)

    def absorb(self, params, sequences) -> dict:
        """The params with the finished `sequences` added to the store (`Suffix.absorb`)."""
        return {**params, "suffix": self.suffix.absorb(params["suffix"], sequences)}
