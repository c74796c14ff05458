"""Device meshes and where a model's arrays live on them, for decoding and head training, on one process or
several (`initialize`: one process per host, each feeding its own devices).

A mesh has the axes `("data", "model")`. A Llama's matrices (`llama_shardings`) are split
Megatron style over `model`: the fused q/k/v and gate/up projections by output rows (column parallel), the
attention and MLP output projections by input columns (row parallel), an untied LM head by vocabulary rows;
embeddings and norms are replicated. The batch is split over `data` and the KV cache's merged (row, kv head)
axis over both axes (with one row per data shard, exactly its kv heads over `model`). XLA inserts the
collectives; the loop stays one compiled program. A drafter's matrices named like a Llama's (a draft model,
EAGLE's decoder layer) are split like the target's where their shapes divide, the rest is replicated.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import MeshError


def initialize(coordinator: str | None, num_processes: int, process_id: int) -> None:
    """Joins a run of `num_processes` processes (one per host) through `jax.distributed`, process 0 serving at
    `coordinator` (HOST:PORT); nothing for one process. CPU devices talk through gloo."""
    if num_processes == 1:
        return
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise MeshError(
            f"process_id {process_id} is not one of the {num_processes} processes; give each process an id "
            f"in 0..{num_processes - 1}"
        )
    host, _, port = (coordinator or "").rpartition(":")
    if not host or not port.isdigit():
        raise MeshError(
            f"--coordinator={coordinator!r}: a run of several processes needs process 0's address as HOST:PORT"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)


def is_main() -> bool:
    """Whether this is the process that writes files and logs (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def main_first(name: str):
    """A context whose body runs on process 0 first, then on the others (e.g. writing a cache, then reading it)."""

    @contextlib.contextmanager
    def run():
        if not is_main():
            barrier(name)
        yield
        if is_main():
            barrier(name)

    return run()


def from_main(values: np.ndarray) -> np.ndarray:
    """Process 0's `values` on every process (the same array back for one process): what a host measured, where
    every process must feed the compiled program the same numbers."""
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def place(tree, shardings):
    """`tree`'s arrays placed by the matching `shardings`, on one process or several (there, an array not yet
    global is given by each process from the whole host copy that every process holds)."""

    def put(x, at):
        if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, at)  # nothing to do for an array already placed so
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, at, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def to_host(tree):
    """`tree`'s arrays as numpy arrays on every process (gathered from all processes where they are split)."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    return jax.tree.map(get, tree)


def global_array(sharding: NamedSharding, shape: tuple[int, ...], rows):
    """The global array of `shape` placed by `sharding` (split on its first axis), each process reading only its
    own devices' rows through `rows(slice) -> numpy array`."""
    return jax.make_array_from_callback(shape, sharding, lambda index: rows(index[0]))


def make_mesh(n_data: int = -1, n_model: int = 1) -> Mesh:
    """A `("data", "model")` mesh of the first n_data x n_model devices (n_data = -1: all the model axis leaves)."""
    devices = jax.devices()
    if n_data == -1:
        n_data = len(devices) // n_model
    if n_data < 1 or n_model < 1 or n_data * n_model > len(devices):
        raise MeshError(
            f"mesh data={n_data} x model={n_model} needs {max(n_data, 1) * max(n_model, 1)} devices but "
            f"{len(devices)} are here; use a smaller mesh"
        )
    grid = np.array(devices[: n_data * n_model]).reshape(n_data, n_model)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def parse_mesh(text: str) -> tuple[int, int]:
    """(data, model) from 'data:2,model:4' (either axis may be left out: 1)."""
    sizes = {"data": 1, "model": 1}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition(":")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise MeshError(f"cannot read mesh {text!r}: write it like data:2,model:4 (sizes >= 1)")
        sizes[name] = int(value)
    return sizes["data"], sizes["model"]


def check_divides(what: str, size: int, axis: str, n: int, fix: str = "") -> None:
    if size % n:
        fix = fix or f"choose a {axis} axis dividing {size}"
        raise MeshError(f"{what} ({size}) cannot be split evenly over the mesh's {axis} axis ({n}); {fix}")


def _llama_spec(path: tuple[str, ...], shape: tuple[int, ...], n_model: int) -> P:
    name = "/".join(path)
    if n_model == 1 or len(shape) != 2:
        return P()
    if any(k in name for k in ("wqkv/", "w_gate_up/")) or name.startswith("lm_head/"):
        return P("model", None) if shape[0] % n_model == 0 else P()
    if any(k in name for k in ("wo/", "w_down/")):
        return P(None, "model") if shape[1] % n_model == 0 else P()
    return P()


def _path(keypath) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def llama_shardings(mesh: Mesh, params):
    """NamedShardings of a Llama's parameters (Megatron style over `model`, replicated where a shape does not
    divide); the tree of `params`."""
    n = mesh.shape["model"]
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, _llama_spec(_path(kp), tuple(x.shape), n)), params
    )


def leaf_placer(mesh: Mesh):
    """`put(path, host array)` -> that parameter on `mesh` as `llama_shardings` splits it, each device given its
    own slice: a model read one parameter at a time (`specjax.models.weights.params_from_hf`) never lands whole
    on one device."""
    n = mesh.shape["model"]
    return lambda path, x: jax.device_put(
        x, NamedSharding(mesh, _llama_spec(tuple(map(str, path)), tuple(x.shape), n))
    )


def check_target(mesh: Mesh, cfg, batch: int) -> None:
    """Refuses a mesh on which the target's (`cfg`, a LlamaConfig) heads or hidden units, or the batch, do not
    divide."""
    n_data, n_model = mesh.shape["data"], mesh.shape["model"]
    check_divides("the target's kv heads", cfg.n_kv_heads, "model", n_model)
    check_divides("the target's MLP hidden size", cfg.expert_dim or cfg.hidden_dim, "model", n_model)
    check_divides("the batch", batch, "data", n_data, f"decode a multiple of {n_data} prompts per batch")


def place_target(mesh: Mesh, cfg, params, batch: int):
    """The target's parameters on `mesh` (after `check_target`)."""
    check_target(mesh, cfg, batch)
    return place(params, llama_shardings(mesh, params))


def place_drafter(mesh: Mesh, drafter_params):
    """A drafter's parameters on `mesh`: matrices named like a Llama's split as the target's where their shapes
    divide, everything else replicated."""
    if drafter_params is None:
        return None
    return place(drafter_params, llama_shardings(mesh, drafter_params))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))


def constrain_cache(cache):
    """Inside a jitted function under `jax.set_mesh`: the KV cache's buffers split over the mesh (their merged
    (row, kv head) axis over data x model, or over data alone where model does not divide it); without a mesh,
    the cache as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cache
    rows = cache.k[0].shape[0]
    n_data, n_model = mesh.shape["data"], mesh.shape["model"]
    spec = (
        P(("data", "model")) if rows % (n_data * n_model) == 0 else P("data") if rows % n_data == 0 else P()
    )
    put = lambda x: jax.lax.with_sharding_constraint(x, spec)
    return cache.replace(k=tuple(map(put, cache.k)), v=tuple(map(put, cache.v)))
