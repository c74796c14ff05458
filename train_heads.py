r"""Trains Medusa or EAGLE drafting heads on a frozen target; see the command at the top of each config.

    python train_heads.py --config=configs/medusa.py:smoke --workdir=/tmp/medusa_smoke
    python train_heads.py --config=configs/eagle.py --workdir=checkpoints/eagle --config.optimizer.lr=3e-4

Re-running with the same --workdir resumes from its latest checkpoint; Ctrl-C or SIGTERM (preemption)
saves the current step before exiting. The heads load into
`run_decode.py --drafter=medusa|eagle --heads=WORKDIR`.
"""

import signal

from absl import app, flags, logging
from ml_collections import config_flags

from specjax.training.trainer import train

config_flags.DEFINE_config_file("config", None, "configs/medusa.py or configs/eagle.py, optionally ':smoke'",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, heads.json, metrics.jsonl and TensorBoard events go here")
flags.mark_flags_as_required(["config", "workdir"])


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # the trainer saves the current step, then re-raises


def main(argv):
    del argv
    signal.signal(signal.SIGTERM, interrupt)
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)  # per-save chatter
    summary = train(flags.FLAGS.config, flags.FLAGS.workdir)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    app.run(main)
