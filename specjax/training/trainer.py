"""Optax training of Medusa / EAGLE heads on a frozen target restored from an Orbax checkpoint.

Sharding: a `("data", "model")` mesh; the batch is split over `data`, head parameters and optimiser state
are replicated, the frozen target's matrices are split over `model` along their first axis. The same code
runs on one CPU device or a pod. Checkpoints (head params, optimiser state, step, data position) go to
`WORKDIR/checkpoints` through an Orbax `CheckpointManager`; a restart resumes from the latest finished one.
Metrics go to the log, `WORKDIR/metrics.jsonl` and TensorBoard event files in `WORKDIR/tensorboard`.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import checkpoint, heads
from specjax.drafters.eagle import layer_config
from specjax.models.loading import load_tokenizer
from specjax.models.weights import CheckpointError
from specjax.training import data, losses


def make_mesh(n_data: int = -1, n_model: int = 1) -> Mesh:
    devices = jax.devices()
    if n_data == -1:
        n_data = len(devices) // n_model
    if n_data < 1 or n_model < 1 or n_data * n_model > len(devices):
        raise ValueError(
            f"mesh data={n_data} x model={n_model} needs more than the {len(devices)} devices here"
        )
    grid = np.array(devices[: n_data * n_model]).reshape(n_data, n_model)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def target_sharding(mesh: Mesh):
    """Places a target parameter: matrices split over `model` along their first axis where it divides."""
    n = mesh.shape["model"]

    def place(shape: jax.ShapeDtypeStruct):
        split = len(shape.shape) >= 2 and shape.shape[0] % n == 0
        return NamedSharding(mesh, P("model") if split and n > 1 else P())

    return place


def make_optimizer(opt, steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay, after clipping the global gradient norm."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, opt.warmup_steps, max(steps, opt.warmup_steps + 1), opt.lr * opt.final_lr_fraction
    )
    return optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.adamw(schedule, opt.b1, opt.b2, weight_decay=opt.weight_decay),
    )


def load_target(config, mesh: Mesh):
    path = Path(config.target).absolute()
    if not (path / checkpoint.MARKER).exists():
        raise CheckpointError(
            f"target checkpoint {path} not found (no {checkpoint.MARKER}): convert the target "
            f"first, e.g. `python -m specjax.convert stories260K {config.target}`"
        )
    cfg, graphdef, params = checkpoint.restore_model(path, sharding=target_sharding(mesh))
    return (cfg, graphdef, params), load_tokenizer(path / "tokenizer", cfg.vocab_size)


def loss_fn(meta: dict, config, graphdef, target):
    """`loss(head_params, target_params, tokens, feats, key) -> (loss, metrics)` for the configured method;
    `feats=None` computes the target's features online."""
    cfg, target_graphdef = target[0], target[1]
    h = config.heads

    def loss(params, target_params, tokens, feats, key):
        if feats is None:
            feats = losses.target_features(cfg, target_graphdef, target_params, tokens)
        if meta["method"] == "medusa":
            return losses.medusa_loss(graphdef, params, feats, tokens, h.decay)
        full = heads.drafter_params(meta, params, cfg, target_params)
        return losses.eagle_loss(
            graphdef, layer_config(cfg), full, feats, tokens, key, h.noise, h.ce_weight
        )

    return loss


