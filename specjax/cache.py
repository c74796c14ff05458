"""Static-shape KV cache: preallocated buffers plus a per-row committed length.

Slots `[0, length[b])` of row b are committed and visible to every new token. A forward pass writes
its T new keys/values at slots `[length[b], length[b] + T)` without committing them; the caller then
commits (`advance`), rolls back (`with_length`), or keeps a chosen subset (`compact`). Shapes never
change, so nothing recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """One buffer per layer (a slice of a stacked buffer would be copied before every attention matmul),
    rows and heads merged into one leading axis (attention is then a batched matmul that reads the buffer
    as it is; XLA would copy a reshaped one)."""

    k: tuple[jax.Array, ...]  # per layer [B * kv_heads, S, head_dim]
    v: tuple[
        jax.Array, ...
    ]  # per layer [B * kv_heads, head_dim, S]: S last, so attention reads it untransposed
    length: jax.Array  # [B] int32: committed slots per row

    @classmethod
    def init(cls, n_layers: int, batch: int, size: int, n_kv_heads: int, head_dim: int, dtype=jnp.float32):
        k = tuple(jnp.zeros((batch * n_kv_heads, size, head_dim), dtype) for _ in range(n_layers))
        v = tuple(jnp.zeros((batch * n_kv_heads, head_dim, size), dtype) for _ in range(n_layers))
        return cls(k, v, jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.k[0].shape[1]

    def _head_rows(self, slots_BN: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(buffer rows [B*kv, 1], slots [B*kv, N]): per-row slots repeated over the row's heads."""
        heads = self.k[0].shape[0] // self.length.shape[0]
        return jnp.arange(self.k[0].shape[0])[:, None], jnp.repeat(slots_BN, heads, axis=0)

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, offset: int = 0) -> KVCache:
        """Writes `[B, kv_heads, T, head_dim]` keys/values of `layer` at slots `length + offset + [0, T)`."""
        batch, heads, t, hd = k_new.shape
        rows, slots = self._head_rows(self.length[:, None] + offset + jnp.arange(t)[None, :])
        k, v = list(self.k), list(self.v)
        k[layer] = k[layer].at[rows, slots].set(k_new.reshape(batch * heads, t, hd).astype(k[layer].dtype))
        v[layer] = (
            v[layer].at[rows, :, slots].set(v_new.reshape(batch * heads, t, hd).astype(v[layer].dtype))
        )
        return self.replace(k=tuple(k), v=tuple(v))

    def advance(self, n: jax.Array | int) -> KVCache:
        """Commits the next `n` (per row, or scalar) written slots."""
        return self.replace(length=self.length + n)

    def with_length(self, length: jax.Array) -> KVCache:
        """Sets the committed length: rolling back is forgetting slots beyond it."""
        return self.replace(length=jnp.broadcast_to(length, self.length.shape).astype(jnp.int32))

    def compact(self, keep: jax.Array, n_keep: jax.Array) -> KVCache:
        """Commits a chosen subset of the last written tokens, in order.

        `keep[B, M]` holds indices into the T tokens written after `length` (e.g. an accepted tree
        path); the first `n_keep[B]` of them are gathered to slots `length .. length + n_keep - 1`
        of every layer, and the committed length grows by `n_keep`. Static shapes.
        """
        m = keep.shape[1]
        dst = self.length[:, None] + jnp.arange(m)[None, :]
        dst = jnp.where(jnp.arange(m)[None, :] < n_keep[:, None], dst, self.size)  # out of bounds: dropped
        rows, src = self._head_rows(self.length[:, None] + keep)
        _, dst = self._head_rows(dst)
        k = tuple(k.at[rows, dst].set(k[rows, src], mode="drop") for k in self.k)
        v = tuple(v.at[rows, :, dst].set(v[rows, :, src], mode="drop") for v in self.v)
        return self.replace(k=k, v=v, length=self.length + n_keep)

    def visible(self, mask_BTW: jax.Array) -> jax.Array:
        """Attention mask `[B, T, S]`: committed slots, plus the uncommitted window `[length, length + W)`
        as `mask_BTW` allows (the T new tokens occupy the window's last T slots)."""
        batch, t, w = mask_BTW.shape
        rel = jnp.arange(self.size)[None, :] - self.length[:, None]  # [B, S]
        in_window = (rel >= 0) & (rel < w)
        idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], (batch, t, self.size))
        window_visible = jnp.take_along_axis(mask_BTW, idx, axis=2) & in_window[:, None, :]
        return (rel < 0)[:, None, :] | window_visible

    def recent(self, positions_BT: jax.Array, w: int, window: int) -> jax.Array:
        """`[B, T, S]`: which slots hold a token less than `window` positions before each new token (a sliding
        layer's reach). A committed slot holds the position equal to its index (prompts start at slot 0 and
        commits are contiguous); the T new tokens (the window's last T slots) are at `positions_BT`; an earlier
        slot of the window (W > T: a draft written level by level) counts at its index."""
        t = positions_BT.shape[1]
        slots = jnp.arange(self.size)[None, :]
        rel = slots - self.length[:, None] - (w - t)  # index among the new tokens
        new = jnp.take_along_axis(positions_BT, jnp.clip(rel, 0, t - 1), axis=1)
        key_positions = jnp.where((rel >= 0) & (rel < t), new, slots)  # [B, S]
        return key_positions[:, None, :] > positions_BT[:, :, None] - window
