"""`make tables`: Theorem 3.8's table equals the closed form and the simulation agrees with it (a wrong
acceptance rate does not); `experiments.tables --quick` writes every file, each stamped, each table with its
columns; files without a stamp or tables with missing columns are caught."""

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tolerance import approx

from experiments import harness, tables
from specjax import results

REPO = Path(__file__).resolve().parents[1]
COLUMNS = {  # the columns each table must have
    "suffix_rollouts": ["method", "T", "own_only", "with_earlier"],
    "dflash_categories": [
        "method",
        "setting",
        "T",
        "tau",
        "verified_per_round",
        "a",
        "draft_passes_per_round",
    ],
    "leviathan_theorem38": [
        "alpha",
        "c",
        *(f"gamma={g}" for g in range(1, 9)),
        "optimal_gamma",
        "improvement",
    ],
    "leviathan_simulation": ["alpha", "gamma", "c", "exact", "simulated", "ci99", "within"],
    "main_stories260K": [
        "method",
        "setting",
        "category",
        "T",
        "tau",
        "tok_s",
        "speedup",
        "a",
        "tau_iid",
        "iid_error",
    ],
    "memory_bound_machine": ["read_GBs", "matmul_GFLOPs", "fma_peak_GFLOPs", "roof_GFLOPs"],
    "memory_bound_curve": ["target", "batch", "T", "ms", "per_T1", "floor_ms", "roof_ms", "bound_over_ms"],
    "memory_bound_pilot": ["shape", "nodes", "tau_stories260K", "v", "predicted"],
    "memory_bound_decode": [
        "category",
        "batch",
        "T",
        "method",
        "draft",
        "tau",
        "a",
        "c",
        "v",
        "tok_s",
        "speedup",
        "decode_speedup",
        "predicted",
        "measured_over_predicted",
        "of_floor",
        "loop_eff",
    ],  # fmt: skip
    "memory_bound_k": [
        "K",
        "tau",
        "a",
        "c",
        "v",
        "speedup",
        "decode_speedup",
        "predicted",
        "analytic_optimum",
    ],
    "memory_bound_batch": [
        "batch",
        "K",
        "tau",
        "rounds",
        "predicted_rounds",
        "ar_tok_s",
        "spec_tok_s",
        "speedup",
        "decode_speedup",
        "predicted",
        "measured_over_predicted",
        "one_row_model",
        "policy_tok_s",
        "policy_speedup",
        "policy_rounds_by_k",
    ],
    "heads_medusa_accuracy": ["head", "predicts", "top1", "top5"],
    "heads_eagle_acceptance": ["head", "draft", "T", "tau", "alpha_1"],
    "sweep_k": ["drafter", "K", "tau", "a", "speedup", "analytic_optimum"],
    "sweep_temperature": ["drafter", "T", "tau"],
    "sweep_batch": ["drafter", "batch", "ar_tok_s", "spec_tok_s", "speedup"],
    "peers": ["peer", "method", "T", "tok_s", "tau", "same_as_specjax_ar"],
    "distill_divergence": [
        "draft",
        "divergence",
        "data",
        "steps",
        "alpha_T0",
        "alpha_T1",
        "tau_T0",
        "tau_T1",
    ],
    "distill_categories": ["draft", "category", "T", "tau"],
    "systems": [
        "method",
        "setting",
        "compile_s",
        "rounds",
        "round_ms",
        "round_over_ar_step",
        "extra_param_MB",
        "target_kv_KB",
        "draft_state_KB",
    ],
}
PLOTS = ["leviathan_figure3", "sweeps", "memory_bound_sweeps"]


def test_the_cpu_is_named_by_generation_and_vectors(monkeypatch):
    """A stamp tells apart hosts that a virtual machine names alike (Zen 1 and Zen 5 are both "AMD EPYC")."""
    zen = lambda family, model, flags: {
        "model name": "AMD EPYC",
        "cpu family": family,
        "model": model,
        "flags": f"fpu sse2 {flags}",
    }
    named = {}
    for host, info in {
        "zen1": zen("23", "1", "avx avx2 fma"),
        "zen5": zen("26", "2", "avx2 avx512f"),
    }.items():
        monkeypatch.setattr(results, "cpu_info", lambda info=info: info)
        named[host] = results.cpu_name()
    assert named == {
        "zen1": "AMD EPYC (family 23, model 1, AVX2)",
        "zen5": "AMD EPYC (family 26, model 2, AVX-512)",
    }
    monkeypatch.setattr(results, "cpu_info", dict)  # no /proc/cpuinfo: what the platform says
    assert results.cpu_name() and "(" not in results.cpu_name()


