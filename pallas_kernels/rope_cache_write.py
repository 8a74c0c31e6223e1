"""From the fused q/k/v projection to attention's inputs, in one kernel.

After the q/k/v matmul a Qwen3 layer normalises q and k per head, rotates
them (RoPE), and writes the new k and v into the KV cache. XLA runs that as
about eight small kernels per layer (two reductions, the scaling, two
concatenations for rotate_half, a select, two cache updates); at batch 1 each
costs about 1.4 us of GPU time, mostly start-up. This kernel does all of it:
for each new token, programs of 8 heads each (Qwen3-8B's 32 q + 8 k + 8 v heads
are 6 programs) read their heads of the q/k/v row once, write the rotated q,
and write k and v into the cache in place (the caches are aliased to the
outputs, so nothing else of them is read or copied). One program per token
doing all 48 heads took 2.6 us at batch 1 on the H200 (BENCHMARKS.md).

rotate_half never slices a register tile: each head is loaded as its two
halves, x1 = x[:H/2] and x2 = x[H/2:], and RoPE is out1 = x1 cos - x2 sin,
out2 = x2 cos + x1 sin (cos and sin repeat over the two halves, as
eagle3_jax.models.layers.rope_tables builds them). The last program's rows past the
last head repeat it and are never stored. A token at a position past the
cache's capacity writes nothing (like kv_cache.write).

Rounding follows eagle3_jax.models.layers: norm in float32, cast, scale; each RoPE
product and sum in the inputs' dtype.

Lowering: Pallas' Triton backend, like the attention kernels (see
pallas_kernels/__init__.py); interpret=True runs it on the CPU for the tests.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

HEADS_PER_PROGRAM = 8  # q, k and v heads alike: Qwen3-8B's 32 + 8 + 8 heads are 6 programs per token


def _norm(x1, x2, w1, w2, eps):
    """Per-row RMSNorm of heads given as halves x1, x2 [P, H/2], with per-row weights w1, w2 [P, H/2]."""
    half = x1.shape[1]
    a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
    inv_rms = lax.rsqrt(((a * a).sum(axis=1) + (b * b).sum(axis=1)) / (2 * half) + eps)[:, None]
    return w1 * (a * inv_rms).astype(x1.dtype), w2 * (b * inv_rms).astype(x2.dtype)


def _kernel(start_ref, qkv_ref, cos_ref, sin_ref, *refs, num_heads, num_kv_heads, eps, normed):
    # start_ref: [B] cache length before this step; token t of row b goes to start[b] + t
    # qkv_ref: [(N + 2K) H] one token's projection; cos_ref, sin_ref: [H] its RoPE row
    # q_norm_ref, k_norm_ref (normed): [H]
    # k_in, v_in: the caches, aliased to k_out, v_out: [K, S, H] row b's caches
    # q_out: [N, H] the token's rotated queries
    # This program owns heads g * P .. g * P + P - 1 of the token's q, k, v heads (in that order).
    if normed:
        q_norm_ref, k_norm_ref, _, _, q_out, k_out, v_out = refs
    else:
        _, _, q_out, k_out, v_out = refs
    N, K = num_heads, num_kv_heads
    H = q_out.shape[1]
    half = H // 2
    cols = jnp.arange(half)[None, :]
    head = pl.program_id(2) * HEADS_PER_PROGRAM + jnp.arange(HEADS_PER_PROGRAM)
    is_q, is_v = head < N, head >= N + K
    is_k = ~is_q & ~is_v
    real = head < N + 2 * K
    loaded = jnp.minimum(head, N + 2 * K - 1)[:, None] * H + cols  # padding rows repeat the last head
    x1, x2 = qkv_ref[loaded], qkv_ref[loaded + half]

    rope1, rope2 = x1, x2  # rotate_half is done on the halves: never a slice of a register tile
    if normed:
        w1 = jnp.where(is_q[:, None], q_norm_ref[pl.ds(0, half)][None, :], k_norm_ref[pl.ds(0, half)][None, :])
        w2 = jnp.where(is_q[:, None], q_norm_ref[pl.ds(half, half)][None, :], k_norm_ref[pl.ds(half, half)][None, :])
        rope1, rope2 = _norm(x1, x2, w1, w2, eps)
    cos, sin = cos_ref[pl.ds(0, half)][None, :], sin_ref[pl.ds(0, half)][None, :]
    rope1, rope2 = rope1 * cos - rope2 * sin, rope2 * cos + rope1 * sin
    out1 = jnp.where(is_v[:, None], x1, rope1)  # v heads: neither normed nor rotated
    out2 = jnp.where(is_v[:, None], x2, rope2)

    position = start_ref[pl.program_id(0)] + pl.program_id(1)
    in_cache = position < k_out.shape[1]  # a token past capacity writes nothing (like kv_cache.write)
    slot = jnp.minimum(position, k_out.shape[1] - 1)
    # Each row stores into one of q_out, k_out, v_out; in the other two its index is past the end
    # (distinct and masked off), never a real row that a masked-off store could race.
    for ref, mine, index, keep, at_slot in (
        (q_out, is_q, head, real, ()),
        (k_out, is_k, head - N, real & in_cache, (slot,)),
        (v_out, is_v, head - N - K, real & in_cache, (slot,)),
    ):
        index = jnp.where(mine, index, ref.shape[0] + head)[:, None]
        mask = (mine & keep)[:, None]
        pltriton.store(ref.at[(index, *at_slot, cols)], out1.astype(ref.dtype), mask=mask)
        pltriton.store(ref.at[(index, *at_slot, cols + half)], out2.astype(ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret"))
def _rope_cache_write(qkv, cos, sin, start, k_cache, v_cache, q_norm, k_norm, *, num_heads, num_kv_heads, eps,
                      interpret):
    B, T, F = qkv.shape
    _, K, S, H = k_cache.shape
    normed = q_norm is not None
    token = lambda b, t, g: (b, t, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((B,), lambda b, t, g: (0,)),
        pl.BlockSpec((None, None, F), token),
        pl.BlockSpec((None, None, H), token),
        pl.BlockSpec((None, None, H), token),
    ]
    operands = [start, qkv, cos, sin]
    if normed:
        in_specs += [pl.BlockSpec((H,), lambda b, t, g: (0,))] * 2
        operands += [q_norm, k_norm]
    cache_spec = pl.BlockSpec((None, K, S, H), lambda b, t, g: (b, 0, 0, 0))
    in_specs += [cache_spec, cache_spec]
    operands += [k_cache, v_cache]
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, normed=normed),
        grid=(B, T, pl.cdiv(num_heads + 2 * K, HEADS_PER_PROGRAM)),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, num_heads, H), lambda b, t, g: (b, t, 0, 0)), cache_spec, cache_spec],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, num_heads, H), qkv.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_cache_write",
    )(*operands)


def rope_cache_write(qkv, cos, sin, k_cache, v_cache, start, *, num_heads: int, q_norm=None, k_norm=None,
                     eps: float = 1e-6, interpret: bool = False):
    """qkv [B, T, (N + 2K) H] (q heads, then k, then v) -> (q [B, T, N, H], k_cache, v_cache).

    q and k are RMS-normalised per head (when q_norm and k_norm [H] are given), then rotated with
    cos, sin [B, T, H]; the rotated k and the v of token t of row b go into the caches
    [B, K, S, H] at start[b] + t (dropped past S). The caches are updated in place when the caller
    donates them (as the model's jitted steps do).
    """
    B, T, F = qkv.shape
    _, K, S, H = k_cache.shape
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    if F != (num_heads + 2 * K) * H or k_cache.shape[0] != B or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"qkv {qkv.shape} does not fit caches {k_cache.shape}, {v_cache.shape} with {num_heads} q heads"
        )
    if cos.shape != (B, T, H) or sin.shape != cos.shape or start.shape != (B,):
        raise ValueError(f"cos {cos.shape}, sin {sin.shape}, start {start.shape} do not fit qkv {qkv.shape}")
    if not _common.is_power_of_2(H) or H < 4:
        raise ValueError(f"head_dim {H} must be a power of 2 >= 4 (Triton vectors of H / 2)")
    return _rope_cache_write(qkv, cos, sin, start.astype(jnp.int32), k_cache, v_cache, q_norm, k_norm,
                             num_heads=num_heads, num_kv_heads=K, eps=float(eps), interpret=interpret)
