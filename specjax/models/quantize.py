"""Weight-only quantisation of a Llama's matrices: int8 or int4, symmetric, with float32 scales per output
channel or per group of input columns (GPTQ's `group_size`).

Every matrix a one-token pass reads whole (the blocks' linear layers and the LM head) is stored as ints with
its scales (`QLinear`); the forward dequantises a matrix right before its product, inside the compiled
function, so memory holds the ints (int4: two per byte) and a GPU/TPU, where XLA fuses the dequantisation
into the product, reads only them. XLA CPU does not: it writes each dequantised matrix to a temporary first,
and its int-to-float conversion is slow (int4 most), so there a quantised pass costs more than the float one
(measured: a [5632, 1024] matrix-vector product 1.7 ms float32, 4.8 ms int8, 8.1 ms int4 g32). Norms and the
embedding table stay float (a token reads one embedding row); a tied head becomes a quantised copy of the
embedding. Lossy against the float model: each weight moves by at most half its scale (`error_bound`).

    from specjax.models.quantize import Quantization, quantize_model
    graphdef_q, params_q = quantize_model(graphdef, params, Quantization(bits=4, group_size=32))
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from specjax.errors import QuantizationError
from specjax.models.llama import Linear, replace_linears

INT_DTYPES = {8: jnp.int8, 4: jnp.int4}
_WARNED: set[int] = set()  # group sizes whose shorter last group was announced


@dataclasses.dataclass(frozen=True)
class Quantization:
    """`bits` 8 or 4; `group_size` input columns share one scale (0: one scale per output channel; a last,
    shorter group takes what is left of a row)."""

    bits: int = 8
    group_size: int = 0

    def __post_init__(self):
        if self.bits not in INT_DTYPES or isinstance(self.bits, bool):
            raise QuantizationError(f"unsupported bit width {self.bits!r}; quantise to bits=8 or bits=4")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise QuantizationError(
                f"group_size must be an integer >= 0, got {self.group_size!r}; pass 0 for one scale per "
                "output channel or the input columns per scale (e.g. 32)"
            )

    def check(self, cfg) -> None:
        """Refuses (QuantizationError) a group size that does not divide the model's width (the input of its
        attention, MLP-in and LM-head matrices); where it does not divide the MLP's hidden width, the down
        projection's rows end in a shorter group (the rule of the class docstring), said once in a warning."""
        g = self.group_size
        widths = {"the model's width (dim)": cfg.dim, "the attention output": cfg.n_heads * cfg.head_dim}
        bad = {name: n for name, n in widths.items() if g and n % g}
        if bad:
            common = math.gcd(*widths.values())
            fits = [2**i for i in range(3, 8) if common % 2**i == 0] or [common]
            raise QuantizationError(
                f"a group of {g} input columns does not divide {', '.join(f'{k} {v}' for k, v in bad.items())}; "
                f"pass a group size that divides {common} (e.g. {fits[-1]}), or 0 for one scale per output channel"
            )
        if g and cfg.hidden_dim % g and g not in _WARNED:
            _WARNED.add(g)
            logging.warning(
                "a group of %d does not divide the MLP's hidden width %d: each row of the down projection ends "
                "in a group of %d columns",
                g,
                cfg.hidden_dim,
                cfg.hidden_dim % g,
            )

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # symmetric: -qmax..qmax (int4 never uses -8)

    def describe(self) -> str:
        scales = f"groups of {self.group_size}" if self.group_size else "per output channel"
        return f"int{self.bits} ({scales})"


def parse_quantization(text: str) -> Quantization | None:
    """`--quantize` values: '' or 'none' -> None, 'int8' (per output channel), 'int4' (groups of 32),
    'int4:64' / 'int8:128' (explicit group size)."""
    if text in ("", "none"):
        return None
    name, _, group = text.partition(":")
    bits = {"int8": 8, "int4": 4}.get(name)
    if bits is not None and group.isdigit() and int(group) == 0:
        raise QuantizationError(
            f"--quantize={text!r} asks for groups of 0 columns; pass {name}:GROUP_SIZE with a group >= 1 (e.g. "
            f"{name}:32), or int8 for one scale per output channel"
        )
    if bits is None or (group and not group.isdigit()):
        raise QuantizationError(
            f"--quantize={text!r} is not understood; pass int8, int4 or int4:GROUP_SIZE (e.g. int4:64)"
        )
    return Quantization(bits, int(group) if group else (32 if bits == 4 else 0))


def _group(n_in: int, group_size: int) -> int:
    return group_size if 0 < group_size < n_in else n_in