def test_theorem_38_table_is_the_closed_form():
    rows = {(r["alpha"], r["c"]): r for r in tables.improvement_rows()}
    for a, c, g in [(0.5, 0.01, 1), (0.7, 0.1, 3), (0.8, 0.05, 8), (0.9, 0.5, 2), (0.6, 0.2, 5)]:
        closed = (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))
        # the same closed form, evaluated in another order
        assert rows[a, c][f"gamma={g}"] == approx(closed, dtype=np.float64, depth=6)
    for (a, c), row in rows.items():
        by_gamma = [(1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)) for g in range(1, 65)]
        assert row["optimal_gamma"] == 1 + int(np.argmax(by_gamma))


def test_simulation_agrees_with_the_theorem_and_a_wrong_rate_does_not():
    assert all(r["within"] for r in tables.simulation_rows(rounds=100_000))
    a, g, c = tables.SIMULATED[2]
    wrong, half = tables.simulate_improvement(a + 0.03, g, c, 100_000)  # negative control
    assert abs(wrong - tables.analysis.expected_speedup(a, g, c)) > half


def test_quick_tables_write_every_file_stamped(tmp_path):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "experiments.tables", "--quick", f"--results={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    written = sorted(p.name for p in out.iterdir())
    expected = sorted([f"{n}.{e}" for n in COLUMNS for e in ("md", "csv")] + [f"{n}.png" for n in PLOTS])
    assert written == expected
    for path in out.iterdir():
        stamp = results.read_stamp(path)
        assert "experiments.tables --quick" in stamp["command"] and stamp["commit"] and stamp["device"]
    for name, columns in COLUMNS.items():
        with open(out / f"{name}.csv") as f:
            header = next(csv.reader(line for line in f if not line.startswith("#")))
        assert all(c in header for c in columns), f"{name} misses {set(columns) - set(header)}"
        assert "| " + " | ".join(header) + " |" in (out / f"{name}.md").read_text()
    with open(out / "memory_bound_decode.csv") as f:
        decode = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [r["method"] for r in decode] == [
        "AR",
        "draft model",
        "distilled draft",
        "quantized",
        "retrieval",
        "lookahead",
        "eagle",
    ]
    assert all(float(r["tok_s"]) > 0 and float(r["tau"]) >= 1 for r in decode)
    tau = {r["method"]: float(r["tau"]) for r in decode}
    assert (
        tau["distilled draft"] > tau["draft model"] + 0.5
    )  # the trained draft agrees, the truncated one not
    with open(out / "suffix_rollouts.csv") as f:
        rollouts = {r["method"]: r for r in csv.DictReader(x for x in f if not x.startswith("#"))}
    ngram, chain = rollouts["n-gram"], rollouts["suffix chain"]
    assert ngram["own_only"] == ngram["with_earlier"]  # no store
    assert float(chain["with_earlier"]) > float(
        chain["own_only"]
    )  # the second sample drafts from the first
    with open(out / "distill_divergence.csv") as f:
        alpha = {
            r["draft"]: float(r["alpha_T0"]) for r in csv.DictReader(x for x in f if not x.startswith("#"))
        }
    assert alpha["forward_kl / samples (committed)"] > alpha["first layer, undistilled"] + 0.3
    with open(out / "peers.csv") as f:
        peers = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert all(
        float(r["same_as_specjax_ar"]) == 1.0 for r in peers
    )  # greedy: the same tokens as specjax AR
    # the checks can fail: a file without a stamp, a table whose rows disagree on their columns
    (tmp_path / "plain.md").write_text("# a table\n\n| a |\n|---|\n| 1 |\n")
    with pytest.raises(results.ResultsError, match="has no stamp"):
        results.read_stamp(tmp_path / "plain.md")
    with pytest.raises(results.ResultsError, match="a row has columns"):
        results.write_table(tmp_path, "bad", [{"a": 1, "b": 2}, {"a": 1}], "bad")


