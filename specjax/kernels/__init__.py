"""A matrix product of few rows for XLA CPU that reads each weight once (`packed_matmul.cc`, an XLA FFI handler).

XLA CPU's product of 2 to 16 rows re-reads a memory-bound layer's matrix (8 rows of the expanded stories260K's
[512, 4096] products: 1.6-1.8 one-row products, `docs/benchmarks.md`); this kernel streams the matrix once, packed
as panels of 32 output columns, and feeds every weight it loads to all rows. `python -m specjax.kernels` (run by
`make`) compiles it for this machine beside its source, with its provenance (source hash, CPU, compiler) in
`packed_matmul.json`; a missing, stale or foreign build is not used, and products stay XLA's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.errors import MissingInputError
from specjax.results import cpu_name

HERE = Path(__file__).parent
SOURCE = HERE / "packed_matmul.cc"
LIBRARY = HERE / "packed_matmul.so"
PROVENANCE = HERE / "packed_matmul.json"
PANEL = 32  # output columns per packed panel (the kernel's constant)
TARGET = "specjax_packed_matmul"


def _provenance(compiler: str) -> dict:
    return {
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "cpu": cpu_name(),
        "compiler": compiler,
    }


def build() -> Path:
    """Compiles the kernel for this machine (-march=native) into LIBRARY; MissingInputError without a C++
    compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise MissingInputError(
            "no C++ compiler (g++) found; install one (apt-get install g++) to build the CPU kernel"
        )
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    tmp = LIBRARY.with_suffix(".so.tmp")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17"]
    subprocess.run(
        [cxx, *flags, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", str(tmp)], check=True
    )
    PROVENANCE.with_suffix(".json.tmp").write_text(json.dumps(_provenance(version), indent=1))
    tmp.replace(LIBRARY)
    PROVENANCE.with_suffix(".json.tmp").replace(PROVENANCE)
    return LIBRARY


@functools.cache
def available() -> bool:
    """Whether the kernel is built for this source and this CPU, and registered with XLA CPU (once)."""
    if not (LIBRARY.is_file() and PROVENANCE.is_file()):
        return False
    recorded, now = json.loads(PROVENANCE.read_text()), _provenance("")
    if any(recorded.get(key) != now[key] for key in ("source_sha256", "cpu")):
        logging.warning(
            "the CPU kernel %s was built from another source or CPU: products stay XLA's (run make)",
            LIBRARY,
        )
        return False
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(str(LIBRARY)).PackedMatmul)
    )
    return True


def pack(w_OI: jax.Array) -> jax.Array:
    """W [out, in] as the kernel reads it: [ceil(out / 32), in, 32] panels of 32 output columns (zeros past out)."""
    n_out, n_in = w_OI.shape
    panels = -(-n_out // PANEL)
    w = jnp.pad(w_OI, ((0, panels * PANEL - n_out), (0, 0)))
    return w.reshape(panels, PANEL, n_in).transpose(0, 2, 1)


def packed_matmul(x_RI: jax.Array, w_PIC: jax.Array, n_out: int) -> jax.Array:
    """`x @ W.T` [R, n_out] float32 for a float32 W packed by `pack` (XLA CPU, where `available()`)."""
    if not available():
        raise MissingInputError(
            "specjax's CPU kernel is not built for this source and CPU; run make (python -m specjax.kernels)"
        )
    rows = x_RI.shape[0]
    out = jax.ShapeDtypeStruct((rows, w_PIC.shape[0] * PANEL), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x_RI, w_PIC)
    return y[:, :n_out]