def quantize(w_OI, quant: Quantization) -> tuple[jax.Array, jax.Array]:
    """(ints [O, I], float32 scales [O, ceil(I / group)]): scale = max |w| of the group / qmax, ints =
    round(w / scale), so no weight is clipped. Runs on the host (numpy, once per load: no compiles)."""
    w = np.asarray(w_OI, np.float32)
    n_out, n_in = w.shape
    group = _group(n_in, quant.group_size)
    n_groups = -(-n_in // group)
    padded = np.pad(w, ((0, 0), (0, n_groups * group - n_in))).reshape(n_out, n_groups, group)
    scale_OG = np.abs(padded).max(-1) / np.float32(quant.qmax)
    scale_OG = np.where(scale_OG > 0, scale_OG, 1).astype(
        np.float32
    )  # an all-zero group: any scale is exact
    q = np.clip(np.round(w / np.repeat(scale_OG, group, axis=1)[:, :n_in]), -quant.qmax, quant.qmax)
    return jax.device_put(q.astype(jnp.dtype(INT_DTYPES[quant.bits]))), jax.device_put(scale_OG)


def spread(scale_OG: jax.Array, n_in: int, group_size: int) -> jax.Array:
    """Each column's scale [O, I] (a group's scale repeated over its columns)."""
    group = _group(n_in, group_size)
    return jnp.repeat(scale_OG, group, axis=1, total_repeat_length=scale_OG.shape[1] * group)[:, :n_in]


def dequantize(q_OI: jax.Array, scale_OG: jax.Array, group_size: int, dtype=jnp.float32) -> jax.Array:
    """The float matrix [O, I] the ints stand for."""
    return (q_OI.astype(jnp.float32) * spread(scale_OG, q_OI.shape[1], group_size)).astype(dtype)


def error_bound(scale_OG: jax.Array, n_in: int, group_size: int) -> jax.Array:
    """|w - dequantize(quantize(w))| <= scale / 2 for every weight [O, I] (rounding to the nearest int; no
    clipping since |w| / scale <= qmax), i.e. max |w of its group| / (2 qmax): 1/254 of it for int8, 1/14
    for int4 (exact arithmetic; float32 adds relative rounding of order 1e-7)."""
    return spread(scale_OG, n_in, group_size) / 2


class QLinear(Linear):
    """A `Linear` whose weight is stored as ints [out, in] with float32 scales [out, groups]; `matrix()`
    dequantises inside the compiled forward, so the ints are what memory holds and reads."""

    def __init__(self, weight_OI: jax.Array, bias, quant: Quantization):
        q, scale = quantize(weight_OI, quant)
        self.weight, self.scale = nnx.Param(q), nnx.Param(scale)
        self.bias = None if bias is None else nnx.Param(bias[...])
        self.group_size = quant.group_size
        self.dtype = str(weight_OI.dtype)  # what the dequantised matrix is computed in (the model's dtype)

    def matrix(self):
        return dequantize(self.weight[...], self.scale[...], self.group_size, self.dtype)


def quantize_model(graphdef, params, quant: Quantization):
    """(graphdef, params) of the model with every `Linear` and the LM head quantised; the float leaves it keeps
    (embedding, norms) are the same arrays as in `params`, not copies."""
    graphdef, params = replace_linears(
        graphdef, params, lambda node: QLinear(node.weight[...], node.bias, quant)
    )
    model = nnx.merge(graphdef, params)
    if (
        model.lm_head is None
    ):  # tied: the head reads the whole table each token, the embedding one row of it
        model.lm_head = nnx.data(QLinear(model.embed.embedding[...], None, quant))
    return nnx.split(model)


# --- bytes read per token -------------------------------------------------------------------------------


def stored_bytes(x: jax.Array) -> int:
    """Bytes `x` occupies as stored (int4: two values per byte)."""
    dt = jnp.dtype(x.dtype)
    bits = jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).bits
    return math.ceil(x.size * bits / 8)


def bytes_per_token(graphdef, params) -> dict[str, int]:
    """Weight bytes one decoding step of one token reads: `matrices` (every linear layer and the LM head, ints
    and scales or floats, biases included) and `total` (also the norms and one embedding row; a tied float
    head reads the whole table)."""
    model = nnx.merge(graphdef, params)
    leaf_bytes = lambda tree: sum(stored_bytes(x) for x in jax.tree.leaves(tree))
    table = stored_bytes(model.embed.embedding[...])
    tied = model.lm_head is None
    matrices = sum(
        leaf_bytes(nnx.state(node)) for _, node in nnx.iter_graph(model) if isinstance(node, Linear)
    ) + (table if tied else 0)
    row = table // model.embed.embedding.shape[0]
    return {"matrices": matrices, "total": leaf_bytes(params) - table + (table if tied else row)}


def quantize_loaded(model, quant: Quantization | None):
    """A `LoadedModel` whose params are quantised (`run_decode.py --quantize`); `None` returns it unchanged."""
    if quant is None:
        return model
    graphdef, params = quantize_model(model.graphdef, model.params, quant)
    return dataclasses.replace(model, graphdef=graphdef, params=params)
