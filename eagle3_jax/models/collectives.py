"""What one device computes with its shard, inside a shard_map over the mesh's "tp" axis.

Every function takes `tp`: the `Shards` of the map, or None outside one, where it is exactly the plain
single-device computation (no collective, the same ops), so the unsharded path is unchanged.

The vocabulary (embedding rows, lm_head rows, the logits' last axis) is split into `tp.size` contiguous
slices, device d holding ids [d V_l, (d + 1) V_l). `Vocab` computes a reduction over a row of logits
from the slices: a local reduction, then one collective of a few numbers per row (never the row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Shards:
    """The mesh axis a shard_map splits the model over, and its size (static: part of a step's spec)."""

    size: int
    axis: str = TP_AXIS

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis)


def all_reduce(x: jax.Array, tp: Shards | None) -> jax.Array:
    """The sum over devices of a row-parallel matmul's partial results (after o_proj, down_proj, experts)."""
    return x if tp is None else jax.lax.psum(x, tp.axis)


def embed(table: jax.Array, tokens: jax.Array, tp: Shards | None) -> jax.Array:
    """table [V, D] rows of tokens; with `tp`, each device looks up the tokens in its slice of the vocabulary
    (zeros for the others) and the slices' rows are summed: one all-reduce of [..., D]."""
    if tp is None:
        return table[tokens]
    rows = table.shape[0]
    local = tokens - tp.index() * rows
    mine = (local >= 0) & (local < rows)
    found = table[jnp.where(mine, local, 0)]
    return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)), tp.axis)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Reductions over the last axis of rows of logits [..., V_l]: the whole vocabulary (`shards` None:
    plain jnp, V_l = V) or this device's slice of it. Results are per row and the same on every device."""

    shards: Shards | None = None

    def ids(self, local: int) -> jax.Array:
        """The vocabulary ids of this device's `local` entries."""
        ids = jnp.arange(local, dtype=jnp.int32)
        return ids if self.shards is None else ids + self.shards.index().astype(jnp.int32) * local

    def sum(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        out = jnp.sum(x, axis=-1, keepdims=keepdims)
        return out if self.shards is None else jax.lax.psum(out, self.shards.axis)

    def max(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        out = jnp.max(x, axis=-1, keepdims=keepdims)
        return out if self.shards is None else jax.lax.pmax(out, self.shards.axis)

    def min(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        out = jnp.min(x, axis=-1, keepdims=keepdims)
        return out if self.shards is None else jax.lax.pmin(out, self.shards.axis)

    def argmax(self, x: jax.Array) -> jax.Array:
        """The id of each row's largest entry, the lowest id of a tie (jnp.argmax's rule), as int32: each
        device's (max, id) pair is gathered and the first device holding the row's max wins."""
        if self.shards is None:
            return jnp.argmax(x, axis=-1).astype(jnp.int32)
        best = jnp.max(x, axis=-1)
        ids = jnp.argmax(x, axis=-1).astype(jnp.int32) + self.shards.index().astype(jnp.int32) * x.shape[-1]
        all_best = jax.lax.all_gather(best, self.shards.axis)  # [tp, ...]
        all_ids = jax.lax.all_gather(ids, self.shards.axis)
        winner = jnp.argmax(all_best, axis=0)
        return jnp.take_along_axis(all_ids, winner[None], axis=0)[0]

    def count_after(self, mask: jax.Array) -> jax.Array:
        """Per entry of mask [R, V_l], how many entries of its row with a higher id are True."""
        local = jnp.sum(mask, axis=-1, keepdims=True) - jnp.cumsum(mask, axis=-1)
        if self.shards is None:
            return local
        counts = jax.lax.all_gather(jnp.sum(mask, axis=-1), self.shards.axis)  # [tp, R]
        later = jnp.arange(self.shards.size)[:, None] > self.shards.index()
        return local + jnp.sum(jnp.where(later, counts, 0), axis=0)[:, None]

    def softmax(self, x: jax.Array) -> jax.Array:
        if self.shards is None:
            return jax.nn.softmax(x, axis=-1)
        unnormalized = jnp.exp(x - self.max(x, keepdims=True))
        return unnormalized / self.sum(unnormalized, keepdims=True)

    def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x [..., V_l] at vocabulary ids [...] (one per row): the owning device's entry, 0 from the others."""
        if self.shards is None:
            return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]
        local = ids - self.shards.index().astype(ids.dtype) * x.shape[-1]
        mine = (local >= 0) & (local < x.shape[-1])
        found = jnp.take_along_axis(x, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
        return self.sum(jnp.where(mine, found, 0)[..., None])

    def local_index(self, ids: jax.Array, local: int) -> jax.Array:
        """Vocabulary ids -> indices into this device's `local` entries; ids it does not hold -> `local`
        (out of range, so a one-hot is 0 there and a scatter with mode="drop" skips them)."""
        if self.shards is None:
            return ids
        offset = ids - self.shards.index().astype(ids.dtype) * local
        return jnp.where((offset >= 0) & (offset < local), offset, local)

    def categorical(self, key: jax.Array, logits: jax.Array) -> jax.Array:
        """jax.random.categorical(key, logits [V_l]) of one row: the Gumbel noise of the whole vocabulary
        drawn from the key (so each id gets the noise it gets on one device), this device's slice of it
        added, then the argmax across devices: the same token as the unsharded draw."""
        if self.shards is None:
            return jax.random.categorical(key, logits)
        local = logits.shape[-1]
        noise = jax.random.gumbel(key, (local * self.shards.size,), logits.dtype)
        mine = jax.lax.dynamic_slice_in_dim(noise, self.shards.index() * local, local)
        return self.argmax(mine + logits)


FULL = Vocab()
