"""Draft shapes: `Chain`, static `Tree` and EAGLE-2-style `DynamicTree`, each knowing its depth, node count,
cache slots, on-device layout and how an autoregressive drafter searches it (`specjax.drafting.search`).

Static trees are lists of paths (Medusa's format) turned once, in numpy, into index arrays.

A path `(r_1, ..., r_d)` names the node reached by taking the r_1-th candidate after the root, then the
r_2-th candidate after that, ... (rank among the parent's candidates, 0 = best). Node 0 is the root
(the pending token); nodes 1..N are sorted by depth, then path, so parents precede children.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from specjax.drafting import search
from specjax.drafting.layouts import ChainLayout, TreeLayout
from specjax.errors import TreeError


@dataclasses.dataclass(frozen=True)
class Chain:
    """K draft tokens in a line."""

    k: int
    dynamic = False  # the layout is fixed before drafting
    reread = 2  # tokens an autoregressive drafter re-reads each round (see DraftModel.propose)

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise TreeError(f"K (draft tokens per round) must be an integer >= 1, got {self.k!r}")

    @property
    def depth(self) -> int:
        return self.k

    @property
    def size(self) -> int:
        """Tokens one verification pass scores: the pending token and the draft."""
        return self.k + 1

    @property
    def width(self) -> int:
        """Candidates drafted per node at most (1 for a chain): no more than the vocabulary."""
        return 1

    @property
    def cache_slots(self) -> int:
        """Cache slots written past the sequence in one round (by the drafter or the verification)."""
        return self.k + 1

    def describe(self) -> str:
        return f"K={self.k}"

    def layout(self, batch: int) -> ChainLayout:
        return ChainLayout(self.k)

    def search(self, step, sampler, root_logits_BV, root_ctx, pos0_B, cache, key):
        return search.chain(step, sampler, self.k, root_logits_BV, root_ctx, pos0_B, cache, key)

    def keep_path(self, cache, path_BD, n_accepted_B):
        """A drafter's cache after verification: a chain's accepted tokens already sit in order."""
        return cache


@dataclasses.dataclass(frozen=True)
class Tree:
    paths: tuple[tuple[int, ...], ...]  # node i >= 1 is paths[i - 1]
    dynamic = False
    reread = 2

    def __post_init__(self):
        paths = [tuple(int(r) for r in p) for p in self.paths]
        if not paths:
            raise TreeError("a tree needs at least one node; e.g. [[0]] is a chain of one token")
        seen = set()
        for p in paths:
            if not p or min(p) < 0:
                raise TreeError(f"path {list(p)} must be a non-empty list of ranks >= 0")
            if p in seen:
                raise TreeError(f"duplicate path {list(p)}")
            seen.add(p)
        for p in paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise TreeError(f"path {list(p)} has no parent: add {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
                raise TreeError(
                    f"path {list(p)} skips a sibling: add {list(p[:-1] + (p[-1] - 1,))} "
                    "(candidate ranks of a node must be 0, 1, 2, ...)"
                )
        object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))

    @property
    def size(self) -> int:
        """Nodes including the root: the tokens one verification pass scores."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max(map(len, self.paths))

    @functools.cached_property
    def arrays(self) -> TreeArrays:
        return TreeArrays.build(self.paths)

    def is_chain(self) -> bool:
        return all(p == (0,) * len(p) for p in self.paths)

    @property
    def width(self) -> int:
        """Candidates drafted per node at most (1 for a chain): no more than the vocabulary."""
        return max(p[-1] + 1 for p in self.paths)

    @property
    def cache_slots(self) -> int:
        return self.size

    def describe(self) -> str:
        return f"a tree of {self.size} nodes"

    def layout(self, batch: int) -> TreeLayout:
        return TreeLayout.from_arrays(self.arrays, batch)

    def search(self, step, sampler, root_logits_BV, root_ctx, pos0_B, cache, key):
        return search.static_tree(step, sampler, self, root_logits_BV, root_ctx, pos0_B, cache, key)

    def keep_path(self, cache, path_BD, n_accepted_B):
        """A drafter's cache after verification: the accepted path gathered into its committed region
        (nodes at the last depth were never fed: they stay stale)."""
        return cache.compact(path_BD - 1, jnp.minimum(n_accepted_B, self.depth - 1))


