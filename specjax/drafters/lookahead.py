"""Lookahead (Jacobi) decoding (Fu et al. 2024): no weights, no training; the target's own pass drafts.

Static settings: window W, n-gram size N (draft depth K = N - 1), guess-set size G, pool capacity C.

One target pass scores three kinds of tokens (`LookaheadLayout`):

- the pending token (node 0);
- the *verification branch*: G guesses, each an (N - 1)-token chain under the root (`ngram.branch_tree`),
  taken from the n-gram pool: the G most recently inserted n-grams whose first token is the pending token
  (missing guesses repeat the pending token); the tree rule keeps the deepest accepted path;
- the *lookahead branch*: the Jacobi window, N - 1 levels of W tokens; token (l, j) sits at position
  pending + 1 + j + l and sees the pending token, level 0's columns 0..j and column j of levels 1..l (its
  trajectory), never the verification branch (nor does the verification branch see it).

After the pass the target's argmax at the last level closes W n-grams (column j's levels 0..N-2, then
that argmax), which enter the pool; the window drops level 0 and takes the argmax row as its new last
level. Text n-grams (the prompt's at `init`, each round's emitted tokens at `propose`) enter the pool too.
The pool is a per-row ring of C distinct n-grams (an n-gram already there, or earlier in the same
insertion, is skipped; the oldest entry is overwritten). The window starts from prompt tokens.

The lookahead branch never changes what is accepted (its tokens are masked off the verification branch),
and guesses are deterministic (`q_probs=None`): exact with any sampler and any lossless tree rule.

The window's argmax reaches `commit` as `Verification.feedback`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.ngram import branch_tree
from specjax.drafting import registry
from specjax.drafting.layouts import Draft, TreeLayout
from specjax.errors import LookaheadError


def pool_insert(pool_BCN, stamp_BC, clock_B, grams_BXN, valid_BX):
    """Inserts the valid n-grams `grams_BXN` (in order) into each row's ring: (pool, stamps, clock).

    `stamp_BC` is each entry's insertion number (-1: empty); the i-th new entry of a row gets stamp
    clock + i and slot (clock + i) mod C. A gram equal to a pool entry or to an earlier valid gram of the
    same insertion is skipped."""
    rows = jnp.arange(pool_BCN.shape[0])[:, None]
    size, width = pool_BCN.shape[1], grams_BXN.shape[1]
    in_pool = jnp.all(grams_BXN[:, :, None] == pool_BCN[:, None], -1) & (stamp_BC[:, None] >= 0)
    earlier = jnp.tril(jnp.ones((width, width), bool), -1)[None] & valid_BX[:, None, :]
    repeated = jnp.all(grams_BXN[:, :, None] == grams_BXN[:, None], -1) & earlier
    new = valid_BX & ~in_pool.any(2) & ~repeated.any(2)
    rank = jnp.cumsum(new, axis=1) - 1
    count = new.sum(1)
    new = new & (rank >= count[:, None] - size)  # more than C new ones: only the last C stay
    stamps = clock_B[:, None] + rank
    slot = jnp.where(new, stamps % size, size)  # out of range: dropped
    pool = pool_BCN.at[rows, slot].set(grams_BXN, mode="drop")
    return pool, stamp_BC.at[rows, slot].set(stamps, mode="drop"), clock_B + count


def guesses(pool_BCN, stamp_BC, pending_B, g: int):
    """The continuations (tokens 1..N-1) of the `g` most recent pool n-grams starting with the pending token:
    (chains [B, g, N-1] int32, found [B, g] bool; a missing guess repeats the pending token)."""
    score = jnp.where((pool_BCN[:, :, 0] == pending_B[:, None]) & (stamp_BC >= 0), stamp_BC, -1)
    top, index = jax.lax.top_k(score, g)
    chains = jnp.take_along_axis(pool_BCN[:, :, 1:], index[:, :, None], axis=1)
    found = top >= 0
    return jnp.where(found[..., None], chains, pending_B[:, None, None]), found


def jacobi_step(window_BLW, argmax_BLW):
    """(n-grams [B, W, N] closed by the pass: column j's levels then the last level's argmax, new window)."""
    grams = jnp.concatenate([window_BLW, argmax_BLW[:, -1:]], axis=1).swapaxes(1, 2)
    return grams, jnp.concatenate([window_BLW[:, 1:], argmax_BLW[:, -1:]], axis=1)


def text_grams(seq_BS, start_B, stop_B, n: int, width: int):
    """The n-grams of each row's text ending at positions start..stop-1 (at most `width` of them):
    (grams [B, width, n], valid [B, width]); only tokens below `stop_B` are read."""
    ends = start_B[:, None] + jnp.arange(width)[None]  # [B, X]
    valid = (ends < stop_B[:, None]) & (ends >= n - 1)
    pos = jnp.clip(ends[..., None] - (n - 1) + jnp.arange(n), 0, seq_BS.shape[1] - 1)
    grams = jnp.take_along_axis(seq_BS, pos.reshape(pos.shape[0], -1), axis=1).reshape(pos.shape)
    return grams.astype(jnp.int32), valid


@functools.cache
def lookahead_arrays(w: int, n: int, g: int):
    """(offsets [T] from the pending token's position, mask [T, T]) of one pass (see the module docstring)."""
    tree = branch_tree(g, n - 1).arrays
    v = tree.depth.size  # 1 + G(N-1)
    lvl, col = np.divmod(np.arange((n - 1) * w), w)
    t = v + lvl.size
    mask = np.zeros((t, t), bool)
    mask[:v, :v] = tree.mask
    sees_level0 = (lvl[None] == 0) & (col[None] <= col[:, None])
    sees_column = (col[None] == col[:, None]) & (lvl[None] >= 1) & (lvl[None] <= lvl[:, None])
    mask[v:, v:] = sees_level0 | sees_column
    mask[v:, 0] = True
    return np.concatenate([tree.depth, 1 + col + lvl]).astype(np.int32), mask


@struct.dataclass
class LookaheadLayout:
    """The verification tree (G chains) followed by the Jacobi window in one pass."""

    tree: TreeLayout
    w: int = struct.field(pytree_node=False)
    n: int = struct.field(pytree_node=False)

    @property
    def mask(self) -> jax.Array:
        return jnp.asarray(lookahead_arrays(self.w, self.n, self.g)[1])

    @property
    def g(self) -> int:
        return (self.tree.parent.shape[1] - 1) // (self.n - 1)

    def positions(self, length_B: jax.Array) -> jax.Array:
        return length_B[:, None] + jnp.asarray(lookahead_arrays(self.w, self.n, self.g)[0])[None]

    def accept(self, rule, key, sampler, draft: Draft, logits_BTV, feats_BTH):
        v = self.tree.parent.shape[1]
        guess = Draft(draft.tokens[:, : v - 1], None, self.tree)
        verdict = self.tree.accept(rule, key, sampler, guess, logits_BTV[:, :v], feats_BTH[:, :v])
        argmax = jnp.argmax(logits_BTV[:, v:], axis=-1).astype(jnp.int32)
        return verdict.replace(feedback=argmax)

    def commit(self, cache, committed_B, verdict, active_B):
        """The accepted guess path gathered into the committed region; the window's slots are dropped."""
        return self.tree.commit(cache, committed_B, verdict, active_B)


@struct.dataclass
class LookaheadState:
    pool_BCN: jax.Array  # n-grams, one per slot
    stamp_BC: jax.Array  # insertion number of each slot's n-gram, -1: empty
    clock_B: jax.Array  # n-grams inserted so far
    window_BLW: jax.Array  # the Jacobi window, N - 1 levels of W tokens
    scanned_B: jax.Array  # text n-grams ending before this position are in the pool


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """Lookahead decoding: window `w`, n-gram size `n`, guess-set size `g`, pool capacity `pool_size`.
    No params (pass None)."""

    w: int = 4
    n: int = 4
    g: int = 4
    pool_size: int = 256

    def __post_init__(self):
        for name in ("w", "n", "g", "pool_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise LookaheadError(
                    f"lookahead {name} must be an integer, got {value!r}; pass a whole number"
                )
            object.__setattr__(self, name, int(value))
        if self.w < 1:
            raise LookaheadError(f"lookahead window W={self.w} looks nowhere ahead; use W >= 1")
        if self.n < 2:
            raise LookaheadError(
                f"lookahead n-gram size N={self.n} guesses nothing; use N >= 2 (K = N - 1 >= 1 draft tokens)"
            )
        if self.g < 1:
            raise LookaheadError(f"lookahead guess set G={self.g} verifies nothing; use G >= 1")
        if self.pool_size < self.w + self.n:
            raise LookaheadError(
                f"lookahead pool_size={self.pool_size} cannot hold one round's n-grams; "
                f"use pool_size >= W + N = {self.w + self.n}"
            )

    @property
    def shape(self) -> LookaheadShape:
        return LookaheadShape(self.w, self.n, self.g)

    def validate(self, target_cfg) -> None:
        """Any target: guesses and the window are the target's own tokens."""

    def init(self, params, tokens_BP, lengths_B, cache_size: int, feats_BPH=None):
        batch, width = tokens_BP.shape
        tokens = jnp.asarray(tokens_BP, jnp.int32)
        lengths = jnp.asarray(lengths_B, jnp.int32)
        empty = jnp.full((batch, self.pool_size), -1, jnp.int32)
        pool = jnp.full((batch, self.pool_size, self.n), -1, jnp.int32)
        grams, valid = text_grams(tokens, jnp.zeros_like(lengths), lengths, self.n, width)
        pool, stamp, clock = pool_insert(pool, empty, jnp.zeros_like(lengths), grams, valid)
        spots = (
            jnp.arange((self.n - 1) * self.w)[None] % lengths[:, None]
        )  # the window starts from the prompt
        window = jnp.take_along_axis(tokens, spots, axis=1).reshape(batch, self.n - 1, self.w)
        return LookaheadState(pool, stamp, clock, window, lengths)

    def propose(self, params, state: LookaheadState, seq_BS, n_tokens_B, key):
        grams, valid = text_grams(seq_BS, state.scanned_B, n_tokens_B, self.n, self.n + 1)
        pool, stamp, clock = pool_insert(state.pool_BCN, state.stamp_BC, state.clock_B, grams, valid)
        state = state.replace(pool_BCN=pool, stamp_BC=stamp, clock_B=clock, scanned_B=n_tokens_B)
        pending = jnp.take_along_axis(seq_BS, (n_tokens_B - 1)[:, None], axis=1)[:, 0].astype(jnp.int32)
        chains, _ = guesses(pool, stamp, pending, self.g)
        batch = chains.shape[0]
        # node order of `branch_tree`: depth first, then guess; then the window, level by level
        tokens = [chains.swapaxes(1, 2).reshape(batch, -1), state.window_BLW.reshape(batch, -1)]
        return Draft(jnp.concatenate(tokens, axis=1), None, self.shape.layout(batch)), state

    def commit(self, params, state: LookaheadState, n_accepted_B, n_tokens_B, path_BD, feats_BDH, feedback):
        """`feedback`: the target's argmax over the window, [B, (N - 1) W] (`LookaheadLayout.accept`)."""
        grams, window = jacobi_step(state.window_BLW, feedback.reshape(state.window_BLW.shape))
        valid = jnp.ones(grams.shape[:2], bool)
        pool, stamp, clock = pool_insert(state.pool_BCN, state.stamp_BC, state.clock_B, grams, valid)
        return state.replace(pool_BCN=pool, stamp_BC=stamp, clock_B=clock, window_BLW=window)


@dataclasses.dataclass(frozen=True)
class LookaheadShape:
    """One lookahead round: depth N - 1; one pass over the pending token, G(N-1) guess and (N-1)W window tokens."""

    w: int
    n: int
    g: int

    @property
    def depth(self) -> int:
        return self.n - 1

    @property
    def size(self) -> int:
        return 1 + (self.g + self.w) * (self.n - 1)

    @property
    def width(self) -> int:
        """The G guesses hang under the pending token."""
        return self.g

    @property
    def cache_slots(self) -> int:
        return self.size

    def describe(self) -> str:
        return f"lookahead W={self.w} N={self.n} G={self.g} ({self.size} tokens per pass)"

    def layout(self, batch: int) -> LookaheadLayout:
        return LookaheadLayout(branch_tree(self.g, self.n - 1).layout(batch), self.w, self.n)


@dataclasses.dataclass(frozen=True)
class LookaheadSettings:
    """The drafter's flags; `--k` is N - 1 (the n-gram size minus one, the draft depth)."""

    window: int = 4
    guesses: int = 4
    pool_size: int = 256


def build(target, settings: LookaheadSettings, k: int, tree, sampler):
    """(Lookahead(W=window, N=k + 1, G=guesses), no params); the guess tree is its own."""
    if tree is not None:
        raise LookaheadError(
            "the lookahead drafter builds its own tree; drop --tree and set --guesses (and --k = N - 1)"
        )
    return Lookahead(settings.window, k + 1, settings.guesses, settings.pool_size), None


HELP = {
    "window": "lookahead drafter: Jacobi window W (tokens per level; --k is N - 1, the n-gram size minus 1).",
    "guesses": "lookahead drafter: guess set G (pool n-grams verified per round, as tree branches).",
    "pool_size": "lookahead drafter: n-gram pool capacity per row (oldest entries are overwritten).",
}
registry.register(registry.Entry("lookahead", LookaheadSettings, build, help=HELP))
