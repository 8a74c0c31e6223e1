"""The building blocks shared by the target and the drafter: RMSNorm, RoPE, the gated MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models.config import RopeConfig

# Whether Hopper takes the Mosaic GPU add + RMSNorm (pallas_kernels/add_rms_norm_mgpu.py) over the Triton one. Off:
# on the H200 (jax 0.12) both take 1.34 us of kernel time at one row, but with it on, the Qwen3-8B spec-off step
# takes 2.3% / 2.4% longer at batch 1 / 8 and the gamma-3 round 1.3% / 1.0% (round_ab, BENCHMARKS.md (s)): about
# 1.4 / 1.6 us more a call over the step's 72. The Mosaic GPU kernel is the one that takes over when Pallas drops
# Triton.
MOSAIC_NORM_ON_HOPPER = False


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, kernels: str):
    """The residual add and the norm after it: (x + delta, rms_norm(x + delta)); delta None: (x, rms_norm(x)).
    One kernel instead of three with the Pallas kernels, lowered as norm_lowering chooses."""
    lowering = norm_lowering(x, delta, weight, kernels, on_hopper=kernels_lib.hopper())
    if lowering == "mosaic_gpu":
        return pallas_kernels.add_rms_norm_mgpu(x, delta, weight, eps=eps)
    if lowering == "triton":
        return pallas_kernels.add_rms_norm(x, delta, weight, eps=eps, interpret=kernels_lib.interpret())
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def norm_lowering(x, delta, weight, kernels: str, *, on_hopper: bool) -> str:
    """Which kernel runs add_rms_norm: "xla", "mosaic_gpu" or "triton".

    With the fused Pallas kernels: with MOSAIC_NORM_ON_HOPPER on a Hopper GPU the Mosaic GPU kernel
    (pallas_kernels/add_rms_norm_mgpu.py) where it takes the operands (every Qwen3 hidden size, under jax 0.12),
    else the Triton kernel (pallas_kernels/add_rms_norm.py), as on other GPUs and in the CPU tests (Pallas'
    interpreter)."""
    if not kernels_lib.fused_in_pallas(kernels):
        return "xla"
    if on_hopper and MOSAIC_NORM_ON_HOPPER and pallas_kernels.add_rms_norm_mgpu_unsupported(x, delta, weight) is None:
        return "mosaic_gpu"
    return "triton"


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


def linear(x: jax.Array, w: jax.Array, kernels: str = "xla") -> jax.Array:
    """x [..., in] times a weight stored as transformers stores it, [out, in].

    With the EXACT kernels, pallas_kernels.skinny_matmul: each row's result is the same whatever the
    number of rows (eagle3_jax/models/kernels.py).

    On CUDA GPUs a matmul with one row (batch 1, one token) and a weight at least as tall as it is wide
    is a row reduction over the weight, which XLA emits as one kernel streaming the weight once, where
    it would emit a split-K GEMM and a reduce kernel. Measured on the H200 at Qwen3-8B shapes
    (BENCHMARKS.md, design decisions): faster for q/k/v, o and gate/up; slower for down (4096 x 12288),
    hence the shape test; far slower from 4 rows on (each row re-reads the weight), hence one row.
    Elsewhere XLA's dot: on the CPU the reduction form is many times slower (100x for 4096 x 4096 in f32).
    """
    if kernels_lib.exact(kernels):
        return pallas_kernels.skinny_matmul(x, w, interpret=kernels_lib.interpret())
    if math.prod(x.shape[:-1]) == 1 and w.shape[0] >= w.shape[1]:
        return jax.lax.platform_dependent(x, w, cuda=matvec_by_rows, default=_matmul)
    return _matmul(x, w)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w)


def matvec_by_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """`linear` as a reduction: float32 products summed along each weight row, in einsum's output dtype.
    The products are exact float32, where XLA's GPU dot of float32 inputs uses TF32 by default."""
    products = x[..., None, :].astype(jnp.float32) * w.astype(jnp.float32)
    return products.sum(axis=-1).astype(jnp.result_type(x, w))


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, kernels: str = "xla") -> jax.Array:
    """SiLU-gated MLP with gate and up fused into one [2I, D] weight (one read of x, one matmul)."""
    gate, up = jnp.split(linear(x, w_gate_up, kernels), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w_down, kernels)
