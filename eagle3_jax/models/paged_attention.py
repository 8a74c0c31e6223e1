"""Attention over paged KV (models/kv_cache.py): the model's attention block (`attention_block`: q/k norm,
RoPE, the new tokens' K/V written into their pages, attention), its entry that picks the kernel (`attend`),
and the XLA path.

A step's queries are one flat batch of N tokens (kv_cache.Layout): sequence s owns tokens cu_q_lens[s] ..
cu_q_lens[s + 1] - 1, query i of it sits at kv_len[s] - q_len[s] + i (kv_lens count the new tokens) and sees
its sequence's keys up to there. On a Hopper GPU the Mosaic GPU kernel (pallas_kernels/ragged_paged_attention.py)
runs it; everywhere else the XLA path here computes the same thing in plain jnp (the CPU tests, other GPUs), and
is the kernel's test oracle beside the dense reference (pallas_kernels.reference.paged_attention_reference).
With `Engine(exact=True)`'s kernels (EXACT), each row's pages are gathered into one contiguous cache for
pallas_kernels.invariant_attention, whose result for a query does not depend on the batch around it.
With the fused Pallas kernels the q/k norm, RoPE and page write are one kernel (pallas_kernels.rope_page_write),
else XLA's ops and scatters (write_pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models.kv_cache import Layout
from eagle3_jax.models.layers import apply_rope, rms_norm


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(seq [T], position [T]) of each token of the flat batch; tokens past cu_q_lens[-1] get seq S
    (no sequence) and position -1, which write_pages drops."""
    S = kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, token, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    real = token < cu_q_lens[-1]
    seq = jnp.clip(seq, 0, S - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + token - cu_q_lens[seq]
    return jnp.where(real, seq, S), jnp.where(real, position, -1)


def write_pages(k_pages, v_pages, page_table, seq, positions, k, v):
    """Writes new k, v [T, K, H] into the pages [K, P, page_size, H] at each token's (seq [T],
    position [T]): page page_table[seq, position // page_size], slot position % page_size.

    A token with no sequence (seq out of range), a negative position, a position past the page table's
    width, or a page id outside the pool (such as -1) writes nothing (never clamped: a clamped write would
    overwrite committed keys).
    Returns (k_pages, v_pages); updated in place when the caller donates them.
    """
    S, pages_per_seq = page_table.shape
    page_size = k_pages.shape[2]
    slot_in_table = positions // page_size
    keep = (seq >= 0) & (seq < S) & (positions >= 0) & (slot_in_table < pages_per_seq)
    page = page_table[jnp.clip(seq, 0, S - 1), jnp.clip(slot_in_table, 0, pages_per_seq - 1)]
    # A page id outside the pool (-1: unallocated) writes nothing either: a negative scatter index would count from
    # the end of the pool, into another sequence's page.
    keep = keep & (page >= 0) & (page < k_pages.shape[1])
    page = jnp.where(keep, page, k_pages.shape[1])  # out of range: dropped
    slot = positions % page_size
    heads = jnp.arange(k_pages.shape[0])[None, :]
    at = (heads, page[:, None], slot[:, None])
    return (k_pages.at[at].set(k.astype(k_pages.dtype), mode="drop"),
            v_pages.at[at].set(v.astype(v_pages.dtype), mode="drop"))


def attention_block(qkv, cos, sin, k_pages, v_pages, layout: Layout, *, num_heads: int, q_norm, k_norm,
                    eps: float, kernels: str):
    """The fused q/k/v projection of the layout's tokens [B, T, (N + 2K) H] (B T = the layout's N tokens) ->
    (attention's output [B, T, N, H], k_pages, v_pages with the tokens' K/V written).

    q and k are RMS-normalised per head when q_norm and k_norm are given (Qwen3 layers), then rotated by RoPE
    (cos, sin [B, T, H], each token's own position); k and v go into the pages at the layout's write positions.
    With the fused Pallas kernels that is one kernel (pallas_kernels.rope_page_write), else XLA's ops.
    """
    B, T, F = qkv.shape
    N, K, H = num_heads, k_pages.shape[0], k_pages.shape[3]
    if kernels_lib.fused_in_pallas(kernels) and H & (H - 1) == 0 and H >= 4:
        q, k_pages, v_pages = pallas_kernels.rope_page_write(
            qkv.reshape(B * T, F), cos.reshape(B * T, H), sin.reshape(B * T, H), k_pages, v_pages, layout.page_table,
            layout.seq, layout.write_positions, num_heads=N, q_norm=q_norm, k_norm=k_norm, eps=eps,
            interpret=kernels_lib.interpret())
        q = q.reshape(B, T, N, H)
    else:
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages, v_pages = write_pages(k_pages, v_pages, layout.page_table, layout.seq, layout.write_positions,
                                       k.reshape(B * T, K, H), v.reshape(B * T, K, H))
    if kernels_lib.exact(kernels):
        (group,) = layout.groups
        if group.tree_bits is not None:
            raise ValueError("the exact kernels' attention has no tree mask")
        return _invariant(q, k_pages, v_pages, group), k_pages, v_pages
    flat = q.reshape(B * T, N, H)
    outs = [attend(flat[g.start : g.start + g.tokens], k_pages, v_pages, g.read_table, g.kv_lens, g.cu_q_lens,
                   max_q_len=g.max_q_len, kernels=kernels, uniform=g.uniform, tree_start=g.tree_start,
                   tree_bits=g.tree_bits) for g in layout.groups]
    return jnp.concatenate(outs).reshape(B, T, N, H), k_pages, v_pages


def _invariant(q, k_pages, v_pages, group):
    """EXACT's attention of q [B, T, N, H], B rows of T tokens each (a uniform layout's one group): each row's pages
    gathered into a contiguous cache [B, K, W page_size, H] for pallas_kernels.invariant_attention, whose partition
    of a query's keys depends on the query's position alone."""
    B, T = q.shape[:2]
    K, _, page_size, H = k_pages.shape
    table = group.read_table
    W = table.shape[1]

    def rows(pages):
        return jnp.moveaxis(pages[:, table], 0, 1).reshape(B, K, W * page_size, H)

    start = group.kv_lens - T
    return pallas_kernels.invariant_attention(q, rows(k_pages), rows(v_pages), start, scale=q.shape[-1] ** -0.5,
                                              interpret=kernels_lib.interpret())


def attend(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, max_q_len: int, kernels: str,
           uniform: bool = False, tree_start=None, tree_bits=None) -> jax.Array:
    """Ragged paged attention of q [T, N, H] -> [T, N, H]: the Mosaic GPU kernel where it runs
    (uses_paged_kernel), the XLA path everywhere else. page_table: every entry a page of the pool (the layout's
    read_table). uniform: the group is a uniform batch (kv_cache.Attention.uniform), which the kernel's merge
    of its splits uses. tree_start, tree_bits: a draft tree's mask (kv_cache.Attention), or None. The EXACT kernels
    take `attention_block`'s own path (a uniform batch), not this one."""
    if kernels_lib.exact(kernels):
        raise ValueError(f"kernels={kernels!r}: batch-invariant attention runs through attention_block")
    scale = q.shape[-1] ** -0.5
    if uses_paged_kernel(q, k_pages, v_pages, max_q_len=max_q_len, kernels=kernels, on_hopper=kernels_lib.hopper()):
        return pallas_kernels.ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, scale=scale,
                                                     max_q_len=max_q_len, uniform=uniform, tree_start=tree_start,
                                                     tree_bits=tree_bits)
    return paged_attention_xla(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, scale=scale, max_q_len=max_q_len,
                               tree_start=tree_start, tree_bits=tree_bits)


