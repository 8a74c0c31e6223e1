"""Plain-jnp GQA attention over a KV cache: the oracle for the Pallas kernels."""

import jax
import jax.numpy as jnp


def attention_reference(q, k_cache, v_cache, start, *, scale):
    """Causal GQA attention of T new queries over a cache, in float32.

    q: [B, T, N, H]; k_cache, v_cache: [B, K, S, H]; start: [B] int32, the cache
    length before this step. Query t of row b sits at position start[b] + t and
    sees keys s <= start[b] + t. Returns [B, T, N, H] in q.dtype.
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
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksh->btkgh", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, N, H).astype(q.dtype)
