"""`make tables --sections=suffix`: suffix decoding on the workloads it is for, on stories260K (batch 1, float32).

- suffix_rollouts: 4 prompts x 16 samples x 128 tokens at T = 1, 0.7 and 0.3, one request at a time, each prompt's
  samples in a row: tau (tokens per target pass) with the drafter's store kept from request to request (earlier
  outputs in it) and with an empty store each time (the request's own prompt and output only).
- suffix_repeated: greedy, each prompt 4 times in a row: tau over all requests and over the 4th repetitions.
Rows: suffix chains K = 8 (most frequent path, sized by the match; where sampling, drawn with q from the
continuations' frequencies, or from the mean of the target's next-token distributions the store recorded with each
continuation token (its 8 most likely tokens); verifying all K), a frequency tree of 24 nodes, n-gram prompt
lookup K = 8 and EAGLE-3's committed head (K = 7), which have no store, and the hybrid of a suffix chain and that
head (K = 8, `--drafter=hybrid`). The store's size and the lookup's cost are in the notes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from experiments import harness
from specjax import expand
from specjax.decoding import compile_decode
from specjax.drafters.hybrid import HybridSettings
from specjax.drafters.ngram import NGramSettings
from specjax.drafters.suffix import SuffixSettings
from specjax.drafting import registry
from specjax.sampling import Sampler

PROMPTS = ("Once upon a time", "Tom had a red ball", "Lily went to the park", "One day, a little bird")
STORE_TOKENS = 65_536
K = 8
# the target's most likely next tokens the store records per token, for q from distributions
DISTRIBUTIONS = 8


def drafters(quick: bool) -> list[tuple]:
    """(method, registered drafter, settings, K, when): `when` says at which temperatures the row runs."""
    chain = SuffixSettings(store_tokens=STORE_TOKENS)
    rows = [
        ("suffix chain", "suffix", chain, K, "always"),
        ("n-gram", "ngram", NGramSettings(), K, "always"),
    ]
    if quick:
        return rows
    whole = dataclasses.replace(chain, spec_factor=float(K), min_prob=0.0)
    recorded = lambda s: dataclasses.replace(s, frequencies=True, distributions=DISTRIBUTIONS)
    return rows[:1] + [
        ("suffix chain, q from frequencies", "suffix", dataclasses.replace(chain, frequencies=True), K, "sampling"),
        ("suffix chain, q from distributions", "suffix", recorded(chain), K, "sampling"),
        ("suffix chain, verifies K", "suffix", whole, K, "always"),
        ("suffix chain, verifies K, q from frequencies", "suffix", dataclasses.replace(whole, frequencies=True), K,
         "sampling"),
        ("suffix chain, verifies K, q from distributions", "suffix", recorded(whole), K, "sampling"),
        ("suffix tree, 24 nodes", "suffix", dataclasses.replace(chain, nodes=24), K, "always"),
        rows[1],
        ("EAGLE-3 chain K=7 (committed head)", "eagle3", registry.get("eagle3").settings(), 7, "always"),
        ("hybrid: suffix chain or EAGLE-3, K=8", "hybrid", HybridSettings(store_tokens=STORE_TOKENS), K, "always"),
    ]  # fmt: skip


def replay(target, drafter, dparams, requests, sampler, n_new: int) -> list[tuple]:
    """Decodes `requests` one at a time, twice: with the store kept across them and with an empty store each time.
    {mode: [(tokens emitted, target passes) per request]} and the store at the end."""
    spec = harness.generate_spec(n_new, sampler, eos_id=None)
    run, _ = compile_decode(
        target.cfg, target.graphdef, target.params, [requests[0]], spec, drafter, dparams, 32
    )
    out = {}
    for mode in ("own", "earlier") if hasattr(drafter, "absorb") else ("own",):
        store, counts = dparams, []
        for i, prompt in enumerate(requests):
            gen = jax.device_get(run([prompt], i, store))
            counts.append((int(np.sum(gen.stats.emitted)), int(np.sum(gen.stats.row_rounds))))
            if mode == "earlier" and hasattr(drafter, "absorb"):
                store = drafter.absorb(store, [prompt + gen.tokens[0, : gen.lengths[0]].tolist()])
        out[mode] = counts
    return out | {"earlier": out.get("earlier", out["own"])}, store


def tau(counts) -> float:
    """Tokens per target pass over all the requests."""
    return sum(e for e, _ in counts) / sum(p for _, p in counts)


def mean_tau(counts) -> float:
    """The mean of the requests' own tau."""
    return float(np.mean([e / p for e, p in counts]))


