"""Optax training of any registered head type (Medusa, EAGLE, EAGLE-3, ...) on a frozen target restored from an
Orbax checkpoint (a target given as anything else the decoder loads is converted into one on the first run:
`specjax.models.conversion.converted`).

Sharding: a `("data", "model")` mesh; the batch is split over `data`, head parameters and optimiser state
are replicated, the frozen target is restored straight onto the mesh, split Megatron style over `model`
(`specjax.sharding`). The same code runs on one CPU device, a pod, or several processes (`train_heads.py
--num_processes`: process 0 writes the workdir records and logs, each process feeds its own devices).
Checkpoints (head params, optimiser state, step, data position) go to `WORKDIR/checkpoints` through an Orbax
`CheckpointManager`; a restart resumes from the latest finished one.
Metrics go to the log, `WORKDIR/metrics.jsonl` (each line written before its step's checkpoint; a resumed run
first drops the lines after the step it resumes from) and TensorBoard event files in `WORKDIR/tensorboard`.

Safety: the config is validated before anything is loaded; the workdir is locked while a run uses it
(`WORKDIR/.lock`); the first run records its resolved config and the target's identity in `WORKDIR/config.json`
and a resumed run with another one is refused (unless `train.allow_config_change`); a non-finite loss or
gradient stops the run with NonFiniteLossError and keeps the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import cli, files, heads, pair, precision, sharding
from specjax.drafting import registry
from specjax.errors import NonFiniteLossError
from specjax.models.conversion import converted
from specjax.models.loading import load_tokenizer
from specjax.models.store import identity, restore_model, restore_step
from specjax.sharding import llama_shardings, make_mesh
from specjax.training import data, losses
from specjax.training.config import OPERATIONAL, TrainingConfigError, flatten, validate

CONFIG = "config.json"  # the resolved config of the run that started the workdir, and the target's identity


def make_optimizer(opt, steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay, after clipping the global gradient norm."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, opt.warmup_steps, max(steps, opt.warmup_steps + 1), opt.lr * opt.final_lr_fraction
    )
    return optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.adamw(schedule, opt.b1, opt.b2, weight_decay=opt.weight_decay),
    )


def target_path(config) -> Path:
    """The target's specjax checkpoint: `config.target` if it is one, else its conversion (made on the first
    run, at `config.target_checkpoint`; see `specjax.models.conversion.converted`)."""
    return converted(config.target, config.target_checkpoint)


def load_target(config, mesh: Mesh):
    with sharding.main_first("target converted"):  # converted once, by process 0
        path = target_path(config)
    cfg, graphdef, params = restore_model(path, shardings=lambda tree: llama_shardings(mesh, tree))
    return (cfg, graphdef, params), load_tokenizer(path / "tokenizer", cfg.vocab_size)


def feature_taps(meta: dict, cfg) -> tuple[int, ...]:
    """The target layers the method's features tap beside the final features."""
    return tuple(registry.trained(meta["method"]).feature_taps(meta["shape"], cfg))


def loss_fn(meta: dict, config, graphdef, target):
    """`loss(head_params, target_params, tokens, loss_mask, feats, key) -> (loss, metrics)` for the configured
    method; `feats=None` computes the target's features online."""
    cfg, target_graphdef = target[0], target[1]
    h = config.heads
    taps = feature_taps(meta, cfg)

    def loss(params, target_params, tokens, loss_mask, feats, key):
        if feats is None:
            feats = losses.target_features(cfg, target_graphdef, target_params, tokens, taps)
        full = heads.drafter_params(meta, params, cfg, target_params)
        return registry.trained(meta["method"]).loss(graphdef, cfg, full, feats, tokens, loss_mask, key, h)

    return loss


# heads settings that change neither an array nor what one means: `train.init_from` may start across them
ARRAYLESS_SETTINGS = frozenset({"block_size"})


