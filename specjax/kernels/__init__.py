"""specjax's CPU kernels for decoding passes of a few rows, XLA FFI handlers in one library:

- `packed_matmul` (`packed_matmul.cc`): XLA CPU's product of 2 to 16 rows re-reads a memory-bound layer's matrix (8
  rows of the expanded stories260K's [512, 4096] products: 1.6-1.8 one-row products, `docs/benchmarks.md`); this
  streams the matrix once, packed as panels of two vectors' width (32 output columns with AVX-512, 16 with AVX2: the
  build's entry in `PANELS`), and feeds every weight it loads to all rows.
- `decode_attention` (`decode_attention.cc`): XLA reads the whole static KV cache on one thread (a batch of 4 rows'
  attention cost more than 7 one-row attentions); this reads each row's cache once, up to its last visible slot, on
  XLA's threads.
- `fma_peak_gflops` (`peak.cc`): the host's float multiply-add peak, the compute roof no product here can pass
  (XLA's own matrix product reaches less: `experiments.bench_memory_bound`'s curve).

`python -m specjax.kernels` (run by `make`) compiles them for this machine beside their sources, unless a build of
these sources for this CPU is there, with its provenance (sources' hash, CPU and its feature flags, compiler) in
`specjax_cpu.json`; any other build is not used, and products and attention stay XLA's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import MissingInputError, UsageError
from specjax.results import cpu_info, cpu_name

HERE = Path(__file__).parent
SOURCES = ("pool.h", "vec.h", "packed_matmul.cc", "decode_attention.cc", "peak.cc")
LIBRARY = HERE / "specjax_cpu.so"
PROVENANCE = HERE / "specjax_cpu.json"
HANDLERS = {"packed_matmul": "PackedMatmul", "decode_attention": "DecodeAttention"}
# output columns per packed panel of each registered build (its `SpecjaxPanel()`)
PANELS: dict[str, int] = {}


def _provenance(compiler: str) -> dict:
    """What a build depends on: its sources, the CPU -march=native compiled for (its name and the hash of its
    feature flags: CPUs a virtual machine names alike may differ in their instructions), and the compiler."""
    info = cpu_info()
    features = " ".join(sorted((info.get("flags") or info.get("Features") or "").split()))
    return {
        "source_sha256": hashlib.sha256(
            b"".join((HERE / name).read_bytes() for name in SOURCES)
        ).hexdigest(),
        "cpu": cpu_name(),
        "cpu_features_sha256": hashlib.sha256(features.encode()).hexdigest(),
        "compiler": compiler,
    }


def stale() -> str | None:
    """Why the build in LIBRARY cannot be used here (missing, other sources, another CPU), or None."""
    if not (LIBRARY.is_file() and PROVENANCE.is_file()):
        return f"{LIBRARY} is not built"
    recorded, now = json.loads(PROVENANCE.read_text()), _provenance("")
    if recorded.get("source_sha256") != now["source_sha256"]:
        return f"{LIBRARY} was built from other sources"
    if recorded.get("cpu") != now["cpu"]:
        return f"{LIBRARY} was built for another CPU ({recorded.get('cpu')}; this one: {now['cpu']})"
    if recorded.get("cpu_features_sha256") != now["cpu_features_sha256"]:
        return f"{LIBRARY} was built for a CPU with other features than this {now['cpu']}"
    return None


def compile_library(out: Path, march: str = "native") -> str:
    """Compiles the kernels for `-march` into `out`; the compiler's version. MissingInputError without a C++
    compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise MissingInputError(
            "no C++ compiler (g++) found; install one (apt-get install g++) to build the CPU kernels"
        )
    sources = [str(HERE / name) for name in SOURCES if name.endswith(".cc")]
    flags = ["-O3", f"-march={march}", "-shared", "-fPIC", "-std=c++17", "-isystem", jax.ffi.include_dir()]
    subprocess.run([cxx, *flags, *sources, "-o", str(out)], check=True)
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def build() -> Path:
    """Compiles the kernels for this machine (-march=native) into LIBRARY, with its provenance."""
    tmp = LIBRARY.with_suffix(".so.tmp")
    # the sources as they are compiled, not as they are after it (a checkout during a build)
    provenance = _provenance("")
    provenance["compiler"] = compile_library(tmp)
    PROVENANCE.with_suffix(".json.tmp").write_text(json.dumps(provenance, indent=1))
    tmp.replace(LIBRARY)
    PROVENANCE.with_suffix(".json.tmp").replace(PROVENANCE)
    return LIBRARY


