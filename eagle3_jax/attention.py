"""Grouped-query attention of T new queries against a KV cache: the one place a kernel plugs in.

Query t of row b sits at position start[b] + t and sees cache entries s <= start[b] + t; the new
tokens' K/V are already in the cache. `impl` picks the implementation: "xla" (plain jnp, the reference
and the CPU path) or "pallas" (the GPU kernels in `pallas_kernels/`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "pallas")
_DECODE_KERNEL_MAX_TOKENS = 16  # decode/verify/rebuild steps; longer runs (prefill) use the flash kernel


def pallas_supports(head_dim: int) -> bool:
    """The kernels' Triton block shapes need a power-of-two head_dim of at least 16 (Qwen3: 128)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def default_impl(*head_dims: int) -> str:
    """Pallas on GPU when the kernels support every head_dim given, XLA elsewhere."""
    on_gpu = jax.default_backend() == "gpu"
    return "pallas" if on_gpu and all(pallas_supports(h) for h in head_dims) else "xla"


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, impl: str) -> jax.Array:
    """q [B, T, N, H], k/v cache [B, K, S, H], start [B] -> [B, T, N, H]."""
    scale = q.shape[-1] ** -0.5
    if impl == "xla":
        return xla_attention(q, k_cache, v_cache, start, scale=scale)
    if impl == "pallas":
        import pallas_kernels

        # Off the GPU the same kernels run in Pallas' interpreter (slow; for tests).
        interpret = jax.default_backend() != "gpu"
        kernel = pallas_kernels.decode_attention if q.shape[1] <= _DECODE_KERNEL_MAX_TOKENS else pallas_kernels.prefill_attention
        return kernel(q, k_cache, v_cache, start, scale=scale, interpret=interpret)
    raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


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
