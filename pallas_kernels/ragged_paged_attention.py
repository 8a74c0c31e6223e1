"""Ragged paged GQA attention in one Mosaic GPU kernel (TMA + wgmma) for Hopper: decode, verify and
prefill chunks over a paged KV cache, given per-sequence query lengths, KV lengths and page tables.

Contract (paged_attention_reference in reference.py is the plain statement of it):
- q [T, N, H]: a flat batch of tokens, RoPE applied. Sequence s owns tokens cu_q_lens[s] ..
  cu_q_lens[s + 1] - 1 (q_len[s] of them); a sequence with q_len 0 is skipped. Tokens past
  cu_q_lens[-1] belong to no sequence: their output rows are left unwritten (undefined).
- k_pages, v_pages [K, P, page_size, H]: one layer's page pool, already holding the new tokens.
- page_table [S, pages_per_seq] int32: sequence s's key j sits in page page_table[s, j // page_size]
  at slot j % page_size. Entries past a sequence's last page in use are never read (any value).
- kv_lens [S] int32: keys of sequence s, its new tokens included (q_len <= kv_len <=
  pages_per_seq * page_size). Query i of sequence s sits at position kv_len - q_len + i and sees
  keys 0 .. that position (causal among the new queries, all of the cached prefix).
- Every slot of a page in use holds finite values (the pool starts zeroed and is only ever written
  with K/V): the TMA moves whole pages, so a page's slots past kv_len are read, their logits
  masked to -inf, and 0 * NaN would still be NaN in P V.

Layout. Pages are [K, P, page_size, H], KV-head major, so one (head, page) is one contiguous
page_size x H block and one TMA of page_size * H * 2 bytes (4 KiB at page 16, 32 KiB at page 128)
moves it, where a token-major [P, page_size, K, H] page would be page_size strided 256-byte rows.
A token's write scatters K rows (eagle3_jax.models.paged_attention.write_pages), which costs
nothing next to the reads; tensor parallelism shards axis 0 as the contiguous cache's.

Work. Rows of a tile are token * G + g for the G query heads of KV head h (_common's docstring):
one tile holds TQ = min(64 // G, max_q_len) tokens in the 64 rows of one warpgroup's wgmma. A
sequence of q_len tokens takes ceil(q_len / TQ) tiles; the caller bounds q_len by `max_q_len`
(static), which sets the tiles per sequence, and tiles past a sequence's queries exit at once.
Decode (1 token) and verify (gamma + 1 <= TQ tokens) are one tile per (sequence, KV head); a
prefill chunk is several, each reading only the keys its last row sees.
- A CTA is one loader warpgroup and `wgs` compute warpgroups, each owning one tile of the same
  sequence: wgs = 1 when a sequence has one tile (decode, verify), 2 when it can have more (a
  chunk), so two tiles share each key block brought in and one's softmax overlaps the other's
  matmuls on the tensor cores. Grid: (K, splits, S * ceil(tiles / wgs)).
- The loader walks the CTA's key blocks (block_kv keys, a multiple of 64: wgmma's K for P V),
  reads page ids from the page table in GMEM and issues one TMA per page (or per block_kv-slice of
  a page larger than a block) for K and for V into a ring of num_stages shared-memory slots; a
  slot is refilled once every compute warpgroup has freed it. A compute warpgroup runs S = Q K^T
  (wgmma), the masked online softmax in base 2, P through shared memory, and P V (wgmma) into a
  per-block accumulator added in registers. A compute warpgroup whose tile has no queries only
  frees the slots.
- splits: each CTA's key blocks are split evenly over `splits` CTAs when the work alone leaves
  the H200's SMs idle (batch 1: 8 KV heads for 132 SMs). With one split a CTA writes its tokens'
  rows of the output; with several, each writes a partial output (normalised, in q's dtype) and
  its base-2 log-sum-exp per row, merged in XLA (merge_splits, reading only the real rows: four
  small fusions on the H200 for a ragged batch, two for a uniform one) into the tokens' rows.
- Q arrives by one TMA per token of its [G, H] heads (tokens past the array read as zeros) into
  an untiled [64, H] buffer, whose rows are then stored into the swizzled tile wgmma reads (an
  untiled buffer takes any row start; a tiled one only multiples of 8). The output leaves through
  the same buffer, one TMA store per token, issued only for the sequence's own tokens (a
  whole-tile store would overwrite the next sequence's tokens).
- Block slots past the CTA's keys re-read its last page in use (so a page-table entry past it is
  never dereferenced); their keys are masked like any key past a row's position.
- Shared memory: 128-key blocks in 2 stages with one compute warpgroup (about 180 KB at head_dim
  128, bf16); two compute warpgroups take 64-key blocks in 4 (RaggedPagedConfig.for_kernel).

Testing. jax 0.12's Mosaic GPU interpreter (plgpu.InterpretGPUParams) runs this kernel unchanged
on the CPU: every TMA (and its zero fill past the array), barrier, page lookup, mask, split, the
two compute warpgroups (also under its race detector) and the merge are tested there
(tests/test_ragged_paged_attention.py). It does not check swizzled or tiled layouts (identities
there), the wgmma itself, register layouts, ptxas or timing; the H200 does: `pytest -m gpu`
(the same file, at Qwen3-8B heads) and eagle3_jax_bench/paged_attention.py, which times every
row against the copy rate. P goes through shared memory (not
registers) and each block's P V is its own accumulator added in registers: the forms the
interpreter runs (FA3's register P and run_state accumulator do not run there). Decode and verify
are bandwidth bound, so the few hundred cycles this costs per block hide under the next block's
TMA; for prefill chunks it is a cost against FlashAttention-3's structure, which the bench's chunk
rows measure.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows of a tile: one warpgroup's wgmma M
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: a row with no visible key in a block keeps exp2(m_old - m_new) = 1, never NaN
_SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
_SMEM_RESERVED = 4096  # for the barriers and alignment padding Mosaic GPU adds to the scratch buffers
_WAVE = 132  # the H200's SMs: one CTA each (the ring fills most of an SM's shared memory)


@dataclasses.dataclass(frozen=True)
class RaggedPagedConfig:
    """Static tuning. block_kv keys per loop step (a multiple of 64); num_stages slots of K and V;
    num_splits forces the split count (else: enough CTAs to fill one wave of `wave`)."""

    block_kv: int = 128
    num_stages: int = 2
    num_splits: int | None = None
    wave: int = _WAVE

    def __post_init__(self):
        if self.block_kv < 64 or self.block_kv % 64:
            raise ValueError(f"{self.block_kv=} must be a positive multiple of 64 (wgmma's K for P V)")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.wave < 1:
            raise ValueError(f"{self.wave=} must be >= 1")

    @classmethod
    def for_kernel(cls, head_dim: int, itemsize: int, warpgroups: int, **tuning) -> "RaggedPagedConfig":
        """The defaults where they fit a Hopper block's shared memory, else 64-key blocks in as many
        stages (up to 4) as fit (bf16, head_dim 128, two compute warpgroups: 4); then the given fields."""
        defaults = {}
        if cls().smem_bytes(head_dim, itemsize, warpgroups) > _SMEM_BYTES:
            fits = [n for n in range(2, 5) if cls(block_kv=64, num_stages=n).smem_bytes(
                head_dim, itemsize, warpgroups) <= _SMEM_BYTES]
            defaults = {"block_kv": 64, "num_stages": max(fits, default=2)}
        return cls(**{**defaults, **tuning})

    def smem_bytes(self, head_dim: int, itemsize: int, warpgroups: int = 1) -> int:
        """Shared memory of a CTA: the K/V ring, per compute warpgroup its q staging, q tile, P and
        lse, and what Mosaic GPU adds (barriers, alignment)."""
        ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        tiles = 2 * ROWS * head_dim * itemsize + ROWS * self.block_kv * itemsize + ROWS * 4
        return ring + warpgroups * tiles + _SMEM_RESERVED

    def splits_for(self, work_items: int, capacity: int) -> int:
        """Splits of each tile's key blocks: one wave of CTAs at most, never more than the blocks."""
        wanted = self.num_splits or max(1, self.wave // work_items)
        return max(1, min(wanted, -(-capacity // self.block_kv)))


def compute_warpgroups(tiles: int) -> int:
    """Compute warpgroups of a CTA: two tiles of a sequence share each key block the loader brings
    when a sequence can have two tiles or more (prefill chunks), one tile otherwise (decode, verify)."""
    return 2 if tiles > 1 else 1


def tokens_per_tile(group: int, max_q_len: int) -> int:
    """Tokens of a tile: as many as fill the 64 rows, or max_q_len when fewer (decode: 1, so one
    query TMA and one output store per CTA; the rows past tq * G are never loaded nor stored)."""
    return max(1, min(ROWS // group, max_q_len))  # (1 for a group over 64 rows, which unsupported refuses)


def unsupported(q, k_pages, v_pages, config: RaggedPagedConfig | None = None, *, max_q_len=None,
                interpret=False) -> str | None:
    """Why this kernel cannot take these operands, or None when it can (max_q_len: as the entry's;
    config None: the defaults the entry would take, RaggedPagedConfig.for_kernel).

    Compiled, wgmma needs 16-bit operands (f32 would be tf32, whose transposed V operand Hopper
    lacks); interpreted, float32 runs too, so the CPU tests check the indexing at f32 precision.
    """
    _, N, H = q.shape
    K, _, page_size, _ = k_pages.shape
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_pages, v_pages)}
    allowed = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) + ((jnp.dtype(jnp.float32),) if interpret else ())
    if len(dtypes) != 1 or next(iter(dtypes)) not in allowed:
        return f"needs q and pages of one dtype among {[str(d) for d in allowed]}, got {q.dtype}, " \
               f"{k_pages.dtype}, {v_pages.dtype}"
    if H not in (64, 128, 256):
        return f"needs head_dim 64, 128 or 256, got {H}"
    G = N // K
    if ROWS % G:
        return f"needs a group size dividing {ROWS} (query heads per KV head), got {G} = {N} // {K}"
    if page_size % 8:
        return f"needs page_size a multiple of 8, got {page_size} (tiled shared-memory slices)"
    tq = tokens_per_tile(G, max_q_len or q.shape[0])
    warpgroups = compute_warpgroups(-(-(max_q_len or q.shape[0]) // tq))
    config = config or RaggedPagedConfig.for_kernel(H, q.dtype.itemsize, warpgroups)
    if config.block_kv % page_size and page_size % config.block_kv:
        return f"needs page_size dividing block_kv={config.block_kv} or a multiple of it, got {page_size}"
    smem = config.smem_bytes(H, q.dtype.itemsize, warpgroups)
    if smem > _SMEM_BYTES:
        return f"needs {smem} bytes of shared memory with {config} and {warpgroups} compute warpgroups, " \
               f"over Hopper's {_SMEM_BYTES}"
    return None


def _check_shapes(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens):
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} must match, [K, pages, page_size, head_dim]")
    T, N, H = q.shape
    K = k_pages.shape[0]
    if k_pages.shape[3] != H or N % K:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape} (head_dim, heads a multiple of K)")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [seqs, pages_per_seq], got {page_table.shape}")
    S = page_table.shape[0]
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,):
        raise ValueError(f"kv_lens {kv_lens.shape} must be ({S},) and cu_q_lens {cu_q_lens.shape} ({S + 1},)")


def tile_keys(q_len, kv_len, first, tq):
    """Keys the tile of tokens first .. first + tq - 1 needs: up to its last real row's position."""
    last = jnp.minimum(first + tq, q_len) - 1
    return jnp.where(first < q_len, kv_len - q_len + last + 1, 0)


def split_blocks(num_keys, split, *, splits: int, block_kv: int):
    """[lo, hi): split `split`'s even share of the blocks holding num_keys keys (split 0 holds key 0)."""
    blocks = lax.div(num_keys + block_kv - 1, block_kv)
    return lax.div(split * blocks, splits), lax.div((split + 1) * blocks, splits)


def _kernel(cu_q_ref, kv_lens_ref, pt_ref, q_ref, k_ref, v_ref, *refs, scale, config, pairs, splits, group, tq, wgs,
            tree_words):
    # cu_q_ref [S + 1], kv_lens_ref [S], pt_ref [S, pages_per_seq] int32; q_ref [T, N, H];
    # k_ref, v_ref [K, P, page_size, H], all in GMEM; with a tree mask (tree_words > 0) also tree_start_ref [S] and
    # tree_bits_ref [T, tree_words] int32.
    # outputs, one split: o_ref [T, N, H]; several: part_ref [splits, S * pairs * wgs, K, ROWS, H] q.dtype,
    #   lse_ref [splits, S * pairs * wgs, K, ROWS] f32 (base 2; -inf where a row saw no key).
    # scratch, per compute warpgroup: q_raw [wgs, ROWS, H] untiled (queries in, output out), q_tile
    #   [wgs, ROWS, H] swizzled, p_tile [wgs, ROWS, block_kv] swizzled, lse_smem [wgs, ROWS] f32;
    #   shared: k_smem, v_smem [stages, block_kv, H] swizzled.
    # A CTA owns `wgs` consecutive tiles of one sequence (a "pair" when wgs = 2), compute warpgroup c
    # tile pair * wgs + c; the loader (warpgroup wgs) fills the blocks the last of them needs.
    tree_refs, refs = (refs[:2], refs[2:]) if tree_words else (None, refs)
    *outs, scratch = refs
    (q_raw, q_tile, p_tile, lse_smem, k_smem, v_smem), (q_ready, k_ready, v_ready), (k_free, v_free) = scratch
    bkv, stages = config.block_kv, config.num_stages
    page_size = k_ref.shape[2]
    G = group
    dtype = q_ref.dtype
    head, split, work = lax.axis_index("heads"), lax.axis_index("splits"), lax.axis_index("work")
    seq, pair = lax.div(work, pairs), lax.rem(work, pairs)
    q_start = cu_q_ref[seq]
    q_len = cu_q_ref[seq + 1] - q_start
    kv_len = kv_lens_ref[seq]
    # The keys of the CTA: those of its last tile with queries (tile_keys is 0 for one without).
    num_keys = functools.reduce(
        jnp.maximum, [tile_keys(q_len, kv_len, (pair * wgs + c) * tq, tq) for c in range(wgs)])
    lo, hi = split_blocks(num_keys, split, splits=splits, block_kv=bkv)
    wg = lax.axis_index("wg")

    @pl.when((num_keys > 0) & (wg < wgs))
    def _compute():
        if wgs > 1:  # three warpgroups share the register file: the loader needs few (as in the prefill kernel)
            plgpu.set_max_registers(232, action="increase")
        tile = pair * wgs + wg
        first = tile * tq
        mine = first < q_len  # this warpgroup's tile has queries

        @pl.when(mine)
        def _():
            _attend_tile(q_ref, outs, q_raw.at[wg], q_tile.at[wg], p_tile.at[wg], lse_smem.at[wg], k_smem, v_smem,
                         q_ready.at[wg], k_ready, v_ready, k_free, v_free, scale=scale, bkv=bkv, stages=stages,
                         group=G, tq=tq, dtype=dtype, head=head, split=split, part_index=work * wgs + wg,
                         q_start=q_start, q_len=q_len, kv_len=kv_len, first=first, lo=lo, hi=hi,
                         tree=None if tree_refs is None else (tree_refs[0][seq], tree_refs[1]))

        if wgs > 1:  # a tile past the sequence's queries still frees each slot the other one reads

            @pl.when(~mine)
            def _():
                @pl.loop(lo, hi)
                def _(i):
                    slot = lax.rem(i - lo, stages)
                    for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                        plgpu.barrier_wait(ready.at[slot])
                        plgpu.barrier_arrive(free.at[slot])

    @pl.when((num_keys > 0) & (wg == wgs))
    def _load():
        if wgs > 1:
            plgpu.set_max_registers(40, action="decrease")
        # The CTA's last page in use; clamped to the table, so keys past pages_per_seq * page_size (a
        # broken precondition) read a wrong page, never past the table.
        last_page = jnp.minimum(lax.div(num_keys - 1, page_size), pt_ref.shape[1] - 1)

        @pl.loop(lo, hi)
        def _(i):
            slot = lax.rem(i - lo, stages)
            # The block's page ids are read once for K and V, before waiting for a free slot, so the
            # page table's latency hides under that wait.
            if page_size <= bkv:
                per_block = bkv // page_size
                pages = [pt_ref[seq, jnp.minimum(i * per_block + j, last_page)] for j in range(per_block)]
                sources = [(page, pl.ds(0, page_size), pl.ds(j * page_size, page_size)) for j, page in enumerate(pages)]
            else:
                per_page = page_size // bkv
                page = pt_ref[seq, jnp.minimum(lax.div(i, per_page), last_page)]
                sources = [(page, pl.ds(lax.rem(i, per_page) * bkv, bkv), pl.ds(0, bkv))]
            for ref, smem, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):

                @pl.when(i - lo >= stages)  # the first round fills an empty ring
                def _():
                    plgpu.barrier_wait(free.at[slot])

                for page, rows, dest in sources:
                    plgpu.copy_gmem_to_smem(ref.at[head, page, rows], smem.at[slot, dest], ready.at[slot])