def register(library: Path, name: str) -> None:
    """Registers a compiled library's handlers with XLA CPU as `{name}_{handler}` (the functions' `registered`)."""
    handlers = ctypes.cdll.LoadLibrary(str(library))
    for handler, symbol in HANDLERS.items():
        jax.ffi.register_ffi_target(f"{name}_{handler}", jax.ffi.pycapsule(getattr(handlers, symbol)))
    PANELS[name] = handlers.SpecjaxPanel()


@functools.cache
def available() -> bool:
    """Whether the kernels are built for these sources and this CPU, and registered with XLA CPU (once)."""
    why = stale()
    if why is not None:
        if LIBRARY.is_file():
            logging.warning("%s: XLA's products and attention stay in use (run make)", why)
        return False
    register(LIBRARY, "specjax")
    return True


def pack(w_OI: jax.Array, registered: str = "specjax") -> jax.Array:
    """W [out, in] as the build `registered` reads it: [ceil(out / N), in, N] panels of its N output columns
    (zeros past out)."""
    _require(registered)
    n_out, n_in = w_OI.shape
    width = PANELS[registered]
    panels = -(-n_out // width)
    w = jnp.pad(w_OI, ((0, panels * width - n_out), (0, 0)))
    return w.reshape(panels, width, n_in).transpose(0, 2, 1)


def _require(registered: str):
    if registered == "specjax" and not available():
        raise MissingInputError(
            "specjax's CPU kernels are not built for these sources and CPU; run make (python -m specjax.kernels)"
        )


def fma_peak_gflops(threads: int | None = None, iterations: int = 20_000_000, runs: int = 3) -> float:
    """The host's float multiply-add peak, GFLOP/s: `threads` threads (default: the CPUs this process may run on)
    each running chains of `iterations` fused multiply-adds held in registers (`peak.cc`); the best of `runs`."""
    _require("specjax")
    rate = ctypes.cdll.LoadLibrary(str(LIBRARY)).SpecjaxFmaGflops
    rate.restype, rate.argtypes = ctypes.c_double, (ctypes.c_int, ctypes.c_int64)
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    threads = threads or len(usable)
    return max(rate(threads, iterations) for _ in range(runs))


def packed_matmul(x_RI: jax.Array, w_PIC: jax.Array, n_out: int, registered: str = "specjax") -> jax.Array:
    """`x @ W.T` [R, n_out] float32 for a float32 W packed by `pack` for the same build (XLA CPU, where
    `available()`; `registered`: the name another build was `register`ed under)."""
    _require(registered)
    if w_PIC.shape[2] != PANELS[registered]:
        raise UsageError(
            f"W is packed in panels of {w_PIC.shape[2]} columns, the {registered} build reads "
            f"{PANELS[registered]}: pack it with kernels.pack(w, {registered!r})"
        )
    out = jax.ShapeDtypeStruct((x_RI.shape[0], w_PIC.shape[0] * w_PIC.shape[2]), jnp.float32)
    y = jax.ffi.ffi_call(f"{registered}_packed_matmul", out, vmap_method="sequential")(x_RI, w_PIC)
    return y[:, :n_out]


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def decode_attention(
    q_XRD, k_XSD, v_XDS, visible_BTS, scale: float, registered: str = "specjax"
) -> jax.Array:
    """softmax(scale q.k over the visible slots) . v [X, R, D] float32, for X = B x kv heads (row-major), R = query
    heads per kv head x T tokens (token fastest), a cache laid out as `KVCache`'s (XLA CPU, where `available()`).
    Differentiable: its derivatives are `reference_attention`'s (a head trained on the CPU)."""
    _require(registered)
    out = jax.ShapeDtypeStruct(q_XRD.shape, jnp.float32)
    call = jax.ffi.ffi_call(f"{registered}_decode_attention", out, vmap_method="sequential")
    return call(q_XRD, k_XSD, v_XDS, visible_BTS, scale=np.float32(scale))


@decode_attention.defjvp
def _decode_attention_jvp(scale, registered, primals, tangents):
    q, k, v, visible = primals
    reference = lambda q, k, v: reference_attention(q, k, v, visible, scale)
    return jax.jvp(reference, (q, k, v), tangents[:3])


def reference_attention(q_XRD, k_XSD, v_XDS, visible_BTS, scale: float) -> jax.Array:
    """`decode_attention` as XLA computes it (masked slots at the float minimum: a token that sees none averages
    every slot)."""
    b, t, _ = visible_BTS.shape
    x, r, _ = q_XRD.shape
    scores = jnp.einsum("xrd,xsd->xrs", q_XRD, k_XSD) * scale
    seen = jnp.broadcast_to(visible_BTS[:, None, None], (b, x // b, r // t, t, visible_BTS.shape[-1]))
    scores = jnp.where(seen.reshape(scores.shape), scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("xrs,xds->xrd", jax.nn.softmax(scores, axis=-1), v_XDS)
