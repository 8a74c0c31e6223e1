"""Paged KV caches: a model's keys and values live in one pool of pages shared by every sequence, and a
sequence finds its keys through its row of a page table.

A layer's pages are k, v [K, P, page_size, H] (KV-head major: one (head, page) is one contiguous block, one
TMA in the Hopper kernel; pallas_kernels/ragged_paged_attention.py). Key j of a sequence sits in page
page_table[s, j // page_size], slot j % page_size; a table entry of -1 is a page the sequence does not own
(nothing is written there, and a read of it sees page 0, whose keys only queries past the sequence's keys
would see). The pool is an immutable buffer carried through the jitted steps: a step returns it with the new
tokens' K/V written, and a sequence is rewound by lowering its length, never by clearing.

`Layout` says where a forward's tokens go: one flat batch of N tokens in S sequences, each token at its own
position, written (or not) at that position of its sequence's pages, and attended in groups (`Attention`): a group
is a run of the batch's tokens in sequences of their own, one kernel call. A batch of B rows of T tokens each
(decode, verify) is `Layout.uniform`; a packed prefill chunk, `Layout.ragged`; a round's rows and a chunk in one
forward, the first's `then` the second.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """One model's page pool: per layer k, v [K, P, page_size, H]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def create(cls, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
               dtype) -> KVPages:
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        # Distinct zeroed buffers per layer (not one broadcast), so each is donated and updated in place, and a
        # slot no token wrote holds a finite value for the kernels' whole-block reads.
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one token's K and V take in a pool of these dimensions."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def table_width(max_len: int, page_size: int, tail: int) -> int:
    """Page-table columns for sequences of up to max_len tokens whose steps may reach `tail` positions further
    (a round's drafts past a row's room): every position a step's queries sit at has a column, so a kernel's
    reads never pass the table's row."""
    return -(-(max_len + tail) // page_size)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("page_table", "kv_lens", "cu_q_lens"),
                   meta_fields=("start", "tokens", "max_q_len", "uniform"))