def heldout_config(config):
    """The config the held-out metrics are measured under: training's input noise off (decoding feeds the heads
    the target's true features)."""
    if not config.heads.get("noise"):
        return config
    heldout = config.copy_and_resolve_references()
    heldout.heads.noise = 0.0
    return heldout


def resampler(meta: dict, config, graphdef, target):
    """`(head_params, target_params, tokens, loss_mask, key) -> (tokens, loss_mask)`: the training batch as the
    method wants it (e.g. sequences its heads sample themselves), or None where it takes the batch as it is."""
    cfg = target[0]
    resample = registry.trained(meta["method"]).resample
    if resample is None:
        return None

    def batch(params, target_params, tokens, loss_mask, key):
        full = heads.drafter_params(meta, jax.lax.stop_gradient(params), cfg, target_params)
        return resample(graphdef, cfg, full, tokens, loss_mask, key, config)

    return batch


def make_train_step(loss, optimizer, config, dtype, resample=None):
    """The compiled step `(params, opt_state, target_params, tokens, loss_mask, feats, key, step, first_bad) ->
    (params, opt_state, metrics, first_bad)`: the batch remade by `resample` where given (`resampler`), forward
    and backward at `config.matmul_precision` for weights of `dtype` (`specjax.precision`); `first_bad` keeps the
    first step whose loss or gradient was not finite."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, target_params, tokens, loss_mask, feats, key, step, first_bad):
        with precision.scope(config.matmul_precision, dtype):
            if resample is not None:
                tokens, loss_mask = resample(
                    params, target_params, tokens, loss_mask, jax.random.fold_in(key, 1)
                )
            (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(
                params, target_params, tokens, loss_mask, feats, key
            )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            metrics | {"grad_norm": grad_norm},
            jnp.where((first_bad < 0) & ~finite, step, first_bad),  # the first step with a non-finite loss
        )

    return train_step


def deepened(trained, fresh, n_trained: int):
    """`fresh` (heads of more decoder layers) with `trained`'s arrays wherever it has them: the layers after its
    `n_trained` keep their fresh weights but write nothing to the residual stream (attention and MLP outputs at zero),
    so the deeper heads start as the trained ones and draft the same tokens."""

    def silent(layer):
        if not {"wo", "w_down"} <= layer.keys():
            raise TrainingConfigError(
                f"train.init_from: cannot deepen heads whose layers have no dense attention and MLP outputs "
                f"(wo, w_down; these have {sorted(layer)}); train the deeper heads from the start"
            )
        return {
            n: jax.tree.map(jnp.zeros_like, a) if n in ("wo", "w_down") else a for n, a in layer.items()
        }

    layers = {
        i: trained["layers"][i] if i < n_trained else silent(layer) for i, layer in fresh["layers"].items()
    }
    return {**fresh, **trained, "layers": layers}


def start_from(source: str, meta: dict, params, cfg, target_params):
    """The parameters of the heads in `source` (`train.init_from`), which must be heads of this run's method and
    target with the arrays of `params` (this run's fresh heads): settings that change no array, as a DFlash head's
    block size, may differ, and a run of more decoder layers (`n_layers`) starts from them `deepened`."""
    theirs = heads.read_meta(Path(source))
    depth = (theirs["shape"].get("n_layers"), meta["shape"].get("n_layers"))
    deeper = None not in depth and depth[0] < depth[1] and isinstance(params.get("layers"), dict)
    if deeper:  # compared as the trained heads' depth
        meta = {**meta, "shape": {**meta["shape"], "n_layers": depth[0]}}
        fresh, params = params, heads.new_heads(meta, cfg, target_params)[1]
    if theirs != meta:
        shapes = lambda tree: (
            jax.tree.structure(tree),
            [(x.shape, x.dtype) for x in jax.tree.leaves(tree)],
        )
        same_arrays = (theirs["method"], theirs["target"]) == (meta["method"], meta["target"]) and (
            shapes(heads.new_heads(theirs, cfg, target_params)[1]) == shapes(params)
        )
        diff = {k: (theirs.get(k), meta.get(k)) for k in {*theirs, *meta} if theirs.get(k) != meta.get(k)}
        if not same_arrays:
            raise TrainingConfigError(
                f"config train.init_from={source!r} holds other heads than this run trains ((those, these) differ "
                f"in {diff}); start from heads trained with the same method, heads settings and target"
            )
        mine, their_shape = meta["shape"], theirs["shape"]
        meaning = sorted(
            k for k in {*mine, *their_shape} - ARRAYLESS_SETTINGS if mine.get(k) != their_shape.get(k)
        )
        if meaning:  # e.g. EAGLE-3's draft vocabulary, the tapped layers, the MASK token
            raise TrainingConfigError(
                f"config train.init_from={source!r} holds heads whose arrays mean other things than this run's: "
                f"their {meaning} differ ((those, these): {[(their_shape.get(k), mine.get(k)) for k in meaning]}); "
                "start from heads trained with the same settings (only the block size may change)"
            )
        logging.info("the heads in %s have the same arrays; (those, these) differ in %s", source, diff)
    logging.info("starting from the heads in %s, with a fresh optimiser", source)
    trained = heads.load_heads(source, cfg, target_params)[2]
    if deeper:
        logging.info("deepened from %d to %d decoder layers (the new ones start silent)", *depth)
        return deepened(trained, fresh, depth[0])
    return trained


def _logged_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def trim_metrics(path: Path, step: int) -> None:
    """Keeps the whole lines of `path` (metrics.jsonl) up to `step`, the checkpoint a run resumes from: a run
    killed half-way through a line, or after logging steps it never saved, leaves lines the resumed run would
    otherwise follow with a merged line or log a second time."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [
        line for line in lines if line.endswith("\n") and (_logged_step(line) or 0) in range(1, step + 1)
    ]
    if kept != lines:
        logging.warning(
            "%s: dropping %d line(s) after step %d (an interrupted run's)",
            path,
            len(lines) - len(kept),
            step,
        )
        files.write_text(path, "".join(kept), replaceable=lambda p: True)


