"""Helper of test_training.py, run in its own process with 8 simulated CPU devices: trains the same smoke
config on meshes data=1, data=8 and data=4 x model=2, prints the loss trajectories as JSON."""

import json
import sys
from pathlib import Path

import jax

from specjax.training import trainer
from specjax.training.config import base_config, smoke

target, corpus, out = sys.argv[1:4]
runs = {"devices": len(jax.devices())}
for name, n_data, n_model in [("data1", 1, 1), ("data8", 8, 1), ("data4_model2", 4, 2)]:
    c = smoke(base_config("eagle"))
    c.target, c.data.cache = target, corpus
    c.train.steps, c.train.log_every, c.train.batch_size = 8, 1, 16
    c.mesh.data, c.mesh.model = n_data, n_model
    trainer.train(c, Path(out) / name)
    runs[name] = [
        json.loads(line)["loss"] for line in (Path(out) / name / "metrics.jsonl").read_text().splitlines()
    ]
print(json.dumps(runs))