def lookup_ms(drafter, dparams, seq_len: int, repeats: int = 20) -> float:
    """One `propose` of a row of `seq_len` tokens against the store `dparams` (ms, median)."""
    seq = np.ones((1, seq_len), np.int32)
    propose = jax.jit(lambda p, s, n: drafter.propose(p, (), s, n, jax.random.key(0))[0].tokens)
    call = lambda: propose(dparams, seq, np.array([seq_len], np.int32)).block_until_ready()
    return 1e3 * harness.median_time(call, repeats)


def memory_bound_rows(target, prompts, n_new: int, repeats: int) -> list[dict]:
    """Repeated greedy tasks on the memory-bound expansion of stories260K (`specjax.expand`: synthetic cost,
    stories260K's distribution): each prompt's 4th request, with its 3 earlier outputs (identical under greedy: the
    AR output absorbed 3 times) in the store, against AR; batch 1, timed in turns. Rows: the suffix chains, EAGLE-3's
    committed head (expanded with the target) and the hybrid of the two."""
    from experiments import bench_memory_bound as bench
    from experiments import costs
    from specjax.decoding import GenerateSpec
    from specjax.drafters.hybrid import Hybrid

    _, big, _, loaded = bench.load(bench.Settings(kinds=("eagle3 chain",)))
    cfg, graphdef, params = big
    build = lambda s, k: registry.get("suffix").build(target, s, k, None, Sampler())
    settings = SuffixSettings(store_tokens=STORE_TOKENS)
    eagle3 = lambda k: bench.make_drafter("eagle3", big, None, loaded, k, None, Sampler())
    ar, _ = compile_decode(cfg, graphdef, params, [prompts[0]], GenerateSpec(n_new, eos_id=None), bucket=32)
    histories = [[prompt + np.asarray(ar([prompt]).tokens)[0].tolist()] * 3 for prompt in prompts]
    learned = lambda drafter, store: costs.PerGroup(drafter.absorb(store, h) for h in histories)
    (suffix, store), (fallback, fparams) = build(settings, K), eagle3(K)
    whole, whole_store = build(dataclasses.replace(settings, spec_factor=float(K), min_prob=0.0), K)
    hybrid = Hybrid(suffix, fallback)
    drafters = {
        "suffix chain": (suffix, learned(suffix, store)),
        "suffix chain, verifies K": (whole, learned(whole, whole_store)),
        "EAGLE-3 chain K=7 (committed head)": eagle3(7),
        "hybrid: suffix chain or EAGLE-3, K=8": (
            hybrid,
            learned(hybrid, {"suffix": store, "fallback": fparams}),
        ),
    }
    groups = [[prompt] for prompt in prompts]
    times, outputs = costs.timed_groups(big, groups, dict(max_new_tokens=n_new), drafters, repeats)
    tokens_of = lambda name: [np.asarray(g.tokens).tolist() for g in outputs[name]]
    n_tokens, ar_s, rows = len(prompts) * n_new, np.median(times["AR"]), []
    for method in drafters:
        assert tokens_of(method) == tokens_of("AR"), f"greedy {method} differs from AR"
        stats = [jax.device_get(g.stats) for g in outputs[method]]
        tau = sum(int(np.sum(s.emitted)) for s in stats) / sum(int(np.sum(s.row_rounds)) for s in stats)
        rows.append(
            dict(
                method=method, tau=tau, ar_tok_s=n_tokens / ar_s, tok_s=n_tokens / np.median(times[method])
            )
            | dict(speedup=harness.ratio(times["AR"], times[method]))
        )
    return rows


