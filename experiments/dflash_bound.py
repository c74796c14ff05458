"""The tau a block drafter could reach on a target: the optimum of DFlash's training objective, against the head.

DFlash trains block position i on the forward KL from the target's distribution of token a + i, given the corpus's
tokens a + 1 .. a + i - 1, which the block does not see. Over a corpus sampled at temperature t_c that objective
is minimised by the target's own marginal q_i(x) = E[p(x_{a+i} = x | context, x_{a+1} .. x_{a+i-1})], the
intermediate tokens drawn at t_c. `marginals` estimates it (Rao-Blackwellised: the mean of the target's
distributions over sampled intermediates); drafting from it (its argmax at T = 0, independent draws at T = 1, as a
DFlash chain does) and verifying with the target gives the tau of a head that reached its objective's optimum: the
ceiling that a head trained on the same objective approaches as its capacity and training grow. The head's own tau
on the same contexts, drafted and verified the same way, says how far from it a trained head is. A head with a
Markov head (DSpark's) tilts each position by the token drafted before it: it is drafted so here, and this ceiling,
which is for positions drawn independently, does not bound it.

That optimum is not the draft accepted most often at T = 1: a position drawn from q is accepted with probability
sum_x min(p(x), q(x)) under the target's p after the intermediate tokens, and over their draws that is maximised by a
quantile of the p's, not their mean (`acceptance_optimum`), the optimum of the TVD objective
(`heads.divergence = "tvd"`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import harness
from specjax import precision
from specjax.models.llama import causal_mask, features, forward, init_cache
from specjax.sampling import Sampler

CHUNK = 256  # rows per target pass


def _padded(rows: list) -> np.ndarray:
    """Rows right-padded with token 0 to a multiple of 16 (causal attention: padding after a token never reaches
    it; one compiled pass per width)."""
    width = -(-max(map(len, rows)) // 16) * 16
    return np.stack([np.pad(np.asarray(r), (0, width - len(r))) for r in rows])


def _target_pass(target, seqs: np.ndarray, taps: tuple[int, ...] = ()):
    """(logits [B, S, V] float32, features [B, S, F]) of the target over right-padded rows, in chunks."""
    b, s = seqs.shape
    logits, feats = [], []
    for i in range(0, b, CHUNK):
        chunk = jnp.asarray(seqs[i : i + CHUNK], jnp.int32)
        n = chunk.shape[0]
        lg, hidden, _ = forward(
            target.graphdef,
            target.params,
            chunk,
            jnp.broadcast_to(jnp.arange(s), (n, s)),
            init_cache(target.cfg, n, s),
            causal_mask(s),
            taps,
        )
        logits.append(np.asarray(lg))
        feats.append(np.asarray(features(hidden, taps)) if taps else None)
    return np.concatenate(logits), (np.concatenate(feats) if taps else None)


def _at(a_BS, starts_B, k: int):
    """[B, k, ...]: rows' entries at starts + 0 .. k - 1."""
    return np.stack([a_BS[b, s : s + k] for b, s in enumerate(starts_B)])


def contexts(target, prompts: list[list[int]], temperature: float, n_new: int, every: int, k: int) -> list:
    """Contexts ending at an anchor: each prompt decoded `n_new` tokens at `temperature`, cut after every `every`-th
    new token (while k more follow)."""
    from specjax.decoding import generate

    spec = harness.generate_spec(n_new, Sampler(temperature), eos_id=None)
    out = np.asarray(generate(target.cfg, target.graphdef, target.params, prompts, spec, seed=1).tokens)
    return [
        list(p) + list(new[:j]) for p, new in zip(prompts, out) for j in range(every, n_new - k + 1, every)
    ]


def path_distributions(target, ctx: list, k: int, t_c: float, n_paths: int, seed: int = 0) -> np.ndarray:
    """[C, n_paths, k, V]: the target's distributions (T = 1) of tokens a + 1 .. a + k after each context, one per
    draw of the intermediate tokens at temperature `t_c` (position 1 has none: the same on every path)."""
    from specjax.decoding import generate

    rows = [c for c in ctx for _ in range(n_paths)]
    paths = np.zeros((len(rows), 0), np.int32)
    if k > 1:
        spec = harness.generate_spec(k - 1, Sampler(t_c), eos_id=None)
        paths = np.asarray(
            generate(target.cfg, target.graphdef, target.params, rows, spec, seed=seed).tokens
        )
    logits, _ = _target_pass(target, _padded([r + list(p) for r, p in zip(rows, paths)]))
    p = jax.nn.softmax(_at(logits, [len(r) - 1 for r in rows], k), -1)
    return np.asarray(p).reshape(len(ctx), n_paths, k, -1)


