"""Grouped-query attention of T new queries against a KV cache: the one place a kernel plugs in.

Query t of row b sits at position start[b] + t and sees cache entries s <= start[b] + t; the new
tokens' K/V are already in the cache. `kernels` (see eagle3_jax/kernels.py) picks plain jnp (the
reference and the CPU path) or the Pallas GPU kernels in `pallas_kernels/`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax import kernels as kernels_lib

_DECODE_KERNEL_MAX_TOKENS = 16  # decode/verify/rebuild steps; longer runs (prefill) use the flash kernel


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, kernels: str) -> jax.Array:
    """q [B, T, N, H], k/v cache [B, K, S, H], start [B] -> [B, T, N, H]."""
    scale = q.shape[-1] ** -0.5
    if not kernels_lib.attention_in_pallas(kernels):
        return xla_attention(q, k_cache, v_cache, start, scale=scale)
    kernel = pallas_kernels.decode_attention if q.shape[1] <= _DECODE_KERNEL_MAX_TOKENS else pallas_kernels.prefill_attention
    return kernel(q, k_cache, v_cache, start, scale=scale, interpret=kernels_lib.interpret())


def xla_attention(q, k_cache, v_cache, start, *, scale: float) -> jax.Array:
    """The reference: scores in float32, softmax in float32, probabilities cast to q's dtype."""
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * scale
    query_pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= query_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v_cache, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, N, H)
