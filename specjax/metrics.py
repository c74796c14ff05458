"""Acceptance statistics and speed metrics, each defined once (docs/metrics.md repeats the formulas)."""

from __future__ import annotations

import numpy as np


def summarize(stats) -> dict:
    """Metrics of a speculative run from its on-device `SpecStats`.

    tau: tokens emitted per target verification pass, bonus included = sum(emitted) / sum(row_rounds).
    alpha_i: fraction of rounds in which draft position i was accepted given all before it were.
    hist: rounds by number of draft tokens accepted (0..K).
    Counts are on emitted tokens: accepted drafts cut by EOS or max_new_tokens are not accepted, and where a
    round is cut before the token after its accepted drafts, the position after the emitted ones is censored
    (neither accepted nor reached), whatever its verdict.
    draft_efficiency: accepted draft tokens / drafted (verified) tokens, each round's depth summed.
    acceptance_rate: the i.i.d. model's a (Leviathan et al.), estimated as accepted draft tokens / draft
    positions reached (each reached position a Bernoulli(a) trial).
    """
    hist = np.asarray(stats.accepted_hist)
    drafted = int(np.dot(np.arange(hist.shape[0]), stats.k_hist))  # adaptive K: each round's own depth
    passes = int(np.sum(stats.row_rounds))
    accepted = np.asarray(stats.accepted_at)
    reached = np.asarray(stats.reached_at)
    return {
        "tau": float(np.sum(stats.emitted)) / max(passes, 1),
        "alpha": np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan),
        "hist": hist,
        "draft_efficiency": float(accepted.sum()) / max(drafted, 1),
        "acceptance_rate": float(accepted.sum()) / max(int(reached.sum()), 1),
        "target_passes": passes,
        "rounds": int(stats.rounds),
    }


def pooled(stats_list) -> dict:
    """`summarize` of several runs' statistics together (e.g. one per prompt)."""
    import jax

    return summarize(jax.tree.map(lambda *xs: np.sum(xs, axis=0), *stats_list))


def speedup(ar_seconds: float, spec_seconds: float) -> float:
    """AR wall time / speculative wall time for the same prompts, process and target."""
    return ar_seconds / spec_seconds


def loop_efficiency(draft_s: float, verify_s: float, round_s: float) -> float:
    """(draft time + verify time) / measured round time, the model calls timed on their own: 1.0 means the
    loop adds nothing. Draft time is K draft steps (x draft-step time for a draft model)."""
    return (draft_s + verify_s) / round_s
