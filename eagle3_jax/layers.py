"""The building blocks shared by the target and the drafter: RMSNorm, RoPE, the matmuls, the gated MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import kernels as kernels_lib
from eagle3_jax.config import RopeConfig
from pallas_kernels import skinny_matmul


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, rope: RopeConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin for integer positions [B, T] -> each [B, T, head_dim], in float32 then cast."""
    inv_freq = jnp.asarray(np.asarray(rope.inverse_frequencies(), np.float32))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles) * rope.attention_factor
    sin = jnp.sin(angles) * rope.attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, heads, H] by the half-split convention (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def linear(x: jax.Array, w: jax.Array, kernels: str = "xla", out_dtype=None) -> jax.Array:
    """x [..., in] times a weight stored as transformers stores it, [out, in]."""
    if _skinny(x, w.shape[0], kernels):
        return _pallas_skinny(x, w, out_dtype=out_dtype)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)


def normed_linear(x: jax.Array, norm_weight: jax.Array, eps: float, w: jax.Array, kernels: str) -> jax.Array:
    """linear(rms_norm(x)), the norm fused into the matmul's kernel when it is a Pallas one."""
    if _skinny(x, w.shape[0], kernels):
        return _pallas_skinny(x, w, norm_weight=norm_weight, eps=eps)
    return linear(rms_norm(x, norm_weight, eps), w)


def gated_mlp(x, norm_weight, eps: float, w_gate_up, w_down, kernels: str) -> jax.Array:
    """SiLU-gated MLP of rms_norm(x), gate and up fused into one [2I, D] weight (one read of x).

    With Pallas matmuls the norm, both products and silu(gate) * up are one kernel.
    """
    if _skinny(x, w_gate_up.shape[0] // 2, kernels):
        hidden = _pallas_skinny(x, w_gate_up, norm_weight=norm_weight, eps=eps, gated=True)
    else:
        gate, up = jnp.split(linear(rms_norm(x, norm_weight, eps), w_gate_up), 2, axis=-1)
        hidden = jax.nn.silu(gate) * up
    return linear(hidden, w_down, kernels)


def _skinny(x: jax.Array, out_features: int, kernels: str) -> bool:
    """Whether this matmul goes to the Pallas skinny-matmul kernel (few rows: decode and verify)."""
    rows = x.size // x.shape[-1]
    return kernels_lib.matmuls_in_pallas(kernels) and skinny_matmul.supports(rows, out_features, x.shape[-1])


def _pallas_skinny(x, w, **options):
    return skinny_matmul.skinny_matmul(x, w, interpret=kernels_lib.interpret(), **options)
