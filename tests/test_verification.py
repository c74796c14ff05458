"""Block and traversal verification, typical acceptance and `specjax.verify_exactness`.

Exactness by enumeration: small vocabularies, random target and draft conditionals for every prefix, every draft
(chain or tree) weighted by its probability, and every pattern of the rule's pass / fail decisions (block: its K
uniform tests, each passing with probability h_i; traversal: each decided node accepted with probability w), the
implementation run once per pattern with thresholds that force it. One round's output (kept prefix, next
token), completed by the target to the draft's depth + 1 tokens, must be distributed as that many tokens of the
target (to float32 rounding: tests/tolerance.py, POSITION_DEPTH stages per position).
"""

import csv
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import child_env
from helpers import SMALL, peaked
from tolerance import approx, assert_close, assert_far

from specjax import acceptance, verify_exactness
from specjax.acceptance.block import Block, block_outcome, block_verification, block_weights
from specjax.acceptance.greedy import greedy_chain
from specjax.acceptance.rejection import acceptance_probs
from specjax.acceptance.traversal import traversal_outcome, traversal_verification
from specjax.acceptance.typical import TypicalLossy
from specjax.decoding import GenerateSpec, speculative_generate
from specjax.drafters.draft_model import DraftModel
from specjax.drafting import registry, trees
from specjax.drafting.layouts import TreeLayout
from specjax.metrics import summarize
from specjax.models.llama import causal_mask, forward, init_cache
from specjax.sampling import Sampler

V = 4
SAMPLERS = [Sampler(0.5), Sampler(1.0), Sampler(1.5, top_k=3), Sampler(1.0, top_p=0.8)]


class Case:
    """Random target and draft logits for every prefix of up to K tokens over V tokens, warped by `sampler`;
    the draft's logits are the target's plus noise (so that drafts are sometimes right). Every draft x^K with
    its probability; `deterministic`: a single draft (each token the draft's argmax) proposed as a point mass."""

    def __init__(self, seed: int, k: int, sampler: Sampler, deterministic: bool = False):
        rng = np.random.default_rng(seed)
        prefixes = [pre for t in range(k + 1) for pre in itertools.product(range(V), repeat=t)]
        logits = rng.normal(size=(len(prefixes), V)) * 2.0
        draft_logits = logits + rng.normal(size=logits.shape) * 1.5
        probs = lambda x: np.asarray(sampler.probs(jnp.asarray(x, jnp.float32)), np.float64)
        p, q = probs(logits), probs(draft_logits)
        index = {pre: i for i, pre in enumerate(prefixes)}
        self.k, self.sampler, self.index, self.logits, self.p = k, sampler, index, logits, p
        if deterministic:
            x = ()
            for _ in range(k):
                x += (int(np.argmax(draft_logits[index[x]])),)
            drafts, self.weight = [x], np.ones(1)
        else:
            drafts = list(itertools.product(range(V), repeat=k))
            self.weight = np.array([np.prod([q[index[d[:i]], d[i]] for i in range(k)]) for d in drafts])
        self.drafts = drafts
        self.draft = jnp.asarray(drafts, jnp.int32)
        self.q = (
            None
            if deterministic
            else jnp.asarray([[q[index[d[:i]]] for i in range(k)] for d in drafts], jnp.float32)
        )
        self.p_BKV = jnp.asarray([[p[index[d[:i]]] for i in range(k + 1)] for d in drafts], jnp.float32)
        self.logits_BKV = jnp.asarray(
            [[logits[index[d[:i]]] for i in range(k + 1)] for d in drafts], jnp.float32
        )

    def cond(self, prefix) -> np.ndarray:
        return self.p[self.index[prefix]] if len(prefix) <= self.k else None

    def target(self) -> np.ndarray:
        """The target's joint distribution of K + 1 tokens [V^(K+1)]."""
        return self.complete({(): 1.0})

    def complete(self, out: dict) -> np.ndarray:
        """Output masses of prefixes, each continued by the target to K + 1 tokens: [V^(K+1)]."""
        full = np.zeros((V,) * (self.k + 1))
        for seq in itertools.product(range(V), repeat=self.k + 1):
            for t in range(self.k + 2):
                mass = out.get(seq[:t], 0.0)
                if mass:
                    full[seq] += mass * np.prod(
                        [self.p[self.index[seq[:i]], seq[i]] for i in range(t, self.k + 1)]
                    )
        return full.reshape(-1)

    def tokenwise_expected_accepted(self) -> float:
        a = np.asarray(acceptance_probs(self.draft, self.q, self.p_BKV), np.float64)
        return float(self.weight @ np.cumprod(a, axis=1).sum(1))


