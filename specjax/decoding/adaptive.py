"""Adaptive draft length: each round's K is chosen on device, inside the compiled loop, among a few static Ks.

The loop compiles one round per K in `ks` (`speculative.adaptive_rounds`; the caches and statistics are sized for
the largest K) and picks one from data: the per-position acceptance rates measured so far and the measured cost
of a round drafting each K, maximising expected tokens per unit of time (`specjax.analysis`). K = 0 is a plain
autoregressive round inside the same loop (one token per round, at the cost of a one-token target pass), for
where speculation loses, as a large batch on a machine whose multi-token passes are not nearly free. Where a plain
round (an AR round that never calls the drafter; a K = 0 round still keeps the drafter in step, which costs a draft
call a round) would be the choice at the start, the job runs plain. Where later, as the acceptance measured in the
job moves, a plain round beats the drafted round the loop would run, the job runs plain from there to its end; where
the loop would run a K = 0 round it stays, keeping the drafter in step for a draft that pays again (a drafter whose
K = 0 round costs a plain round's, n-gram or suffix lookup, never leaves).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.analysis import expected_rounds_to_finish, tokens_per_round_distributions
from specjax.errors import DrafterError


@struct.dataclass
class Measured:
    """Adaptive K's measured inputs, data of the compiled loop (not constants): one program both times the rounds
    (`speculative.calibrate`) and decodes with what it measured."""

    costs: jax.Array  # [len(ks)] float32, each K's round cost
    prior: jax.Array  # [] float32
    forced: jax.Array  # [] int32: every round drafts ks[forced] (calibrating); -1: the policy chooses
    rounds: jax.Array  # [] int32: forced, the loop runs this many rounds (ended rows idle)
    plain_cost: jax.Array  # [] float32: a plain round's cost (drafter idle); float32 max: never; 0: always


@struct.dataclass
class Estimate:
    """What adaptive K knows on device after the rounds so far."""

    counts_2K: jax.Array  # EMAs of row-rounds (per row) that accepted / proposed draft position i < K_max
    choice: jax.Array  # [] index into `ks` of the next round's K
    measured: Measured
    plain: jax.Array  # [] bool: every round from now on is a plain AR round, the drafter never called again


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """Per round, the K in `ks` that would finish the batch soonest if kept: E[rounds until every row has its
    tokens](alpha, K, each row's tokens left) x costs[K] (K = 0: one token a round; `specjax.analysis`'s renewal
    model of the rounds, whose maximum over the rows is what a batch waits for). With one row and many tokens left
    this is the K of most tokens per unit of time; near a row's end, or where a batch waits for its slowest row, it
    is a shorter K or K = 0.

    costs: per K, the time of one round (draft + verify + commit, any unit: only ratios matter). None: measured
      once before the loop by `specjax.decoding.speculative.calibrate` (a few timed rounds per K on the job's
      prompts); for Leviathan et al.'s model pass K c + v (c: draft step / target step, v: verify cost).
    alpha_i, the acceptance of draft position i given all before it were, is an exponential moving average over
      rounds (`decay` per round) of the batch's row-rounds (per row) that accepted position i over those that
      proposed it with all before it accepted, plus `prior_weight` pseudo row-rounds at the pooled rate of all
      positions (a position never proposed takes it: the i.i.d. model of `specjax.analysis`), which starts at
      `prior` with the same weight. prior None: the acceptance rate of a few rounds at the largest K, measured
      with the costs by `calibrate`. The defaults (a memory of about 100 rounds, 20 pseudo row-rounds, the
      measured prior) come from `experiments.bench_verification --adaptive_costs`: a memory of 10 rounds, half a
      pseudo row-round and a fixed prior of 0.6 chased single rounds' noise, mostly into K = 1 in the first rounds
      of a prompt, and lost 3-5% of the best fixed K's tokens per unit of time.
    plain_cost: with K = 0 in `ks`, the time of a plain AR round (one that never calls the drafter; a K = 0 round
      keeps the drafter in step). A job runs plain from its start where K = 0 at this cost is the best choice then,
      and from a later round where it beats that round's drafted K. None: measured with the costs (where they are
      measured), else never plain."""

    ks: tuple[int, ...] = (1, 2, 4, 8)
    costs: tuple[float, ...] | None = None
    decay: float = 0.99
    prior: float | None = None
    prior_weight: float = 20.0
    plain_cost: float | None = None

    def __post_init__(self):
        ks = tuple(self.ks)
        if not ks or any(not isinstance(k, int) or k < 0 for k in ks) or list(ks) != sorted(set(ks)):
            raise DrafterError(
                f"adaptive K needs increasing distinct integers >= 0, e.g. 1,2,4,8 or 0,1,2,4,8; got {list(ks)}"
            )
        if ks[-1] == 0:
            raise DrafterError("adaptive K needs a K >= 1 besides 0 (K = 0 drafts nothing); e.g. 0,1,2,4")
        object.__setattr__(self, "ks", ks)
        if self.costs is not None:
            costs = tuple(float(c) for c in self.costs)
            if len(costs) != len(ks) or min(costs) <= 0:
                raise DrafterError(f"adaptive K needs one positive round cost per K in {ks}; got {costs}")
            object.__setattr__(self, "costs", costs)
        if self.plain_cost is not None and not self.plain_cost > 0:
            raise DrafterError(f"adaptive K needs a positive plain round cost; got {self.plain_cost}")
        if not (
            0 <= self.decay < 1 and (self.prior is None or 0 < self.prior < 1) and self.prior_weight > 0
        ):
            raise DrafterError(
                "adaptive K needs 0 <= decay < 1, 0 < prior < 1 and prior_weight > 0; got "
                f"decay={self.decay}, prior={self.prior}, prior_weight={self.prior_weight}"
            )

    @classmethod
    def parse(cls, text: str | list[str]) -> AdaptiveK:
        """From '1,2,4,8' (or a list of strings, as absl's list flags give)."""
        parts = text.split(",") if isinstance(text, str) else text
        try:
            return cls(tuple(int(p) for p in parts))
        except ValueError as err:
            if "adaptive K" in str(err):
                raise
            raise DrafterError(f"cannot read adaptive K {text!r}: give draft lengths like 1,2,4,8") from err

    @property
    def k_max(self) -> int:
        return self.ks[-1]

    def describe(self) -> str:
        return f"adaptive K in {{{', '.join(map(str, self.ks))}}}"

    @property
    def unmeasured(self) -> AdaptiveK:
        """This policy without its costs and prior: the compiled loop's static part (`measured` holds them)."""
        return dataclasses.replace(self, costs=None, prior=None, plain_cost=None)

    def measured(self, forced: int = -1, rounds: int = 0, plain: bool = False) -> Measured:
        """The costs and prior as data (`forced` >= 0: every round drafts ks[forced], for `rounds` rounds; the
        costs and prior may then be unknown; `plain`: the job runs plain)."""
        if forced < 0 and (self.costs is None or self.prior is None):
            raise DrafterError("adaptive K has no round costs or prior yet: calibrate it first")
        costs = jnp.ones(len(self.ks)) if self.costs is None else jnp.asarray(self.costs)
        prior = 0.5 if self.prior is None else self.prior
        never = float(jnp.finfo(jnp.float32).max)  # x rounds: inf, or 0 for no rounds (not inf x 0 = nan)
        plain_cost = 0.0 if plain else never if self.plain_cost is None else self.plain_cost
        return Measured(
            costs.astype(jnp.float32),
            jnp.float32(prior),
            jnp.int32(forced),
            jnp.int32(rounds),
            jnp.float32(plain_cost),
        )

    def zeros(self, remaining_B, measured: Measured) -> Estimate:
        """The estimate before any round, with `remaining_B` tokens to emit in each row (0: done), and whether the
        job runs plain: K = 0 at a plain round's cost is the best choice now."""
        counts_2K = jnp.zeros((2, self.k_max), jnp.float32)
        choice, plain = self.decide(counts_2K, remaining_B, measured)
        return Estimate(counts_2K, choice, measured, plain)

    def alpha(self, estimate_2K, prior):
        """[K_max] the per-position acceptance estimate: each position's counts plus `prior_weight` pseudo
        row-rounds at the rate of all positions pooled (itself shrunk towards `prior`)."""
        accepted, proposed = estimate_2K
        w = self.prior_weight
        pooled = (accepted.sum() + w * prior) / (proposed.sum() + w)
        return (accepted + w * pooled) / (proposed + w)

    def pick(self, counts_2K, remaining_B, measured: Measured):
        """[] index into `ks` of the best K for rows with `remaining_B` tokens left (the smaller on ties), or the
        forced one."""
        return self.decide(counts_2K, remaining_B, measured)[0]

    def decide(self, counts_2K, remaining_B, measured: Measured):
        """(`pick`'s K, [] whether K = 0 at a plain round's cost would be the best choice instead: never without
        K = 0 in the set), from one evaluation of each K's expected rounds to finish x its cost."""
        rounds = self.expected_rounds(counts_2K, remaining_B, measured.prior)
        best = jnp.argmin(rounds * measured.costs).astype(jnp.int32)
        choice = jnp.where(measured.forced >= 0, measured.forced, best)
        if self.ks[0] != 0:
            return choice, jnp.bool_(False)
        return choice, jnp.argmin(rounds * measured.costs.at[0].set(measured.plain_cost)) == 0

    def expected_rounds(self, counts_2K, remaining_B, prior):
        """[len(ks)] the expected rounds until every row has its `remaining_B` tokens, each round drafting ks[i]."""
        tokens_KJ = tokens_per_round_distributions(self.alpha(counts_2K, prior))
        drafting = jnp.asarray([k - 1 for k in self.ks if k > 0])
        # every K at once: a round runs this, and a few batched operations cost less than a few per K
        rounds = jax.vmap(expected_rounds_to_finish, (0, None))(tokens_KJ[drafting], remaining_B)
        if self.ks[0] == 0:  # K = 0: a token a round
            rounds = jnp.concatenate([jnp.max(remaining_B).astype(jnp.float32)[None], rounds])
        return rounds

    def choose(self, estimate: Estimate):
        """[] index into `ks` of this round's K, picked when the round before was observed."""
        return estimate.choice

    def observe(self, estimate: Estimate, k: int, n_accepted_B, active_B, remaining_B) -> Estimate:
        """The estimate after a round that proposed `k` tokens to the `active_B` rows and accepted `n_accepted_B`,
        leaving `remaining_B` tokens to emit: position i was proposed with all before it accepted when n >= i
        (i < k), accepted when n > i."""
        pos = jnp.arange(self.k_max)[None]
        n = n_accepted_B[:, None]
        live = active_B[:, None] & (pos < k)
        counts = jnp.stack([jnp.sum(live & (n > pos), 0), jnp.sum(live & (n >= pos), 0)])
        counts_2K = self.decay * estimate.counts_2K + counts.astype(jnp.float32) / n_accepted_B.shape[0]
        choice, plain_wins = self.decide(counts_2K, remaining_B, estimate.measured)
        # plain from here where a plain round beats the drafted K the loop would run
        plain = estimate.plain | (plain_wins & (choice > 0) & (estimate.measured.forced < 0))
        return estimate.replace(counts_2K=counts_2K, choice=choice, plain=plain)
