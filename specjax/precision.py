"""The matrix-product precision policy, in one place: the parameter dtype decides.

float32 parameters run every dot product and einsum at full float32 precision on every backend (XLA's GPU
default runs float32 products as TF32, which made a batch decode differently from each prompt alone on an
H100); bfloat16/float16 keep the backend's default. A user may choose otherwise (`default`, `high`,
`highest`): the choice is a static setting of a job (`GenerateSpec.matmul_precision`,
`config.matmul_precision` in training) and is entered once around each compiled program with `scope`.
`follows_params` applies the dtype rule to a pure function called on its own (the model's `forward`, a
head's logits or loss), unless a scope is already active.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import PrecisionError

CHOICES = ("dtype", "default", "high", "highest")


def check(choice: str) -> str:
    """`choice` if it is a known precision, else a one-line `PrecisionError`."""
    if choice not in CHOICES:
        raise PrecisionError(
            f"unknown matmul precision {choice!r}; use one of {', '.join(CHOICES)} "
            "(dtype: full precision for float32 weights, the backend's default for bfloat16/float16)"
        )
    return choice


def resolve(choice: str, dtype) -> str:
    """The precision JAX runs products at for `choice` and parameters of `dtype`."""
    if check(choice) != "dtype":
        return choice
    return "highest" if np.dtype(dtype) == np.float32 else "default"


def describe(choice: str, dtype) -> str:
    """How results name the precision: `highest (dtype)` under the dtype rule, else the choice made."""
    return f"{resolve(choice, dtype)} (dtype)" if choice == "dtype" else f"{choice} (chosen)"


def params_dtype(params):
    """The widest floating dtype among the array leaves of `params` (float32 for a model with any float32
    leaf; float32 when there are none)."""
    dtypes = [x.dtype for x in jax.tree.leaves(params) if hasattr(x, "dtype")]
    floats = [np.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.floating)]  # not PRNG keys' dtypes
    return max(floats, key=lambda d: d.itemsize, default=np.dtype(np.float32))


def scope(choice: str, dtype) -> contextlib.AbstractContextManager:
    """The context every product of a traced program runs in, for `choice` and parameters of `dtype`."""
    return jax.default_matmul_precision(resolve(choice, dtype))


def follows_params(fn):
    """`fn(...)` (a model's forward, a head's logits or loss) with its products at the dtype rule for the
    arrays it is given (`params_dtype`), unless a caller's `scope` already chose (a compiled job's opt-in
    wins)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if jax.config.jax_default_matmul_precision is not None:
            return fn(*args, **kwargs)
        with scope("dtype", params_dtype((args, kwargs))):
            return fn(*args, **kwargs)

    return wrapped
