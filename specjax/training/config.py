"""The training configuration every `configs/*.py` file starts from (ml_collections, locked: a key that is not
defined here is an error, not a silent no-op)."""

from __future__ import annotations

import ml_collections


def base_config(method: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = method  # "medusa" or "eagle"
    c.target = "checkpoints/stories260K"  # a specjax (Orbax) checkpoint: python -m specjax.convert SRC DST
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.source = "self_distill"  # or a .txt / .jsonl file
    c.data.num_samples = 2048  # self-distillation: documents sampled from the target
    c.data.sample_len = 256  # ... of at most this many tokens after BOS
    c.data.temperature = 1.0  # ... at this temperature
    c.data.cache = (
        "checkpoints/stories260K_corpus.npy"  # packed tokens, built once ("" = rebuild every run)
    )
    c.data.seq_len = 128
    c.data.features = (
        "online"  # "online": the target runs inside the train step; "store": precomputed on disk
    )
    c.data.store = ""  # feature-store folder for features = "store"

    c.heads = ml_collections.ConfigDict()
    c.heads.num_heads = 4  # Medusa
    c.heads.num_layers = 1  # Medusa residual blocks per head
    c.heads.decay = 0.8  # Medusa: head i's loss weight decay^i (1 = uniform)
    c.heads.noise = 0.2  # EAGLE: width of the uniform noise on input features
    c.heads.ce_weight = 0.1  # EAGLE: weight of the cross-entropy beside the SmoothL1 feature loss

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.lr = 1e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.final_lr_fraction = 0.1  # cosine decay to lr x this
    c.optimizer.weight_decay = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.clip_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 2000
    c.train.batch_size = 32  # global: split over the mesh's data axis
    c.train.log_every = 50
    c.train.checkpoint_every = 500
    c.train.keep_checkpoints = 3

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # devices on the data axis (-1: all that the model axis leaves)
    c.mesh.model = 1  # devices sharding the frozen target's parameters
    return c


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks a config to a run of seconds: a small self-distilled corpus (not cached), a few steps."""
    c.data.num_samples = 64
    c.data.sample_len = 64
    c.data.seq_len = 32
    c.data.cache = ""
    c.optimizer.warmup_steps = 2
    c.train.steps = 30
    c.train.batch_size = 8
    c.train.log_every = 10
    c.train.checkpoint_every = 10
    return c
