"""Plain-jnp GQA attention over a KV cache: the oracle for the Pallas kernels."""

import jax
import jax.numpy as jnp


def attention_reference(q, k_cache, v_cache, start, *, scale, mask=None):
    """Causal GQA attention of T new queries over a cache, in float32.

    q: [B, T, N, H]; k_cache, v_cache: [B, K, S, H]; start: [B] int32, the cache
    length before this step. Query t of row b sits at position start[b] + t and
    sees keys s <= start[b] + t (and, given mask [B, T, S] bool, only those where
    it is set). Returns [B, T, N, H] in q.dtype.
    """
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, K, N // K, H).astype(jnp.float32)
    k = k_cache.astype(jnp.float32)
    # Slots past start + T hold garbage (possibly NaN): zero V there, since the
    # softmax weight 0 times NaN would still be NaN.
    in_use = jnp.arange(S)[None, :] < (start[:, None] + T)  # [B, S]
    v = jnp.where(in_use[:, None, :, None], v_cache.astype(jnp.float32), 0.0)
    s = jnp.einsum("btkgh,bksh->bkgts", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    if mask is not None:
        visible = visible & mask
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksh->btkgh", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, N, H).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale, tree_start=None,
                              tree_bits=None):
    """Ragged paged attention, one sequence at a time on concrete arrays: the oracle for the paged paths.

    q [T, N, H]; k_pages, v_pages [K, P, page_size, H]; page_table [S, pages_per_seq]; kv_lens [S];
    cu_q_lens [S + 1]. Each sequence's keys are assembled page by page into a contiguous cache, and
    attention_reference attends its q_len queries at start kv_len - q_len. With a tree mask (tree_start [S],
    tree_bits [T, W] int32: ragged_paged_attention's) a query also sees only the keys from tree_start on whose
    bit is set, each bit read one at a time. Returns [T, N, H] in q's dtype, zeros for tokens past cu_q_lens[-1].
    """
    out = jnp.zeros(q.shape, q.dtype)
    page_size = k_pages.shape[2]
    for s in range(page_table.shape[0]):
        lo, hi, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if hi == lo:
            continue
        pages = [int(page_table[s, j]) for j in range(-(-kv_len // page_size))]
        k = jnp.concatenate([k_pages[:, p] for p in pages], axis=1)[None, :, :kv_len]  # [1, K, kv_len, H]
        v = jnp.concatenate([v_pages[:, p] for p in pages], axis=1)[None, :, :kv_len]
        start = jnp.array([kv_len - (hi - lo)], jnp.int32)
        mask = None
        if tree_bits is not None:
            first = int(tree_start[s])
            words = tree_bits.shape[1]

            def shown(i, j):
                word, bit = divmod(j - first, 32)
                return j < first or (word < words and bool((int(tree_bits[i, word]) >> bit) & 1))

            rows = [[shown(i, j) for j in range(kv_len)] for i in range(lo, hi)]
            mask = jnp.asarray(rows)[None]
        out = out.at[lo:hi].set(attention_reference(q[None, lo:hi], k, v, start, scale=scale, mask=mask)[0])
    return out
