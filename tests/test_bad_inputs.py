"""Bad input through the real entry points: run_decode.py, train_heads.py, `python -m specjax.convert`,
`python -m specjax.verify_exactness`, `python -m specjax.datastore`, `python -m specjax.heads` and the
experiments. Every user error ends with a non-zero exit status and
one last line on stderr, `error: <what>; <fix>`, naming the problem, with no traceback; outputs that existed
before (sentinel files) come out byte-for-byte intact; documented behaviours (a temperature below 1e-5 decodes
greedily, with a warning) hold.

Cases marked `alone` run as separate processes of the real command. The others run in one process per command
(this file run as a script, `python tests/test_bad_inputs.py CASES.json RESULTS.json`), which executes the real
script or module as `__main__` once per case (absl re-parses the flags from their defaults each time), so the
import of Python and JAX is paid once per command, not once per case.
"""

import contextlib
import dataclasses
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from children import child_env

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "models" / "stories260K"
COMMANDS = {  # name: how the real command starts (a script of the repository, or a module run with -m)
    "run_decode": ("script", "run_decode.py"),
    "train_heads": ("script", "train_heads.py"),
    "convert": ("module", "specjax.convert"),
    "verify": ("module", "specjax.verify_exactness"),
    "datastore": ("module", "specjax.datastore"),
    "heads": ("module", "specjax.heads"),
    "bench_ar": ("module", "experiments.bench_ar"),
    "bench_trees": ("module", "experiments.bench_trees"),
    "bench_verification": ("module", "experiments.bench_verification"),
}
STORY = "Once upon a time, there was a little {} named {}. {} liked to play in the park with a red ball.\n"


def command(name: str) -> list[str]:
    kind, target = COMMANDS[name]
    return [sys.executable, target] if kind == "script" else [sys.executable, "-m", target]