def test_decode_rows_time_each_drafter_in_turns_with_ar(stories):
    """`harness.decode_rows`: AR's row is the baseline itself (no statistics, speedup 1), a greedy drafter's row
    has AR's tokens on every prompt and its own acceptance; untimed (`repeats=0`) the same tokens, no seconds."""
    from specjax.sampling import Sampler

    prompts = [stories.tokenizer.encode(t) for t in ("Once upon a time", "Lily wanted to")]
    spec = harness.generate_spec(8, Sampler(0.0), eos_id=None)
    ngram = harness.registered("n-gram", "chain K=4", "ngram", 4)
    ar, spec_row = harness.decode_rows(stories, prompts, spec, [harness.AR, ngram], 1)
    assert ar.stats is None and ar.metrics == {"tau": 1.0} and ar.speedup == 1.0 and ar.seconds > 0
    assert spec_row.row is ngram and spec_row.tokens == ar.tokens and len(ar.tokens) == 2
    assert spec_row.seconds > 0 and spec_row.ar_seconds > 0
    assert spec_row.metrics["tau"] == sum(int(s.emitted.sum()) for s in spec_row.stats) / sum(
        int(s.row_rounds.sum()) for s in spec_row.stats
    )
    (untimed,) = harness.decode_rows(stories, prompts, spec, [ngram], 0)
    assert np.isnan(untimed.seconds) and untimed.tokens == ar.tokens


def test_sampled_memory_bound_jobs_draw_each_prompt_once_a_seed(stories):
    """At T > 0 the memory-bound decode table runs each prompt `seeds` times (greedy: once); `costs.timed_groups`
    gives group i seed i, so the copies of a prompt are different samples (with one sample a prompt, T = 1's tau
    on 4 prompts varied between seeds by a standard deviation of 0.2-0.28)."""
    from experiments import bench_memory_bound as bench
    from experiments import costs
    from specjax.sampling import Sampler

    settings = bench.Settings(batches=(1, 4), temperatures=(0.0, 1.0), seeds=3, categories=())
    texts = {(b, t): x for _, b, t, x, _ in bench.jobs(settings)}
    assert texts[(1, 0.0)] == texts[(4, 0.0)] == bench.PROMPTS[:4]
    assert texts[(1, 1.0)] == texts[(4, 1.0)] == bench.PROMPTS[:4] * 3
    groups = [[stories.tokenizer.encode(bench.PROMPTS[0])]] * 3
    target, kw = (stories.cfg, stories.graphdef, stories.params), dict(max_new_tokens=16)
    _, sampled = costs.timed_groups(target, groups, kw | dict(sampler=Sampler(1.0)), {}, 1)
    rows = [np.asarray(o.tokens)[0].tolist() for o in sampled["AR"]]
    assert len({tuple(r) for r in rows}) == 3
    _, greedy = costs.timed_groups(target, groups, kw, {}, 1)
    assert len({tuple(np.asarray(o.tokens)[0].tolist()) for o in greedy["AR"]}) == 1  # the control


def test_timed_groups_give_each_group_its_own_params(stories):
    """`costs.timed_groups` with `PerGroup` params: group i drafts from params[i] (here a suffix store that holds
    group i's greedy output, so every draft token is accepted); swapped stores (the control) accept fewer."""
    from experiments import costs
    from specjax.drafting import registry
    from specjax.sampling import Sampler

    groups = [[stories.tokenizer.encode(t)] for t in ("Once upon a time", "Lily wanted to")]
    target, kw = (stories.cfg, stories.graphdef, stories.params), dict(max_new_tokens=24)
    entry = registry.get("suffix")
    suffix, store = entry.build(stories, entry.settings(), 4, None, Sampler())
    _, ar = costs.timed_groups(target, groups, kw, {}, 1)
    histories = [[g[0] + np.asarray(out.tokens)[0].tolist()] for g, out in zip(groups, ar["AR"])]
    stores = [suffix.absorb(store, h) for h in histories]
    drafters = {"own": (suffix, costs.PerGroup(stores)), "swapped": (suffix, costs.PerGroup(stores[::-1]))}
    times, outputs = costs.timed_groups(target, groups, kw, drafters, 1)
    assert set(times) == {"AR", "own", "swapped"} and all(len(t) == 1 for t in times.values())
    tokens = {name: [np.asarray(o.tokens).tolist() for o in outs] for name, outs in outputs.items()}
    assert tokens["own"] == tokens["swapped"] == tokens["AR"]  # greedy: AR's tokens whatever the drafts
    rounds = {name: [int(np.sum(o.stats.row_rounds)) for o in outputs[name]] for name in drafters}
    assert all(r <= -(-23 // 5) for r in rounds["own"])  # 23 tokens after the first, 5 a round
    assert all(s > o for s, o in zip(rounds["swapped"], rounds["own"]))
