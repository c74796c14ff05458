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
    k: jax.Array  # [layers, B, kv_heads, S, head_dim]
    v: jax.Array  # [layers, B, kv_heads, head_dim, S]: S last, so attention reads it without a transpose
    length: jax.Array  # [B] int32: committed slots per row

    @classmethod
    def init(cls, n_layers: int, batch: int, size: int, n_kv_heads: int, head_dim: int, dtype=jnp.float32):
        k = jnp.zeros((n_layers, batch, n_kv_heads, size, head_dim), dtype)
        v = jnp.zeros((n_layers, batch, n_kv_heads, head_dim, size), dtype)
        return cls(k, v, jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, offset: int = 0) -> "KVCache":
        """Writes `[B, kv_heads, T, head_dim]` keys/values of `layer` at slots `length + offset + [0, T)`."""
        batch, _, t, _ = k_new.shape
        rows = jnp.arange(batch)[:, None]
        slots = self.length[:, None] + offset + jnp.arange(t)[None, :]
        # advanced indices (rows, slots) around a slice: the indexed result is [B, T, kv_heads, head_dim]
        return self.replace(k=self.k.at[layer, rows, :, slots].set(k_new.swapaxes(1, 2).astype(self.k.dtype)),
                            v=self.v.at[layer, rows, :, :, slots].set(v_new.swapaxes(1, 2).astype(self.v.dtype)))

    def advance(self, n: jax.Array | int) -> "KVCache":
        """Commits the next `n` (per row, or scalar) written slots."""
        return self.replace(length=self.length + n)

    def with_length(self, length: jax.Array) -> "KVCache":
        """Sets the committed length: rolling back is forgetting slots beyond it."""
        return self.replace(length=jnp.broadcast_to(length, self.length.shape).astype(jnp.int32))

    def compact(self, keep: jax.Array, n_keep: jax.Array) -> "KVCache":
        """Commits a chosen subset of the last written tokens, in order.

        `keep[B, M]` holds indices into the T tokens written after `length` (e.g. an accepted tree
        path); the first `n_keep[B]` of them are gathered to slots `length .. length + n_keep - 1`
        of every layer, and the committed length grows by `n_keep`. One static-shape gather.
        """
        batch, m = keep.shape
        rows = jnp.arange(batch)[:, None]
        src = self.length[:, None] + keep
        dst = self.length[:, None] + jnp.arange(m)[None, :]
        valid = jnp.arange(m)[None, :] < n_keep[:, None]
        dst = jnp.where(valid, dst, self.size)  # out of bounds: dropped
        k = self.k.at[:, rows, :, dst].set(self.k[:, rows, :, src], mode="drop")
        v = self.v.at[:, rows, :, :, dst].set(self.v[:, rows, :, :, src], mode="drop")
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
