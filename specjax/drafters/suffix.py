"""Suffix decoding (SuffixDecoding, Oliaro et al. 2025): the draft is what followed the row's longest matching
suffix in its own text, in the batch's other rows, and in a store of earlier outputs that grows with every
finished output (`Suffix.absorb`) and is kept on disk with its provenance. Nothing is trained.

Per row with `L` tokens (`x[L-1]` pending), the searched text is [store ; every row of the batch] (beyond
`SHARED_ROWS` rows: [store ; the row]), each row read up to its length, documents separated by -1:

- a match of length n ends at i when the n tokens ending at i equal the row's last n (n <= `max_match`) and a
  token follows i; the longest n found anywhere (>= `min_match`) is the row's match, and its `occurrences` most
  recent ends (latest in the text first) are read with the K tokens after each, cut at a document's end;
- chain: at each depth the most frequent next token among the continuations that agree with the path so far
  (ties: the more recent); with `frequencies` and a sampling target, the token is drawn from those frequencies
  instead and the draft carries them as q (exact under every acceptance rule); with `distributions` as well, from
  the mean of those continuations' next-token distributions as the target gave them when the store learned them
  (a continuation in the batch's own text: a point mass on its token), the expected frequencies in place of the
  sampled ones;
- the round verifies the shortest of `lengths` (1, 2, 4, ..., K) that covers the live rows' longest most-frequent
  path whose empirical probability stays >= `min_prob`, capped at ceil(`spec_factor` n) tokens (SuffixDecoding's
  speculation length). The choice reads only the most-frequent paths, never a sampled token;
- tree (`nodes` > 0): the `nodes` continuation prefixes of largest empirical probability (the share of the
  occurrences read that continue so; ties: shallower, then more recent), best first as in SuffixDecoding: a
  prefix-closed tree, siblings tried in that order;
- no match: the pending token repeated.

The store (`{"store": int32 [R]}`, the drafter's params) holds the newest R tokens of what it absorbed, oldest
first, -1 before them while it fills and between documents; when full, the oldest tokens go first. With
`distributions` = m it also holds, for each token, the target's m most likely next tokens and their log-probabilities
at temperature 1 (`next_ids` int32 [R, m], `next_logp` float32 [R, m]; one target pass over each sequence it
absorbs), warped by the run's sampler when drawn from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import files
from specjax.drafting import registry
from specjax.drafting.layouts import Draft, TreeLayout
from specjax.drafting.trees import Chain
from specjax.errors import SuffixError
from specjax.sampling import Sampler, inverse_cdf

FORMAT = "specjax-suffix-store"
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class FrequencyTree:
    """The shape of a suffix draft tree: `nodes` nodes chosen each round, at most `depth` deep."""

    depth: int
    nodes: int
    dynamic = True  # the layout comes out of the lookup
    reread = 0  # no drafter cache

    @property
    def size(self) -> int:
        return self.nodes + 1

    @property
    def width(self) -> int:
        return self.nodes

    @property
    def cache_slots(self) -> int:
        return self.nodes + 1

    def describe(self) -> str:
        return f"a suffix frequency tree of {self.size} nodes"

    def layout(self, batch: int):
        raise SuffixError(f"{self} has no fixed layout: the suffix drafter builds one each round")


# Up to this many rows, each row also searches the batch's other rows (the text is shared: O(B^2) comparisons per
# round); beyond, each row searches the store and its own text.
SHARED_ROWS = 16


def searched_text(store_R, seq_BS, n_tokens_B):
    """(text [1 or B, C], each row's pending token's index in its text [B]): [store ; row 0 ; -1 ; row 1 ; -1 ; ...]
    shared by the rows up to `SHARED_ROWS` rows, else [store ; the row ; -1] per row; rows read up to their
    lengths."""
    batch, size = seq_BS.shape
    rows = jnp.where(jnp.arange(size)[None] < n_tokens_B[:, None], seq_BS.astype(jnp.int32), -1)
    rows = jnp.pad(rows, ((0, 0), (0, 1)), constant_values=-1)
    store = store_R.astype(jnp.int32)[None]
    if batch > SHARED_ROWS:
        text = jnp.concatenate([jnp.broadcast_to(store, (batch, store.shape[1])), rows], axis=1)
        return text, store.shape[1] + n_tokens_B - 1
    text = jnp.concatenate([store, rows.reshape(1, -1)], axis=1)
    return text, store.shape[1] + jnp.arange(batch) * (size + 1) + n_tokens_B - 1


def occurrences_of_suffix(text_TC, pending_B, min_match: int, max_match: int, occurrences: int, k: int):
    """(match length n [B], continuations [B, X, k] (-1 past a document's end), read [B, X] bool, ends [B, X]
    (their index in the text)): the ends of each row's longest matching suffix in its text (`searched_text`), most
    recent first (see the module docstring)."""
    batch, size = pending_B.shape[0], text_TC.shape[1]
    text = jnp.broadcast_to(text_TC, (batch, size)) if text_TC.shape[0] == 1 else text_TC
    at = lambda index: jnp.take_along_axis(
        text, jnp.clip(index, 0, size - 1).reshape(batch, -1), 1
    ).reshape(index.shape)
    lag = jnp.arange(max_match)
    suffix = jnp.where(lag[None] <= pending_B[:, None], at(pending_B[:, None] - lag), -1)
    suffix = jnp.where(suffix >= 0, suffix, -2)  # [B, M]: never matches a separator or the row's start
    run, still = jnp.zeros((batch, size), jnp.int32), True
    for m in range(max_match):
        shifted = jnp.pad(text_TC, ((0, 0), (m, 0)), constant_values=-1)[
            :, :size
        ]  # shifted[i] = text[i - m]
        still = still & (shifted == suffix[:, m : m + 1])
        run = run + still
    follows = jnp.pad(text_TC[:, 1:], ((0, 0), (0, 1)), constant_values=-1) >= 0  # a token follows the end
    run = jnp.where((run >= min_match) & follows, run, 0)
    n = jnp.max(run, axis=1)  # [B]: 0 where nothing matched
    # the `occurrences` latest ends of the longest match, latest first, by their rank from the text's end (a sort or
    # top_k over the whole text cost XLA CPU 11 ms a round at 65,536 tokens)
    best = (run == n[:, None]) & (n[:, None] > 0)
    rank = jnp.cumsum(best[:, ::-1], axis=1)[:, ::-1] - 1  # [B, C]: later ends of the match after this one
    slot = jnp.where(best & (rank < occurrences), rank, occurrences)
    rows = jnp.arange(batch)[:, None]
    ends = jnp.zeros((batch, occurrences + 1), jnp.int32).at[rows, slot].set(jnp.arange(size)[None])[:, :-1]
    read = jnp.arange(occurrences)[None] < jnp.sum(best, axis=1, keepdims=True)
    after = ends[..., None] + 1 + jnp.arange(k)  # [B, X, k]
    cont = jnp.where(after < size, at(after), -1)
    cont = jnp.where(jnp.cumprod(cont >= 0, axis=-1).astype(bool) & read[..., None], cont, -1)
    return n, cont, read, ends


def continuation_distributions(params, ends_BX, cont_BXK, sampler):
    """(token ids, probabilities) [B, X, k, m] of each continuation token's target distribution: the store's
    recorded top-m (`Suffix.distributions`) warped by `sampler` where the token follows a stored one, a point mass
    on the token itself where it follows the batch's text."""
    ids_RM, logp_RM = params["next_ids"], params["next_logp"]
    size, m = ids_RM.shape
    # the index of the token each continuation token follows
    before = ends_BX[..., None] + jnp.arange(cont_BXK.shape[-1])
    stored = (before < size) & (cont_BXK >= 0)
    at = jnp.clip(before, 0, size - 1)
    one_hot = jnp.arange(m) == 0
    ids = jnp.where(stored[..., None], ids_RM[at], jnp.where(one_hot, cont_BXK[..., None], -1))
    probs = sampler.probs(jnp.where(stored[..., None], logp_RM[at], jnp.where(one_hot, 0.0, -jnp.inf)))
    return ids, jnp.where((ids >= 0) & (cont_BXK >= 0)[..., None], probs, 0.0)


def frequent_path(cont_BXK, read_BX, pending_B, k: int, uniform_BK=None, vocab: int = 0, dists=None):
    """The chain through the continuations: tokens [B, k], the empirical probability of each prefix [B, k], and
    with `uniform_BK`, tokens drawn from the frequencies instead, with the frequencies as q [B, k, V]; with
    `dists` (`continuation_distributions`), drawn from the mean of the agreeing continuations' distributions."""
    active, prob, tokens, probs, qs = read_BX, 1.0, [], [], []
    for d in range(k):
        tok = cont_BXK[:, :, d]
        ok = active & (tok >= 0)
        total = ok.sum(1)
        count = jnp.sum((tok[:, :, None] == tok[:, None, :]) & ok[:, None, :], axis=2) * ok
        if uniform_BK is None:  # the most frequent; argmax takes the first, the most recent
            pick = jnp.argmax(count, axis=1)
        else:  # an occurrence drawn uniformly among those agreeing so far: its token has the frequency's law
            nth = jnp.floor(uniform_BK[:, d] * total).astype(jnp.int32)
            pick = jnp.argmax(jnp.cumsum(ok, axis=1) > nth[:, None], axis=1)
            rows = jnp.arange(tok.shape[0])[:, None]
            if dists is None:
                q = (
                    jnp.zeros((tok.shape[0], vocab))
                    .at[rows, jnp.maximum(tok, 0)]
                    .add(ok.astype(jnp.float32))
                )
            else:
                ids, mass = dists[0][:, :, d], jnp.where(ok[..., None], dists[1][:, :, d], 0.0)
                q = jnp.zeros((tok.shape[0], vocab)).at[rows[..., None], jnp.maximum(ids, 0)].add(mass)
            fallback = jax.nn.one_hot(pending_B, vocab)
            qs.append(jnp.where(total[:, None] > 0, q / jnp.maximum(total, 1)[:, None], fallback))
        chosen = jnp.take_along_axis(tok, pick[:, None], 1)[:, 0]
        if dists is not None:
            chosen = inverse_cdf(qs[-1], uniform_BK[:, d])
        token = jnp.where(total > 0, chosen, pending_B)
        prob = prob * jnp.where(
            total > 0, jnp.take_along_axis(count, pick[:, None], 1)[:, 0] / jnp.maximum(total, 1), 0
        )
        tokens.append(token)
        probs.append(prob)
        active = ok & (tok == token[:, None])
    q = jnp.stack(qs, 1) if qs else None
    return jnp.stack(tokens, 1), jnp.stack(probs, 1), q


def expected_accepted(cont_BXK, read_BX, tokens_BK):
    """[B] the tokens of each row's chain `tokens_BK` expected accepted: the sum over depths of the share of the
    occurrences read that continue with the chain so far, counting one more occurrence that does not (one
    occurrence alone is weak evidence: it expects K / 2 tokens)."""
    valid = read_BX & (cont_BXK[:, :, 0] >= 0)
    agree = jnp.cumprod(cont_BXK == tokens_BK[:, None, :], axis=2) & valid[:, :, None]
    return jnp.sum(agree, axis=(1, 2)) / (jnp.sum(valid, axis=1) + 1.0)


def frequency_tree(cont_BXK, read_BX, pending_B, nodes: int):
    """(tokens [B, N], parents [B, N + 1], root first): the `nodes` continuation prefixes of largest empirical
    probability; slots left over are the pending token under the root."""
    batch, x, k = cont_BXK.shape
    same = jnp.cumprod(cont_BXK[:, :, None, :] == cont_BXK[:, None, :, :], axis=-1).astype(
        bool
    )  # [B, X, X', k]
    same = same & read_BX[:, None, :, None] & (cont_BXK >= 0)[:, :, None, :]
    count = same.sum(2)  # [B, X, k]: occurrences sharing x's prefix through depth d
    earlier = jnp.tril(jnp.ones((x, x), bool), -1)[None, :, :, None]  # x' < x
    canonical = (count > 0) & ~jnp.any(same & earlier, axis=2)  # the first occurrence of each prefix
    depth = jnp.arange(k)
    score = (count * (k + 1) + (k - depth)) * x + (x - 1 - jnp.arange(x))[
        :, None
    ]  # parents outrank children
    score = jnp.where(canonical, score, -1).reshape(batch, -1)
    top, node = jax.lax.top_k(score, nodes)  # [B, N], parents first
    ox, od = node // k, node % k
    tokens = jnp.take_along_axis(cont_BXK.reshape(batch, -1), node, 1)
    # the parent prefix's first occurrence, and where it sits among the chosen nodes
    shares = jnp.take_along_axis(same, ox[:, :, None, None], 1)  # [B, N, X', k]
    above = jnp.take_along_axis(shares, jnp.maximum(od - 1, 0)[:, :, None, None], 3)[..., 0]  # [B, N, X']
    parent_x = jnp.argmax(above, axis=2)
    is_parent = (ox[:, None, :] == parent_x[:, :, None]) & (od[:, None, :] == od[:, :, None] - 1)
    parent = jnp.where(od > 0, jnp.argmax(is_parent, axis=2) + 1, 0)
    real = top >= 0
    tokens = jnp.where(real, tokens, pending_B[:, None])
    parent = jnp.where(real, parent, 0)
    return tokens, jnp.pad(parent, ((0, 0), (1, 0)))


@dataclasses.dataclass(frozen=True)
class Suffix:
    """Suffix drafter (see the module docstring): params `{"store": int32 [R]}`; no state. `store` names the
    folder the store is saved to after each `absorb` (with the tokenizer's identity `provenance`)."""

    k: int
    vocab_size: int
    min_match: int = 1
    max_match: int = 16
    occurrences: int = 32
    nodes: int = 0
    spec_factor: float = 1.0
    min_prob: float = 0.1
    frequencies: bool = False
    distributions: int = 0
    sampler: Sampler = Sampler()
    store: str = ""
    provenance: str = ""
    target_id: str = ""
    score: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("k", "min_match", "max_match", "occurrences", "nodes", "distributions"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise SuffixError(f"suffix {name} must be an integer, got {value!r}; pass a whole number")
            object.__setattr__(self, name, int(value))
            if value < (0 if name in ("nodes", "distributions") else 1):
                raise SuffixError(
                    f"suffix {name}={value} is too small; pass a positive number (nodes, distributions: 0 = none)"
                )
        if self.max_match < self.min_match:
            raise SuffixError(
                f"suffix max_match={self.max_match} is below min_match={self.min_match}; use max_match >= min_match"
            )
        if self.nodes > self.occurrences * self.k:
            raise SuffixError(
                f"suffix nodes={self.nodes} exceeds the {self.occurrences} x {self.k} continuation prefixes read; "
                "use nodes <= occurrences x k"
            )
        if self.distributions and self.score is None:
            raise SuffixError(
                f"suffix distributions={self.distributions} records the target's distributions, but no target "
                "scores them; build the drafter with its target (`build`), or pass distributions=0"
            )
        if not (self.spec_factor > 0 and 0 <= self.min_prob <= 1):
            raise SuffixError(
                f"suffix spec_factor={self.spec_factor}, min_prob={self.min_prob}; use spec_factor > 0 and "
                "0 <= min_prob <= 1"
            )

    @functools.cached_property
    def shape(self):
        return Chain(self.k) if self.nodes == 0 else FrequencyTree(self.k, self.nodes)

    @property
    def lengths(self) -> tuple[int, ...]:
        """The chain prefixes a round may verify: 1, 2, 4, ... and K."""
        return tuple(sorted({*(2**i for i in range(int(math.log2(self.k)) + 1)), self.k}))

    def validate(self, target_cfg) -> None:
        if target_cfg.vocab_size != self.vocab_size:
            raise SuffixError(
                f"the suffix drafter was built for a vocabulary of {self.vocab_size}, the target has "
                f"{target_cfg.vocab_size}; build it for this target"
            )

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        return ()

    def propose(self, params, state, seq_BS, n_tokens_B, key):
        return self.scored(params, seq_BS, n_tokens_B, key)[0], state

    def scored(self, params, seq_BS, n_tokens_B, key):
        """(the round's draft, [B] the tokens each row's most-frequent chain expects accepted: `expected_accepted`;
        0 for a tree)."""
        text, pending = searched_text(params["store"], seq_BS, n_tokens_B)
        n, cont, read, ends = occurrences_of_suffix(
            text, pending, self.min_match, self.max_match, self.occurrences, self.k
        )
        last = jnp.take_along_axis(seq_BS, jnp.maximum(n_tokens_B - 1, 0)[:, None], 1)[:, 0].astype(
            jnp.int32
        )
        if self.nodes:
            tokens, parent = frequency_tree(cont, read, last, self.nodes)
            draft = Draft(tokens, None, TreeLayout.from_parents(parent, self.k, self.nodes))
            return draft, jnp.zeros(n.shape, jnp.float32)
        tokens, probs, _ = frequent_path(cont, read, last, self.k)
        covered = jnp.sum(probs >= self.min_prob, axis=1)
        want = jnp.minimum(covered, jnp.ceil(self.spec_factor * n).astype(jnp.int32))
        # the shortest length that every live row's wanted tokens fit in (the first if none wants any): a row scores
        # -1 where its tokens do not fit
        scores = -(jnp.asarray(self.lengths)[None] < want[:, None]).astype(jnp.float32)
        q = None
        expected = expected_accepted(cont, read, tokens)
        if self.frequencies:
            uniform = jax.random.uniform(key, tokens.shape)
            dists = (
                continuation_distributions(params, ends, cont, self.sampler) if self.distributions else None
            )
            tokens, _, q = frequent_path(cont, read, last, self.k, uniform, self.vocab_size, dists)
        draft = Draft(tokens, q, Chain(self.k).layout(tokens.shape[0]), lengths=self.lengths, scores=scores)
        return draft, expected

    def commit(self, params, state, n_accepted_B, n_tokens_B, path_BD, feats_BDH):
        return state

    def absorb(self, params, sequences) -> dict:
        """The params with `sequences` (token lists: each a finished prompt and output) added to the store (with
        `distributions`, each token's next-token distribution as `score` gives it), the oldest tokens dropped when
        it is full; saved to `store` when the drafter has one."""
        size = len(params["store"])
        keep = lambda old, new: np.concatenate([np.asarray(old), new])[-size:]
        new = np.asarray([t for s in sequences for t in (*s, -1)], np.int32)
        out = {"store": keep(params["store"], new)}
        if self.distributions:
            scored = [self.score(list(s)) for s in sequences]
            gap = (
                np.full((1, self.distributions), -1, np.int32),
                np.full((1, self.distributions), -np.inf),
            )
            out["next_ids"] = keep(
                params["next_ids"], np.concatenate([a for i, _ in scored for a in (i, gap[0])])
            )
            out["next_logp"] = keep(
                params["next_logp"],
                np.concatenate([a for _, lp in scored for a in (lp, gap[1])]).astype(np.float32),
            )
        if self.store:
            save_store(self.store, out, self.provenance, self.target_id)
        return {name: jnp.asarray(array) for name, array in out.items()}


def empty_store(capacity: int, distributions: int = 0) -> dict:
    """A store of `capacity` tokens (with `distributions`: their next-token distributions' top entries), empty."""
    store = {"store": jnp.full((capacity,), -1, jnp.int32)}
    if distributions:
        store["next_ids"] = jnp.full((capacity, distributions), -1, jnp.int32)
        store["next_logp"] = jnp.full((capacity, distributions), -jnp.inf, jnp.float32)
    return store


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _top_next(cfg, graphdef, params, tokens_T, top: int):
    from specjax.models.llama import sequence_logits

    logits = sequence_logits(cfg, graphdef, params, tokens_T[None])[0]
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), top)
    return ids.astype(jnp.int32), logp