def uses_paged_kernel(q, k_pages, v_pages, *, max_q_len: int, kernels: str, on_hopper: bool) -> bool:
    """The kernel runs on a Hopper GPU (wgmma), when Pallas attention is chosen and it takes the
    operands (bf16/f16, head_dim 64/128/256, a group size dividing 64, page sizes it tiles); the XLA
    path runs on the CPU, on other GPUs and for everything else."""
    return (on_hopper and kernels_lib.attention_in_pallas(kernels)
            and pallas_kernels.ragged_paged_unsupported(q, k_pages, v_pages, max_q_len=max_q_len) is None)


XLA_BLOCK = 16  # queries per work item of the XLA path: a chunk's queries never share one [queries, keys] block


def paged_attention_xla(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale: float, max_q_len: int,
                        tree_start=None, tree_bits=None):
    """Causal GQA attention of a ragged token batch q [T, N, H] over pages -> [T, N, H] in q's dtype.

    Work items of at most Q = min(max_q_len, XLA_BLOCK) queries of one sequence, as the kernel's tiles: item w
    gathers its sequence's pages into a [K, pages_per_seq * page_size, H] cache and its queries into Q rows, so the
    work grows with the tokens and the keys, never with sequences x max_q_len. Scores and softmax in float32,
    probabilities cast to q's dtype. Keys past kv_len are masked and their V zeroed, so any page-table entry or slot
    past a sequence's keys is harmless. Tokens past cu_q_lens[-1] get zeros. tree_start [S], tree_bits [T, W]: the
    kernel's tree mask (pallas_kernels.ragged_paged_attention), keys from tree_start on seen only where a query's
    bits name them.
    """
    T, N, H = q.shape
    K, _, page_size, _ = k_pages.shape
    S, pages_per_seq = page_table.shape
    G, L, dtype = N // K, pages_per_seq * page_size, q.dtype
    Q = min(max_q_len, XLA_BLOCK)
    # Items: sequence s holds ceil(q_len / Q) of them, so at most S + T / Q in all (S when every q_len fits one).
    items = min(S * -(-max_q_len // Q), S + -(-T // Q))
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    blocks = -(-q_len // Q)
    first_item = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks).astype(jnp.int32)])  # [S + 1]
    item = jnp.arange(items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_item, item, side="right", method="scan_unrolled").astype(jnp.int32) - 1,
                   0, S - 1)  # [items]
    block = item - first_item[seq]
    row = jnp.arange(Q, dtype=jnp.int32)[None, :]
    local = block[:, None] * Q + row  # [items, Q]: each row's query within its sequence
    real = (local < q_len[seq][:, None]) & (item < first_item[-1])[:, None]
    qs = q[jnp.clip(cu_q_lens[seq][:, None] + local, 0, T - 1)].reshape(items, Q, K, G, H)
    position = kv_lens[seq][:, None] - q_len[seq][:, None] + local  # [items, Q]
    pages = jnp.clip(page_table[seq], 0, k_pages.shape[1] - 1)  # [items, W]
    k = k_pages[:, pages].reshape(K, items, L, H)
    v = v_pages[:, pages].reshape(K, items, L, H)
    key = jnp.arange(L, dtype=jnp.int32)[None, None, :]
    in_use = key < kv_lens[seq][:, None, None]
    visible = (key <= position[:, :, None]) & in_use & real[:, :, None]  # [items, Q, L]
    if tree_bits is not None:
        rows = tree_bits[jnp.clip(cu_q_lens[seq][:, None] + local, 0, T - 1)]  # [items, Q, W]
        visible = visible & tree_shown(key - tree_start[seq][:, None, None], rows)
    v = jnp.where(in_use[:, 0][None, :, :, None], v, 0)
    qs, k, v = (widen_on_cpu(x) for x in (qs, k, v))
    scores = jnp.einsum("iqkgh,kith->ikgqt", qs, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(dtype).astype(qs.dtype)  # rows with no key: zeros
    out = jnp.einsum("ikgqt,kith->iqkgh", probs, v, preferred_element_type=jnp.float32).astype(dtype)
    out = out.reshape(items * Q, N, H)
    token_seq, _ = token_positions(cu_q_lens, kv_lens, T)  # S: no sequence
    is_real, token_seq = token_seq < S, jnp.minimum(token_seq, S - 1)
    token_local = jnp.arange(T, dtype=jnp.int32) - cu_q_lens[token_seq]
    at = jnp.clip((first_item[token_seq] + token_local // Q) * Q + token_local % Q, 0, items * Q - 1)
    return jnp.where(is_real[:, None, None], out[at], 0).astype(dtype)


def tree_shown(rel, words) -> jax.Array:
    """Which keys a tree mask shows: rel [..., L], each key's offset from its sequence's tree start, and words
    [..., W] int32, each query's bits -> bool [..., L]: every key before the start (rel < 0), and key rel >= 0 when
    bit rel % 32 of word rel // 32 is set (none past the W words)."""
    shown = rel < 0
    for w in range(words.shape[-1]):
        shift = rel - 32 * w
        bit = jax.lax.shift_right_logical(words[..., w : w + 1], jnp.clip(shift, 0, 31)) & 1
        shown = shown | ((shift >= 0) & (shift < 32) & (bit != 0))
    return shown


def widen_on_cpu(x: jax.Array) -> jax.Array:
    """XLA:CPU has no batched bf16/f16 dot with a float32 result ("Unsupported element type for DotThunk"), so
    there the 16-bit operands are widened to float32 first: exact, and the same float32 products and sums the
    GPU's dot computes."""
    return x.astype(jnp.float32) if jax.default_backend() == "cpu" and x.dtype.itemsize < 4 else x