class Logger:
    """One line per log step (step N/M, tokens/s, time left, the metrics), a short progress line between them
    at most every `cli.PROGRESS_S` seconds, plus `metrics.jsonl` (trimmed to the step the run starts from) and
    TensorBoard scalars."""

    def __init__(self, workdir: Path, step: int = 0, end: int = 0):
        from tensorboardX import SummaryWriter

        trim_metrics(workdir / "metrics.jsonl", step)
        self.jsonl = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 (closed by close())
        self.tb = SummaryWriter(str(workdir / "tensorboard"))
        self.first, self.end = step, end
        self.start = self.shown = time.perf_counter()

    def where(self, step: int) -> str:
        """'step N/M (P%), about H:MM:SS left' from the pace of this run so far."""
        self.shown = time.perf_counter()
        left = cli.time_left(step - self.first, self.end - self.first, self.shown - self.start)
        return f"step {step}/{self.end} ({100 * step // max(self.end, 1)}%), {left}"

    def progress(self, step: int) -> None:
        """The short line, if `cli.PROGRESS_S` have passed since the last line."""
        if time.perf_counter() - self.shown >= cli.PROGRESS_S:
            logging.info("%s", self.where(step))

    def __call__(self, step: int, metrics: dict) -> None:
        rate = metrics.get("tokens_per_s", 0.0)
        others = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "tokens_per_s")
        logging.info("%s, %.4g tokens/s  %s", self.where(step), rate, others)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self):
        self.jsonl.close()
        self.tb.close()


