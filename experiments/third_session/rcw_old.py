"""From the fused q/k/v projection to attention's inputs, in one kernel.

After the q/k/v matmul a Qwen3 layer normalises q and k per head, rotates
them (RoPE), and writes the new k and v into the KV cache. XLA runs that as
about eight small kernels per layer (two reductions, the scaling, two
concatenations for rotate_half, a select, two cache updates); at batch 1 each
costs about 1.4 us of GPU time, mostly start-up. This kernel does all of it:
one program per new token reads its q/k/v row once, writes the rotated q,
and writes k and v into the cache in place (the caches are aliased to the
outputs, so nothing else of them is read or copied).

rotate_half never slices a register tile: each head is loaded as its two
halves, x1 = x[:H/2] and x2 = x[H/2:], and RoPE is out1 = x1 cos - x2 sin,
out2 = x2 cos + x1 sin (cos and sin repeat over the two halves, as
eagle3_jax.layers.rope_tables builds them). Heads are padded to a power of 2
for Triton; the padding repeats the last head and is never stored. A token at
a position past the cache's capacity writes nothing (like kv_cache.write).

Rounding follows eagle3_jax.layers: norm in float32, cast, scale; each RoPE
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


def _halves(qkv_ref, first_head, num_heads, head_dim):
    """Heads first_head .. first_head + num_heads - 1 of one token's q/k/v row: (x1, x2) [P, H/2], and
    the head index of each of the P (a power of 2) rows; padding rows repeat the last head."""
    half = head_dim // 2
    heads = jnp.arange(_common.next_power_of_2(num_heads))
    loaded = first_head + jnp.minimum(heads, num_heads - 1)
    cols = jnp.arange(half)
    start = loaded[:, None] * head_dim + cols[None, :]
    return qkv_ref[start], qkv_ref[start + half], heads


def _norm(x1, x2, norm_ref, eps):
    half = x1.shape[1]
    a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
    inv_rms = lax.rsqrt(((a * a).sum(axis=1) + (b * b).sum(axis=1)) / (2 * half) + eps)[:, None]
    w1, w2 = norm_ref[pl.ds(0, half)], norm_ref[pl.ds(half, half)]
    return w1[None, :] * (a * inv_rms).astype(x1.dtype), w2[None, :] * (b * inv_rms).astype(x2.dtype)


def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _kernel(start_ref, qkv_ref, cos_ref, sin_ref, *refs, num_heads, num_kv_heads, eps, normed):
    # start_ref: [B] cache length before this step; token t of row b goes to start[b] + t
    # qkv_ref: [(N + 2K) H] one token's projection; cos_ref, sin_ref: [H] its RoPE row
    # q_norm_ref, k_norm_ref (normed): [H]
    # k_in, v_in: the caches, aliased to k_out, v_out: [K, S, H] row b's caches
    # q_out: [N, H] the token's rotated queries
    if normed:
        q_norm_ref, k_norm_ref, _, _, q_out, k_out, v_out = refs
    else:
        q_norm_ref = k_norm_ref = None
        _, _, q_out, k_out, v_out = refs
    N, K = num_heads, num_kv_heads
    H = q_out.shape[1]
    half = H // 2
    cols = jnp.arange(half)
    cos, sin = cos_ref[pl.ds(0, half)][None, :], sin_ref[pl.ds(0, half)][None, :]

    def rotated(first_head, num, norm_ref):
        x1, x2, heads = _halves(qkv_ref, first_head, num, H)
        if norm_ref is not None:
            x1, x2 = _norm(x1, x2, norm_ref, eps)
        return (*_rotate(x1, x2, cos, sin), heads)

    q1, q2, heads = rotated(0, N, q_norm_ref)
    real = (heads < N)[:, None]
    pltriton.store(q_out.at[heads[:, None], cols[None, :]], q1.astype(q_out.dtype), mask=real)
    pltriton.store(q_out.at[heads[:, None], cols[None, :] + half], q2.astype(q_out.dtype), mask=real)

    position = start_ref[pl.program_id(0)] + pl.program_id(1)
    k1, k2, heads = rotated(N, K, k_norm_ref)
    v1, v2, _ = _halves(qkv_ref, N + K, K, H)
    # Padding heads, and every head of a token past capacity, store nothing.
    keep = ((heads < K) & (position < k_out.shape[1]))[:, None]
    slot = jnp.minimum(position, k_out.shape[1] - 1)
    for ref, lo, hi in ((k_out, k1, k2), (v_out, v1, v2)):
        pltriton.store(ref.at[heads[:, None], slot, cols[None, :]], lo.astype(ref.dtype), mask=keep)
        pltriton.store(ref.at[heads[:, None], slot, cols[None, :] + half], hi.astype(ref.dtype), mask=keep)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret"))
def _rope_cache_write(qkv, cos, sin, start, k_cache, v_cache, q_norm, k_norm, *, num_heads, num_kv_heads, eps,
                      interpret):
    B, T, F = qkv.shape
    _, K, S, H = k_cache.shape
    normed = q_norm is not None
    token = lambda b, t: (b, t, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((B,), lambda b, t: (0,)),
        pl.BlockSpec((None, None, F), token),
        pl.BlockSpec((None, None, H), token),
        pl.BlockSpec((None, None, H), token),
    ]
    operands = [start, qkv, cos, sin]
    if normed:
        in_specs += [pl.BlockSpec((H,), lambda b, t: (0,))] * 2
        operands += [q_norm, k_norm]
    cache_spec = pl.BlockSpec((None, K, S, H), lambda b, t: (b, 0, 0, 0))
    in_specs += [cache_spec, cache_spec]
    operands += [k_cache, v_cache]
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, normed=normed),
        grid=(B, T),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, num_heads, H), lambda b, t: (b, t, 0, 0)), cache_spec, cache_spec],
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