def _row_words(bits_ref, q_start, first, tq, group):
    """Each tile row's tree mask words (a list of tree_words [ROWS] int32 in the row layout): row r holds token
    r // group's, read as scalars (a token past the batch reads the last one; its row is never stored)."""
    token = lax.div(plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(1)), group)
    last = bits_ref.shape[0] - 1
    words = []
    for w in range(bits_ref.shape[1]):
        word = plgpu.layout_cast(jnp.full((ROWS,), 0, jnp.int32), plgpu.Layout.WGMMA.reduce(1))
        for t in range(tq):
            word = jnp.where(token == t, bits_ref[jnp.minimum(q_start + first + t, last), w], word)
        words.append(word)
    return words


def _tree_visible(key, tree_start, words):
    """[ROWS, bkv] bool: the keys a row's tree mask shows, every key before tree_start and, from it, key
    tree_start + j where bit j of the row's words is set (word j // 32, bit j % 32)."""
    rel = key - tree_start
    shown = rel < 0
    for w, word in enumerate(words):
        shift = rel - 32 * w
        bits = lax.broadcast_in_dim(word, key.shape, [0])
        bit = lax.shift_right_logical(bits, jnp.clip(shift, 0, 31)) & 1
        shown = shown | ((shift >= 0) & (shift < 32) & (bit != 0))
    return shown