def record_config(config, workdir: Path, target_id: str, resuming: bool) -> None:
    """Records the run's config in `WORKDIR/config.json`; a resumed run whose config differs (beyond the
    OPERATIONAL keys, and head settings added since at their defaults) or whose target differs is refused unless
    `train.allow_config_change`."""
    path = workdir / CONFIG
    now = json.loads(json.dumps({"config": flatten(config), "target_id": target_id}, default=str))
    if resuming and path.exists():
        try:
            old = json.loads(path.read_text())
            before = {**old["config"], "target (identity)": old["target_id"]}
        except (OSError, ValueError, KeyError, TypeError):
            if not config.train.allow_config_change:
                raise files.ProvenanceError(
                    f"{path} is corrupt, so this resumed run cannot be checked against the run that started "
                    "the workdir; restore the file, or pass --config.train.allow_config_change=True"
                ) from None
            old, before = None, {}
        after = {**now["config"], "target (identity)": target_id}
        # a head setting added since the workdir was recorded: unchanged while it keeps its default
        settings = registry.trained(config.method).settings()
        added = {
            f"heads.{f.name}": json.loads(json.dumps(getattr(settings, f.name)))
            for f in dataclasses.fields(settings)
            if f"heads.{f.name}" not in before
        }
        before = added | before
        changed = [
            f"{k}: {before.get(k, '<unset>')!r} -> {after.get(k, '<unset>')!r}"
            for k in sorted(set(before) | set(after))
            if k not in OPERATIONAL and before.get(k) != after.get(k)
        ]
        if changed and not config.train.allow_config_change:
            raise files.ProvenanceError(
                f"workdir {workdir} was trained with another config ({'; '.join(changed[:6])}"
                f"{'; ...' if len(changed) > 6 else ''}); resume with the recorded config ({path}), use a new "
                "--workdir, or pass --config.train.allow_config_change=True to continue knowingly"
            )
        if changed:
            logging.warning("resuming %s with a changed config: %s", workdir, "; ".join(changed))
        elif old == now:
            return
    elif resuming:
        logging.warning("%s records no config (an older specjax started it): recording this run's", workdir)
    files.write_text(path, json.dumps(now, indent=1), replaceable=lambda p: True)


def train(
    config, workdir: str | Path, stop_at: int | None = None, stop: threading.Event | None = None
) -> dict:
    """Trains heads per `config` in `workdir`, resuming from its latest checkpoint; stops after step
    `config.train.steps` (or `stop_at`, for a time-sliced run), or after the step during which `stop` is set
    (preemption), saving that step. Returns the last logged metrics and timing."""
    validate(config)
    workdir = Path(workdir).absolute()
    with files.locked(workdir) if sharding.is_main() else contextlib.nullcontext():  # process 0 holds it
        return _train(config, workdir, stop_at, stop)


def _train(config, workdir: Path, stop_at: int | None, stop: threading.Event | None) -> dict:
    import orbax.checkpoint as ocp

    t = config.train
    mesh = make_mesh(config.mesh.data, config.mesh.model)
    n_data = mesh.shape["data"]
    if t.batch_size % n_data:
        raise TrainingConfigError(
            f"train.batch_size {t.batch_size} must divide evenly over the {n_data} data-parallel "
            "devices; change one of them"
        )
    target, tokenizer = load_target(config, mesh)
    cfg, _, target_params = target
    registry.trained(config.method).check(config.heads, cfg)  # before anything is written
    if (workdir / heads.META).is_file():  # a resumed run: its heads were trained for a target that fits
        pair.check_pair(cfg, tokenizer, workdir, config.target)
    d = config.data
    if d.seq_len > cfg.max_seq_len:
        raise TrainingConfigError(
            f"config data.seq_len={d.seq_len} exceeds the target's context of {cfg.max_seq_len} tokens; "
            f"pass --config.data.seq_len={cfg.max_seq_len} or less"
        )
    if d.source == "self_distill" and d.sample_len + 1 > cfg.max_seq_len:
        raise TrainingConfigError(
            f"config data.sample_len={d.sample_len} (+ BOS) exceeds the target's context of "
            f"{cfg.max_seq_len} tokens; pass --config.data.sample_len={cfg.max_seq_len - 1} or less"
        )
    target_id = identity(target_path(config), cfg, target_params)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=t.keep_checkpoints, create=True, enable_async_checkpointing=False
    )
    manager = ocp.CheckpointManager(workdir / "checkpoints", options=options)
    try:
        return _run(config, workdir, stop_at, stop, mesh, target, tokenizer, target_id, manager)
    finally:
        manager.close()


