"""The acceptance-rule protocol and registry: a rule turns the target's logits over a draft into a verdict.

A rule is a frozen, hashable object (a static argument of the compiled loop) with two entry points, one per
draft layout; both take static-shape arrays and return per-row results, with no host round trip.
Rules are found by name (`--acceptance=NAME`, `GenerateSpec.acceptance`) through `register` / `get`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import jax

from specjax.errors import SamplingError


class AcceptanceRule(Protocol):
    name: ClassVar[str]  # the registry name; a lossy rule says so in it
    lossless: ClassVar[bool]  # True: the output is distributed exactly as sampling from the target

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV) -> tuple[jax.Array, jax.Array]:
        """(n_accepted [B], next_token [B]) for a chain of K draft tokens; `logits_BKV` has K + 1 positions
        (position i scores the token after draft token i - 1); `q_BKV` is None for deterministic drafts."""

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement: bool):
        """(n_accepted [B], next_token [B], path [B, D]: accepted node indices by depth, 0 padded) for a tree
        (`specjax.drafting.layouts.TreeLayout`); `logits_BNV` has N + 1 nodes, the root first."""


RULES: dict[str, type] = {}


def register(rule_cls: type) -> type:
    """Class decorator: makes `rule_cls()` available as `get(rule_cls.name)`."""
    RULES[rule_cls.name] = rule_cls
    return rule_cls


def get(name: str, **settings) -> AcceptanceRule:
    """The registered rule `name` built with `settings`; an unknown name is an error listing the known ones."""
    if name not in RULES:
        raise SamplingError(f"unknown acceptance rule {name!r}; choose one of {sorted(RULES)}")
    return RULES[name](**settings)
