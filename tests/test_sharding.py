"""Sharded decoding (`specjax.sharding`): the same tokens on 8 simulated devices as on one, for every kind of
drafter, and clear errors for meshes that cannot hold the job."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from children import cpu_env
from helpers import run_processes

from specjax import sharding
from specjax.models.config import LlamaConfig

REPO = Path(__file__).resolve().parents[1]
CFG = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=4, hidden_dim=64)


@pytest.fixture(scope="module")
def sharded_runs():
    """Runs in its own process: the device count is fixed when JAX starts."""
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sharded_decoding.py")],
        env=cpu_env(8),  # XLA_FLAGS already has conftest's compile flags
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ar_on_a_mesh_decodes_like_one_device(sharded_runs):
    assert sharded_runs["devices"] == 8
    runs = sharded_runs["runs"]
    assert runs["ar T=0 2x4"] == runs["ar T=0 1"]
    assert len({tuple(row) for row in runs["ar T=0 1"]}) > 4  # rows differ: the comparisons below can fail


@pytest.mark.parametrize("name", ["draft_model", "medusa", "eagle", "ngram"])
def test_meshes_decode_like_one_device(sharded_runs, name):
    runs = sharded_runs["runs"]
    meshes = ("1x8", "2x4", "8x1") if name == "eagle" else ("2x4",)  # see sharded_decoding.py
    for mesh in meshes:  # greedy speculation on a mesh gives AR's tokens on one device
        assert runs[f"{name} T=0 {mesh}"] == runs["ar T=0 1"], mesh
    if name != "ngram":  # sampled: the same tokens for the same seed
        assert runs[f"{name} T=1 2x4"] == runs[f"{name} T=1 1"] != runs["ar T=0 1"]


def test_mixture_of_experts_on_a_mesh_decodes_like_one_device(sharded_runs):
    """gpt-oss's parts (experts split over `model`, sinks, windows): AR and greedy EAGLE on 2x4 give AR's tokens
    on one device."""
    runs = sharded_runs["runs"]
    assert runs["moe ar T=0 2x4"] == runs["moe ar T=0 1"] == runs["moe eagle T=0 2x4"]
    assert len({tuple(row) for row in runs["moe ar T=0 1"]}) > 4


def test_compiled_loop_is_split_without_host_transfers(sharded_runs):
    program = sharded_runs["program"]
    assert program["collectives"] > 0  # the target really is split over the mesh
    assert program["host_transfers"] == 0  # no device-to-host copy in the loop
    assert program["while_loops"] >= 1  # the decode loop is in the program


def test_checkpoint_restores_straight_onto_the_mesh(sharded_runs):
    restored = sharded_runs["restored"]
    assert restored["equal"]
    specs = restored["specs"]
    assert specs["layers/0/wqkv/weight/.value"] == "P('model', None)"  # column parallel
    assert specs["layers/1/w_down/weight/.value"] == "P(None, 'model')"  # row parallel
    assert specs["embed/embedding/.value"] == "P()"


def test_safetensors_load_onto_the_mesh_a_parameter_at_a_time(sharded_runs):
    hf = sharded_runs["hf"]
    assert hf["equal"]  # the same values as on one device
    assert hf["specs"]["layers/3/w_gate_up/weight/.value"] == "P('model', None)"
    assert hf["specs"]["layers/3/wo/weight/.value"] == "P(None, 'model')"
    # the host never holds the model: a few layers' tensors at a time, while reading every tensor at once (the
    # control) holds all of it
    assert hf["peak_mesh"] < hf["model_bytes"] / 3 and hf["peak_one_device"] < hf["model_bytes"] / 3
    assert hf["peak_all_at_once"] >= hf["model_bytes"]


def test_mesh_text_and_device_count():
    assert sharding.parse_mesh("data:2,model:4") == (2, 4)
    assert sharding.parse_mesh("model:8") == (1, 8)
    for bad in ("data:0", "model=2", "pipeline:2", "data:x"):
        with pytest.raises(sharding.MeshError, match="write it like data:2,model:4"):
            sharding.parse_mesh(bad)
    n = len(jax.devices())
    with pytest.raises(sharding.MeshError, match=f"needs {2 * n} devices but {n} are here"):
        sharding.make_mesh(2, n)


def test_bad_process_settings_are_refused_before_joining():
    with pytest.raises(sharding.MeshError, match="process_id 2 is not one of the 2 processes"):
        sharding.initialize("localhost:1234", 2, 2)
    with pytest.raises(sharding.MeshError, match="needs process 0's address as HOST:PORT"):
        sharding.initialize(None, 2, 0)
    with pytest.raises(sharding.MeshError, match="needs process 0's address as HOST:PORT"):
        sharding.initialize("localhost", 2, 1)
    sharding.initialize(None, 1, 0)  # one process: nothing to join
    assert jax.process_count() == 1


@pytest.mark.parametrize(
    "cfg, batch, shape, message",
    [
        (
            CFG.replace(n_kv_heads=2, n_heads=4),
            8,
            (1, 4),
            r"kv heads \(2\) cannot be split evenly over the mesh's model axis \(4\)",
        ),
        (
            CFG.replace(hidden_dim=60),
            8,
            (1, 8),
            r"MLP hidden size \(60\) cannot be split evenly over the mesh's model axis \(8\)",
        ),
        (CFG, 3, (2, 4), r"batch \(3\) cannot be split evenly over the mesh's data axis \(2\)"),
    ],
)
def test_meshes_that_do_not_divide_are_refused(cfg, batch, shape, message):
    mesh = jax.sharding.AbstractMesh(shape, ("data", "model"))
    with pytest.raises(sharding.MeshError, match=message):
        sharding.check_target(mesh, cfg, batch)


def test_two_processes_decode_like_one():
    """run_decode.py as 2 processes of 2 CPU devices (jax.distributed, gloo) on a data:2,model:2 mesh prints
    what one process on one device prints; the other process prints nothing. Both choose each round's K (K = 0
    or 2) from process 0's timed costs (`speculative.agreed`), as the default policy does (its four Ks cost 2.5x
    the time)."""
    args = [
        sys.executable,
        str(REPO / "run_decode.py"),
        "--drafter=eagle",
        "--max_new_tokens=24",
        "--adaptive_k=0,2",
    ]
    args += ["--prompt=Once upon a time", "--prompt=Lily"]
    one = subprocess.run(args, env=cpu_env(1), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    outs = run_processes(args + ["--mesh=data:2,model:2"], devices=2)
    # gloo's connection messages go to stdout too, from several threads (a message may be split over lines,
    # leaving fragments such as a lone rank number)
    noise = ("[Gloo]", "peer ranks", "|", "adaptive K in")
    text = lambda out: [
        line for line in out.splitlines() if len(line.strip()) > 3 and not any(n in line for n in noise)
    ]
    assert text(outs[0]) == text(one.stdout) and len(text(one.stdout)) == 4  # two prompts, two stories
    assert text(outs[1]) == []