def marginals(target, ctx: list, k: int, t_c: float, n_paths: int, seed: int = 0) -> np.ndarray:
    """[C, k, V]: the forward KL's optimum, the mean of `path_distributions` (Rao-Blackwellised)."""
    return path_distributions(target, ctx, k, t_c, n_paths, seed).mean(1)


def acceptance_optimum(p_CNkV: np.ndarray) -> np.ndarray:
    """[C, k, V]: the q that maximises mean_n sum_x min(p_n(x), q(x)), a draft's expected acceptance at T = 1 over
    the paths' distributions p_n (the optimum of the TVD objective). Raising q(x) gains the share of paths with
    p_n(x) > q(x), so at the optimum every q(x) lies where that share is the same m / N: between the m-th and the
    (m + 1)-th largest p_n(x), with m the largest count whose m-th largest values still sum to >= 1."""
    n = p_CNkV.shape[1]
    if n == 1:
        return p_CNkV[:, 0]
    # [C, N, k, V]: each token's values, largest first (float64: paths that agree sum alike, not to rounding)
    ranked = -np.sort(-np.asarray(p_CNkV, np.float64), axis=1)
    sums = ranked.sum(-1)  # [C, N, k], falling with the rank; rank 1 sums to >= 1, rank N to <= 1
    m = np.clip((sums >= 1).sum(1), 1, n - 1)[:, None]  # [C, 1, k]: ranks m - 1 and m (0-based) bracket 1
    upper = np.take_along_axis(ranked, m[..., None] - 1, 1)[:, 0]
    lower = np.take_along_axis(ranked, m[..., None], 1)[:, 0]
    s_up, s_low = (np.take_along_axis(sums, i, 1)[:, 0] for i in (m - 1, m))
    gap = s_up - s_low  # 0 where the two ranks sum alike (paths that agree): either rank will do
    w = np.clip(np.where(gap > 0, (1 - s_low) / np.where(gap > 0, gap, 1.0), 0.0), 0, 1)[..., None]
    q = lower + w * (upper - lower)
    return q / q.sum(-1, keepdims=True)


@precision.follows_params
@functools.partial(jax.jit, static_argnames=("graphdef", "k", "mask_token"))
def _block_logits(graphdef, params, seqs_BS, taps_BSF, anchors_B, k: int, mask_token: int):
    """[B, k, V] float32: a DFlash head's logits of tokens a + 1 .. a + k after each row's anchor a, by its training
    pass at one anchor per row (which `tests/test_dflash.py` pins to the drafting pass)."""
    anchors = anchors_B[:, None]
    block = jnp.where(
        jnp.arange(k + 1) == 0, jnp.take_along_axis(seqs_BS, anchors, 1)[:, :, None], mask_token
    )
    head = nnx.merge(graphdef, params["head"])
    positions = anchors[:, :, None] + jnp.arange(k + 1)
    x = head.blocks(head.embed(params["embed"], block), positions, taps_BSF, anchors)
    return jnp.einsum("bid,vd->biv", x[:, 0, 1:], params["unembed"]).astype(jnp.float32)


def head_distributions(target, heads_dir, ctx: list, k: int):
    """(q [C, k, V], tilt): a DFlash head's block distributions after each context (its last token is the anchor),
    and its Markov head's bias `tilt(previous tokens [...]) -> [..., V]` on each position's logits (None: none)."""
    from specjax import heads

    meta, graphdef, params = heads.load_heads(heads_dir, target.cfg, target.params)
    taps = tuple(meta["shape"]["layers"])
    seqs = _padded(ctx)
    _, feats = _target_pass(target, seqs, taps)
    logits = _block_logits(
        graphdef,
        heads.drafter_params(meta, params, target.cfg, target.params),
        jnp.asarray(seqs, jnp.int32),
        jnp.asarray(feats[..., : len(taps) * target.cfg.dim]),
        jnp.asarray([len(c) - 1 for c in ctx]),
        k,
        meta["shape"]["mask_token"],
    )
    # float64: a tilted draft's log q is then exact where float32 probabilities would underflow
    q = np.exp(np.asarray(jax.nn.log_softmax(logits, -1), np.float64))
    tilt = None
    if "markov" in params:
        inp, out = (np.asarray(params["markov"][n], np.float32) for n in ("inp", "out"))
        tilt = lambda previous: inp[previous] @ out
    return q, tilt


