"""Grouped-query attention of T new queries against a KV cache: the one place a kernel plugs in.

Query t of row b sits at position start[b] + t and sees cache entries s <= start[b] + t; the new
tokens' K/V are already in the cache. `kernels` (see eagle3_jax/models/kernels.py) picks plain jnp (the
reference and the CPU path) or the Pallas GPU kernels in `pallas_kernels/`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import kv_cache
from eagle3_jax.models.layers import apply_rope, rms_norm

_DECODE_KERNEL_MAX_TOKENS = 16  # decode/verify/rebuild steps; longer runs (prefill) use the flash kernel


def rotate_and_cache(qkv, cos, sin, k_cache, v_cache, start, *, num_heads: int, q_norm, k_norm, eps: float,
                     kernels: str):
    """The fused q/k/v projection [B, T, (N + 2K) H] -> attention's inputs.

    q and k are RMS-normalised per head when q_norm and k_norm are given (Qwen3 layers), then
    rotated by RoPE (cos, sin [B, T, H]); k and v of token t go into the caches [B, K, S, H] at
    start[b] + t. Returns (q [B, T, N, H], k_cache, v_cache). One kernel with the Pallas kernels
    (pallas_kernels/rope_cache_write.py), about eight with XLA's.
    """
    if kernels_lib.fused_in_pallas(kernels):
        return pallas_kernels.rope_cache_write(qkv, cos, sin, k_cache, v_cache, start, num_heads=num_heads,
                                               q_norm=q_norm, k_norm=k_norm, eps=eps, interpret=kernels_lib.interpret())
    B, T, _ = qkv.shape
    N, K, H = num_heads, k_cache.shape[1], k_cache.shape[3]
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
    q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return q, kv_cache.write(k_cache, k, positions), kv_cache.write(v_cache, v, positions)


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, kernels: str) -> jax.Array:
    """q [B, T, N, H], k/v cache [B, K, S, H], start [B] -> [B, T, N, H]."""
    scale = q.shape[-1] ** -0.5
    if not kernels_lib.attention_in_pallas(kernels):
        return xla_attention(q, k_cache, v_cache, start, scale=scale)
    interpret = kernels_lib.interpret()
    if kernels_lib.exact(kernels):
        return pallas_kernels.invariant_attention(q, k_cache, v_cache, start, scale=scale, interpret=interpret)
    if q.shape[1] <= _DECODE_KERNEL_MAX_TOKENS:
        return pallas_kernels.decode_attention(q, k_cache, v_cache, start, scale=scale, interpret=interpret)
    if uses_mosaic_prefill(q, k_cache, v_cache, on_hopper=kernels_lib.hopper()):
        return pallas_kernels.prefill_attention_mgpu(q, k_cache, v_cache, start, scale=scale)
    return pallas_kernels.prefill_attention(q, k_cache, v_cache, start, scale=scale, interpret=interpret)


def uses_mosaic_prefill(q, k_cache, v_cache, *, on_hopper: bool) -> bool:
    """Prefill's lowering, by measurement (BENCHMARKS.md): Mosaic GPU where it runs (a Hopper GPU;
    operands it takes: bf16/f16, head_dim 64/128, sizes multiples of 8), else the Triton kernel."""
    return on_hopper and pallas_kernels.mosaic_prefill_unsupported(q, k_cache, v_cache) is None


def xla_attention(q, k_cache, v_cache, start, *, scale: float) -> jax.Array:
    """The reference: scores in float32, softmax in float32, probabilities cast to q's dtype."""
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    dtype = q.dtype
    q, k_cache, v_cache = (_widen_on_cpu(x) for x in (q, k_cache, v_cache))
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * scale
    query_pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= query_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype).astype(q.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v_cache, preferred_element_type=jnp.float32)
    return out.astype(dtype).reshape(B, T, N, H)


def _widen_on_cpu(x: jax.Array) -> jax.Array:
    """XLA:CPU has no batched bf16/f16 dot with a float32 result ("Unsupported element type for
    DotThunk"), so there the 16-bit operands are widened to float32 first: exact, and the same float32
    products and sums the GPU's dot computes."""
    return x.astype(jnp.float32) if jax.default_backend() == "cpu" and x.dtype.itemsize < 4 else x