def block_enumerated(case: Case, outcome=block_outcome):
    """(completed output distribution, expected accepted tokens) of block verification, enumerated exactly."""
    h = np.asarray(block_weights(case.draft, case.q, case.p_BKV)[0], np.float64)  # [D, K]
    patterns = np.array(list(itertools.product([True, False], repeat=case.k)))  # [P, K]: test i passes?
    eta = np.where(patterns[:, None], h / 2, (1 + h) / 2)  # [P, D, K] inside the pass / fail interval
    p_pattern = np.prod(np.where(patterns[:, None], h, 1 - h), axis=-1)  # [P, D]
    n_pat, d = p_pattern.shape
    tile = lambda x: None if x is None else jnp.tile(x, (n_pat,) + (1,) * (x.ndim - 1))
    tau, nxt = jax.jit(outcome)(
        jnp.asarray(eta.reshape(-1, case.k), jnp.float32), tile(case.draft), tile(case.q), tile(case.p_BKV)
    )
    tau, nxt = np.asarray(tau), np.asarray(nxt, np.float64)
    mass = (p_pattern * case.weight[None]).reshape(-1)
    out, expected = {}, 0.0
    for row in np.nonzero(mass)[0]:
        kept = case.drafts[row % d][: tau[row]]
        expected += mass[row] * tau[row]
        for y in range(V):
            out[kept + (y,)] = out.get(kept + (y,), 0.0) + mass[row] * nxt[row, y]
    return case.complete(out), expected


CASES = [(k, s) for k in (1, 2, 3) for s in range(len(SAMPLERS))]
POSITION_DEPTH = (
    5  # float32 per position: the warped p and q, the ratio, the residual and its normalisation
)


@pytest.mark.parametrize("k,sampler_index", CASES)
def test_block_output_distribution_is_the_target_s(k, sampler_index):
    for seed, deterministic in [(k * 10 + sampler_index, False), (k * 10 + sampler_index, True)]:
        case = Case(seed, k, SAMPLERS[sampler_index], deterministic)
        out, _ = block_enumerated(case)
        depth = POSITION_DEPTH * (k + 1)
        assert out.sum() == approx(1.0, dtype=jnp.float32, depth=depth)
        assert_close(out, case.target(), dtype=jnp.float32, depth=depth)


def test_block_negative_control_resampling_from_p_fails():
    def broken(eta, draft, q, p):
        tau, _ = block_outcome(eta, draft, q, p)
        return tau, jnp.take_along_axis(p, tau[:, None, None], axis=1)[:, 0]

    case = Case(3, 2, Sampler(1.0))
    out, _ = block_enumerated(case, broken)
    assert_far(out, case.target(), dtype=jnp.float32, depth=POSITION_DEPTH * 3)


def test_block_accepts_at_least_as_many_tokens_as_tokenwise():
    gains = []
    for k, s in CASES:
        for seed in range(2):
            case = Case(100 + seed, k, SAMPLERS[s])
            _, block_tau = block_enumerated(case)
            tokenwise = case.tokenwise_expected_accepted()
            same = approx(tokenwise, dtype=jnp.float32, depth=POSITION_DEPTH * (k + 1))
            assert block_tau >= tokenwise or block_tau == same, (k, s, seed)
            gains.append(block_tau - tokenwise)
            if k == 1:  # one token: the same rule
                assert block_tau == same
    assert max(gains) > 1e-2  # strictly better somewhere


