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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("page_table", "kv_lens", "cu_q_lens", "tree_start", "tree_bits"),
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
    # A draft tree's mask (None: plain causal): sequence s's keys from tree_start[s] on are seen by a query only where
    # its bits (tree_bits [tokens, W] int32, bit j of the words: key tree_start[s] + j) name them, its ancestors and
    # itself (pallas_kernels.ragged_paged_attention's tree_start and tree_bits)
    tree_start: jax.Array | None = None  # [S] int32
    tree_bits: jax.Array | None = None  # [tokens, W] int32

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
    def tree(cls, page_table, tree_start, first, positions, bits, write=None) -> Layout:
        """B rows of T tokens of a draft tree (decoding/tree.py): row b's token j at RoPE position positions[b, j]
        [B, T], written at key slot first[b] + j, seeing its sequence's keys before tree_start[b] [B] and, from
        there on, the slots its mask bits [B, T, W] int32 name (bit i of the words: slot tree_start[b] + i; its
        ancestors and itself, all at lower slots); write [B] bool as `uniform`'s."""
        B, T = positions.shape
        slots = first[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        written = slots if write is None else jnp.where(write[:, None], slots, -1)
        group = Attention(page_table, (first + T).astype(jnp.int32), jnp.arange(B + 1, dtype=jnp.int32) * T, 0,
                          B * T, T, uniform=True, tree_start=tree_start.astype(jnp.int32),
                          tree_bits=bits.reshape(B * T, bits.shape[-1]))
        return cls(page_table, positions.reshape(-1).astype(jnp.int32), jnp.repeat(jnp.arange(B, dtype=jnp.int32), T),
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


def mask_words(mask) -> jax.Array:
    """A tree mask as Layout.tree takes it: bool [..., R] (entry i: slot i of the tree region) -> int32 words
    [..., ceil(R / 32)], slot i at bit i % 32 of word i // 32."""
    R = mask.shape[-1]
    W = -(-R // 32)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, W * 32 - R)])
    bits = padded.reshape(*mask.shape[:-1], W, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)


def copy_entries(pages: KVPages, page_table, source, dest) -> KVPages:
    """Every layer's K/V at key slots source [B, M] of each row copied to its slots dest [B, M] (-1: nothing), all
    read before any is written (a draft tree's accepted path moved into position order: decoding/tree.py). A slot
    in a page the row does not own reads page 0 and writes nothing."""
    page_size, width = pages.page_size, page_table.shape[1]
    rows = jnp.arange(page_table.shape[0])[:, None]

    def page_of(slot):
        column = slot // page_size
        page = page_table[rows, jnp.clip(column, 0, width - 1)]
        return jnp.where((slot >= 0) & (column < width), page, -1), slot % page_size

    src_page, src_slot = page_of(source)
    dst_page, dst_slot = page_of(dest)
    src_page = jnp.maximum(src_page, 0)
    dst_page = jnp.where((dst_page >= 0) & (dst_page < pages.num_pages), dst_page, pages.num_pages)  # past: dropped

    def copy(x):
        return x.at[:, dst_page, dst_slot].set(x[:, src_page, src_slot], mode="drop")

    return KVPages(tuple(copy(k) for k in pages.k), tuple(copy(v) for v in pages.v))


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