@dataclasses.dataclass(frozen=True)
class Attention:
    """The tokens start .. start + tokens - 1 of a forward's batch, attended in one kernel call: S sequences,
    sequence s owning tokens cu_q_lens[s] .. cu_q_lens[s + 1] - 1 of the group (query i of it at position kv_lens[s]
    - q_len + i)."""

    page_table: jax.Array  # [S, W] int32, -1 where the sequence owns no page
    kv_lens: jax.Array  # [S] int32: keys of each sequence once this forward's tokens are in, theirs included
    cu_q_lens: jax.Array  # [S + 1] int32, from 0
    start: int  # static: the group's first token in the batch
    tokens: int  # static: the group's tokens (those past cu_q_lens[-1] belong to no sequence)
    max_q_len: int  # static: at least every sequence's q_len (the kernel's tile plan)
    uniform: bool = False  # static: every sequence has max_q_len tokens, in order (cu_q_lens[s] = s max_q_len)

    @property
    def read_table(self) -> jax.Array:
        """The page table as attention reads it: unowned entries (-1) at page 0, so every read is in the pool."""
        return jnp.maximum(self.page_table, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """A forward's N tokens over paged KV (the module docstring): where each is written, and the attention groups
    that cover them (decode and verify rows in one, a prefill chunk in another: the kernel's tiles follow a group's
    max_q_len)."""

    page_table: jax.Array  # [S, W] int32: every sequence's pages, as `seq` indexes them
    positions: jax.Array  # [N] int32: each token's position (RoPE)
    seq: jax.Array  # [N] int32: each token's sequence (S: none)
    write_positions: jax.Array  # [N] int32: where each token's K/V are written, -1: not written
    groups: tuple[Attention, ...]

    @classmethod
    def uniform(cls, page_table, start, num_tokens: int, write=None) -> Layout:
        """B rows of T = num_tokens tokens each, row b's at positions start[b] .. start[b] + T - 1; write [B]
        bool: the rows whose K/V are written (None: every row). A row not written still attends (its result is
        never used): a finished row's pages may already belong to another sequence."""
        B, T = start.shape[0], num_tokens
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        written = positions if write is None else jnp.where(write[:, None], positions, -1)
        group = Attention(page_table, (start + T).astype(jnp.int32), jnp.arange(B + 1, dtype=jnp.int32) * T, 0,
                          B * T, T, uniform=True)
        return cls(page_table, positions.reshape(-1), jnp.repeat(jnp.arange(B, dtype=jnp.int32), T),
                   written.reshape(-1), (group,))

    @classmethod
    def ragged(cls, page_table, start, cu_q_lens, num_tokens: int) -> Layout:
        """S sequences of a packed batch of num_tokens tokens (a prefill chunk): sequence s owns tokens cu_q_lens[s]
        .. cu_q_lens[s + 1] - 1, at positions start[s] onwards, all written; tokens past cu_q_lens[-1] belong to none
        (not written)."""
        S = start.shape[0]
        token = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = jnp.searchsorted(cu_q_lens, token, side="right", method="scan_unrolled").astype(jnp.int32) - 1
        real = token < cu_q_lens[-1]
        seq = jnp.where(real, jnp.clip(seq, 0, S - 1), S)
        position = start[jnp.minimum(seq, S - 1)] + token - cu_q_lens[jnp.minimum(seq, S - 1)]
        position = jnp.where(real, position, -1)
        kv_lens = start + cu_q_lens[1:] - cu_q_lens[:-1]
        group = Attention(page_table, kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32), 0, num_tokens,
                          num_tokens)
        return cls(page_table, jnp.maximum(position, 0), seq, position, (group,))

    def then(self, other: Layout) -> Layout:
        """This batch's tokens, then `other`'s, in one forward: their sequences side by side, each group attended
        as before."""
        S, N = self.page_table.shape[0], self.positions.shape[0]
        moved = tuple(dataclasses.replace(g, start=g.start + N) for g in other.groups)
        return Layout(jnp.concatenate([self.page_table, other.page_table]),
                      jnp.concatenate([self.positions, other.positions]),
                      jnp.concatenate([jnp.where(self.seq < S, self.seq, S + other.page_table.shape[0]),
                                       other.seq + S]),
                      jnp.concatenate([self.write_positions, other.write_positions]), self.groups + moved)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowCache:
    """A fixed batch's KV over pages each row owns outright (row b: pages b W .. b W + W - 1) and its lengths:
    the forward of whole sequences with no allocator (training's target features, pre-training, the golden tests,
    the benches' timed steps). `layout(T)` places T new tokens a row after each row's keys; the caller commits
    them with `with_lengths`."""

    pages: KVPages
    table: jax.Array  # [B, W] int32
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype,
               page_size: int = 16) -> RowCache:
        """Zeroed pages for `batch` rows of up to `capacity` tokens, none in use."""
        width = -(-capacity // page_size)
        pages = KVPages.create(num_layers, batch * width, num_kv_heads, page_size, head_dim, dtype)
        return cls.over(pages, batch, jnp.zeros((batch,), jnp.int32))

    @classmethod
    def over(cls, pages: KVPages, batch: int, lengths) -> RowCache:
        """A row cache over given pages (batch x W of them), `lengths` in use."""
        width = pages.num_pages // batch
        table = jnp.asarray(np.arange(batch * width, dtype=np.int32).reshape(batch, width))
        return cls(pages, table, jnp.asarray(lengths, jnp.int32))

    def layout(self, num_tokens: int) -> Layout:
        return Layout.uniform(self.table, self.lengths, num_tokens)

    def written(self, pages: KVPages) -> RowCache:
        """This cache with a forward's pages (lengths unchanged)."""
        return dataclasses.replace(self, pages=pages)

    def with_lengths(self, lengths) -> RowCache:
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))
