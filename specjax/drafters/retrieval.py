"""Retrieval drafting (REST, He et al. 2024): the draft is what most often followed the sequence's suffix in a
corpus, looked up on device in the corpus's suffix array (`specjax.datastore`). No weights are trained; the
datastore's arrays are the drafter's params, so the compiled loop takes them as arguments.

The rule, per row with `L` tokens `x[0..L-1]` (`x[L-1]` is the pending token), corpus `c[0..R-1]` read as -1
at and beyond R:

- the query is the longest suffix `x[L-n..L-1]`, n from `max_suffix` down to `min_suffix` (n <= L), that occurs
  in the corpus; its occurrences are a range [lo, hi) of the suffix array, sorted by what follows them;
- `occurrences` of them are read evenly across that range (occurrence lo + floor(j (hi - lo) / occurrences));
  each one's continuation is the K tokens after it, and its frequency the number of occurrences in the range
  followed by the same K tokens (found by bisection: equal continuations are contiguous in the range);
- the proposal is the most frequent sampled continuation (ties: the lexicographically smaller); with
  `branches` > 1, that many distinct continuations by frequency, each a chain of depth K under the root
  (`ngram.branch_tree`); a -1 (past the corpus's end) reads as the corpus's last token;
- no occurrence (or fewer distinct continuations than branches): the pending token repeated K times.

Bisections run a static ceil(log2(R + 1)) steps; everything is fixed-shape and batched over ragged rows.
Proposals are deterministic (`q_probs=None`): exact with any sampler.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from specjax.datastore import Datastore, open_datastore
from specjax.drafters.ngram import branch_tree
from specjax.drafting import registry
from specjax.drafting.layouts import Draft
from specjax.drafting.trees import Chain, Tree
from specjax.errors import RetrievalError
from specjax.training.data import check_token_range


def _read(corpus_R, pos):
    """corpus tokens at `pos`, -1 at and beyond its end."""
    size = corpus_R.shape[0]
    return jnp.where(pos < size, corpus_R[jnp.minimum(pos, size - 1)], -1)


def _bisect(corpus_R, suffix_R, key, valid, offset, lo, hi, upper: bool):
    """First index in [lo, hi) of the suffix array whose text from `offset` compares >= `key` (upper: > key),
    over the `valid` positions of the last axis; `lo`, `hi`, `offset` share the key's leading shape."""
    size = corpus_R.shape[0]
    width = jnp.arange(key.shape[-1])

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        text = _read(corpus_R, (suffix_R[jnp.minimum(mid, size - 1)] + offset)[..., None] + width)
        differ = (text != key) & valid
        first = jnp.argmax(differ, axis=-1)[..., None]
        below = jnp.take_along_axis(text, first, -1)[..., 0] < jnp.take_along_axis(key, first, -1)[..., 0]
        equal = ~differ.any(-1)
        right = (~equal & below) | (equal & upper)  # the answer lies after mid
        active = lo < hi
        return jnp.where(active & right, mid + 1, lo), jnp.where(active & ~right, mid, hi)

    return jax.lax.fori_loop(0, math.ceil(math.log2(size + 1)), step, (lo, hi))[0]