def next_token_distributions(target, top: int, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(ids, log-probabilities) [len(tokens), top]: the target's `top` most likely tokens after each token of
    `tokens` (temperature 1), from one pass over them (padded to a multiple of 128: one compile per 128)."""
    n = len(tokens)
    padded = np.zeros(-(-n // 128) * 128, np.int32)
    padded[:n] = tokens
    ids, logp = _top_next(target.cfg, target.graphdef, target.params, jnp.asarray(padded), top)
    return np.asarray(ids)[:n], np.asarray(logp)[:n]


def is_store(folder: Path) -> bool:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


DISTRIBUTION_FILES = ("next_ids", "next_logp")


def save_store(folder: str | Path, store: dict, tokenizer_id: str, target_id: str = "") -> None:
    """Writes the store at `folder` (its arrays, the tokenizer's identity, with distributions the identity of the
    target that gave them, and their digests), whole or not at all."""
    from specjax.training.data import array_digest

    arrays = {name: np.asarray(array) for name, array in store.items()}
    tokens_R = arrays["store"].astype(np.int32)
    manifest = {
        "format": FORMAT,
        "provenance": {"tokenizer": tokenizer_id},
        "capacity": int(tokens_R.size),
        "n_tokens": int(np.sum(tokens_R >= 0)),
        "digest": array_digest(tokens_R),
    }
    if "next_ids" in arrays:
        manifest["provenance"]["target"] = target_id
        manifest["distributions"] = int(arrays["next_ids"].shape[1])
        manifest["distribution_digests"] = [array_digest(arrays[name]) for name in DISTRIBUTION_FILES]
    with files.atomic_dir(folder, replaceable=is_store, what="suffix store") as tmp:
        np.save(tmp / "tokens.npy", tokens_R, allow_pickle=False)
        for name in DISTRIBUTION_FILES if "next_ids" in arrays else ():
            np.save(tmp / f"{name}.npy", arrays[name], allow_pickle=False)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def load_store(
    folder: str | Path, capacity: int, tokenizer_id: str, distributions: int = 0, target_id: str = ""
) -> dict:
    """The params of the store saved at `folder`, resized to `capacity` (its newest tokens kept); an empty store
    where there is none yet. A store of another tokenizer, or one modified since it was written, is refused. With
    `distributions`, the saved distributions' top entries (refused if another target than `target_id` gave them);
    a store saved without them has, for each token, a point mass on the token that followed it."""
    from specjax.training.data import array_digest

    folder = Path(folder).absolute()
    if not folder.exists():
        return empty_store(capacity, distributions)
    fix = f"pass another --store, or move {folder} away to start an empty store there"
    if not is_store(folder):
        raise SuffixError(f"{folder} is not a suffix store (no {MANIFEST} of format {FORMAT}); {fix}")
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("provenance", {}).get("tokenizer") != tokenizer_id:
        raise SuffixError(f"the suffix store {folder} was written with another tokenizer; {fix}")
    recorded = distributions and "distributions" in manifest
    if recorded and manifest["provenance"].get("target") != target_id:
        raise SuffixError(
            f"the suffix store {folder} holds another target's distributions; {fix}, or pass --distributions=0"
        )
    names = ("tokens", *(DISTRIBUTION_FILES if recorded else ()))
    try:
        arrays = [np.load(folder / f"{name}.npy", allow_pickle=False) for name in names]
    except (OSError, ValueError) as err:
        raise SuffixError(f"the suffix store {folder} is unreadable ({err}); {fix}") from err
    digests = [manifest.get("digest"), *manifest.get("distribution_digests", [])][: len(arrays)]
    if [array_digest(a) for a in arrays] != digests:
        raise SuffixError(f"the suffix store {folder} was modified since it was written; {fix}")
    tokens = arrays[0].astype(np.int32)
    store = {"store": tokens}
    if distributions:
        ids, logp = arrays[1:] if len(arrays) == 3 else observed_distributions(tokens)
        width = lambda a, fill: np.pad(a[:, :distributions], ((0, 0), (0, max(0, distributions - a.shape[1]))),
                                       constant_values=fill)  # fmt: skip
        store.update(
            next_ids=width(ids.astype(np.int32), -1), next_logp=width(logp.astype(np.float32), -np.inf)
        )
    empty = empty_store(capacity, distributions)
    return {name: jnp.concatenate([empty[name], jnp.asarray(a)])[-capacity:] for name, a in store.items()}


def observed_distributions(tokens_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([R, 1] ids, [R, 1] log-probabilities): a point mass on the token after each token (none at a document's
    end)."""
    after = np.append(tokens_R[1:], -1)
    follows = (tokens_R >= 0) & (after >= 0)
    return np.where(follows, after, -1)[:, None], np.where(follows, 0.0, -np.inf)[:, None]


@dataclasses.dataclass(frozen=True)
class SuffixSettings:
    """The suffix drafter's flags: its store and its lookup."""

    store: str = ""
    store_tokens: int = 65_536
    suffix_corpus: str = ""
    min_match: int = 1
    max_match: int = 16
    occurrences: int = 32
    nodes: int = 0
    spec_factor: float = 1.0
    min_prob: float = 0.1
    frequencies: bool = False
    distributions: int = 0
    HELP = dict(
        store="suffix drafter: folder of its store of earlier outputs, read at start and written after each batch "
        "(empty: kept in memory for the run).",
        store_tokens="suffix drafter: the store's capacity in tokens (the oldest go first when it is full).",
        suffix_corpus="suffix drafter: .txt/.jsonl documents added to the store at start.",
        min_match="suffix drafter: shortest suffix match used.",
        max_match="suffix drafter: longest suffix matched.",
        occurrences="suffix drafter: most recent occurrences of the match read for continuation frequencies.",
        nodes="suffix drafter: nodes of a frequency tree (0: a chain sized by the match).",
        spec_factor="suffix drafter: a round verifies at most ceil(spec_factor x match length) tokens.",
        min_prob="suffix drafter: verify the chain while its empirical probability stays >= min_prob.",
        frequencies="suffix drafter: when sampling, draw the chain from the continuation frequencies (q).",
        distributions="suffix drafter, with --frequencies: the store also keeps the target's this many most likely "
        "next tokens at each stored token (one target pass over each finished output), and q averages those "
        "distributions instead of counting tokens (0: counts).",
    )


def build(target, settings: SuffixSettings, k: int, tree, sampler):
    if tree is not None:
        raise SuffixError("the suffix drafter builds its own tree; drop --tree and set --nodes instead")
    from specjax.datastore import tokenizer_identity
    from specjax.models.store import identity as model_identity
    from specjax.training.data import check_token_range, read_documents

    s, tokenizer = settings, target.tokenizer
    needs_tokenizer = s.store or s.suffix_corpus
    if needs_tokenizer and tokenizer is None:
        raise SuffixError(
            "a suffix store or corpus holds the target's tokens; load a model with a tokenizer"
        )
    identity = tokenizer_identity(tokenizer) if needs_tokenizer else ""
    if s.distributions and not s.frequencies:
        raise SuffixError(
            f"--distributions={s.distributions} sets the q of drafts drawn from the store; add --frequencies"
        )
    target_id = (
        model_identity(target.path, target.cfg, target.params) if s.distributions and s.store else ""
    )
    drafter = Suffix(
        k, target.cfg.vocab_size, s.min_match, s.max_match, s.occurrences, s.nodes, s.spec_factor, s.min_prob,
        s.frequencies and not sampler.greedy, s.distributions, sampler, s.store, identity, target_id,
        functools.partial(next_token_distributions, target, s.distributions) if s.distributions else None,
    )  # fmt: skip
    if s.store_tokens < 1:
        raise SuffixError(f"--store_tokens={s.store_tokens} holds nothing; pass a positive capacity")
    params = (
        load_store(s.store, s.store_tokens, identity, s.distributions, target_id)
        if s.store
        else empty_store(s.store_tokens, s.distributions)
    )
    if s.suffix_corpus:
        docs = read_documents(s.suffix_corpus, tokenizer, "suffix corpus", "--suffix_corpus")
        check_token_range(
            np.concatenate(docs), target.cfg.vocab_size, f"the suffix corpus {s.suffix_corpus}"
        )
        params = dataclasses.replace(drafter, store="").absorb(params, docs)
    return drafter, params


def example(target, k: int, tree, sampler, distributions: int = 4):
    """The drafter over a store of random tokens (exactness checks): repeats of one random text, so that
    matches are found; when sampling, drawn from the target's recorded `distributions` (0: from counts)."""
    text = np.random.default_rng(0).integers(0, target.cfg.vocab_size, 64).tolist()
    top = 0 if sampler.greedy else distributions
    score = functools.partial(next_token_distributions, target, top) if top else None
    drafter = Suffix(
        k, target.cfg.vocab_size, frequencies=top > 0, distributions=top, sampler=sampler, score=score
    )
    return drafter, drafter.absorb(empty_store(512, top), [text, text[:40], text[20:]])


registry.register(
    registry.Entry("suffix", SuffixSettings, build, help=SuffixSettings.HELP, example=example)
)