class Logger:
    """One progress line per log step, plus `metrics.jsonl` and TensorBoard scalars."""

    def __init__(self, workdir: Path):
        from tensorboardX import SummaryWriter

        self.jsonl = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 (closed by close())
        self.tb = SummaryWriter(str(workdir / "tensorboard"))

    def __call__(self, step: int, metrics: dict) -> None:
        logging.info("step %d  %s", step, "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self):
        self.jsonl.close()
        self.tb.close()


def train(
    config, workdir: str | Path, stop_at: int | None = None, stop: threading.Event | None = None
) -> dict:
    """Trains heads per `config` in `workdir`, resuming from its latest checkpoint; stops after step
    `config.train.steps` (or `stop_at`, for a time-sliced run), or after the step during which `stop` is set
    (preemption), saving that step. Returns the last logged metrics and timing."""
    import orbax.checkpoint as ocp

    workdir = Path(workdir).absolute()
    if config.method not in heads.METHODS:
        raise ValueError(f"config.method must be one of {heads.METHODS}, got {config.method!r}")
    t = config.train
    mesh = make_mesh(config.mesh.data, config.mesh.model)
    n_data = mesh.shape["data"]
    if t.batch_size % n_data:
        raise ValueError(
            f"train.batch_size {t.batch_size} must divide evenly over the {n_data} data-parallel "
            "devices; change one of them"
        )
    target, tokenizer = load_target(config, mesh)
    cfg, _, target_params = target
    shape = (
        {"num_heads": config.heads.num_heads, "num_layers": config.heads.num_layers}
        if config.method == "medusa"
        else {}
    )
    meta = heads.describe(config.method, shape, cfg)
    heads.write_meta(workdir, meta)

    tokens = data.load_corpus(config, target, tokenizer)
    store = None
    if config.data.features == "store":
        store = _feature_store(config, target, tokens)
        tokens = store.tokens
    elif config.data.features != "online":
        raise ValueError(f"data.features must be 'online' or 'store', got {config.data.features!r}")

    graphdef, params = heads.new_heads(meta, cfg, target_params, config.seed)
    optimizer = make_optimizer(config.optimizer, t.steps)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    batch_sharding = NamedSharding(mesh, P("data"))
    loss = loss_fn(meta, config, graphdef, target)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, target_params, tokens, feats, key):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(
            params, target_params, tokens, feats, key
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            metrics | {"grad_norm": optax.tree.norm(grads)},
        )

    options = ocp.CheckpointManagerOptions(
        max_to_keep=t.keep_checkpoints, create=True, enable_async_checkpointing=False
    )
    manager = ocp.CheckpointManager(workdir / "checkpoints", options=options)
    step, position = 0, 0
    if manager.latest_step() is not None:
        step = manager.latest_step()
        abstract = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree
        )
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract(params)),
                    opt_state=ocp.args.StandardRestore(abstract(opt_state)),
                    progress=ocp.args.JsonRestore(),
                ),
            )
        except Exception as err:  # Orbax/tensorstore raise many types for damaged or missing files
            raise CheckpointError(
                f"cannot resume from step {step} in {workdir / 'checkpoints'} ({type(err).__name__}: "
                f"{str(err)[:300]}); the checkpoint is corrupt: delete that step directory to "
                "resume from an earlier one"
            ) from err
        params, opt_state, position = (
            restored["params"],
            restored["opt_state"],
            restored["progress"]["position"],
        )
        logging.info("resumed from step %d (data position %d) in %s", step, position, workdir)

    def save():
        manager.save(
            step,
            force=True,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                progress=ocp.args.JsonSave({"step": step, "position": position}),
            ),
        )

    logger, last, end = Logger(workdir), {}, min(t.steps, stop_at or t.steps)
    stop = stop or threading.Event()  # never set: run to the end
    window_start, window_tokens = time.perf_counter(), 0
    try:
        while step < end and not stop.is_set():
            rows = data.batch_indices(position, t.batch_size, len(tokens), config.seed)
            batch = jax.device_put(tokens[rows], batch_sharding)
            window_tokens += batch.size
            feats = None if store is None else jax.device_put(store.features(rows), batch_sharding)
            key = jax.random.fold_in(jax.random.key(config.seed), step)
            params, opt_state, metrics = train_step(params, opt_state, target_params, batch, feats, key)
            step, position = step + 1, position + t.batch_size
            if step % t.checkpoint_every == 0:
                save()
            if step % t.log_every == 0 or step == end:
                last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                last["tokens_per_s"] = window_tokens / (time.perf_counter() - window_start)
                logger(step, last)
                window_start, window_tokens = time.perf_counter(), 0
    finally:  # finished or interrupted (Ctrl-C included): keep the last step
        if step > 0 and manager.latest_step() != step:
            save()
        manager.wait_until_finished()
        manager.close()
        logger.close()
    return {"step": step, **last}


def _feature_store(config, target, tokens):
    """Opens `config.data.store`, building it first (once) from the frozen target."""
    cfg, graphdef, params = target
    folder = Path(config.data.store or "").absolute()
    if not config.data.store:
        raise ValueError("data.features = 'store' needs data.store, a folder for the precomputed features")
    if not (folder / data.MANIFEST).exists():
        features = jax.jit(lambda t: losses.target_features(cfg, graphdef, params, t))
        manifest = data.build_feature_store(folder, tokens, features)
        logging.info(
            "feature store %s: %d sequences, %d bytes per token",
            folder,
            manifest["rows"],
            manifest["bytes_per_token"],
        )
    return data.FeatureStore(folder)
