"""Suffix decoding with a fallback (`--drafter=hybrid`, SuffixDecoding's hybrid with EAGLE): each round, each row
drafts the suffix store's chain where the store expects more of its tokens accepted than the fallback drafter
(`--fallback`: EAGLE-3 by default, a draft model, ...) has been getting, and the fallback's chain elsewhere.

The store's expectation is `specjax.drafters.suffix.expected_accepted` (read from its most-frequent paths) times a
moving average, over the row's rounds the store drafted, of the tokens accepted over the tokens it expected
(starting at `prior`: 1 for greedy decoding; under sampling 0.3, as the frequencies of matches seen once or twice
promise more than the target accepts: on stories260K's rollouts at T = 0.7-1 the store's rounds got 0.12-0.24 of the
tokens they expected); the fallback's is a moving average of the draft tokens accepted in the row's rounds it
drafted, starting at `threshold`. Neither reads a token drafted this round, so each row's draft is drawn from the
distribution its q states and every acceptance rule stays exact. The fallback drafts every round (its state follows
the committed tokens whichever draft they came from), except in a round where every row drafts from the store: a
fallback that can (EAGLE's `catch_up`) then only re-reads the last round. A round costs its draft, the store's lookup
and one verification.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.suffix import Suffix, SuffixSettings
from specjax.drafting import registry
from specjax.drafting.layouts import ChainLayout, Draft
from specjax.drafting.protocol import feature_taps
from specjax.drafting.trees import Chain
from specjax.errors import DrafterError


@struct.dataclass
class HybridState:
    fallback: object
    fallback_accepted: jax.Array  # [B] moving average of the draft tokens accepted in the fallback's rounds
    store_calibration: jax.Array  # [B] moving average of accepted / expected tokens in the store's rounds
    expected: jax.Array  # [B] the tokens the store expected this round (0: the fallback drafted it)


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Drafter: the store's chain (`suffix`) where it expects more accepted tokens (calibrated by its own record)
    than `fallback`'s chain of the same K has had lately (moving averages with weight `decay` per round; the
    fallback's from `threshold`), else the fallback's.
    Params: `{"suffix": the store, "fallback": the fallback's params}`."""

    suffix: Suffix
    fallback: object
    threshold: float = 2.0
    decay: float = 0.8
    prior: float = 1.0  # the store's calibration before its first round

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
        if not (self.threshold > 0 and 0 <= self.decay < 1 and self.prior > 0):
            raise DrafterError(
                f"suffix hybrid threshold={self.threshold}, decay={self.decay}, prior={self.prior}; pass "
                "threshold > 0, 0 <= decay < 1 and prior > 0"
            )

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
        rows = lengths_B.shape
        return HybridState(  # the suffix drafter keeps no state
            self.fallback.init(params["fallback"], tokens_BP, lengths_B, cache_size, feats_BPH),
            jnp.full(rows, self.threshold, jnp.float32),
            jnp.full(rows, self.prior, jnp.float32),
            jnp.zeros(rows, jnp.float32),
        )

    def propose(self, params, state: HybridState, seq_BS, n_tokens_B, key):
        key_suffix, key_fallback = jax.random.split(key)
        stored, expected_B = self.suffix.scored(params["suffix"], seq_BS, n_tokens_B, key_suffix)
        use_B = state.store_calibration * expected_B > state.fallback_accepted
        fallback = lambda: self.fallback.propose(
            params["fallback"], state.fallback, seq_BS, n_tokens_B, key_fallback
        )
        # where every row drafts from the store, a fallback that can catch up only does so (it drafts nothing)
        if hasattr(self.fallback, "catch_up"):

            def caught_up():
                unused = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fallback)[0])
                return unused, self.fallback.catch_up(
                    params["fallback"], state.fallback, seq_BS, n_tokens_B
                )

            drawn, fallback_state = jax.lax.cond(jnp.all(use_B), caught_up, fallback)
        else:
            drawn, fallback_state = fallback()
        tokens = jnp.where(use_B[:, None], stored.tokens, drawn.tokens)
        q = None
        if stored.q_probs is not None or drawn.q_probs is not None:
            as_q = lambda d: (
                jax.nn.one_hot(d.tokens, self.suffix.vocab_size) if d.q_probs is None else d.q_probs
            )
            q = jnp.where(use_B[:, None, None], as_q(stored), as_q(drawn))
        draft = Draft(tokens, q, ChainLayout(self.suffix.k))
        return draft, state.replace(fallback=fallback_state, expected=jnp.where(use_B, expected_B, 0.0))

    def commit(self, params, state: HybridState, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        fallback = self.fallback.commit(
            params["fallback"], state.fallback, n_accepted_B, n_tokens_B, path_BD, feats_BDH
        )
        n = n_accepted_B.astype(jnp.float32)
        from_store = state.expected > 0
        mix = lambda old, new: self.decay * old + (1 - self.decay) * new
        ratio = n / jnp.maximum(state.expected, 1e-6)
        calibration = jnp.where(from_store, mix(state.store_calibration, ratio), state.store_calibration)
        accepted = jnp.where(from_store, state.fallback_accepted, mix(state.fallback_accepted, n))
        return state.replace(fallback=fallback, fallback_accepted=accepted, store_calibration=calibration)

    def absorb(self, params, sequences) -> dict:
        """The params with the finished `sequences` added to the store (`Suffix.absorb`)."""
        return {**params, "suffix": self.suffix.absorb(params["suffix"], sequences)}


@dataclasses.dataclass(frozen=True)
class HybridSettings(SuffixSettings):
    """The suffix drafter's settings, the fallback drafter (its own settings, e.g. `heads`, are the flags of the same
    names) and the threshold."""

    fallback: str = "eagle3"
    fallback_threshold: float = 2.0
    sampled_store_prior: float = 0.3
    heads: str | None = None
    HELP = SuffixSettings.HELP | dict(
        fallback="hybrid drafter: the registered drafter that drafts where the suffix store expects too little.",
        fallback_threshold="hybrid drafter: the fallback's accepted draft tokens per round assumed before it "
        "has drafted (a row drafts from the store where the store expects more).",
        sampled_store_prior="hybrid drafter, sampling: the share of the tokens the store's frequencies promise "
        "that it is assumed to get accepted before it has drafted (greedy: 1).",
    )


def build(target, settings: HybridSettings, k: int, tree, sampler):
    if tree is not None:
        raise DrafterError("the hybrid drafter drafts chains; drop --tree")
    if settings.fallback in ("suffix", "hybrid"):
        raise DrafterError(
            f"--fallback={settings.fallback} is the store itself; name another drafter, e.g. eagle3"
        )
    # each part's settings: the fields of its settings class that the hybrid's settings carry
    part = lambda kind: kind(
        **{f.name: getattr(settings, f.name) for f in dataclasses.fields(kind) if hasattr(settings, f.name)}
    )
    suffix, store = registry.get("suffix").build(target, part(SuffixSettings), k, None, sampler)
    entry = registry.get(settings.fallback)
    fallback, fparams = entry.build(target, part(entry.settings), k, None, sampler)
    prior = 1.0 if sampler.greedy else settings.sampled_store_prior
    drafter = Hybrid(suffix, fallback, settings.fallback_threshold, prior=prior)
    return drafter, {"suffix": store, "fallback": fparams}


def example(target, k: int, tree, sampler):
    """The store of `Suffix`'s example (its q from counts, where the suffix drafter's own example has the target's
    distributions) with a fresh EAGLE-3 head as fallback (exactness checks)."""
    suffix, store = registry.get("suffix").example(target, k, None, sampler, distributions=0)
    fallback, fparams = registry.get("eagle3").example(target, k, None, sampler)
    return Hybrid(suffix, fallback, threshold=1.0), {"suffix": store, "fallback": fparams}


registry.register(
    registry.Entry("hybrid", HybridSettings, build, help=HybridSettings.HELP, example=example)
)
