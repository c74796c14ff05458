"""Acceptance rules behind one protocol (`base.AcceptanceRule`), found by name with `get`.

Built in: `tokenwise` (lossless: greedy matching at temperature 0, rejection sampling otherwise), `block`
(lossless: block verification for chains, traversal verification for trees; also as `traversal`) and
`typical_lossy` (Medusa-2 typical acceptance, lossy). A new rule is
one module with a class decorated by `register`, imported here.
"""

from specjax.acceptance import (
    block,  # noqa: F401  (registers "block" and "traversal")
    rejection,  # noqa: F401  (registers the built-in rules)
    typical,  # noqa: F401  (registers "typical_lossy")
)
from specjax.acceptance.base import RULES, AcceptanceRule, get, register

DEFAULT = "tokenwise"

__all__ = ["DEFAULT", "RULES", "AcceptanceRule", "get", "register"]
