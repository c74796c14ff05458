"""The matrix-product precision policy (`specjax.precision`) reaches every product of every compiled program:
the AR loop, the speculative loop of every registered drafter (a chain, and a tree where the drafter drafts
trees) and a training step of every trained head type are lowered (not run) and every `dot_general` of their
program text is read. float32 weights: HIGHEST on every backend; bfloat16: the backend's default; an opt-in:
what was chosen. A new module that forgets the policy fails here on a CPU, before a GPU runs it as TF32."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from specjax import precision
from specjax.decoding.autoregressive import generate_compiled
from specjax.decoding.jobs import GenerateSpec, job_key, prepare, prepare_speculative
from specjax.decoding.speculative import speculative_compiled
from specjax.drafting import registry
from specjax.drafting.trees import TreeError, parse_tree
from specjax.models.llama import init_params
from specjax.models.loading import LoadedModel
from specjax.sampling import Sampler
from specjax.verify_exactness import tiny_drafter

DOT = re.compile(r"stablehlo\.dot_general\b[^\n]*")
PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")
PROMPTS = [[1, 5, 9], [1, 7]]
SAMPLER = Sampler(temperature=1.0)


def dot_precisions(lowered) -> list[str]:
    """The precision of every dot_general in a lowered program (no attribute: DEFAULT)."""
    found = []
    for line in DOT.findall(lowered.as_text()):
        m = PRECISION.search(line)
        assert m is None or m.group(1) == m.group(2), line
        found.append(m.group(1) if m else "DEFAULT")
    assert found, "the program has no matrix product: the test reads the wrong text"
    return found


def target(dtype: str) -> LoadedModel:
    cfg = dataclasses.replace(TINY, dtype=dtype)
    graphdef, params = init_params(cfg, seed=0)
    return LoadedModel(cfg, graphdef, params, None, None)


def lower_ar(t: LoadedModel, choice: str):
    spec = GenerateSpec(4, SAMPLER, eos_id=None, matmul_precision=choice)
    tokens, lengths, spec = prepare(t.cfg, PROMPTS, spec)
    return generate_compiled.lower(t.cfg, t.graphdef, t.params, tokens, lengths, job_key(0), spec)


def lower_speculative(t: LoadedModel, name: str, tree, choice: str):
    k = 2 if tree is None else tree.depth
    drafter, dparams = tiny_drafter(name, t, k, tree, SAMPLER)
    spec = GenerateSpec(4, SAMPLER, eos_id=None, matmul_precision=choice)
    tokens, lengths, spec = prepare_speculative(t.cfg, drafter, PROMPTS, spec)
    args = (t.cfg, t.graphdef, t.params, drafter, dparams, tokens, lengths, job_key(0), spec)
    return speculative_compiled.lower(*args)


def training_parts(t: LoadedModel, method: str, choice: str):
    """(config, head params, the loss and the batch resampler) of `method` on `t`."""
    from specjax import heads
    from specjax.training import trainer
    from specjax.training.config import base_config

    config, trained = base_config(method), registry.trained(method)
    config.matmul_precision = choice
    if "init" in config.heads:  # a draft model: from scratch (the tiny target lacks the default's layers)
        config.heads.init = "scratch"
    if trained.resample is not None:  # half of every batch sampled by the heads inside the step
        config.data.on_policy_fraction = 0.5
    trained.check(config.heads, t.cfg)
    shape = trained.shape_of(config.heads, t.cfg, None)
    meta = heads.describe(method, shape, t.cfg)
    graphdef, params = heads.new_heads(meta, t.cfg, t.params, 0)
    target_ = (t.cfg, t.graphdef, t.params)
    loss = trainer.loss_fn(meta, config, graphdef, target_)
    return config, params, loss, trainer.resampler(meta, config, graphdef, target_)


def lower_train_step(t: LoadedModel, method: str, choice: str):
    from specjax.training import trainer

    config, params, loss, resample = training_parts(t, method, choice)
    optimizer = trainer.make_optimizer(config.optimizer, 10)
    step = trainer.make_train_step(loss, optimizer, config, t.cfg.dtype, resample)
    tokens = jnp.ones((2, 16), jnp.int32)
    args = (
        params,
        optimizer.init(params),
        t.params,
        tokens,
        jnp.ones_like(tokens),
        None,
        jax.random.key(0),
    )
    return step.lower(*args, jnp.int32(1), jnp.int32(-1))


def drafter_shapes():
    """(drafter, None for a chain or its tree): every registered drafter as a chain, and as a small static tree
    where it drafts trees."""
    tree = parse_tree("0;1;0,0")
    cases = []
    for name in registry.names():
        cases.append((name, None))
        try:
            tiny_drafter(name, target("float32"), tree.depth, tree, SAMPLER)
        except (TreeError, ValueError, NotImplementedError):
            continue  # a chain drafter
        cases.append((name, tree))
    return cases


@pytest.fixture(scope="module")
def f32():
    return target("float32")


def test_unknown_precision_is_one_line_error():
    with pytest.raises(
        precision.PrecisionError, match=r"unknown matmul precision 'tf32'; use one of dtype"
    ):
        GenerateSpec(4, matmul_precision="tf32")
    assert precision.resolve("dtype", jnp.float32) == "highest"
    assert precision.resolve("dtype", jnp.bfloat16) == "default"
    assert precision.resolve("high", jnp.bfloat16) == "high"


def test_float32_ar_loop_runs_every_product_at_highest(f32):
    assert set(dot_precisions(lower_ar(f32, "dtype"))) == {"HIGHEST"}


@pytest.mark.parametrize("name,tree", drafter_shapes(), ids=lambda v: getattr(v, "describe", lambda: v)())
def test_float32_speculative_loop_runs_every_product_at_highest(f32, name, tree):
    assert set(dot_precisions(lower_speculative(f32, name, tree, "dtype"))) == {"HIGHEST"}


@pytest.mark.parametrize("method", registry.head_methods())
def test_float32_training_step_runs_every_product_at_highest(f32, method):
    assert set(dot_precisions(lower_train_step(f32, method, "dtype"))) == {"HIGHEST"}


@pytest.mark.parametrize("method", registry.head_methods())
def test_float32_head_loss_called_alone_runs_every_product_at_highest(f32, method):
    """A head's loss outside the trainer's compiled step (a notebook, a reference test) follows its weights'
    dtype: on a GPU a product left at the default runs as TF32 (the distilled draft's target logits once did)."""
    _, params, loss, _ = training_parts(f32, method, "dtype")
    tokens = jnp.ones((2, 16), jnp.int32)
    grad = jax.grad(
        lambda p: loss(p, f32.params, tokens, jnp.ones_like(tokens), None, jax.random.key(0))[0]
    )
    assert set(dot_precisions(jax.jit(grad).lower(params))) == {"HIGHEST"}


def test_bfloat16_keeps_the_backend_default():
    bf16 = target("bfloat16")
    assert set(dot_precisions(lower_ar(bf16, "dtype"))) == {"DEFAULT"}
    assert set(dot_precisions(lower_speculative(bf16, "eagle", None, "dtype"))) == {"DEFAULT"}
    assert set(dot_precisions(lower_train_step(bf16, "eagle3", "dtype"))) == {"DEFAULT"}


@pytest.mark.parametrize("choice,expected", [("high", "HIGH"), ("default", "DEFAULT")])
def test_an_opt_in_reaches_every_product(f32, choice, expected):
    assert set(dot_precisions(lower_ar(f32, choice))) == {expected}
    assert set(dot_precisions(lower_speculative(f32, "eagle3", None, choice))) == {expected}
    assert set(dot_precisions(lower_train_step(f32, "medusa", choice))) == {expected}


def test_a_function_called_alone_follows_its_weights_dtype(f32):
    """`forward` called outside a compiled job (a notebook, a reference test) uses the dtype rule; inside a job's
    scope, the job's choice."""
    from specjax.models.llama import causal_mask, forward, init_cache

    args = (jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None], init_cache(f32.cfg, 1, 8), causal_mask(3))
    alone = jax.jit(lambda p: forward(f32.graphdef, p, *args)[0]).lower(f32.params)
    assert set(dot_precisions(alone)) == {"HIGHEST"}

    def chosen(p):
        with precision.scope("high", np.float32):
            return forward(f32.graphdef, p, *args)[0]

    assert set(dot_precisions(jax.jit(chosen).lower(f32.params))) == {"HIGH"}
    bf16 = target("bfloat16")
    bf16_args = (*args[:2], init_cache(bf16.cfg, 1, 8), args[3])
    alone = jax.jit(lambda p: forward(bf16.graphdef, p, *bf16_args)[0]).lower(bf16.params)
    assert set(dot_precisions(alone)) == {"DEFAULT"}