def test_block_sampling_follows_its_distribution():
    """The sampled rule (its own uniforms) emits first tokens distributed as the target's p at the root."""
    case = Case(5, 2, Sampler(1.0))
    n = 100_000
    rows = np.random.default_rng(0).choice(len(case.drafts), n, p=case.weight / case.weight.sum())
    tau, nxt = block_verification(jax.random.key(1), case.draft[rows], case.q[rows], case.p_BKV[rows])
    first = np.where(np.asarray(tau) > 0, np.asarray(case.draft[rows, 0]), np.asarray(nxt))
    np.testing.assert_allclose(
        np.bincount(first, minlength=V) / n, case.cond(()), atol=4 * np.sqrt(0.25 / n)
    )


@pytest.mark.parametrize("rule", [Block(), TypicalLossy(), TypicalLossy(epsilon=1.0, delta=9.0)])
def test_greedy_samplers_give_greedy_matching(rule):
    key = jax.random.key(0)
    logits = jax.random.normal(key, (64, 4, V)) * 3
    draft = jnp.where(jax.random.uniform(key, (64, 3)) < 0.7, jnp.argmax(logits[:, :3], -1), 0).astype(
        jnp.int32
    )
    n, nxt = rule.chain(key, Sampler(), draft, None, logits)
    n_ref, nxt_ref = greedy_chain(draft, logits)
    assert n.tolist() == n_ref.tolist() and nxt.tolist() == nxt_ref.tolist()


# --- trees: traversal verification ----------------------------------------------------------------------