def _run(config, workdir, stop_at, stop, mesh, target, tokenizer, target_id, manager) -> dict:
    import orbax.checkpoint as ocp

    t = config.train
    cfg, _, target_params = target
    with sharding.main_first("workdir records"):  # written by process 0, checked by every process
        record_config(config, workdir, target_id, resuming=manager.latest_step() is not None)

    # every process reads (or makes) the corpus, process 0 caches it
    corpus = data.load_corpus(config, target, tokenizer, target_id, write=sharding.is_main())
    n_train = len(corpus.tokens) - config.data.heldout  # the held-out rows follow the training rows
    if n_train < t.batch_size:
        raise data.DataError(
            f"the corpus holds {n_train} training sequences of {config.data.seq_len} tokens, fewer than one batch "
            f"of {t.batch_size} (it would be repeated within a batch); add data, or lower train.batch_size "
            "or data.seq_len"
        )
    # what the heads learn to predict
    trained_tokens = corpus.tokens[:n_train][corpus.loss_mask[:n_train] == 1]
    shape = registry.trained(config.method).shape_of(config.heads, cfg, trained_tokens)
    meta = heads.describe(config.method, shape, cfg)
    with sharding.main_first(
        "heads record"
    ):  # other heads in this workdir: refused, whatever allow_config_change says
        heads.write_meta(workdir, meta)
    taps = feature_taps(meta, cfg)
    store = None
    if config.data.features == "store":
        store = _feature_store(config, target, corpus, target_id, taps)
        corpus = data.Corpus(store.tokens, store.loss_mask)
    tokens, loss_mask = corpus
    heldout = (tokens[n_train:], loss_mask[n_train:])

    graphdef, params = heads.new_heads(meta, cfg, target_params, config.seed)
    optimizer = make_optimizer(config.optimizer, t.steps)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    batch_sharding = NamedSharding(mesh, P("data"))
    width = tokens.shape[1]
    loss = loss_fn(meta, config, graphdef, target)
    train_step = make_train_step(
        loss, optimizer, config, cfg.dtype, resampler(meta, config, graphdef, target)
    )

    heldout_loss = loss_fn(meta, heldout_config(config), graphdef, target)

    @jax.jit
    def evaluate(params, target_params, tokens, mask):
        with precision.scope(config.matmul_precision, cfg.dtype):
            return heldout_loss(params, target_params, tokens, mask, None, jax.random.key(0))[1]

    heldout = jax.device_put(heldout, replicated) if config.data.heldout else None

    step, position = 0, 0
    # a new run may start from trained heads; a resumed one continues from its own checkpoint
    if manager.latest_step() is None and t.init_from:
        params = jax.device_put(start_from(t.init_from, meta, params, cfg, target_params), replicated)
    elif manager.latest_step() is not None:
        step = manager.latest_step()
        abstract = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree
        )
        restored = restore_step(
            manager,
            step,
            f"resume from step {step} in {workdir / 'checkpoints'}",
            "delete that step directory to resume from an earlier one",
            params=ocp.args.StandardRestore(abstract(params)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state)),
            progress=ocp.args.JsonRestore(),
        )
        params, opt_state, position = (
            restored["params"],
            restored["opt_state"],
            restored["progress"]["position"],
        )
        logging.info("resumed from step %d (data position %d) in %s", step, position, workdir)

    first_bad = jnp.asarray(-1, jnp.int32)

    def check_finite():
        bad = int(first_bad)
        if bad >= 0:
            good = manager.latest_step()
            raise NonFiniteLossError(
                f"the loss became non-finite at step {bad}, so the run stopped "
                f"({'no checkpoint was saved' if good is None else f'its last good checkpoint, step {good}, is kept'})"
                "; lower optimizer.lr, raise optimizer.warmup_steps or check the data, then resume"
            )

    def save():
        check_finite()  # never save non-finite parameters over good ones
        manager.save(
            step,
            force=True,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                progress=ocp.args.JsonSave({"step": step, "position": position}),
            ),
        )

    last, end = {}, min(t.steps, stop_at or t.steps)
    logger = Logger(workdir, step, end) if sharding.is_main() else None  # process 0 logs
    stop = stop or threading.Event()  # never set: run to the end
    window_start, window_tokens = time.perf_counter(), 0
    try:
        while step < end and not stop.is_set():
            rows = data.batch_indices(position, t.batch_size, n_train, config.seed)
            # each process reads the rows of its own devices only
            batch = sharding.global_array(batch_sharding, (len(rows), width), lambda i: tokens[rows[i]])
            mask = sharding.global_array(batch_sharding, (len(rows), width), lambda i: loss_mask[rows[i]])
            window_tokens += batch.size
            feats = None
            if store is not None:
                shape = (len(rows), width, store.manifest["dim"])
                feats = sharding.global_array(batch_sharding, shape, lambda i: store.features(rows[i]))
            key = jax.random.fold_in(jax.random.key(config.seed), step)
            params, opt_state, metrics, first_bad = train_step(
                params, opt_state, target_params, batch, mask, feats, key, step + 1, first_bad
            )
            step, position = step + 1, position + t.batch_size
            if step % t.log_every == 0 or step == end:  # logged before saved: a saved step's line is whole
                check_finite()
                last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                last["tokens_per_s"] = window_tokens / (time.perf_counter() - window_start)
                if heldout is not None:  # held-out rows, never trained on
                    metrics = jax.device_get(evaluate(params, target_params, *heldout))
                    last |= {f"eval_{k}": float(v) for k, v in metrics.items()}
                if logger:
                    logger(step, last)
                window_start, window_tokens = time.perf_counter(), 0
            elif logger:
                logger.progress(step)
            if step % t.checkpoint_every == 0:
                save()
    finally:  # finished or interrupted (Ctrl-C included): keep the last step, if its parameters are finite
        try:
            if step > 0 and manager.latest_step() != step and int(first_bad) < 0:
                save()
            manager.wait_until_finished()
        finally:
            if logger:
                logger.close()
    return {"step": step, **last}


def _feature_store(config, target, corpus: data.Corpus, target_id: str, taps: tuple[int, ...] = ()):
    """Opens `config.data.store`, building it first (once) from the frozen target; a store built from another
    target, other tokens, at another matmul precision or with other feature layers is refused."""
    cfg, graphdef, params = target
    folder = Path(config.data.store).absolute()
    matmul = precision.resolve(config.matmul_precision, cfg.dtype)
    provenance = data.store_provenance(target_id, corpus, matmul, taps=taps)
    if not (folder / data.MANIFEST).exists():
        if jax.process_count() > 1:
            raise data.DataError(
                f"feature store {folder} does not exist yet; build it with a run of one process first (or "
                "train with data.features='online')"
            )

        def target_features(tokens):
            with precision.scope(config.matmul_precision, cfg.dtype):
                return losses.target_features(cfg, graphdef, params, tokens, taps)

        features = jax.jit(target_features)
        manifest = data.build_feature_store(folder, corpus, features, provenance=provenance)
        logging.info(
            "feature store %s: %d sequences, %d bytes per token",
            folder,
            manifest["rows"],
            manifest["bytes_per_token"],
        )
    return data.FeatureStore(folder, provenance)