def _attend_tile(q_ref, outs, q_raw, q_tile, p_tile, lse_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free,
                 v_free, *, scale, bkv, stages, group, tq, dtype, head, split, part_index, q_start, q_len, kv_len,
                 first, lo, hi, tree=None):
    """One compute warpgroup's tile: its queries in, key blocks [lo, hi) of the ring, its rows out. tree: None, or
    (the sequence's tree start, tree_bits_ref): rows then also hide the keys from the tree start on that their mask
    words do not show; the blocks before the tree start take the plain causal mask."""
    G = group
    for t in range(tq):  # one TMA per token: its G heads' rows (past the array: zeros)
        plgpu.copy_gmem_to_smem(q_ref.at[q_start + first + t, pl.ds(head * G, G)], q_raw.at[pl.ds(t * G, G)], q_ready)
    plgpu.barrier_wait(q_ready)
    q_tile[...] = plgpu.load(q_raw, layout=plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    H = q_raw.shape[1]
    carry = (
        plgpu.layout_cast(jnp.full((ROWS, H), 0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.full((ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 1, layout=plgpu.Layout.WGMMA)
    position = lax.div(rows, G) + (kv_len - q_len + first)  # of each row's token

    words = None if tree is None else _row_words(tree[1], q_start, first, tq, G)

    def step(i, carry, masked=False):
        acc, m, l = carry
        slot = lax.rem(i - lo, stages)
        plgpu.barrier_wait(k_ready.at[slot])

        def qk(ref):
            plgpu.wgmma(ref, q_tile, k_smem.at[slot].transpose((1, 0)))
            return ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        visible = cols + i * bkv <= position
        if masked:
            visible = visible & _tree_visible(cols + i * bkv, tree[0], words)
        s = jnp.where(visible, s * (scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        p_tile[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_ready.at[slot])

        def pv(ref):
            plgpu.wgmma(ref, p_tile, v_smem.at[slot])
            return ref[...]

        o = pl.run_scoped(pv, plgpu.ACC((ROWS, H), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o, m_new, l

    if tree is None:
        acc, m, l = lax.fori_loop(lo, hi, step, carry)
    else:  # the blocks wholly before the tree start need no tree mask
        mid = jnp.clip(lax.div(tree[0], bkv), lo, hi)
        carry = lax.fori_loop(lo, mid, step, carry)
        acc, m, l = lax.fori_loop(mid, hi, functools.partial(step, masked=True), carry)
    seen = l > 0
    o = acc / lax.broadcast_in_dim(jnp.where(seen, l, 1.0), acc.shape, [0])
    q_raw[...] = o.astype(dtype)
    if len(outs) == 1:  # one split: the tokens' rows of the output
        (o_ref,) = outs
        plgpu.commit_smem()
        for t in range(tq):  # one store per token of the sequence: never a neighbour's rows

            @pl.when(first + t < q_len)
            def _():
                token = q_start + first + t
                plgpu.copy_smem_to_gmem(q_raw.at[pl.ds(t * G, G)], o_ref.at[token, pl.ds(head * G, G)])
    else:
        part_ref, lse_ref = outs
        lse_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        real = pl.ds(0, tq * G)  # the tile's rows that hold tokens: decode writes G rows, not 64
        plgpu.copy_smem_to_gmem(q_raw.at[real], part_ref.at[split, part_index, head, real])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, part_index, head])
    plgpu.wait_smem_to_gmem(0)


def merge_splits(part, lse, cu_q_lens, num_tokens: int, *, tiles: int, group: int, tq: int, uniform: bool = False):
    """Partials [splits, S * tiles, K, ROWS, H] and base-2 lse [splits, S * tiles, K, ROWS] -> the
    output [num_tokens, K * group, H] in part's dtype, reading only the real rows. Tokens past cu_q_lens[-1]
    get zeros. uniform: every sequence has num_tokens / S queries, in order (a decode or verify batch), so
    each token's tile and rows are static and the merge is slices and transposes (two small fusions on the H200;
    ragged: the tokens' sequences looked up on the device, four, about 5 us a layer at batch 1)."""
    splits, _, K, _, H = part.shape
    if uniform:
        S = cu_q_lens.shape[0] - 1
        q_len = num_tokens // S

        def by_token(x):  # [splits, S tiles, K, ROWS, ...] -> [splits, T, K, G, ...]: token s q_len + j tq + r
            x = x.reshape(splits, S, tiles, K, ROWS, *x.shape[4:])[:, :, :, :, : tq * group]
            x = x.reshape(splits, S, tiles, K, tq, group, *x.shape[5:])
            x = jnp.swapaxes(x, 3, 4).reshape(splits, S, tiles * tq, K, group, *x.shape[6:])[:, :, :q_len]
            return x.reshape(splits, num_tokens, K, group, *x.shape[5:])

        lse_rows, parts = by_token(lse), by_token(part)
        w = jnp.exp2(lse_rows - lse_rows.max(axis=0))
        o = (w[..., None] * parts.astype(jnp.float32)).sum(axis=0) / w.sum(axis=0)[..., None]
        return o.reshape(num_tokens, K * group, H).astype(part.dtype)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, token, side="right", method="compare_all").astype(jnp.int32) - 1  # [T]
    real = token < cu_q_lens[-1]
    seq = jnp.clip(seq, 0, cu_q_lens.shape[0] - 2)
    local = token - cu_q_lens[seq]
    work = seq * tiles + lax.div(local, tq)
    work = jnp.clip(work, 0, part.shape[1] - 1)
    rows = lax.rem(local, tq)[:, None] * group + jnp.arange(group)[None, :]  # [T, G]
    lse_rows = lse[:, work[:, None, None], jnp.arange(K)[None, :, None], rows[:, None, :]]  # [splits, T, K, G]
    w = jnp.exp2(lse_rows - lse_rows.max(axis=0))
    parts = part[:, work[:, None, None], jnp.arange(K)[None, :, None], rows[:, None, :]]  # [splits, T, K, G, H]
    o = (w[..., None] * parts.astype(jnp.float32)).sum(axis=0) / w.sum(axis=0)[..., None]
    o = jnp.where(real[:, None, None, None], o, 0.0)
    return o.reshape(num_tokens, K * group, H).astype(part.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "max_q_len", "uniform", "interpret"))
def _ragged(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, tree_start, tree_bits, *, scale, config, max_q_len,
            uniform, interpret):
    T, N, H = q.shape
    tree_words = 0 if tree_bits is None else tree_bits.shape[1]
    K, _, page_size, _ = k_pages.shape
    S, pages_per_seq = page_table.shape
    G = N // K
    tq = tokens_per_tile(G, max_q_len)
    wgs = compute_warpgroups(-(-max_q_len // tq))
    pairs = -(-max_q_len // (tq * wgs))  # CTAs per (sequence, KV head, split)
    tiles = pairs * wgs
    splits = config.splits_for(S * pairs * K, pages_per_seq * page_size)
    bkv, stages = config.block_kv, config.num_stages
    tiling = 128 // q.dtype.itemsize  # a 128-byte swizzled row
    smem = functools.partial(plgpu.SMEM, transforms=(plgpu.TilingTransform((8, tiling)), plgpu.SwizzleTransform(128)))
    copies = max(1, bkv // page_size)  # TMAs per block and per K or V: the ready barriers' arrivals
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((splits, S * tiles, K, ROWS, H), q.dtype),
                    jax.ShapeDtypeStruct((splits, S * tiles, K, ROWS), jnp.float32))

    def entry(*refs):
        pl.run_scoped(
            lambda *scratch: _kernel(*refs, scratch, scale=scale, config=config, pairs=pairs, splits=splits, group=G,
                                     tq=tq, wgs=wgs, tree_words=tree_words),
            (
                plgpu.SMEM((wgs, ROWS, H), q.dtype),
                smem((wgs, ROWS, H), q.dtype),
                smem((wgs, ROWS, bkv), q.dtype),
                plgpu.SMEM((wgs, ROWS), jnp.float32),
                smem((stages, bkv, H), k_pages.dtype),
                smem((stages, bkv, H), v_pages.dtype),
            ),
            (
                plgpu.Barrier(num_arrivals=tq, num_barriers=wgs),  # queries loaded, one TMA per token
                plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # K slot filled
                plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # V slot filled
            ),
            (  # slot read by every compute warpgroup
                plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            ),
            collective_axes="wg",
        )

    out = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(K, splits, S * pairs),
        grid_names=("heads", "splits", "work"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(cu_q_lens, kv_lens, page_table, q, k_pages, v_pages, *(() if tree_bits is None else (tree_start, tree_bits)))
    if splits == 1:
        return out
    return merge_splits(*out, cu_q_lens, T, tiles=tiles, group=G, tq=tq, uniform=uniform)


def ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale, max_q_len=None,
                           uniform=False, tree_start=None, tree_bits=None, interpret=False, **static_tuning):
    """Causal GQA attention of a ragged batch of queries over paged K/V (module docstring: contract).

    tree_start [S], tree_bits [T, W] int32 (both or neither): a tree mask (a draft tree's verify, or its drafting
    steps). Query i of sequence s then also hides each key j >= tree_start[s] whose bit j - tree_start[s] (word
    (j - tree_start[s]) // 32, bit % 32) of tree_bits[i] is clear: it sees the prefix before tree_start and, of the
    keys from there on, those its bits name (its ancestors and itself). The causal rule still holds (keys past the
    query's own slot stay hidden), so the keys a tile reads are those of a causal batch.

    max_q_len: a bound on every sequence's query count (static; default: the token count). It
    sets the tiles per sequence: give the step's own (1 for decode, gamma + 1 for verify, the chunk
    for prefill). uniform: every sequence has max_q_len queries, in order (cu_q_lens[s] = s max_q_len and
    T = S max_q_len: a decode or verify batch), which makes the splits' merge static. interpret: True or a
    plgpu.InterpretGPUParams (e.g. with detect_races) runs the
    kernel in jax's Mosaic GPU interpreter (the CPU tests). static_tuning: fields of
    RaggedPagedConfig (defaults: RaggedPagedConfig.for_kernel). Returns [T, N, H] in q's dtype.
    """
    _check_shapes(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens)
    max_q_len = q.shape[0] if max_q_len is None else max_q_len
    if not isinstance(max_q_len, int) or isinstance(max_q_len, bool) or max_q_len < 1:
        raise ValueError(f"max_q_len must be a positive int, got {max_q_len!r}")
    if uniform and q.shape[0] != (cu_q_lens.shape[0] - 1) * max_q_len:
        raise ValueError(f"uniform: {q.shape[0]} tokens are not {cu_q_lens.shape[0] - 1} sequences of {max_q_len}")
    group = q.shape[1] // k_pages.shape[0]
    warpgroups = compute_warpgroups(-(-max_q_len // tokens_per_tile(group, max_q_len)))
    config = RaggedPagedConfig.for_kernel(q.shape[2], q.dtype.itemsize, warpgroups, **static_tuning)
    if reason := unsupported(q, k_pages, v_pages, config, max_q_len=max_q_len, interpret=bool(interpret)):
        raise ValueError(f"Mosaic GPU ragged paged attention {reason}")
    if (tree_start is None) != (tree_bits is None):
        raise ValueError("tree_start and tree_bits come together: a tree mask needs both")
    if tree_bits is not None and (tree_bits.ndim != 2 or tree_bits.shape[0] != q.shape[0]
                                  or tree_start.shape != kv_lens.shape):
        raise ValueError(f"tree_bits {tree_bits.shape} must be [{q.shape[0]}, words] and tree_start "
                         f"{tree_start.shape} {kv_lens.shape}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    tree = (None, None) if tree_bits is None else (tree_start.astype(jnp.int32), tree_bits.astype(jnp.int32))
    return _ragged(q, k_pages, v_pages, page_table.astype(jnp.int32), kv_lens.astype(jnp.int32),
                   cu_q_lens.astype(jnp.int32), *tree, scale=float(scale), config=config, max_q_len=max_q_len,
                   uniform=bool(uniform), interpret=interpret)