def tables(out: harness.Writer, quick: bool, target) -> None:
    samples, n_new = (2, 16) if quick else (16, 128)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[: 1 if quick else 4]]
    rollouts, repeated, chains = [], [], {}
    for t in (1.0,) if quick else (1.0, 0.7, 0.3, 0.0):
        sampler = Sampler(t)
        requests = [p for p in prompts for _ in range(samples if t else 4)]
        for method, name, settings, k, when in drafters(quick):
            if when == "sampling" and not t:
                continue
            entry = registry.get(name)
            drafter, dparams = entry.build(target, settings, k, None, sampler)
            counts, learned = replay(target, drafter, dparams, requests, sampler, n_new)
            own, earlier = counts["own"], counts["earlier"]
            row = dict(method=method, T=t, own_only=tau(own), with_earlier=tau(earlier))
            row |= dict(own_only_mean=mean_tau(own), with_earlier_mean=mean_tau(earlier))
            if t:
                rollouts.append(row)
            else:
                last = [c for i, c in enumerate(earlier) if i % 4 == 3]
                repeated.append(row | dict(with_earlier_4th=tau(last)))
            if method in ("suffix chain", "suffix chain, q from distributions") and t == 1.0:
                chains[method] = drafter, learned
    suffix, store = chains["suffix chain"]
    held = int(np.sum(np.asarray(store["store"]) >= 0))
    mib = lambda store: sum(a.size * a.dtype.itemsize for a in store.values()) / 2**20
    notes = (
        f"The store (suffix chain, T = 1, after the last request): {held} tokens of {STORE_TOKENS} "
        f"({mib(store):.2f} MiB, int32); one lookup (a row of 256 tokens against it): "
        f"{lookup_ms(suffix, store, 256):.2f} ms on this machine."
    )
    if "suffix chain, q from distributions" in chains:
        recorded, store = chains["suffix chain, q from distributions"]
        notes += (
            f" With the target's {DISTRIBUTIONS} most likely next tokens per token (int32 ids, float32"
            f" log-probabilities): {mib(store):.2f} MiB, and a lookup that draws the chain from them"
            f" {lookup_ms(recorded, store, 256):.2f} ms."
        )
    notes += (
        " n-gram and EAGLE-3 have no store: their columns agree. tau: tokens per target pass over all the requests;"
        " *_mean: the mean of the requests' own tau."
    )
    out.table(
        "suffix_rollouts",
        rollouts,
        f"Suffix decoding on rollouts (stories260K, {len(prompts)} prompts x {samples} samples x {n_new} tokens, one "
        f"request at a time, each prompt's samples in a row; K = {K}): tau with an empty store per request "
        "(own_only) and with the outputs of earlier requests in the store (with_earlier)",
        notes,
    )
    if not quick:
        e = expand.Expansion()
        out.table(
            "suffix_memory_bound",
            memory_bound_rows(target, prompts, n_new, 3),
            f"Repeated greedy tasks on the memory-bound expansion of stories260K ({e.n_layers} layers x {e.dim}, "
            f"float32): each prompt's 4th request ({n_new} tokens) with its 3 earlier outputs in the store, against "
            "AR; batch 1, every prompt in each of 3 rounds timed in turns (medians)",
        )
    if repeated:
        out.table(
            "suffix_repeated",
            repeated,
            f"Suffix decoding on repeated tasks (stories260K, greedy, {len(prompts)} prompts each 4 times in a row, "
            f"{n_new} tokens; K = {K}): tau over every request and over the 4th repetitions",
        )