def _tilted(q_xV, tilt, previous_x):
    """q tilted by the Markov bias after `previous_x` (q itself without a tilt)."""
    if tilt is None:
        return q_xV
    logits = np.log(np.maximum(q_xV, 1e-300)) + tilt(previous_x)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def greedy_tau(target, ctx: list, q: np.ndarray, tilt=None) -> np.ndarray:
    """[k]: how often the chain argmax q (each position tilted by `tilt` after the token drafted before it), verified
    greedily by the target, is accepted up to each position (tau is 1 + its sum)."""
    previous, draft = np.asarray([c[-1] for c in ctx]), []
    for i in range(q.shape[1]):
        previous = _tilted(q[:, i], tilt, previous).argmax(-1)
        draft.append(previous)
    draft = np.stack(draft, 1)
    logits, _ = _target_pass(target, _padded([c + list(d) for c, d in zip(ctx, draft)]))
    ok = _at(logits, [len(c) - 1 for c in ctx], q.shape[1]).argmax(-1) == draft
    return np.cumprod(ok, -1).mean(0)


def sampled_tau(target, ctx: list, q: np.ndarray, n_chains: int, seed: int = 0, tilt=None) -> np.ndarray:
    """[k]: how often `n_chains` chains per context, drawn position by position from q (independently, as a block
    draft is, or tilted by `tilt` after the token drawn before) and accepted by the token-wise rule at T = 1
    against the target, are accepted up to each position."""
    rng = np.random.default_rng(seed)
    c, k, v = q.shape
    u = rng.random((c, n_chains, k, 1))
    previous = np.broadcast_to(np.asarray([x[-1] for x in ctx])[:, None], (c, n_chains))
    draft, q_d = [], []
    for i in range(k):
        q_i = _tilted(np.broadcast_to(q[:, None, i], (c, n_chains, v)), tilt, previous)
        previous = np.minimum((np.cumsum(q_i, -1) < u[:, :, i]).sum(-1), v - 1)  # [C, M]
        draft.append(previous)
        q_d.append(np.take_along_axis(q_i, previous[..., None], -1)[..., 0])
    draft, q_d = np.stack(draft, -1), np.stack(q_d, -1)  # [C, M, k]
    rows = [ctx[i] + list(draft[i, j]) for i in range(c) for j in range(n_chains)]
    logits, _ = _target_pass(target, _padded(rows))
    p = np.asarray(jax.nn.softmax(_at(logits, [len(r) - k - 1 for r in rows], k), -1)).reshape(
        c, n_chains, k, v
    )
    p_d = np.take_along_axis(p, draft[..., None], -1)[..., 0]
    ok = rng.random(p_d.shape) < np.minimum(1.0, p_d / q_d)
    return np.cumprod(ok, -1).mean((0, 1))


TITLE = (
    "The tau a block draft could reach on stories260K (B = 8, contexts every 8 tokens of the free prompts' decoding): "
    "the committed heads against their training objective's optimum, the target's own per-position marginals over "
    "intermediate tokens drawn at the corpus's temperature, drafted and verified alike (T = 0: greedy; T = 1: "
    "independent draws per position, token-wise acceptance; a head with a Markov head tilting "
    "each position by the token drafted before it, which this optimum of independent positions does not bound); "
    "at T = 1 also the optimum of the TVD objective (the draft of independent positions most often accepted over the "
    "same intermediate tokens); reaches_i: the share of drafts accepted up to position i"
)


def rows(target, heads_dirs: list[Path], k: int = 7, n_paths: int = 64, n_chains: int = 64) -> list[dict]:
    """For T = 0 and 1 (contexts decoded at T): the heads' tau and the objective's optimum's for corpora sampled at
    T = 1, 0.5 and 0, with how often each reaches block positions 1, 2, 4 and k."""
    prompts = harness.prompts(target.tokenizer, harness.STORY_OPENINGS)
    out = []
    for t in (0.0, 1.0):
        ctx = contexts(target, prompts, t, 64, 8, k)
        drafts = {f"DFlash head ({h.name})": head_distributions(target, h, ctx, k) for h in heads_dirs}
        for t_c in (1.0, 0.5, 0.0):
            paths = path_distributions(target, ctx, k, t_c, n_paths)
            drafts[f"its objective's optimum, corpus at T={t_c:g}"] = (paths.mean(1), None)
            if t == 1 and t_c == 1:
                drafts["the TVD objective's optimum, corpus at T=1"] = (acceptance_optimum(paths), None)
        for name, (q, tilt) in drafts.items():
            reach = (
                greedy_tau(target, ctx, q, tilt)
                if t == 0
                else sampled_tau(target, ctx, q, n_chains, tilt=tilt)
            )
            out.append(
                dict(T=t, draft=name, contexts=len(ctx), tau=1 + float(reach.sum()))
                | {f"reaches_{i}": float(reach[i - 1]) for i in (1, 2, 4, k)}
            )
    return out
