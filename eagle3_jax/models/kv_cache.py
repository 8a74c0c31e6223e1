"""KV caches: immutable per-layer buffers plus a per-sequence length.

Rewinding is setting `lengths`; entries past a row's length are never read, so nothing is cleared.
The layout is [B, K, S, H] (batch, KV heads, capacity, head_dim): each (row, KV head) is one contiguous
block, which is what the attention kernels stream.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, K, S, H]
    v: tuple[jax.Array, ...]  # per layer [B, K, S, H]
    lengths: jax.Array  # [B] int32: committed entries per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, num_kv_heads, capacity, head_dim)
        # Distinct buffers per layer (not one broadcast) so each can be donated and updated in place.
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def write(buffer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes new [B, T, K, H] into buffer [B, K, S, H] at positions [B, T].

    Positions at or past the capacity are dropped, never clamped: a clamped write would shift the
    entries and overwrite committed ones. Callers never accept a token whose K/V was dropped.
    """
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, :, positions].set(new.astype(buffer.dtype), mode="drop")
