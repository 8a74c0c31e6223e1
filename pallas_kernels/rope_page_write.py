"""From the fused q/k/v projection to attention's inputs over paged KV, in one kernel.

After the q/k/v matmul a Qwen3 layer normalises q and k per head, rotates them (RoPE), and writes the new k
and v into their pages. XLA runs that as about eight small kernels per layer (two reductions, the scaling,
the concatenations of rotate_half, the page lookups and two scatters); at batch 1 each costs about 1.4 us of
GPU time, mostly start-up (about 10 us a layer in all on the H200, BENCHMARKS.md). This kernel does all of
it: for each token of a flat batch, programs of 8 heads each (Qwen3-8B's 32 q + 8 k + 8 v heads are 6
programs) read their heads of the q/k/v row once, write the rotated q, and write k and v into the page and
slot of the token's position (the page pools are aliased to the outputs, so nothing else of them is read or
copied).

rotate_half never slices a register tile: each head is loaded as its two halves, x1 = x[:H/2] and
x2 = x[H/2:], and RoPE is out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin (cos and sin repeat over the two
halves, as eagle3_jax.models.layers.rope_tables builds them). The last program's rows past the last head
repeat it and are never stored. A token whose write position is -1, whose sequence is none, whose position
is past its page table or whose page id is outside the pool writes nothing, as
eagle3_jax.models.paged_attention.write_pages.

Rounding follows eagle3_jax.models.layers: norm in float32, cast, scale; each RoPE product and sum in the
inputs' dtype. Each token is computed by programs of its own, so its results do not depend on the batch
(the exact decode needs this, eagle3_jax/models/kernels.py).

Lowering: Pallas' Triton backend, as add_rms_norm (see pallas_kernels/__init__.py); interpret=True runs it on
the CPU for the tests.
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


def _kernel(seq_ref, pos_ref, table_ref, qkv_ref, cos_ref, sin_ref, *refs, num_heads, num_kv_heads, eps, normed):
    # seq_ref, pos_ref: [T] each token's sequence and write position (-1: none); table_ref: [S, W] page tables
    # qkv_ref: [(N + 2K) H] this token's projection; cos_ref, sin_ref: [H] its RoPE row
    # q_norm_ref, k_norm_ref (normed): [H]
    # k_in, v_in: the page pools, aliased to k_out, v_out: [K, P, page_size, H]
    # q_out: [N, H] the token's rotated queries
    # This program owns heads g * 8 .. g * 8 + 7 of the token's q, k, v heads (in that order).
    if normed:
        q_norm_ref, k_norm_ref, _, _, q_out, k_out, v_out = refs
    else:
        _, _, q_out, k_out, v_out = refs
    N, K = num_heads, num_kv_heads
    H = q_out.shape[1]
    half = H // 2
    cols = jnp.arange(half)[None, :]
    head = pl.program_id(1) * HEADS_PER_PROGRAM + jnp.arange(HEADS_PER_PROGRAM)
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

    S, W = table_ref.shape
    pages, page_size = k_out.shape[1], k_out.shape[2]
    token = pl.program_id(0)
    seq, position = seq_ref[token], pos_ref[token]
    column = position // page_size
    written = (position >= 0) & (seq >= 0) & (seq < S) & (column < W)
    page = table_ref[jnp.clip(seq, 0, S - 1), jnp.clip(column, 0, W - 1)]
    written = written & (page >= 0) & (page < pages)
    at = (jnp.clip(page, 0, pages - 1), jnp.clip(position, 0, None) % page_size)
    # Each row stores into one of q_out, k_out, v_out; in the other two its index is past the end
    # (distinct and masked off), never a real row that a masked-off store could race.
    for ref, mine, index, keep, where in (
        (q_out, is_q, head, real, ()),
        (k_out, is_k, head - N, real & written, at),
        (v_out, is_v, head - N - K, real & written, at),
    ):
        index = jnp.where(mine, index, ref.shape[0] + head)[:, None]
        mask = (mine & keep)[:, None]
        pltriton.store(ref.at[(index, *where, cols)], out1.astype(ref.dtype), mask=mask)
        pltriton.store(ref.at[(index, *where, cols + half)], out2.astype(ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "interpret"))
def _rope_page_write(qkv, cos, sin, seq, positions, page_table, k_pages, v_pages, q_norm, k_norm, *, num_heads, eps,
                     interpret):
    T, F = qkv.shape
    K, _, _, H = k_pages.shape
    normed = q_norm is not None
    whole = lambda shape: pl.BlockSpec(shape, lambda t, g: (0,) * len(shape))  # noqa: E731
    token = lambda t, g: (t, 0)  # noqa: E731
    in_specs = [whole((T,)), whole((T,)), whole(page_table.shape), pl.BlockSpec((None, F), token),
                pl.BlockSpec((None, H), token), pl.BlockSpec((None, H), token)]
    operands = [seq, positions, page_table, qkv, cos, sin]
    if normed:
        in_specs += [whole((H,))] * 2
        operands += [q_norm, k_norm]
    in_specs += [whole(k_pages.shape), whole(v_pages.shape)]
    operands += [k_pages, v_pages]
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=K, eps=eps, normed=normed),
        grid=(T, pl.cdiv(num_heads + 2 * K, HEADS_PER_PROGRAM)),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, num_heads, H), lambda t, g: (t, 0, 0)), whole(k_pages.shape),
                   whole(v_pages.shape)],
        out_shape=[
            jax.ShapeDtypeStruct((T, num_heads, H), qkv.dtype),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_page_write",
    )(*operands)


def rope_page_write(qkv, cos, sin, k_pages, v_pages, page_table, seq, positions, *, num_heads: int, q_norm=None,
                    k_norm=None, eps: float = 1e-6, interpret: bool = False):
    """qkv [T, (N + 2K) H] (q heads, then k, then v) of a flat batch -> (q [T, N, H], k_pages, v_pages).

    q and k are RMS-normalised per head (when q_norm and k_norm [H] are given), then rotated with cos, sin
    [T, H]; the rotated k and the v of token t go into the pages [K, P, page_size, H] at position positions[t]
    of sequence seq[t]: page page_table[seq, position // page_size], slot position % page_size (nothing for a
    position of -1, a sequence out of range, a position past the table or a page id outside the pool). The
    pools are updated in place when the caller donates them (as the model's jitted steps do).
    """
    T, F = qkv.shape
    K, _, _, H = k_pages.shape
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    if F != (num_heads + 2 * K) * H or v_pages.shape != k_pages.shape:
        raise ValueError(f"qkv {qkv.shape} does not fit pages {k_pages.shape}, {v_pages.shape} with {num_heads} "
                         "q heads")
    if cos.shape != (T, H) or sin.shape != cos.shape or seq.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"cos {cos.shape}, sin {sin.shape}, seq {seq.shape}, positions {positions.shape} do not "
                         f"fit qkv {qkv.shape}")
    if not _common.is_power_of_2(H) or H < 4:
        raise ValueError(f"head_dim {H} must be a power of 2 >= 4 (Triton vectors of H / 2)")
    return _rope_page_write(qkv, cos, sin, seq.astype(jnp.int32), positions.astype(jnp.int32),
                            page_table.astype(jnp.int32), k_pages, v_pages, q_norm, k_norm, num_heads=num_heads,
                            eps=float(eps), interpret=interpret)