class TreeCase:
    """Random target / draft logits for every token prefix over V tokens, and every assignment of tokens to the
    nodes of `tree` with its probability: siblings drawn from the draft at their parent without replacement (in
    rank order, as the Gumbel top-k search does; a sibling beyond the draft's support gets a zero-probability
    token, which verification skips) or with replacement; `deterministic`: each node the parent's rank-th most
    likely draft token, proposed as a point mass."""

    def __init__(self, tree, seed, sampler, deterministic=False, without_replacement=True):
        rng = np.random.default_rng(seed)
        arr, depth = tree.arrays, tree.depth
        prefixes = [pre for t in range(depth + 1) for pre in itertools.product(range(V), repeat=t)]
        index = {pre: i for i, pre in enumerate(prefixes)}
        logits = rng.normal(size=(len(prefixes), V)) * 2.0
        draft_logits = logits + rng.normal(size=logits.shape) * 1.5
        probs = lambda x: np.asarray(sampler.probs(jnp.asarray(x, jnp.float32)), np.float64)
        p, q = probs(logits), probs(draft_logits)
        n_nodes = tree.size - 1
        prefix_of = lambda tok, node: (
            tuple(int(tok[a - 1]) for a in arr.ancestors[node] if a > 0) if node else ()
        )
        drafts, weights = [], []

        def assign(node, tok, w):
            if node > n_nodes:
                drafts.append(tuple(tok)), weights.append(w)
                return
            parent = arr.parent[node]
            dist = q[index[prefix_of(tok, parent)]]
            if deterministic:
                order = np.argsort(-draft_logits[index[prefix_of(tok, parent)]], kind="stable")
                return assign(node + 1, tok + [int(order[arr.rank[node]])], w)
            used = [tok[s - 1] for s in arr.children[parent] if 0 < s < node] if without_replacement else []
            left = sum(dist[x] for x in range(V) if x not in used)
            options = [(x, dist[x] / left) for x in range(V) if x not in used and left > 0 and dist[x] > 0]
            for x, px in options or [(next(x for x in range(V) if x not in used), 1.0)]:
                assign(node + 1, tok + [x], w * px)

        assign(1, [], 1.0)
        self.tree, self.arr, self.p, self.index, self.prefix_of = tree, arr, p, index, prefix_of
        self.deterministic, self.without_replacement = deterministic, without_replacement
        self.drafts, self.weight, self.q = drafts, np.array(weights), q
        self.draft = jnp.asarray(drafts, jnp.int32)
        self.p_BNV = jnp.asarray(
            [[p[index[prefix_of(d, n)]] for n in range(n_nodes + 1)] for d in drafts], jnp.float32
        )
        self.q_BNV = None
        if not deterministic:
            rows = [[q[index[prefix_of(d, arr.parent[n])]] for n in range(1, n_nodes + 1)] for d in drafts]
            self.q_BNV = jnp.asarray(rows, jnp.float32)

    def complete(self, out: dict) -> np.ndarray:
        depth = self.tree.depth
        full = np.zeros((V,) * (depth + 1))
        for seq in itertools.product(range(V), repeat=depth + 1):
            for t in range(depth + 2):
                mass = out.get(seq[:t], 0.0)
                if mass:
                    full[seq] += mass * np.prod(
                        [self.p[self.index[seq[:i]], seq[i]] for i in range(t, depth + 1)]
                    )
        return full.reshape(-1)

    def target(self) -> np.ndarray:
        return self.complete({(): 1.0})

    def tokenwise_expected_accepted(self) -> float:
        """Token-wise tree sampling's expected accepted count (its recursion, written out in numpy)."""
        arr, p, index = self.arr, self.p, self.index

        def value(node, target, tok):
            total, reach = 0.0, 1.0
            dist = None if self.deterministic else self.q[index[self.prefix_of(tok, node)]].copy()
            for child in (c for c in arr.children[node] if c > 0):
                x = tok[child - 1]
                q_x = np.eye(V)[x] if dist is None else dist
                if q_x[x] == 0:
                    continue
                a = min(1.0, target[x] / q_x[x])
                total += reach * a * (1 + value(child, p[index[self.prefix_of(tok, child)]], tok))
                reach *= 1 - a
                r = np.maximum(target - q_x, 0)
                target = r / r.sum() if r.sum() > 0 else target
                if dist is not None and self.without_replacement:
                    dist = dist * (1 - np.eye(V)[x])
                    dist = dist / dist.sum() if dist.sum() > 0 else dist
            return total

        return float(sum(w * value(0, p[index[()]], d) for d, w in zip(self.drafts, self.weight)))