def env(name: str, **variables) -> dict:
    """The command's environment: without PyTorch (`helpers.child_env`) but for bench_ar, which compares with it."""
    return dict(os.environ, **variables) if name == "bench_ar" else child_env(**variables)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: `cli` run with `args` ({bad} is the folder of bad files) must end with status `status`
    and a last stderr line `error: ...` holding every needle and `fix` (what to do: by default whatever
    follows '; '); `keep` names sentinel groups that must survive; `kind` is 'error' or 'handled' (a
    documented behaviour, here a warning, comes first)."""

    id: str
    cli: str
    args: list
    needles: tuple
    status: int = 1
    alone: bool = False  # a separate process of the real command, not one of a batch
    kind: str = "error"
    keep: tuple = ()
    fix: str = "; "


def case(cid, cli, args, *needles, **options):
    return pytest.param(Case(cid, cli, args, needles, **options), id=cid)


TRAIN = ["--config=configs/medusa.py:smoke", "--workdir={bad}/work"]
TARGETED = [  # a workdir without checkpoints: each of these runs records its config there, then fails
    "--config=configs/medusa.py:smoke",
    "--workdir={bad}/run",
    "--config.target=stories260K",
    "--config.target_checkpoint={bad}/target_ckpt",
]

CASES = [
    # --- run_decode.py --------------------------------------------------------------------------------
    case(
        "decode-unknown-flag", "run_decode", ["--bogus=1"], "Unknown command line flag 'bogus'", alone=True
    ),
    case("decode-positional", "run_decode", ["Once upon"], "unexpected argument 'Once upon'"),
    case("decode-flag-type", "run_decode", ["--max_new_tokens=abc"], "flag --max_new_tokens=abc"),
    case("decode-flag-enum", "run_decode", ["--dtype=int8"], "--dtype=int8", "float32"),
    case("decode-zero-tokens", "run_decode", ["--max_new_tokens=0"], "--max_new_tokens=0 must be >= 1"),
    case(
        "decode-negative-tokens", "run_decode", ["--max_new_tokens=-3"], "--max_new_tokens=-3 must be >= 1"
    ),
    case("decode-zero-batch", "run_decode", ["--batch_size=0"], "--batch_size=0 must be >= 1"),
    case("decode-negative-batch", "run_decode", ["--batch_size=-2"], "--batch_size=-2 must be >= 1"),
    case(
        "decode-nan-temperature",
        "run_decode",
        ["--temperature=nan"],
        "--temperature=nan must be a finite",
    ),
    case(
        "decode-inf-temperature", "run_decode", ["--temperature=inf"], "--temperature=inf must be a finite"
    ),
    case("decode-negative-temperature", "run_decode", ["--temperature=-1"], "--temperature=-1.0 must be"),
    case("decode-zero-top-p", "run_decode", ["--top_p=0"], "top_p must be in (0, 1]"),
    case("decode-nan-top-p", "run_decode", ["--top_p=nan"], "top_p must be in (0, 1]"),
    case("decode-negative-top-k", "run_decode", ["--top_k=-1"], "top_k must be a non-negative integer"),
    case(
        "decode-empty-prompts-file",
        "run_decode",
        ["--prompts_file={bad}/empty.txt"],
        "holds no prompt",
    ),
    case("decode-blank-prompts-file", "run_decode", ["--prompts_file={bad}/blank.txt"], "holds no prompt"),
    case(
        "decode-binary-prompts-file", "run_decode", ["--prompts_file={bad}/binary.bin"], "is not UTF-8 text"
    ),
    case("decode-directory-prompts-file", "run_decode", ["--prompts_file={bad}"], "(is a directory)"),
    case(
        "decode-missing-prompts-file",
        "run_decode",
        ["--prompts_file={bad}/nothing.txt"],
        "(no such file or directory)",
    ),
    case("decode-k-without-drafter", "run_decode", ["--k=3"], "--k needs a drafter"),
    case("decode-tree-without-drafter", "run_decode", ["--tree=chain4"], "--tree needs a drafter"),
    case("decode-heads-without-drafter", "run_decode", ["--heads=x"], "--heads needs a drafter"),
    case("decode-unknown-drafter", "run_decode", ["--drafter=bogus"], "unknown drafter 'bogus'"),
    case(
        "decode-foreign-drafter-flag",
        "run_decode",
        ["--drafter=ngram", "--heads=x"],
        "--heads do not apply to --drafter=ngram",
    ),
    case("decode-zero-k", "run_decode", ["--drafter=ngram", "--k=0"], "--k=0 drafts nothing"),
    case(
        "decode-zero-draft-temperature",
        "run_decode",
        ["--drafter=draft_model", "--draft_temperature=0"],
        "--draft_temperature=0.0 must be > 0",
    ),
    case(
        "decode-bad-tree",
        "run_decode",
        ["--drafter=draft_model", "--tree=bogus"],
        "cannot read tree 'bogus'",
        fix=": use one of",
    ),
    case(
        "decode-unknown-rule",
        "run_decode",
        ["--drafter=ngram", "--acceptance=bogus"],
        "unknown acceptance rule 'bogus'",
    ),
    case(
        "decode-tree-wider-than-vocabulary",
        "run_decode",
        ["--drafter=draft_model", "--tree=dynamic:600,2,700"],
        "600 candidates per node, more than the model's vocabulary of 512",
    ),
    case(
        "decode-beyond-context",
        "run_decode",
        ["--max_new_tokens=600"],
        "exceeds the model's context of 512",
    ),
    case(
        "decode-prompt-longer-than-cache",
        "run_decode",
        ["--prompt=" + "Once upon a time " * 150, "--max_new_tokens=4"],
        "exceeds the model's context of 512",
    ),
    case(
        "decode-malformed-config",
        "run_decode",
        ["--model={bad}/hf_malformed"],
        "config.json is not valid JSON",
    ),
    case("decode-config-without-vocab", "run_decode", ["--model={bad}/hf_novocab"], "lacks 'vocab_size'"),
    case(
        "decode-config-zero-vocab",
        "run_decode",
        ["--model={bad}/hf_zerovocab"],
        "vocab_size=0 must be a positive integer",
    ),
    case(
        "decode-wrong-tensor-shape",
        "run_decode",
        ["--model={bad}/hf_shape"],
        "tensor 'model.layers.0.self_attn.q_proj.weight' has shape (64, 60), but config.json implies (64, 64)",
    ),
    case("decode-binary-model", "run_decode", ["--model={bad}/binary.bin"], "valid llama2.c header"),
    case(
        "decode-truncated-model",
        "run_decode",
        ["--model={bad}/l2c/stories260K.bin"],
        "truncated or corrupt",
    ),
    case("decode-empty-model-dir", "run_decode", ["--model={bad}/empty_dir"], "holds no config.json"),
    case("decode-missing-model", "run_decode", ["--model={bad}/nothing"], "is neither a local path"),
    case(
        "decode-missing-heads",
        "run_decode",
        ["--drafter=medusa", "--heads={bad}/nothing"],
        "heads.json is missing",
        fix="; pass the --workdir of a train_heads.py run",
    ),
    case(
        "decode-zero-draft-layers",
        "run_decode",
        ["--drafter=draft_model", "--draft_layers=0"],
        "needs 1..5 layers, got 0",
        fix="needs 1..5 layers",
    ),
    case(
        "decode-zero-ngram",
        "run_decode",
        ["--drafter=ngram", "--max_ngram=0"],
        "max_ngram=0 is below min_ngram",
    ),
    # --- train_heads.py -------------------------------------------------------------------------------
    case(
        "train-unknown-variant",
        "train_heads",
        ["--config=configs/eagle.py:bogus", "--workdir={bad}/work"],
        "unknown config variant 'bogus'",
        keep=("work",),
    ),
    case(
        "train-config-key-typo",
        "train_heads",
        [*TRAIN, "--config.optimizer.lrr=1"],
        "unknown config key 'optimizer.lrr'",
        "did you mean 'optimizer.lr'",
        alone=True,
        keep=("work",),
    ),
    case(
        "train-unknown-config-key",
        "train_heads",
        [*TRAIN, "--config.bogus=1"],
        "unknown config key 'bogus'",
    ),
    case(
        "train-missing-config-file",
        "train_heads",
        ["--config=configs/nothing.py", "--workdir={bad}/work"],
        "config file configs/nothing.py does not exist",
    ),
    case(
        "train-binary-config-file",
        "train_heads",
        ["--config={bad}/binary.bin", "--workdir={bad}/work"],
        "cannot load the config file",
    ),
    case(
        "train-no-workdir",
        "train_heads",
        ["--config=configs/medusa.py:smoke"],
        "--workdir must have a value",
    ),
    case("train-positional", "train_heads", [*TRAIN, "extra"], "unexpected argument 'extra'"),
    case(
        "train-value-type", "train_heads", [*TRAIN, "--config.train.steps=abc"], "--config.train.steps=abc"
    ),
    case(
        "train-nan-lr",
        "train_heads",
        [*TRAIN, "--config.optimizer.lr=nan"],
        "lr=nan is not a finite number",
    ),
    case("train-zero-lr", "train_heads", [*TRAIN, "--config.optimizer.lr=0"], "lr=0.0 must be > 0"),
    case("train-negative-lr", "train_heads", [*TRAIN, "--config.optimizer.lr=-1"], "lr=-1.0 must be > 0"),
    case(
        "train-zero-steps", "train_heads", [*TRAIN, "--config.train.steps=0"], "train.steps=0 must be >= 1"
    ),
    case(
        "train-zero-batch",
        "train_heads",
        [*TRAIN, "--config.train.batch_size=0"],
        "batch_size=0 must be >= 1",
    ),
    case(
        "train-zero-interval", "train_heads", [*TRAIN, "--config.train.log_every=0"], "log_every=0 must be"
    ),
    case(
        "train-negative-interval",
        "train_heads",
        [*TRAIN, "--config.train.checkpoint_every=-5"],
        "checkpoint_every=-5 must be >= 1",
    ),
    case("train-seq-len-one", "train_heads", [*TRAIN, "--config.data.seq_len=1"], "seq_len=1 must be >= 2"),
    case(
        "train-inf-temperature",
        "train_heads",
        [*TRAIN, "--config.data.temperature=inf"],
        "temperature=inf is not a finite number",
    ),
    case(
        "train-negative-temperature",
        "train_heads",
        [*TRAIN, "--config.data.temperature=-1"],
        "temperature=-1.0 must be >= 0",
    ),
    case("train-zero-mesh", "train_heads", [*TRAIN, "--config.mesh.model=0"], "mesh.model=0 must be >= 1"),
    case(
        "train-missing-source",
        "train_heads",
        [*TRAIN, "--config.data.source={bad}/nothing.txt"],
        "neither 'self_distill' nor an existing",
    ),
    case(
        "train-workdir-is-a-file",
        "train_heads",
        ["--config=configs/medusa.py:smoke", "--workdir={bad}/notes.txt"],
        "is a file; give a directory",
        keep=("notes",),
    ),
    case(
        "train-unwritable-workdir",
        "train_heads",
        ["--config=configs/medusa.py:smoke", "--workdir={bad}/notes.txt/run"],
        "cannot create the workdir lock",
        keep=("notes",),
    ),
    case(
        "train-missing-target",
        "train_heads",
        [*TRAIN, "--config.target={bad}/nowhere"],
        "target checkpoint",
        "nowhere not found",
        keep=("work",),
    ),
    case(
        "train-foreign-target-checkpoint",
        "train_heads",
        [*TRAIN, "--config.target=stories260K", "--config.target_checkpoint={bad}/mine"],
        "mine already exists and is not a conversion",
        keep=("work", "mine"),
    ),
    case(  # the cases below need the target: the first converts it into {bad}/target_ckpt
        "train-beyond-context",
        "train_heads",
        [*TARGETED, "--config.data.seq_len=600"],
        "seq_len=600 exceeds the target's context of 512",
        keep=("run",),
    ),
    case(
        "train-empty-source",
        "train_heads",
        [*TARGETED, "--config.data.source={bad}/empty.txt"],
        "empty.txt holds no document",
        keep=("run",),
    ),
    case(
        "train-binary-source",
        "train_heads",
        [*TARGETED, "--config.data.source={bad}/binary.bin"],
        "binary.bin is not UTF-8 text",
        keep=("run",),
    ),
    case(
        "train-malformed-jsonl",
        "train_heads",
        [*TARGETED, "--config.data.source={bad}/bad.jsonl"],
        "bad.jsonl:1: expected a JSON object",
        keep=("run",),
    ),
    # --- python -m specjax.convert --------------------------------------------------------------------
    case("convert-no-arguments", "convert", [], "expected a source and a destination, got 0", alone=True),
    case("convert-one-argument", "convert", ["stories260K"], "got 1 argument;"),
    case("convert-three-arguments", "convert", ["a", "b", "c"], "got 3 arguments"),
    case(
        "convert-unwritable-destination",
        "convert",
        ["stories260K", "{bad}/notes.txt/out"],
        "cannot create the directory",
        "choose a writable destination",
        keep=("notes",),
    ),
    case(
        "convert-existing-destination",
        "convert",
        ["stories260K", "{bad}/mine"],
        "mine already exists; choose a new destination",
        keep=("mine",),
    ),
    case(
        "convert-malformed-config",
        "convert",
        ["{bad}/hf_malformed", "{bad}/out1"],
        "is not valid JSON",
    ),
    case(
        "convert-wrong-tensor-shape",
        "convert",
        ["{bad}/hf_shape", "{bad}/out2"],
        "q_proj.weight' has shape",
    ),
    case("convert-missing-source", "convert", ["{bad}/nothing", "{bad}/out3"], "is neither a local path"),
    case("convert-flag-enum", "convert", ["--dtype=int8", "stories260K", "{bad}/out4"], "--dtype=int8"),
    # --- python -m specjax.verify_exactness (user errors exit with 2, a failed check with 1) ------------
    case(
        "verify-unknown-flag",
        "verify",
        ["--drafter=ngram", "--bogus"],
        "Unknown command line flag",
        status=2,
        alone=True,
    ),
    case("verify-no-drafter", "verify", [], "pass --drafter=NAME", status=2),
    case("verify-positional", "verify", ["--drafter=ngram", "extra"], "unexpected arguments", status=2),
    case(
        "verify-nan-alpha",
        "verify",
        ["--drafter=ngram", "--alpha=nan"],
        "--alpha=nan must be in (0, 1)",
        status=2,
    ),
    case("verify-zero-alpha", "verify", ["--drafter=ngram", "--alpha=0"], "--alpha=0.0 must be", status=2),
    case(
        "verify-negative-samples",
        "verify",
        ["--drafter=ngram", "--samples=-1"],
        "--samples=-1 must be",
        status=2,
    ),
    case("verify-zero-k", "verify", ["--drafter=ngram", "--k=0"], "--k=0 must be >= 1", status=2),
    case(
        "verify-greedy",
        "verify",
        ["--drafter=ngram", "--temperature=0"],
        "needs a sampling temperature > 0",
        status=2,
    ),
    case(
        "verify-inf-temperature",
        "verify",
        ["--drafter=ngram", "--temperature=inf"],
        "must be a finite",
        status=2,
    ),
    case(
        "verify-one-token", "verify", ["--drafter=ngram", "--tokens=1"], "--tokens=1 must be >= 2", status=2
    ),
    case(
        "verify-bad-setting",
        "verify",
        ["--drafter=ngram", "--drafter_setting=x"],
        "is not KEY=VALUE",
        status=2,
    ),
    case("verify-unknown-drafter", "verify", ["--drafter=bogus"], "unknown drafter 'bogus'", status=2),
    # --- experiments ----------------------------------------------------------------------------------
    case("bench-positional", "bench_ar", ["extra"], "unexpected argument 'extra'", alone=True),
    case("bench-zero-repeats", "bench_trees", ["--repeats=0"], "repeats=0 times nothing", alone=True),
    case(
        "bench-rules-without-tokenwise",
        "bench_verification",
        ["--rules=block", "--results={bad}/results"],
        "must include tokenwise",
        alone=True,
        keep=("results",),
    ),
    # --- issue 38: heads folders, quantisation groups, flags that cannot take effect -------------------
    case(
        "heads-json-without-target",
        "run_decode",
        ["--drafter=medusa", "--heads={bad}/heads_notarget"],
        "heads.json lacks a valid 'target' entry (no such entry)",
    ),
    case(
        "heads-json-a-list", "run_decode", ["--drafter=medusa", "--heads={bad}/heads_list"], "holds a list"
    ),
    case(
        "heads-json-unknown-method",
        "run_decode",
        ["--drafter=medusa", "--heads={bad}/heads_method"],
        "names the head method 'bogus', which specjax does not know",
    ),
    case(
        "heads-json-other-shape",
        "run_decode",
        ["--drafter=medusa", "--heads={bad}/heads_nheads"],
        "heads.json does not describe the heads its checkpoint",
        "('b', (4, 1, 64), (3, 1, 64))",
    ),
    case(
        "heads-corrupt-checkpoint",
        "run_decode",
        ["--drafter=medusa", "--heads={bad}/heads_corrupt"],
        "cannot restore head parameters of step 2000",  # Orbax's failed reads printed tracebacks around it
    ),
    case("decode-quantize-group-zero", "run_decode", ["--quantize=int4:0"], "asks for groups of 0 columns"),
    case(
        "decode-quantize-group-7",
        "run_decode",
        ["--quantize=int4:7"],
        "a group of 7 input columns does not divide the model's width (dim) 64",
        "(e.g. 64)",
    ),
    case("decode-quantize-group-48", "run_decode", ["--quantize=int8:48"], "a group of 48 input columns"),
    case(
        "decode-quantized-drafter-group-7",
        "run_decode",
        ["--drafter=quantized", "--bits=4", "--group_size=7"],
        "a group of 7 input columns does not divide",
    ),
    case(
        "decode-k-beyond-context",
        "run_decode",
        ["--drafter=ngram", "--k=600", "--max_new_tokens=4"],
        "K=600 draft tokens per round do not fit the model's context of 512",
    ),
    case(
        "decode-compare-ar-without-drafter", "run_decode", ["--compare_ar"], "--compare_ar needs a drafter"
    ),
    case(
        "decode-acceptance-without-drafter",
        "run_decode",
        ["--acceptance=block"],
        "--acceptance needs a drafter",
    ),
    case(
        "decode-several-without-drafter",
        "run_decode",
        ["--k=3", "--compare_ar"],
        "--compare_ar, --k need a drafter",
        fix="drop them",
    ),
    # --- python -m specjax.datastore --------------------------------------------------------------------
    case("datastore-no-corpus", "datastore", [], "the following arguments are required: --corpus"),
    case("datastore-unknown-flag", "datastore", ["--corpus=x", "--bogus=1"], "unrecognized arguments"),
    case(
        "datastore-missing-corpus",
        "datastore",
        ["--corpus={bad}/nothing.txt"],
        "corpus ",
        "does not exist; pass --corpus=FILE",
    ),
    case(
        "datastore-blank-corpus", "datastore", ["--corpus={bad}/blank.txt"], "corpus ", "holds no document"
    ),
    case("datastore-directory-corpus", "datastore", ["--corpus={bad}/empty_dir"], "is a directory"),
    case("datastore-binary-corpus", "datastore", ["--corpus={bad}/binary.bin"], "is not UTF-8 text"),
    case(
        "datastore-foreign-out",
        "datastore",
        ["--corpus={bad}/story.txt", "--out={bad}/mine"],
        "already exists and is not a",
        keep=("mine",),
    ),
    # --- python -m specjax.heads export -----------------------------------------------------------------
    case("heads-no-command", "heads", [], "the following arguments are required: COMMAND"),
    case("heads-unknown-command", "heads", ["frob"], "invalid choice: 'frob'"),
    case("heads-export-no-dest", "heads", ["export", "x"], "the following arguments are required: dest"),
    case(
        "heads-export-not-a-workdir",
        "heads",
        ["export", "{bad}/empty_dir", "{bad}/out"],
        "is not a train_heads.py workdir",
    ),
    case(
        "heads-export-over-foreign",
        "heads",
        ["export", "{bad}/heads_good", "{bad}/mine"],
        "already exists and is not a heads export",
        keep=("mine",),
    ),
    case(
        "heads-export-into-the-workdir",
        "heads",
        ["export", "{bad}/heads_good", "{bad}/heads_good/copy"],
        "lies inside or contains the workdir",
    ),
    # --- documented behaviours ------------------------------------------------------------------------
    case(
        "verify-tiny-temperature",
        "verify",
        ["--drafter=ngram", "--temperature=1e-7"],
        "needs a sampling temperature > 0",
        status=2,
        kind="handled",
    ),
]
CASE_IDS = [p.id for p in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS)


# --- the bad files ------------------------------------------------------------------------------------


def make_bad_files(bad: Path) -> dict:
    """Writes the bad inputs into `bad`; returns {sentinel group: {path: bytes}} to compare afterwards."""
    from safetensors.numpy import load_file, save_file

    bad.mkdir(parents=True, exist_ok=True)
    (bad / "empty.txt").write_bytes(b"")
    (bad / "blank.txt").write_text("\n   \n\t\n")
    (bad / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (bad / "bad.jsonl").write_text('{"body": 1}\n')
    (bad / "empty_dir").mkdir()
    (bad / "notes.txt").write_text("my notes\n")
    hf_files = ["config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"]
    config = json.loads((SHARED / "config.json").read_text())
    for name, change in [
        ("hf_malformed", None),
        ("hf_novocab", "vocab_size"),
        ("hf_zerovocab", 0),
        ("hf_shape", 1),
    ]:
        folder = bad / name
        folder.mkdir()
        for f in hf_files:
            shutil.copy(SHARED / f, folder / f)
        if change is None:
            (folder / "config.json").write_text('{"model_type": "llama", "vocab_size": 512,')
        elif change == "vocab_size":
            (folder / "config.json").write_text(
                json.dumps({k: v for k, v in config.items() if k != change})
            )
        elif change == 0:
            (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 0}))
        else:
            tensors = load_file(str(SHARED / "model.safetensors"))
            name = "model.layers.0.self_attn.q_proj.weight"
            tensors[name] = np.ascontiguousarray(tensors[name][:, :60])
            save_file(tensors, str(folder / "model.safetensors"))
    (bad / "l2c").mkdir()
    (bad / "l2c" / "stories260K.bin").write_bytes(
        (SHARED / "llama2c" / "stories260K.bin").read_bytes()[:4096]
    )
    shutil.copy(SHARED / "llama2c" / "tok512.bin", bad / "l2c" / "tok512.bin")
    (bad / "story.txt").write_text(STORY.format("dog", "Rex", "Rex"))
    heads = REPO / "heads" / "stories260K_medusa"
    meta = json.loads((heads / "heads.json").read_text())
    for name, change in [
        ("good", None),
        ("notarget", lambda m: {k: v for k, v in m.items() if k != "target"}),
        ("list", lambda m: [m]),
        ("method", lambda m: {**m, "method": "bogus"}),
        ("nheads", lambda m: {**m, "shape": {**m["shape"], "num_heads": 3}}),
        ("corrupt", None),
    ]:
        shutil.copytree(heads, bad / f"heads_{name}")
        if change:
            (bad / f"heads_{name}" / "heads.json").write_text(json.dumps(change(meta)))
    for f in (bad / "heads_corrupt" / "checkpoints").rglob("d/*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    groups = {"notes": [bad / "notes.txt"]}
    for group in ("work", "run", "mine", "results"):
        (bad / group / "sub").mkdir(parents=True)
        (bad / group / "notes.txt").write_text(f"{group}: mine, not specjax's\n")
        (bad / group / "sub" / "data.bin").write_bytes(bytes(range(256)) * 3)
        groups[group] = [bad / group / "notes.txt", bad / group / "sub" / "data.bin"]
    (bad / "work" / "checkpoints" / "7").mkdir(parents=True)  # a checkpoint a run would resume from
    (bad / "work" / "checkpoints" / "7" / "params").write_bytes(b"\x00\x01" * 100)
    groups["work"].append(bad / "work" / "checkpoints" / "7" / "params")
    return {g: {p: p.read_bytes() for p in paths} for g, paths in groups.items()}


def fill(args: list[str], bad: Path) -> list[str]:
    return [a.replace("{bad}", str(bad)) for a in args]


def check(c: Case, status: int, stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert status == c.status, f"{c.id}: status {status}, expected {c.status}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{c.id}: a traceback\n{stderr[-3000:]}"
    last = lines[-1] if lines else ""
    assert last.startswith("error: "), f"{c.id}: last line {last!r}"
    for needle in (*c.needles, c.fix):
        assert needle in last, f"{c.id}: {needle!r} not in {last!r}"
    if c.kind == "handled":
        assert "decoding greedily" in stderr, f"{c.id}: no warning\n{stderr[-2000:]}"


# --- the batch runner (this file as a script) ---------------------------------------------------------


@contextlib.contextmanager
def captured_fds():
    """Captures what is written to file descriptors 1 and 2 (Python's and native code's) in the block."""
    out = {}
    with tempfile.TemporaryFile() as f1, tempfile.TemporaryFile() as f2:
        targets = {1: f1, 2: f2}
        saved = {fd: os.dup(fd) for fd in targets}
        sys.stdout.flush(), sys.stderr.flush()
        for fd, f in targets.items():
            os.dup2(f.fileno(), fd)
        try:
            yield out
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, f in targets.items():
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
                f.seek(0)
                out[fd] = f.read().decode(errors="replace")


def run_in_process(name: str, args: list[str]) -> dict:
    """Runs the command `name` with `args` as `__main__` in this process: {status, stdout, stderr}."""
    from absl import flags

    kind, target = COMMANDS[name]
    sys.argv = [target, *args]
    for flag in [f for f in flags.FLAGS if f.startswith("config.")]:  # ml_collections adds one per override
        delattr(flags.FLAGS, flag)
    # The flags of the commands run before, registered under their file paths: absl accepts a command's flags
    # again only from a module object of another id, and a freed module's id can be reused (a flaky
    # DuplicateFlagError).
    for module, defined in list(flags.FLAGS.flags_by_module_dict().items()):
        if os.sep in module:
            for flag in {f.name for f in defined} & set(flags.FLAGS):
                delattr(flags.FLAGS, flag)
    status = 0
    with captured_fds() as out:
        try:
            if kind == "script":
                runpy.run_path(str(REPO / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # noqa: BLE001 (what a real process would print)
            import traceback

            traceback.print_exc()
            status = 1
    return {"status": status, "stdout": out[1], "stderr": out[2]}


def batch_main(cases_file: str, results_file: str) -> None:
    sys.path.insert(0, str(REPO))
    todo = json.loads(Path(cases_file).read_text())
    results = {cid: run_in_process(name, args) for cid, name, args in todo}
    Path(results_file).write_text(json.dumps(results))


# --- the tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    return folder, make_bad_files(folder)


EXTRA = [  # batched runs compared with each other (the documented behaviour of a tiny temperature)
    ("tiny-temperature", "run_decode", ["--temperature=1e-7", "--max_new_tokens=12"]),
    ("zero-temperature", "run_decode", ["--temperature=0", "--max_new_tokens=12"]),
]
HELP = {  # command: what its help must show
    "run_decode": "--max_new_tokens",
    "train_heads": "--config",
    "convert": "--dtype",
    "verify": "--drafter_setting",
    "datastore": "--corpus",
    "heads": "export",
}
EXTRA += [(f"help-{name}{ask}", name, [ask]) for name in HELP for ask in ("--help", "--helpfull", "-h")]


@pytest.fixture(scope="module")
def batched(bad):
    """{case id: {status, stdout, stderr}} of every case not run `alone`, one process per command."""
    folder, _ = bad
    todo = [(c.id, c.cli, fill(c.args, folder)) for c in (p.values[0] for p in CASES) if not c.alone]
    todo += [(cid, name, fill(args, folder)) for cid, name, args in EXTRA]
    results = {}
    for name in COMMANDS:
        mine = [t for t in todo if t[1] == name]
        if not mine:
            continue
        (folder / f"{name}.cases.json").write_text(json.dumps(mine))
        subprocess.run(
            [
                sys.executable,
                __file__,
                str(folder / f"{name}.cases.json"),
                str(folder / f"{name}.out.json"),
            ],
            cwd=REPO,
            env=env(name),
            check=True,
            timeout=600,
        )
        results.update(json.loads((folder / f"{name}.out.json").read_text()))
    return results


@pytest.mark.parametrize("c", CASES)
def test_bad_input(c: Case, bad, request):
    folder, sentinels = bad
    if c.alone:
        out = subprocess.run(
            command(c.cli) + fill(c.args, folder),
            cwd=REPO,
            env=env(c.cli),
            capture_output=True,
            text=True,
            timeout=300,
        )
        result = {"status": out.returncode, "stderr": out.stderr}
    else:
        result = request.getfixturevalue("batched")[c.id]
    check(c, result["status"], result["stderr"])
    for group in c.keep:
        for path, content in sentinels[group].items():
            assert path.read_bytes() == content, f"{c.id}: {path} changed"
    assert not [p for p in folder.rglob("*") if ".partial-" in p.name], f"{c.id}: a half-written output"


def test_tiny_temperature_decodes_greedily_with_a_warning(batched):
    tiny, zero = batched["tiny-temperature"], batched["zero-temperature"]
    assert tiny["status"] == zero["status"] == 0, tiny["stderr"][-2000:]
    assert "--temperature=1e-07 is below 1e-05: decoding greedily" in tiny["stderr"]
    story = lambda out: out["stdout"].split("\n|")[0]  # the text, before the timing table
    assert story(tiny) == story(zero) and "Once upon a time" in story(zero)


@pytest.mark.parametrize("name", HELP)
def test_every_command_answers_help(name, batched):
    """--help, --helpfull and -h print the command's flags on stdout and exit with status 0 (verify_exactness
    answered `error: Unknown command line flag 'help'`)."""
    for ask in ("--help", "--helpfull", "-h"):
        out = batched[f"help-{name}{ask}"]
        assert out["status"] == 0, (ask, out["stderr"][-2000:])
        assert HELP[name] in out["stdout"] and "error:" not in out["stderr"], (ask, out)


def test_debug_shows_the_traceback(bad):
    folder, _ = bad
    out = subprocess.run(
        command("run_decode") + [f"--prompts_file={folder}/nothing.txt"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env("run_decode", SPECJAX_DEBUG="1"),
    )
    assert out.returncode != 0 and "Traceback" in out.stderr and "UsageError" in out.stderr


def test_temperature_rule():
    from specjax import cli

    assert cli.temperature(0.0) == 0.0 and cli.temperature(0.7) == 0.7 and cli.temperature(1e-5) == 1e-5
    assert cli.temperature(1e-6) == 0.0 and cli.temperature(5e-324) == 0.0
    for value in (float("nan"), float("inf"), -0.5):
        with pytest.raises(cli.UsageError, match="must be a finite number >= 0"):
            cli.temperature(value)


# --- the first training run converts its target (issue 23, section 4) ---------------------------------


def test_first_training_run_on_a_fresh_clone_converts_the_target(tmp_path):
    """README's training command works as the first command on a fresh clone (no checkpoints/): the default
    target, stories260K, is converted once into checkpoints/stories260K with its source recorded."""
    from specjax import checkpoint
    from specjax.models.loading import resolve

    text = tmp_path / "stories.txt"
    names = ("Tom", "Lily", "Max", "Sue")
    text.write_text("".join(STORY.format(a, n, n) for a in ("cat", "dog", "bird") for n in names) * 3)
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_heads.py"),
            f"--config={REPO}/configs/eagle.py:smoke",
            f"--workdir={tmp_path / 'run'}",
            "--config.train.steps=2",
            f"--config.data.source={text}",
        ],
        cwd=tmp_path,
        env=env("train_heads"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    converted = tmp_path / "checkpoints" / "stories260K"
    assert "converting the target" in out.stderr and "step=2" in out.stdout
    assert checkpoint.recorded_source(converted)["path"] == str(resolve("stories260K"))
    assert not [p for p in converted.parent.iterdir() if ".partial-" in p.name]


def test_conversion_is_reused_rebuilt_when_the_source_changes_and_never_over_a_foreign_folder(
    tmp_path, stories
):
    from specjax import checkpoint, files
    from specjax.models.loading import tokenizer_files

    source, dest = tmp_path / "source", tmp_path / "ckpt"
    shutil.copytree(SHARED, source)
    assert checkpoint.converted(str(source), dest) == dest
    written = (dest / checkpoint.MARKER).stat().st_mtime_ns
    assert checkpoint.converted(str(source), dest) == dest  # reused, not written again
    assert (dest / checkpoint.MARKER).stat().st_mtime_ns == written
    assert checkpoint.converted(str(dest), tmp_path / "unused") == dest  # a checkpoint is used as it is
    os.utime(source / "model.safetensors", ns=(10**9, 10**9))  # the source changed: rebuilt
    assert checkpoint.converted(str(source), dest) == dest
    assert checkpoint.recorded_source(dest)["files"][str(source / "model.safetensors")][1] == 10**9
    cfg, _, params = checkpoint.restore_model(dest)
    assert cfg == stories.cfg and checkpoint.params_digest(params) == checkpoint.params_digest(
        stories.params
    )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(files.DestinationError, match="mine already exists and is not a conversion"):
        checkpoint.converted(str(source), mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    # A checkpoint that `specjax.convert` wrote before sources were recorded: adopted if it holds the source's
    # weights (its source is recorded), refused otherwise.
    legacy, other = tmp_path / "legacy", tmp_path / "other"
    checkpoint.save_model(legacy, stories.cfg, stories.params, tokenizer_files(stories.path))
    checkpoint.save_model(other, stories.cfg.replace(norm_eps=1e-3), stories.params)
    before = (other / checkpoint.MARKER).read_bytes()
    assert checkpoint.converted(str(source), legacy) == legacy
    assert checkpoint.recorded_source(legacy)["path"] == str(source)
    with pytest.raises(files.DestinationError, match="other already exists and is not a conversion"):
        checkpoint.converted(str(source), other)
    assert (other / checkpoint.MARKER).read_bytes() == before


# --- acceptance statistics are defined on emitted tokens ----------------------------------------------


@pytest.fixture(scope="module")
def cut_rounds():
    """A speculative decode whose drafts are always accepted (the target drafts for itself, K = 4) and whose
    second round is cut by max_new_tokens: 7 new tokens = 1 from the prefill + 5 + 1 of the 5 the round made."""
    from conftest import TINY

    from specjax.decoding import GenerateSpec, speculative_generate
    from specjax.drafters.draft_model import DraftModel
    from specjax.models.llama import init_params

    graphdef, params = init_params(TINY)
    drafter = DraftModel(TINY, graphdef, 4)
    spec = GenerateSpec(7, eos_id=None)
    return speculative_generate(TINY, graphdef, params, drafter, params, [[1, 5, 9]], spec)


def test_tau_counts_only_emitted_tokens(cut_rounds):
    from specjax.metrics import summarize

    s = cut_rounds.stats
    assert int(cut_rounds.lengths[0]) == 7 and int(s.row_rounds.sum()) == 2
    assert int(s.emitted.sum()) == 6 and summarize(s)["tau"] == 3.0  # not (5 + 5) / 2


def test_acceptance_counts_only_emitted_draft_tokens(cut_rounds):
    from specjax.metrics import summarize

    s = cut_rounds.stats
    assert int(np.asarray(s.accepted_at).sum()) == 4 + 1  # round 2 emitted 1 draft token, not 4
    # position 1 of round 2 was accepted but cut: censored, so alpha_1 stays 1/1 rather than 1/2
    np.testing.assert_array_equal(np.asarray(s.reached_at), [2, 1, 1, 1])
    np.testing.assert_array_equal(summarize(s)["alpha"], [1.0, 1.0, 1.0, 1.0])


if __name__ == "__main__":
    batch_main(*sys.argv[1:])
