"""specjax's suffix drafter against the reference implementation on the same recorded rollouts.

Issue 51's goals quote the tau of ArcticInference's `SuffixDecodingCache` (K = 8, match-sized paths, min_token_prob
0.1) replaying stories260K rollouts: 4 prompts x 16 samples x 128 tokens at T = 1, 0.7, 0.3 (each prompt 4 times at
T = 0), each prompt's samples in a row, with an empty store (own prompt and output) or the earlier requests' outputs.
Sampled rollouts differ from seed to seed, and so does their tau. Here both drafters replay the same rollouts,
recorded from specjax's AR decoding under several seeds. A deterministic draft's accepted prefix is the longest one
that the recorded sample continues, so replaying gives exact acceptance. tau is each request's tokens per target
pass, averaged over the requests (the reference simulator's figure).

The reference is C++ with Python bindings (nanobind). Its full package needs vLLM and torch, its suffix-decoding
module alone builds on a CPU:

    pip download arctic-inference==0.3.0 --no-deps --no-binary :all: -d /tmp/arctic
    tar -C /tmp/arctic -xzf /tmp/arctic/arctic_inference-0.3.0.tar.gz && pip install --target /tmp/nb nanobind
    cd /tmp/arctic/arctic_inference-0.3.0/csrc/suffix_decoding
    cmake -B build -DPython_EXECUTABLE=$(which python) -Dnanobind_ROOT=$(PYTHONPATH=/tmp/nb python -m nanobind
        --cmake_dir) && make -C build && cp build/_C*.so ../../arctic_inference/suffix_decoding/

then `python -m experiments.suffix_reference --reference=/tmp/arctic/arctic_inference-0.3.0`.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from absl import flags

from experiments import harness
from experiments.suffix_table import PROMPTS
from specjax import cli
from specjax.decoding import compile_decode
from specjax.drafters import suffix
from specjax.drafting.layouts import best_length
from specjax.errors import SuffixError
from specjax.sampling import Sampler

FLAGS = flags.FLAGS


def define_flags() -> None:
    """This script's flags, defined when it runs (not on import: tests import its functions beside other
    experiments' flags)."""
    flags.DEFINE_string(
        "reference", "", "Folder from which `arctic_inference.suffix_decoding` imports (see above)."
    )
    flags.DEFINE_integer("seeds", 3, "Rollout sets recorded per temperature (each from its own seeds).")
    flags.DEFINE_string("results", str(harness.RESULTS), "Folder the table is written to.")


K, NEW, STORE_TOKENS, NODES = 8, 128, 65_536, 24


def rollouts(target, t: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) per request: 16 samples of each prompt in a row (4 at T = 0), AR decoding."""
    spec = harness.generate_spec(NEW, Sampler(t), eos_id=None)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    run, _ = compile_decode(target.cfg, target.graphdef, target.params, [prompts[0]], spec, bucket=32)
    requests = [p for p in prompts for _ in range(16 if t else 4)]
    out = []
    for i, prompt in enumerate(requests):
        gen = jax.device_get(run([prompt], 10_000 * seed + i))
        out.append((prompt, gen.tokens[0, : gen.lengths[0]].tolist()))
    return out


def accepted(tokens, parents, truth) -> int:
    """The longest prefix of `truth` that the draft tree (`tokens[i]` under node `parents[i]`, root -1) holds."""
    node, n = -1, 0
    for token in truth:
        node = next((i for i, p in enumerate(parents) if p == node and tokens[i] == token), None)
        if node is None:
            return n
        n += 1
    return n


def replay(requests, shared: bool, speculate, learn) -> float:
    """Mean tau over the requests: each round drafts from the text so far, keeps what the recorded output
    continues and one token more. `speculate(prompt, text, store)` -> (tokens, parents); `learn(store, prompt,
    output)` -> the store with the finished request in it (kept across requests when `shared`)."""
    store, taus = None, []
    for prompt, output in requests:
        done, rounds = [], 0
        while len(done) < len(output):
            tokens, parents = speculate(prompt, done, store)
            n = accepted(tokens, parents, output[len(done) :])
            done += output[len(done) : len(done) + n + 1]
            rounds += 1
        taus.append(len(output) / rounds)
        if shared:
            store = learn(store, prompt, output)
    return float(np.mean(taus))


def reference_replay(requests, shared: bool) -> float:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(64, -1 if shared else 0)
    ids = iter(range(len(requests)))
    current = {}

    def speculate(prompt, done, store):
        # a new request: the previous one ends (its output stays in the global tree when shared)
        if not done:
            if current:
                cache.stop_request(current.pop("id"))
            current.update(id=next(ids), n=0)
            cache.start_request(current["id"], prompt)
        cache.add_active_response(current["id"], done[current["n"] :])
        current["n"] = len(done)
        draft = cache.speculate(current["id"], np.asarray(prompt + done, np.int32), max_spec_tokens=K)
        return list(draft.token_ids), list(draft.parents)

    return replay(requests, shared, speculate, lambda store, p, o: store)


def specjax_replay(target, requests, shared: bool, nodes: int) -> float:
    drafter = suffix.Suffix(K, target.cfg.vocab_size, nodes=nodes)
    size = max(len(p) + len(o) for p, o in requests) + 1
    draft = jax.jit(lambda params, seq, n: drafter.propose(params, (), seq, n, jax.random.key(0))[0])
    empty = suffix.empty_store(STORE_TOKENS)

    def speculate(prompt, done, store):
        text = np.zeros((1, size), np.int32)
        text[0, : len(prompt) + len(done)] = prompt + done
        d = jax.device_get(draft(store or empty, text, np.array([len(prompt + done)])))
        if nodes:  # node i + 1 under node parent[i + 1] (0: the root)
            return d.tokens[0].tolist(), (np.asarray(d.layout.parent)[0, 1:] - 1).tolist()
        n = d.lengths[int(best_length(d.scores, np.ones(1, bool)))]
        return d.tokens[0, :n].tolist(), list(range(-1, n - 1))

    learn = lambda store, p, o: drafter.absorb(store or empty, [p + o])
    return replay(requests, shared, speculate, learn)


def main(argv):
    del argv
    if FLAGS.reference:
        sys.path.insert(0, FLAGS.reference)
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError as err:
        raise SuffixError(
            f"the reference suffix decoder does not import ({err}); build it as this module's docstring says and "
            "pass its folder as --reference"
        ) from None
    from specjax.models.loading import load_model, resolve

    target = load_model(resolve("stories260K"))
    rows = []
    for t in (1.0, 0.7, 0.3, 0.0):
        for seed in range(FLAGS.seeds if t else 1):  # greedy rollouts do not depend on the seed
            requests = rollouts(target, t, seed)
            for shared, store in ((False, "own only"), (True, "with earlier")):
                print(f"T={t} seed {seed} {store}", flush=True)
                rows.append(
                    dict(T=t, seed=seed, store=store, reference=reference_replay(requests, shared))
                    | dict(specjax_chain=specjax_replay(target, requests, shared, 0))
                    | dict(specjax_tree=specjax_replay(target, requests, shared, NODES))
                )
    harness.Writer(FLAGS.results).table(
        "suffix_reference",
        rows,
        f"Suffix decoding on the same recorded stories260K rollouts ({len(PROMPTS)} prompts x 16 samples x {NEW} "
        f"tokens, each prompt's samples in a row; T = 0: each prompt 4 times): mean tau per request, ArcticInference's "
        f"SuffixDecodingCache (K = {K}, its defaults) against specjax's suffix chain (K = {K}) and tree "
        f"({NODES} nodes); own only: an empty store per request, with earlier: the earlier requests' outputs",
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