@dataclasses.dataclass(frozen=True, eq=False)
class TreeArrays:
    parent: np.ndarray  # [N+1] parent node (root: 0)
    depth: np.ndarray  # [N+1] root 0
    rank: np.ndarray  # [N+1] candidate rank among siblings (root: 0)
    mask: np.ndarray  # [N+1, N+1] bool: node i sees node j iff j is i or an ancestor of i
    children: np.ndarray  # [N+1, W] child nodes in rank order, -1 padded
    levels: tuple  # levels[d] = node indices at depth d (levels[0] = [0])
    ancestors: np.ndarray  # [N+1, D] node's path from depth 1 down to itself, 0 padded

    @classmethod
    def build(cls, paths):
        index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        n = len(index)
        parent = np.array([0] + [index[p[:-1]] for p in paths], np.int32)
        depth = np.array([0] + [len(p) for p in paths], np.int32)
        rank = np.array([0] + [p[-1] for p in paths], np.int32)
        mask = np.zeros((n, n), bool)
        ancestors = np.zeros((n, depth.max()), np.int32)
        for p, i in index.items():
            for d in range(len(p) + 1):
                mask[i, index[p[:d]]] = True
            for d in range(1, len(p) + 1):
                ancestors[i, d - 1] = index[p[:d]]
        width = max(int(np.sum(parent[1:] == i)) for i in range(n))
        children = np.full((n, width), -1, np.int32)
        for i in range(1, n):
            children[parent[i], rank[i]] = i
        levels = tuple(np.flatnonzero(depth == d).astype(np.int32) for d in range(depth.max() + 1))
        return cls(parent, depth, rank, mask, children, levels, ancestors)


def chain(k: int) -> Tree:
    """K tokens in a line: the chain as a tree."""
    return Tree(tuple((0,) * d for d in range(1, k + 1)))


def balanced(width: int, depth: int) -> Tree:
    """Every node has `width` candidates, `depth` levels deep."""
    import itertools

    return Tree(tuple(p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)))


# Stand-in per-rank acceptance of a drafting head (top-1 .. top-10), for shaping sparse trees.
RANK_ACCEPTANCE = (0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.008, 0.006)


def medusa_like(budget: int = 60, max_depth: int = 5, head_decay: float = 0.7) -> Tree:
    """A sparse tree shaped like the Medusa paper's: wide at depth 1, narrowing with depth.

    Nodes are added greedily by the probability that their whole path is accepted, with per-rank
    acceptance `RANK_ACCEPTANCE` scaled by `head_decay` per depth (later heads guess worse): the
    construction of Medusa's sparse trees, on stand-in numbers."""
    score = lambda p: float(np.prod([RANK_ACCEPTANCE[r] * head_decay**d for d, r in enumerate(p)]))
    chosen, frontier = [], [(0,)]
    while len(chosen) < budget:
        best = max(frontier, key=score)
        frontier.remove(best)
        chosen.append(best)
        if len(best) < max_depth:
            frontier.append(best + (0,))
        if best[-1] + 1 < len(RANK_ACCEPTANCE):
            frontier.append(best[:-1] + (best[-1] + 1,))
    return Tree(tuple(chosen))


PRESETS = {"chain4": chain(4), "balanced_2x3": balanced(2, 3), "medusa60": medusa_like(60)}


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style dynamic tree with static budgets: expand the `top_k` best frontier nodes by `top_k`
    children each for `depth` levels (scored by cumulative draft log-probability), then keep the best
    `total_tokens` nodes. Shapes are static; which nodes are kept is decided on device."""

    top_k: int
    depth: int
    total_tokens: int
    dynamic = True  # the layout comes out of the search

    def __post_init__(self):
        most = self.top_k + (self.depth - 1) * self.top_k**2
        if min(self.top_k, self.depth, self.total_tokens) < 1 or self.total_tokens > most:
            raise TreeError(
                f"dynamic tree needs top_k, depth >= 1 and 1 <= total_tokens <= {most} "
                f"(the candidates it generates); got {self}"
            )

    @property
    def size(self) -> int:
        return self.total_tokens + 1

    @property
    def reread(self) -> int:
        return self.depth + 1  # the drafter's cache keeps nothing of the tree

    @property
    def width(self) -> int:
        """Candidates drafted per node at most (1 for a chain): no more than the vocabulary."""
        return self.top_k

    @property
    def cache_slots(self) -> int:
        return max(self.size, (self.depth - 1) * self.top_k + 1, self.depth + 1)

    def describe(self) -> str:
        return f"a dynamic tree of {self.size} nodes"

    def layout(self, batch: int):
        raise ValueError(f"{self} has no fixed layout: its drafter builds one while searching")

    def search(self, step, sampler, root_logits_BV, root_ctx, pos0_B, cache, key):
        return search.dynamic_tree(step, self, root_logits_BV, root_ctx, pos0_B, cache)

    def keep_path(self, cache, path_BD, n_accepted_B):
        return cache


def parse_tree(spec: str) -> Tree | DynamicTree | None:
    """'' -> None (a chain of the drafter's K); a preset name; 'dynamic:TOP_K,DEPTH,TOTAL_TOKENS'; or
    paths like '0;1;0,0'."""
    if not spec:
        return None
    if spec in PRESETS:
        return PRESETS[spec]
    try:
        if spec.startswith("dynamic:"):
            top_k, depth, total = (int(x) for x in spec.removeprefix("dynamic:").split(","))
            return DynamicTree(top_k, depth, total)
        return Tree(tuple(tuple(int(r) for r in path.split(",")) for path in spec.split(";")))
    except ValueError as err:
        if isinstance(err, TreeError):
            raise
        raise TreeError(
            f"cannot read tree {spec!r}: use one of {sorted(PRESETS)}, 'dynamic:TOP_K,DEPTH,TOTAL' "
            "or paths like '0;1;0,0'"
        ) from err
