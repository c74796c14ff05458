"""N-gram prompt lookup (prompt-lookup decoding, vLLM's `ngram`): the draft is what followed the last n tokens
the previous time they occurred in the prompt or the text generated so far. No weights, no state: the
matching runs on the loop's fixed-capacity sequence buffer with static shapes, one vectorised comparison
per n-gram position, batched over ragged rows.

The rule, per row with `L` tokens `x[0..L-1]` (`x[L-1]` is the pending token):

- a *match* of length n ends at i <= L - 2 when `x[i-n+1..i] == x[L-n..L-1]` (they may overlap);
- each i scores its longest match length n(i) within [min_ngram, max_ngram]; candidates rank by n(i),
  then recency (larger i first): the longest n that matches anywhere, its most recent match;
- the proposal after a match at i is the K tokens `x[i + 1 + (j mod p)]`, j = 0..K-1, p = L - 1 - i: what
  followed the match, continued periodically where it would run past the row's end (the suffix repeats
  with period p, so the guess is that the pattern goes on); nothing past `x[L-1]` is ever read;
- no match: the pending token repeated K times (the same formula at i = L - 2).

The tree variant (`branches` > 1) proposes the continuations of the `branches` best-ranked matches whose
K tokens differ (the first of each distinct continuation), each a chain of depth K under the root;
missing branches repeat the pending token. Proposals are deterministic (`q_probs=None`): exact with any
sampler.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax.numpy as jnp

from specjax.drafting import registry
from specjax.drafting.layouts import Draft
from specjax.drafting.trees import Chain, Tree
from specjax.errors import NGramError


def branch_tree(branches: int, k: int) -> Tree:
    """`branches` chains of depth `k` under the root: branch r's first node is the root's r-th candidate."""
    return Tree(tuple((r,) + (0,) * d for r in range(branches) for d in range(k)))


def ngram_candidates(seq_BS, n_tokens_B, k: int, min_ngram: int, max_ngram: int, branches: int = 1):
    """Continuations of the best-ranked distinct matches of each row's suffix (see the module docstring).

    `seq_BS` [B, S] holds each row's tokens in `[0, n_tokens_B[b])`; what lies beyond is never read.
    Returns (tokens [B, branches, k] int32, found [B, branches] bool: False where a branch had no match and
    holds the pending token repeated)."""
    batch, size = seq_BS.shape
    seq = seq_BS.astype(jnp.int32)
    length = n_tokens_B.astype(jnp.int32)[:, None]  # [B, 1]
    i = jnp.arange(size, dtype=jnp.int32)[None]  # [1, S] candidate match ends

    # run[b, i] = longest m <= max_ngram with x[i-m'] == x[L-1-m'] for all m' < m (reads stay in [0, L-1])
    suffix = jnp.take_along_axis(seq, jnp.maximum(length - 1 - jnp.arange(max_ngram)[None], 0), axis=1)
    run = jnp.zeros((batch, size), jnp.int32)
    still = i <= length - 2  # a match ends strictly before the pending token
    for m in range(max_ngram):
        shifted = jnp.pad(seq, ((0, 0), (m, 0)))[:, :size]  # shifted[:, i] = x[i - m]
        still = still & (i >= m) & (length - 1 - m >= 0) & (shifted == suffix[:, m : m + 1])
        run = run + still
    score = jnp.where(run >= min_ngram, run * size + i, -1)  # longest first, then most recent

    def continuation(end_BX):  # [B, X] match ends -> [B, X, k] tokens x[i + 1 + (j mod p)], all in [0, L-1]
        end = jnp.minimum(end_BX, length - 2)[..., None]  # i = L - 2 (or -1 when L = 1): the pending token
        pos = end + 1 + jnp.arange(k)[None, None] % jnp.maximum(length[..., None] - 1 - end, 1)
        return jnp.take_along_axis(seq, pos.reshape(batch, -1), axis=1).reshape(pos.shape)

    no_match = jnp.broadcast_to(length - 2, (batch, 1))
    if (
        branches == 1
    ):  # scores are distinct: the best one's position is the max mod S (no argmax, no gather)
        top = jnp.max(score, axis=1, keepdims=True)
        found = top >= 0
        return continuation(jnp.where(found, top % size, no_match)), found

    every = continuation(jnp.broadcast_to(i, (batch, size)))  # [B, S, k]
    fallback = continuation(no_match)[:, 0]
    tokens, found = [], []
    for _ in range(branches):
        top = jnp.max(score, axis=1)
        best, hit = top % size, top >= 0
        chosen = jnp.take_along_axis(every, best[:, None, None], axis=1)[:, 0]  # [B, k]
        score = jnp.where(jnp.all(every == chosen[:, None], axis=2), -1, score)  # drop its duplicates
        tokens.append(jnp.where(hit[:, None], chosen, fallback))
        found.append(hit)
    return jnp.stack(tokens, axis=1), jnp.stack(found, axis=1)


@dataclasses.dataclass(frozen=True)
class NGram:
    """Prompt-lookup drafter: K tokens after the most recent match of the last n tokens, n from `max_ngram`
    down to `min_ngram`; `branches` > 1 proposes the continuations of that many distinct matches as a tree
    (`branch_tree`). No params (pass None) and no state."""

    k: int
    min_ngram: int = 1
    max_ngram: int = 3
    branches: int = 1

    def __post_init__(self):
        for name in ("k", "min_ngram", "max_ngram", "branches"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise NGramError(f"n-gram {name} must be an integer, got {value!r}; pass a whole number")
            object.__setattr__(self, name, int(value))  # numpy integers too: a plain, hashable int
        if self.k < 1:
            raise NGramError(f"n-gram k={self.k} drafts nothing; use k >= 1 (draft tokens per round)")
        if self.min_ngram < 1:
            raise NGramError(
                f"n-gram min_ngram={self.min_ngram} matches nothing; use min_ngram >= 1 (suffix tokens to match)"
            )
        if self.max_ngram < self.min_ngram:
            raise NGramError(
                f"n-gram max_ngram={self.max_ngram} is below min_ngram={self.min_ngram}; "
                "use max_ngram >= min_ngram"
            )
        if self.branches < 1:
            raise NGramError(
                f"n-gram branches={self.branches} proposes nothing; use branches >= 1 (1: a chain)"
            )

    def with_k(self, k: int) -> NGram:
        """This drafter drafting chains of `k` tokens (adaptive K; there is no state to take over)."""
        return dataclasses.replace(self, k=k, branches=1)

    @functools.cached_property
    def tree(self) -> Tree | None:
        return None if self.branches == 1 else branch_tree(self.branches, self.k)

    @property
    def shape(self) -> Chain | Tree:
        return Chain(self.k) if self.tree is None else self.tree

    def validate(self, target_cfg) -> None:
        """Any target: the draft is made of the sequence's own tokens."""

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        return ()

    def propose(self, params, state, seq_BS, n_tokens_B, key):
        tokens, _ = ngram_candidates(
            seq_BS, n_tokens_B, self.k, self.min_ngram, self.max_ngram, self.branches
        )
        layout = self.shape.layout(tokens.shape[0])
        if self.branches == 1:
            return Draft(tokens[:, 0], None, layout), state
        # node order of `branch_tree`: depth first, then branch (paths sort by length, then rank)
        return Draft(tokens.swapaxes(1, 2).reshape(tokens.shape[0], -1), None, layout), state

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state


@dataclasses.dataclass(frozen=True)
class NGramSettings:
    min_ngram: int = 1
    max_ngram: int = 3
    branches: int = 1
    HELP = {
        "min_ngram": "n-gram drafter: shortest suffix to match.",
        "max_ngram": "n-gram drafter: longest suffix to match (tried first).",
        "branches": "n-gram drafter: distinct matches proposed as tree branches (1: a chain).",
    }


def build(target, settings: NGramSettings, k: int, tree, sampler):
    if tree is not None:
        raise NGramError("the n-gram drafter builds its own tree; drop --tree and set --branches instead")
    return NGram(k, settings.min_ngram, settings.max_ngram, settings.branches), None


registry.register(registry.Entry("ngram", NGramSettings, build, help=NGramSettings.HELP))
