"""Pieces shared by the kernels: attention rows and softmax steps (invariant_attention.py), shape checks, and the
add + RMSNorm kernels' operands.

Rows: an attention program owns one KV head h and a tile of "rows", where row
r = t * G + g is query token t of query head h * G + g (G = N // K). Grouping
all G heads of a KV head into the rows of one tile is what lets a program read
that head's K/V once for all of them; the token of row r is r // G, which the
causal mask needs. Rows are gathered straight from q's [T, G, H] block.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Running max before any key is seen. Finite on purpose: a row whose keys are
# all masked in a block keeps m = -1e30, so exp(s - m) = exp(-inf) = 0 and
# exp(m_old - m_new) = 1, never exp(-inf - -inf) = NaN.
M_INIT = -1e30


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gather_rows(q_ref, rows):
    """q_ref [T, G, H] -> [M, H], row r = t * G + g for rows [M].

    Rows past T * G (padding up to a power of 2) repeat token T - 1, so they
    load in bounds and compute finite values that are never stored.
    """
    T, G, H = q_ref.shape
    t = token_of(rows, T, G)
    return q_ref[t[:, None], (rows % G)[:, None], jnp.arange(H)[None, :]]


def token_of(rows, num_tokens, group):
    """Token index of each row, padding rows clamped to the last token."""
    return jnp.minimum(rows // group, num_tokens - 1)


def online_softmax_step(carry, s, v, visible=None):
    """One flash-attention step over a KV block.

    carry: acc [M, H] f32 (unnormalized output), m [M] f32 (running max),
    l [M] f32 (running sum). s: [M, bk] f32 scaled logits; v: [bk, H];
    visible: [M, bk] bool, or None where every key is visible to every row.
    """
    acc, m, l = carry
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    pv = pltriton.dot(p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)
    return acc * alpha[:, None] + pv, m_new, l


def init_carry(num_rows: int, head_dim: int):
    return (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), M_INIT, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )


def qk_logits(q, k, scale: float):
    """q [M, H] @ k[bk, H]^T -> [M, bk] f32, scaled (IEEE f32 for f32 inputs)."""
    s = pltriton.dot(q, k, trans_b=True, precision=jax.lax.Precision.HIGHEST)
    return s * scale


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_shapes(q, k_cache, v_cache, start):
    B, _, N, H = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"{k_cache.shape=} and {v_cache.shape=} must match, 4D")
    if k_cache.shape[0] != B or k_cache.shape[3] != H:
        raise ValueError(f"{q.shape=} does not fit {k_cache.shape=}")
    if N % k_cache.shape[1]:
        raise ValueError(f"{N=} query heads not a multiple of the KV heads")
    if start.shape != (B,):
        raise ValueError(f"{start.shape=} must be ({B},)")
    if not is_power_of_2(H) or H < 16:
        raise ValueError(f"{H=} must be a power of 2 >= 16 (Triton block shapes)")


def check_norm_operands(x, delta, weight) -> None:
    """The shapes both add + RMSNorm kernels take: delta as x (or None), weight [D]."""
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta {delta.shape} does not fit x {x.shape}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"norm weight {weight.shape} does not fit x {x.shape}")


def norm_refs(refs, with_delta: bool) -> tuple:
    """An add + RMSNorm kernel's refs as (x, delta, weight, sum, normed); delta and sum are None without a delta."""
    if with_delta:
        return tuple(refs)
    x_ref, w_ref, normed_ref = refs
    return x_ref, None, w_ref, None, normed_ref


def norm_over_rows(kernel, x, delta, weight):
    """Runs kernel(x [M, D], delta [M, D] or None, weight) on x's rows flattened and returns its outputs in x's
    shape, as (sum, normed); delta None: (x, normed)."""
    D = x.shape[-1]
    outs = kernel(x.reshape(-1, D), None if delta is None else delta.reshape(-1, D), weight)
    outs = [o.reshape(x.shape) for o in outs]
    return (outs[0], outs[1]) if delta is not None else (x, outs[0])
