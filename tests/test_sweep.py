"""`experiments.sweep` (a grid of run_decode flags timed in turns against AR) and `experiments.device_check`
(the device-sized benchmarks, here at smoke size on the CPU): one subprocess each, real assertions on their
tables."""

import csv
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from children import child_env
from tolerance import approx

from experiments import device_check, harness, sweep
from specjax import cli, results

REPO = Path(__file__).resolve().parents[1]


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def run(module: str, *args: str) -> None:
    """Runs the module; device_check compares with PyTorch, the others run without it (`child_env`)."""
    env = os.environ if module == "experiments.device_check" else child_env()
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_sweep_runs_the_grid_against_ar_and_reports_a_bad_setting_in_its_row(tmp_path):
    prompt = harness.GROUNDED[0]  # a retelling: n-gram lookup accepts drafts
    run(
        "experiments.sweep",
        "--grid=k:0,1,3",
        "--repeats=1",
        f"--results={tmp_path}",
        "--name=s",
        "--",
        "--drafter=ngram",
        "--max_new_tokens=12",
        f"--prompt={prompt}",
        "--prompt=Once upon a time",
    )
    rows = read_rows(tmp_path / "s.csv")
    assert [(r["k"], r["method"]) for r in rows] == [
        ("0", "-"),
        ("-", "AR"),
        ("1", "ngram K=1"),
        ("3", "ngram K=3"),
    ]
    bad, ar, *spec = rows
    assert bad["error"] == "--k=0 drafts nothing; pass --k=1 or more (draft tokens per round)"
    assert bad["tok_s"] == "nan"
    assert float(ar["tau"]) == 1.0 and float(ar["same_as_ar"]) == 1.0
    for r in spec:
        k = int(r["k"])
        assert not r["error"] and float(r["tok_s"]) > 0 and float(r["speedup"]) > 0
        assert 1.0 <= float(r["tau"]) <= k + 1  # at most K accepted drafts and one target token a round
        assert float(r["same_as_ar"]) == 1.0  # greedy: speculative tokens equal AR's
        assert len(r["alpha_i"].split()) == k
    assert float(spec[1]["tau"]) > 1.0  # the retelling's drafts are accepted
    stamp = results.read_stamp(tmp_path / "s.md")
    assert "experiments.sweep" in stamp["command"] and stamp["matmul_precision"] == "dtype"
    assert results.read_stamp(tmp_path / "s.png")["commit"]


@pytest.mark.parametrize(
    "grid, message",
    [
        (["k"], "is not FLAG:V1,V2"),
        (["bogus:1,2"], "'bogus' is not a run_decode.py flag"),
        (["k:1", "k:2"], "names 'k' twice"),
        ([], "no --grid axis"),
    ],
)
def test_sweep_grid_errors(grid, message):
    with pytest.raises(cli.UsageError, match=message):
        sweep.parse_grid(grid)


def test_device_plan_sizes():
    from specjax.models.config import LlamaConfig

    gpu = device_check.plan("gpu", 80e9, "device")
    cfg = gpu.expansion.config(
        LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, hidden_dim=172, vocab_size=512)
    )
    assert cfg.num_params >= 1e9 and gpu.ar_shapes == ("llama-110M", "llama-1.1B")
    from experiments.bench_memory_bound import KINDS

    assert gpu.memory.temperatures == (0.0, 1.0) and gpu.memory.kinds == KINDS  # every drafter row
    small = device_check.plan("gpu", 16e9, "device").expansion  # a tenth of the memory for the weights
    assert 5 <= small.n_layers < gpu.expansion.n_layers
    assert device_check.plan("cpu", None, "smoke").ar_shapes == ("llama-tiny",)


def test_pytest_summary_counts():
    line = "==== 3 failed, 537 passed, 2 skipped, 1 error in 812.31s (0:13:32) ===="
    assert device_check.summary_counts("x\n" + line) == dict(passed=537, failed=3, errors=1, skipped=2)
    assert device_check.summary_counts("no summary") == dict(passed=0, failed=0, errors=0, skipped=0)
    stopped = (  # a verbose run stopped before its summary: its result lines are counted
        "[gw1] [  1%] PASSED tests/test_a.py::test_x\n[gw0] [  2%] FAILED tests/test_b.py::test_y[3 passed]\n"
        "[gw1] [  3%] PASSED tests/test_a.py::test_z\n[gw2] [  4%] SKIPPED tests/test_c.py::test_w\n"
    )
    assert device_check.summary_counts(stopped) == dict(passed=2, failed=1, errors=0, skipped=1)
    # a later run leaves out what this one passed (`--passed_in`), parametrised ids with spaces whole
    log = stopped + "[gw3] [  5%] PASSED tests/test_d.py::test_v[eagle3 chain] \ntests/test_d.py::test_u\n"
    assert device_check.passed_tests(log) == [
        "tests/test_a.py::test_x",
        "tests/test_a.py::test_z",
        "tests/test_d.py::test_v[eagle3 chain]",
    ]


def test_profile_reads_device_kernels_from_a_trace(tmp_path):
    from experiments import device_profile

    events = [
        dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
        dict(ph="M", pid=7, name="process_name", args=dict(name="/device:GPU:0")),
        dict(ph="X", pid=1, name="gemm_fusion_dot_1", dur=50.0),  # a host event: not a kernel
        dict(ph="X", pid=7, name="nvjet_sm90_tst_128x8", dur=13.0),
        dict(ph="X", pid=7, name="input_scatter_fusion_4", dur=2.0),
    ]
    trace = tmp_path / "plugins/profile/run"
    trace.mkdir(parents=True)
    with gzip.open(trace / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)
    found = device_profile.device_kernels(tmp_path)
    assert found == [("nvjet_sm90_tst_128x8", 13.0), ("input_scatter_fusion_4", 2.0)]
    assert [device_profile.kind(k) for k, _ in found] == ["product", "cache write"]
    assert device_profile.kind("input_reduce_fusion_36") == "reduction (norms, softmax)"


def test_device_check_smoke_writes_stamped_tables(tmp_path):
    # float32 at smoke size, with its K and batch sweeps, is the memory-bound section of `experiments.tables
    # --quick` (test_tables)
    run(
        "experiments.device_check",
        "--sizes=smoke",
        "--notests",
        "--nosweeps",
        "--dtypes=bfloat16",
        f"--results={tmp_path}",
    )
    (tiny,) = read_rows(tmp_path / "device_ar.csv")
    assert tiny["model"] == "llama-tiny" and tiny["dtype"] == "bfloat16"
    assert float(tiny["specjax_tok_s"]) > 0 and float(tiny["torch_tok_s"]) > 0
    for side in ("specjax", "torch"):  # the fraction of the floor: the floor's time over the measured time
        floor = float(tiny["floor_ms_tok"]) / float(tiny[f"{side}_ms_tok"])
        assert float(tiny[f"{side}_of_floor"]) == approx(floor, dtype=np.float64, depth=3) and floor > 0
    for dtype in ("bfloat16",):
        decode = read_rows(tmp_path / f"device_memory_bound_{dtype}_decode.csv")
        assert {(r["method"], r["T"]) for r in decode} == {("AR", "0.0"), ("eagle", "0.0")}
        assert all(float(r["tau"]) >= 1 and float(r["tok_s"]) > 0 for r in decode)
        machine = read_rows(tmp_path / f"device_memory_bound_{dtype}_machine.csv")[0]
        assert float(machine["target_weight_MB"]) > 0
    assert results.read_stamp(tmp_path / "device_ar.md")["device"] == results.device()  # where it ran
