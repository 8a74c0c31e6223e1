"""Attention over a paged KV cache (the model's entry, `attend`, and the XLA path), and the write of
new tokens into pages.

A layer's pages are k_pages, v_pages [K, P, page_size, H] (KV-head major: why, in
pallas_kernels/ragged_paged_attention.py); sequence s's key j sits in page page_table[s, j //
page_size] at slot j % page_size. A step's queries are one flat batch of T tokens: sequence s owns
tokens cu_q_lens[s] .. cu_q_lens[s + 1] - 1, and query i of it sits at position kv_len[s] - q_len[s]
+ i (kv_lens count the new tokens). This module computes the same thing as the Mosaic GPU kernel in
plain jnp, for the CPU and GPUs other than Hopper, and is the kernel's test oracle beside the dense
reference (pallas_kernels.reference.paged_attention_reference). The writes are XLA scatters only:
a Mosaic GPU form of pallas_kernels.rope_cache_write for pages does not exist yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models.attention import _widen_on_cpu
from eagle3_jax.models.layers import apply_rope, rms_norm


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(seq [T], position [T]) of each token of the flat batch; tokens past cu_q_lens[-1] get seq S
    (no sequence) and position -1, which write_pages drops."""
    S = kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, token, side="right", method="compare_all").astype(jnp.int32) - 1
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


def rotate_and_write_pages(qkv, cos, sin, k_pages, v_pages, page_table, seq, positions, *, num_heads: int,
                           q_norm, k_norm, eps: float):
    """The fused q/k/v projection of a flat batch [T, (N + 2K) H] -> (q [T, N, H], k_pages, v_pages).

    q and k are RMS-normalised per head when q_norm and k_norm are given (Qwen3 layers), then
    rotated by RoPE (cos, sin [T, H], each token's own position); k and v go into the pages at
    (seq, positions) as write_pages puts them. The paged form of attention.rotate_and_cache.
    """
    T = qkv.shape[0]
    N, K, H = num_heads, k_pages.shape[0], k_pages.shape[3]
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q[None], cos[None], sin[None])[0], apply_rope(k[None], cos[None], sin[None])[0]
    return (q, *write_pages(k_pages, v_pages, page_table, seq, positions, k, v))


def attend(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, max_q_len: int, kernels: str) -> jax.Array:
    """Ragged paged attention of q [T, N, H] -> [T, N, H]: the Mosaic GPU kernel where it runs
    (uses_paged_kernel), the XLA path everywhere else.

    EXACT (Engine(exact=True)) is refused: neither path is batch-invariant (the kernel's split count
    follows the batch), and a paged form of pallas_kernels.invariant_attention does not exist yet.
    """
    if kernels_lib.exact(kernels):
        raise ValueError(f"kernels={kernels!r}: batch-invariant paged attention is not implemented")
    scale = q.shape[-1] ** -0.5
    if uses_paged_kernel(q, k_pages, v_pages, max_q_len=max_q_len, kernels=kernels, on_hopper=kernels_lib.hopper()):
        return pallas_kernels.ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, scale=scale,
                                                     max_q_len=max_q_len)
    return paged_attention_xla(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, scale=scale, max_q_len=max_q_len)


def uses_paged_kernel(q, k_pages, v_pages, *, max_q_len: int, kernels: str, on_hopper: bool) -> bool:
    """The kernel runs on a Hopper GPU (wgmma), when Pallas attention is chosen and it takes the
    operands (bf16/f16, head_dim 64/128/256, a group size dividing 64, page sizes it tiles); the XLA
    path runs on the CPU, on other GPUs and for everything else."""
    return (on_hopper and kernels_lib.attention_in_pallas(kernels)
            and pallas_kernels.ragged_paged_unsupported(q, k_pages, v_pages, max_q_len=max_q_len) is None)


def paged_attention_xla(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale: float, max_q_len: int):
    """Causal GQA attention of a ragged token batch q [T, N, H] over pages -> [T, N, H] in q's dtype.

    Each sequence's pages are gathered into a [K, pages_per_seq * page_size, H] cache and its
    queries into max_q_len rows (max_q_len bounds every q_len: static, as for the kernel); scores
    and softmax in float32, probabilities cast to q's dtype (attention.xla_attention's rounding).
    Keys past kv_len are masked and their V zeroed, so any page-table entry or slot past a
    sequence's keys is harmless. Tokens past cu_q_lens[-1] get zeros.
    """
    T, N, H = q.shape
    K, _, page_size, _ = k_pages.shape
    S, pages_per_seq = page_table.shape
    G, L, dtype = N // K, pages_per_seq * page_size, q.dtype
    pages = jnp.clip(page_table, 0, k_pages.shape[1] - 1)
    k = k_pages[:, pages].reshape(K, S, L, H)  # [K, S, L, H]
    v = v_pages[:, pages].reshape(K, S, L, H)
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    row = jnp.arange(max_q_len, dtype=jnp.int32)[None, :]  # [1, Q]
    q_rows = jnp.clip(cu_q_lens[:-1, None] + row, 0, T - 1)  # [S, Q]
    qs = q[q_rows].reshape(S, max_q_len, K, G, H)
    position = kv_lens[:, None] - q_len[:, None] + row  # [S, Q]
    key = jnp.arange(L, dtype=jnp.int32)[None, None, :]
    visible = (key <= position[:, :, None]) & (key < kv_lens[:, None, None])  # [S, Q, L]
    v = jnp.where((jnp.arange(L)[None, :] < kv_lens[:, None])[None, :, :, None], v, 0)
    qs, k, v = (_widen_on_cpu(x) for x in (qs, k, v))
    scores = jnp.einsum("sqkgh,ksth->skgqt", qs, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(dtype).astype(qs.dtype)  # rows with no key: zeros
    out = jnp.einsum("skgqt,ksth->sqkgh", probs, v, preferred_element_type=jnp.float32).astype(dtype)
    out = out.reshape(S, max_q_len, N, H)
    seq, _ = token_positions(cu_q_lens, kv_lens, T)  # S: no sequence
    real, seq = seq < S, jnp.minimum(seq, S - 1)
    local = jnp.clip(jnp.arange(T, dtype=jnp.int32) - cu_q_lens[seq], 0, max_q_len - 1)
    return jnp.where(real[:, None, None], out[seq, local], 0).astype(dtype)
