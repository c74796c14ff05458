r"""Trains Medusa or EAGLE drafting heads on a frozen target; see the command at the top of each config.

    python train_heads.py --config=configs/medusa.py:smoke --workdir=/tmp/medusa_smoke
    python train_heads.py --config=configs/eagle.py --workdir=checkpoints/eagle --config.optimizer.lr=3e-4

Re-running with the same --workdir resumes from its latest checkpoint (with the config recorded in
WORKDIR/config.json: another one is refused unless --config.train.allow_config_change=True); a workdir is locked
while a run uses it. Ctrl-C or SIGTERM (preemption) saves the current step before exiting. The heads load into
`run_decode.py --drafter=medusa|eagle --heads=WORKDIR`. A user error ends with one line `error: ...` (exit 1);
SPECJAX_DEBUG=1 shows the traceback.

Several processes (one per host, e.g. the hosts of a TPU pod slice) train one run over all their devices:
start the same command on each with --num_processes=N --process_id=I --coordinator=HOST0:PORT; the mesh of
the config spans every process's devices, each process feeds its own devices' rows of a batch, process 0
writes the workdir records and logs, and Orbax writes each checkpoint once.
"""

import signal
import sys
import threading

from absl import flags, logging
from ml_collections import config_flags

from specjax import cli, sharding
from specjax.training.config import check_command_line
from specjax.training.trainer import NonFiniteLossError, train

config_flags.DEFINE_config_file(
    "config", None, "configs/medusa.py or configs/eagle.py, optionally ':smoke'", lock_config=True
)
flags.DEFINE_string(
    "workdir", None, "checkpoints, heads.json, metrics.jsonl and TensorBoard events go here"
)
cli.define_process_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    # SIGTERM (preemption) ends the run after the current step, which is saved; raising from the handler instead
    # could interrupt a library call half-way and lose the save
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)  # per-save chatter
    cli.join_processes()
    summary = train(flags.FLAGS.config, flags.FLAGS.workdir, stop=preempted)
    if not sharding.is_main():
        return
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    if preempted.is_set():
        sys.exit(f"stopped by SIGTERM at step {summary['step']}: re-run with the same --workdir to resume")


if __name__ == "__main__":
    cli.run(main, errors=(NonFiniteLossError,), check=check_command_line)