def retrieval_candidates(
    corpus_R,
    suffix_R,
    seq_BS,
    n_tokens_B,
    k: int,
    min_suffix: int,
    max_suffix: int,
    branches: int,
    occurrences: int,
):
    """Continuations of each row's longest suffix found in the corpus (see the module docstring).

    Returns (tokens [B, branches, k] int32, found [B, branches] bool: False where a branch holds the pending
    token repeated)."""
    batch, size = seq_BS.shape
    corpus, seq = corpus_R.astype(jnp.int32), seq_BS.astype(jnp.int32)
    length = n_tokens_B.astype(jnp.int32)
    sizes = jnp.arange(min_suffix, max_suffix + 1)  # [Z] query lengths
    t = jnp.arange(max_suffix)
    valid = t < sizes[:, None]  # [Z, W]
    pos = length[:, None, None] - sizes[None, :, None] + t  # [B, Z, W]
    query = jnp.take_along_axis(seq, jnp.clip(pos, 0, size - 1).reshape(batch, -1), 1).reshape(pos.shape)
    bounds = jnp.zeros(query.shape[:2], jnp.int32), jnp.full(query.shape[:2], corpus.shape[0], jnp.int32)
    lo = _bisect(corpus, suffix_R, query, valid, 0, *bounds, upper=False)
    hi = _bisect(corpus, suffix_R, query, valid, 0, *bounds, upper=True)
    ok = (hi > lo) & (sizes[None] <= length[:, None])
    longest = jnp.max(jnp.where(ok, jnp.arange(len(sizes)), -1), axis=1)  # [B]
    pick = lambda a: jnp.take_along_axis(a, jnp.maximum(longest, 0)[:, None], 1)  # [B, 1]
    n, lo, hi = pick(jnp.broadcast_to(sizes, ok.shape)), pick(lo), pick(hi)

    count, j, x = hi - lo, jnp.arange(occurrences), occurrences
    index = lo + j * (count // x) + j * (count % x) // x  # [B, X] lo + floor(j count / x), no overflow
    after = suffix_R[jnp.minimum(index, corpus.shape[0] - 1)] + n
    cont = _read(corpus, after[..., None] + jnp.arange(k))  # [B, X, k]
    block = lo + 0 * index, hi + 0 * index
    first = _bisect(corpus, suffix_R, cont, True, n, *block, upper=False)  # where its block starts
    freq = _bisect(corpus, suffix_R, cont, True, n, *block, upper=True) - first

    fallback = jnp.take_along_axis(seq, jnp.maximum(length - 1, 0)[:, None], 1)  # [B, 1]
    fallback = jnp.broadcast_to(fallback, (batch, k))
    left = jnp.broadcast_to((longest >= 0)[:, None], index.shape)
    tokens, found = [], []
    for _ in range(branches):
        top = jnp.max(jnp.where(left, freq, 0), axis=1, keepdims=True)
        start = jnp.min(jnp.where(left & (freq == top), first, corpus.shape[0]), axis=1, keepdims=True)
        chosen = jnp.take_along_axis(cont, jnp.argmax(left & (first == start), 1)[:, None, None], 1)[:, 0]
        left = left & (first != start)
        hit = top[:, 0] > 0
        tokens.append(jnp.where(hit[:, None], jnp.where(chosen < 0, corpus[-1], chosen), fallback))
        found.append(hit)
    return jnp.stack(tokens, axis=1), jnp.stack(found, axis=1)


@dataclasses.dataclass(frozen=True)
class Retrieval:
    """REST drafter: the K tokens that most often followed the longest matching suffix in the datastore (its
    params: `{"corpus": [R], "suffix": [R]}`); `branches` > 1 proposes that many distinct continuations as a
    tree (`branch_tree`). No state."""

    k: int
    min_suffix: int = 1
    max_suffix: int = 8
    branches: int = 1
    occurrences: int = 16

    def __post_init__(self):
        for name in ("k", "min_suffix", "max_suffix", "branches", "occurrences"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise RetrievalError(
                    f"retrieval {name} must be an integer, got {value!r}; pass a whole number"
                )
            object.__setattr__(self, name, int(value))
            if value < 1:
                raise RetrievalError(f"retrieval {name}={value} must be >= 1; pass a positive number")
        if self.max_suffix < self.min_suffix:
            raise RetrievalError(
                f"retrieval max_suffix={self.max_suffix} is below min_suffix={self.min_suffix}; "
                "use max_suffix >= min_suffix"
            )
        if self.occurrences < self.branches:
            raise RetrievalError(
                f"retrieval occurrences={self.occurrences} cannot give branches={self.branches} distinct "
                "continuations; "
                "use occurrences >= branches"
            )

    @functools.cached_property
    def shape(self) -> Chain | Tree:
        """A chain of K, or `branches` chains of depth K under the root (`branch_tree`)."""
        return Chain(self.k) if self.branches == 1 else branch_tree(self.branches, self.k)

    @staticmethod
    def params(store: Datastore) -> dict:
        return {"corpus": jnp.asarray(store.tokens_R), "suffix": jnp.asarray(store.suffix_R)}

    def validate(self, target_cfg) -> None:
        """Any target: the datastore's tokens are checked against its vocabulary when it is opened."""

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        return ()

    def propose(self, params, state, seq_BS, n_tokens_B, key):
        tokens, _ = retrieval_candidates(
            params["corpus"], params["suffix"], seq_BS, n_tokens_B, self.k, self.min_suffix, self.max_suffix,
            self.branches, self.occurrences,
        )  # fmt: skip
        # node order of `branch_tree`: depth first, then branch
        flat = tokens[:, 0] if self.branches == 1 else tokens.swapaxes(1, 2).reshape(tokens.shape[0], -1)
        return Draft(flat, None, self.shape.layout(tokens.shape[0])), state

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state


@dataclasses.dataclass(frozen=True)
class RetrievalSettings:
    """The retrieval drafter's flags: where its datastore is (or the corpus to build it from) and its lookup."""

    datastore: str = ""
    corpus: str = ""
    min_suffix: int = 1
    max_suffix: int = 8
    branches: int = 1
    occurrences: int = 16
    HELP = dict(
        datastore="retrieval drafter: datastore folder (`python -m specjax.datastore`; default CORPUS.datastore).",
        corpus="retrieval drafter: .txt/.jsonl corpus to build the datastore from (rebuilt when it changes).",
        min_suffix="retrieval drafter: shortest suffix to look up.",
        max_suffix="retrieval drafter: longest suffix to look up (tried first).",
        branches="n-gram / retrieval drafter: distinct continuations proposed as tree branches (1: a chain).",
        occurrences="retrieval drafter: occurrences read per lookup to rank continuations by frequency.",
    )


def build(target, settings: RetrievalSettings, k: int, tree, sampler):
    if tree is not None:
        raise RetrievalError(
            "the retrieval drafter builds its own tree; drop --tree and set --branches instead"
        )
    s = settings
    drafter = Retrieval(k, s.min_suffix, s.max_suffix, s.branches, s.occurrences)  # settings errors first
    store = open_datastore(s.datastore, s.corpus, target.tokenizer)
    check_token_range(store.tokens_R, target.cfg.vocab_size, f"datastore {s.datastore or s.corpus}")
    return drafter, Retrieval.params(store)


def example(target, k: int, tree, sampler):
    """The drafter over a datastore of random tokens, for a target without a tokenizer (exactness checks)."""
    tokens_R = np.random.default_rng(0).integers(0, target.cfg.vocab_size, 400)
    return Retrieval(k), Retrieval.params(Datastore.from_tokens(tokens_R))


registry.register(
    registry.Entry("retrieval", RetrievalSettings, build, help=RetrievalSettings.HELP, example=example)
)