def traversal_enumerated(case: TreeCase):
    """(completed output distribution, expected accepted tokens) of traversal verification: every draft, every
    pattern of pass / fail decisions (thresholds -1 / 2), each counted once (decisions it never read: pass)."""
    n_nodes = case.tree.size - 1
    patterns = np.array(list(itertools.product([True, False], repeat=n_nodes + 1)))
    n_pat, d = len(patterns), len(case.drafts)
    rep = lambda x: None if x is None else jnp.repeat(x, n_pat, axis=0)
    t = jnp.asarray(np.tile(np.where(patterns, -1.0, 2.0), (d, 1)), jnp.float32)
    layout = TreeLayout.from_arrays(case.arr, n_pat * d)
    n, nxt, path, prob, decided = map(
        np.asarray,
        traversal_outcome(
            t, layout, rep(case.draft), rep(case.q_BNV), rep(case.p_BNV), case.without_replacement
        ),
    )
    out, expected = {}, 0.0
    for row in range(n_pat * d):
        bits = patterns[row % n_pat]
        unread = bits[decided[row] :].all() and (
            n[row] > 0 or bits[decided[row] - 1]
        )  # the root always passes
        mass = case.weight[row // n_pat] * prob[row] * unread
        if mass == 0:
            continue
        draft = case.drafts[row // n_pat]
        kept = tuple(draft[a - 1] for a in path[row] if a > 0)
        expected += mass * n[row]
        for y in range(V):
            out[kept + (y,)] = out.get(kept + (y,), 0.0) + mass * nxt[row, y]
    return case.complete(out), expected


TREES = {
    "2x2": trees.Tree(((0,), (1,), (0, 0), (1, 0))),
    "fork": trees.Tree(((0,), (0, 0), (0, 1))),
    "chain": trees.chain(2),
}
TREE_CASES = [
    (name, s, mode)
    for name, samplers in (("2x2", (0, 1, 2, 3)), ("fork", (1, 3)), ("chain", (0, 2)))
    for s in samplers
    for mode in ("without_replacement", "with_replacement", "deterministic")
]


@pytest.mark.parametrize("tree,sampler_index,mode", TREE_CASES)
def test_traversal_output_distribution_is_the_target_s(tree, sampler_index, mode):
    case = TreeCase(
        TREES[tree],
        sampler_index,
        SAMPLERS[sampler_index],
        mode == "deterministic",
        mode == "without_replacement",
    )
    out, traversal_tau = traversal_enumerated(case)
    depth = POSITION_DEPTH * (len(TREES[tree].paths) + 1)  # every node on the way, then the completion
    assert out.sum() == approx(1.0, dtype=jnp.float32, depth=depth)
    assert_close(out, case.target(), dtype=jnp.float32, depth=depth)
    tokenwise = case.tokenwise_expected_accepted()
    same = approx(tokenwise, dtype=jnp.float32, depth=depth)
    assert traversal_tau >= tokenwise or traversal_tau == same  # at least token-wise tree sampling's tokens
    if (
        mode == "deterministic"
    ):  # point masses: token-wise already accepts each path with its target probability
        assert traversal_tau == same


def test_traversal_accepts_more_than_tokenwise_on_sampled_trees():
    gains = [
        traversal_enumerated(case)[1] - case.tokenwise_expected_accepted()
        for case in (TreeCase(TREES["2x2"], seed, Sampler(1.0)) for seed in range(3))
    ]
    assert min(gains) > 1e-3, gains


def test_traversal_negative_control_without_residual_fails(monkeypatch):
    from specjax.acceptance import traversal

    real = traversal.absorb
    monkeypatch.setattr(
        traversal, "absorb", lambda w, P, Q: (real(w, P, Q)[0], P)
    )  # keep p after a rejection
    case = TreeCase(TREES["2x2"], 0, Sampler(1.0))
    out, _ = traversal_enumerated(case)
    assert_far(out, case.target(), dtype=jnp.float32, depth=POSITION_DEPTH * 5)


def test_traversal_sampling_follows_its_distribution():
    case = TreeCase(TREES["2x2"], 4, Sampler(1.0))
    n = 100_000
    rows = np.random.default_rng(0).choice(len(case.drafts), n, p=case.weight / case.weight.sum())
    layout = TreeLayout.from_arrays(case.arr, n)
    n_acc, nxt, path = traversal_verification(
        jax.random.key(1), layout, case.draft[rows], case.q_BNV[rows], case.p_BNV[rows], True
    )
    first_node = np.asarray(path[:, 0])
    first = np.where(
        np.asarray(n_acc) > 0, np.asarray(case.draft[rows])[np.arange(n), first_node - 1], np.asarray(nxt)
    )
    freq = np.bincount(first, minlength=V) / n
    np.testing.assert_allclose(freq, case.p[case.index[()]], atol=4 * np.sqrt(0.25 / n))


# --- end to end -----------------------------------------------------------------------------------------------


def test_typical_reduces_to_greedy_when_only_argmax_tokens_can_pass():
    """epsilon >= 1/2 and delta >= V/2: the threshold is at least 1/2, so only argmax tokens pass, and the next
    token is the argmax: at temperature 1 (the drafter samples too) every token the rounds emit is the target's
    argmax after the tokens before it (the first comes from the prefill, sampled by the loop, not the rule)."""
    cfg, (graphdef, params) = SMALL, peaked(SMALL, 0)  # peaked: argmax tokens often have p > 1/2
    prompts, sampler = [[1, 3], [1], [1, 5, 2, 7, 7]], Sampler(1.0)
    rule = acceptance.get("typical_lossy", epsilon=0.5, delta=cfg.vocab_size / 2)
    logits = jax.random.normal(jax.random.key(0), (256, 4, V)) * 0.7
    draft = jax.random.randint(jax.random.key(1), (256, 3), 0, V)
    n, nxt = rule.chain(None, sampler, draft, None, logits)
    top = np.asarray(jnp.argmax(logits, -1))
    emitted = np.where(
        np.arange(4) < np.asarray(n)[:, None], np.pad(np.asarray(draft), ((0, 0), (0, 1))), -1
    )
    emitted[np.arange(256), np.asarray(n)] = np.asarray(nxt)
    assert ((emitted == top) | (emitted == -1)).all()  # every emitted token is the greedy one there
    assert (np.asarray(n) <= np.asarray(greedy_chain(draft, logits)[0])).all()

    spec = GenerateSpec(30, sampler, eos_id=None, acceptance=rule)
    gen = speculative_generate(
        cfg, graphdef, params, DraftModel(cfg, graphdef, 3, sampler), params, prompts, spec
    )
    assert summarize(gen.stats)["tau"] > 1.5  # drafts were accepted, not just corrected
    new = np.asarray(gen.tokens)
    width = max(map(len, prompts)) + new.shape[1]
    seqs = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        seqs[row, : len(p) + new.shape[1]] = p + new[row].tolist()
    positions = jnp.broadcast_to(jnp.arange(width), seqs.shape)
    cache = init_cache(cfg, len(prompts), width)
    target_argmax = np.asarray(
        jnp.argmax(forward(graphdef, params, seqs, positions, cache, causal_mask(width))[0], -1)
    )
    for row, p in enumerate(prompts):
        np.testing.assert_array_equal(new[row, 1:], target_argmax[row, len(p) : len(p) + new.shape[1] - 1])


# --- typical acceptance: its distance from exact sampling ---------------------------------------------------


def typical_enumerated(case: Case, rule: TypicalLossy) -> np.ndarray:
    n, nxt = rule.chain(None, case.sampler, case.draft, case.q, case.logits_BKV)
    out = {}
    for d, n_i, y, w in zip(case.drafts, np.asarray(n), np.asarray(nxt), case.weight):
        key = d[:n_i] + (int(y),)
        out[key] = out.get(key, 0.0) + w
    return case.complete(out)


def test_typical_total_variation_is_measured(capsys):
    """One round of typical acceptance (Medusa defaults), completed by the target: its total-variation distance
    from K + 1 tokens of the target, exactly, on small vocabularies (reported, and clearly not 0)."""
    rows = []
    for k in (1, 2, 3):
        for temperature in (0.6, 1.0, 1.3):
            tvs = []
            for seed in range(3):
                case = Case(200 + seed, k, Sampler(temperature))
                out = typical_enumerated(case, TypicalLossy())
                assert out.sum() == approx(1.0, dtype=jnp.float32, depth=POSITION_DEPTH * (k + 1))
                tvs.append(0.5 * np.abs(out - case.target()).sum())
            rows.append((k, temperature, float(np.mean(tvs))))
    with capsys.disabled():
        print("\ntypical_lossy (epsilon 0.09, delta 0.3), one round, V=4: mean TV from the target")
        for k, t, tv in rows:
            print(f"  K={k} T={t}: TV {tv:.3f}")
    assert all(tv > 0.05 for *_, tv in rows)


def test_typical_first_token_law_matches_enumeration():
    rule = TypicalLossy()
    for seed in range(3):
        case = Case(300 + seed, 1, Sampler(1.0))
        out = typical_enumerated(case, rule).reshape(V, V).sum(1)  # the round's first token
        q_root = case.q[:1, 0]
        law = np.asarray(rule.first_token_law(case.sampler, q_root, case.logits_BKV[:1, 0]))[0]
        assert_close(law, out, dtype=jnp.float32, depth=POSITION_DEPTH * 2)


def test_typical_tree_on_a_chain_agrees_with_the_chain_rule():
    rule, sampler, b, k = TypicalLossy(epsilon=0.3, delta=0.6), Sampler(0.8), 256, 3
    logits = jax.random.normal(jax.random.key(2), (b, k + 1, V)) * 2.5
    draft = jax.random.randint(jax.random.key(3), (b, k), 0, V)
    n, nxt = rule.chain(None, sampler, draft, None, logits)
    layout = TreeLayout.from_arrays(trees.chain(k).arrays, b)
    n_t, nxt_t, path = rule.tree(None, sampler, layout, draft, None, logits, False)
    assert n_t.tolist() == n.tolist() and nxt_t.tolist() == nxt.tolist()
    assert 0 < float(jnp.mean(n)) < k
    np.testing.assert_array_equal(
        np.asarray(path), np.where(np.arange(1, k + 1) <= np.asarray(n)[:, None], np.arange(1, k + 1), 0)
    )


# --- verify_exactness -----------------------------------------------------------------------------------------


# Drafts that the tiny target rejects often show the broken control at p < 1e-20 with 4,000 samples per rule;
# with the others (rarely rejected: the control differs only on the few rejected drafts) 4,000 samples left the
# control inconclusive for one rule or another (p 0.003-0.2), and the default of 10,000 catches it (p < 1e-8).
OFTEN_REJECTED = (
    "draft_model",
    "eagle3",
    "hybrid",
    "layer_skip",
    "lookahead",
    "ngram",
    "quantized",
    "retrieval",
)


# distill drafts with draft_model's code (a DistilledDraft is a DraftModel): its case would repeat draft_model's;
# test_quantize runs quantized's case with 2,000 samples (its control shows at p < 1e-20 there)
@pytest.mark.parametrize("drafter", [n for n in registry.names() if n not in ("distill", "quantized")])
def test_verify_exactness_passes_every_drafter_and_catches_its_controls(drafter):
    rules = ("tokenwise", "block") + (("typical_lossy",) if drafter == "draft_model" else ())
    samples = 4_000 if drafter in OFTEN_REJECTED else 0
    report = verify_exactness.verify(drafter, rules, greedy=False, samples=samples)
    verdicts = {r.rule: r.verdict(report.alpha) for r in report.rules}
    print(report.format())
    assert verdicts["tokenwise"] == verdicts["block"] == "PASS", report.format()
    if "typical_lossy" in verdicts:
        assert verdicts["typical_lossy"] == "FAIL (lossy by design)" and not report.passed


def test_a_pool_of_rare_cells_expecting_under_five_joins_the_smallest_large_cell():
    """One observation in cells that together expect 0.1 is no evidence against the distribution (kept as a cell
    of its own it gave p = 0.017); a real departure still fails, and an impossible outcome fails outright."""
    probs = np.array([0.5, 0.4999, 0.0001, 0.0])
    gof = verify_exactness.goodness_of_fit
    assert gof(np.array([500, 499, 1, 0]), probs) > 0.5
    assert gof(np.array([600, 399, 1, 0]), probs) < 1e-6  # the control
    assert gof(np.array([500, 499, 0, 1]), probs) == 0.0


@dataclasses.dataclass(frozen=True)
class BonusFromDepthBefore:
    """Token-wise rejection sampling, except that after a full acceptance the bonus token is drawn from the
    target's distribution one position early: wrong at new token K + 2 only."""

    name = "bonus_from_depth_before"
    lossless = True

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        n, token = acceptance.get("tokenwise").chain(key, sampler, draft_BK, q_BKV, logits_BKV)
        k = draft_BK.shape[1]
        early = sampler.sample(jax.random.fold_in(key, 7), logits_BKV[:, k - 1])
        return n, jnp.where(n == k, early, token)


def test_verify_exactness_compares_through_the_first_round_s_bonus_token():
    """By default the check compares K + 2 new tokens: a rule wrong only at the bonus token fails; compared over
    K + 1 tokens (the bonus cut), the same rule passes."""
    rules = (BonusFromDepthBefore(),)
    report = verify_exactness.verify("draft_model", rules, greedy=False, samples=4_000)
    assert report.tokens == 4 and report.rules[0].verdict(report.alpha) == "FAIL", report.format()
    short = verify_exactness.verify("draft_model", rules, greedy=False, samples=4_000, tokens=3)
    assert short.rules[0].p_value >= short.alpha, short.format()  # the blind spot: positions 1..K only


def test_verify_exactness_cli_exit_status(monkeypatch, capsys):
    with pytest.raises(ValueError, match="pass --drafter=NAME"):
        verify_exactness.main(["verify_exactness"])
    result = verify_exactness.RuleResult("block", True, 10, 0.5, 0.01, 0.5, 0.02)  # control not caught
    report = verify_exactness.Report(
        "x", "K=2", "tiny", Sampler(1.0), "exact", 3, 1e-3, [result], 0.01, 0.5, None
    )
    monkeypatch.setattr(verify_exactness, "verify", lambda *a, **kw: report)
    assert verify_exactness.main(["verify_exactness", "--drafter=draft_model", "--acceptance=block"]) == 1
    assert "INCONCLUSIVE" in capsys.readouterr().out
    result.control_p_value = 1e-9
    assert verify_exactness.main(["verify_exactness", "--drafter=draft_model"]) == 0


def test_verify_exactness_on_a_tree_with_greedy():
    """Trees: token-wise tree sampling and block (= traversal) verification on a sampled draft-model tree, with
    their controls, and greedy tree decoding token for token."""
    report = verify_exactness.verify("draft_model", ("tokenwise", "block"), tree="0;1;0,0;1,0", greedy=True)
    assert report.passed, report.format()
    assert report.greedy_identical


def test_bench_verification_smoke(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "experiments.bench_verification", "--smoke", f"--results={tmp_path}"]
    done = subprocess.run(cmd, cwd=root, env=child_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "bench_verification_smoke.md").read_text()
    for rule in ("tokenwise", "block", "typical_lossy", "traversal"):
        assert f"| {rule} |" in table
    rows = (tmp_path / "bench_verification_smoke.csv").read_text().splitlines()[1:]  # after the stamp
    assert len(rows) == 1 + 5 and rows[0].startswith("drafter,shape,T,rule,tau,e_tau_same_drafts")
    with open(tmp_path / "bench_verification_adaptive_smoke.csv") as f:
        adaptive = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [row["draft"] for row in adaptive] == ["K=1", "K=2", "adaptive K in {1, 2}"]
    assert adaptive[2]["rounds_by_k"] and float(adaptive[2]["vs_best"]) > 0
    modeled = [
        float(row["modeled_vs_best"]) for row in adaptive
    ]  # the best fixed K's modeled rate is the unit
    assert max(modeled[:2]) == 1.0 and 0 < modeled[2] <= 1.2
    for (
        row
    ) in adaptive:  # 95% bootstrap intervals over the samples; a fixed K is never above the best fixed K
        for column in ("vs_best_95", "modeled_vs_best_95"):
            lo, hi = map(float, row[column].split("-"))
            assert 0 < lo <= hi and (hi <= 1.0 or row["draft"].startswith("adaptive"))
