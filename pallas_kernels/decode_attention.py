"""Split-K GQA attention for decode (T = 1) and verify (T = gamma + 1 <= 8).

One program per (batch row b, KV head h, split j). It holds the T * G query
rows of head h (see _common) and walks its share of the KV blocks that are in
use, [0, start[b] + T), with an online softmax; blocks past that are never
read. With one split, the program writes its rows straight into the output;
with several, each writes a normalized partial output and its log-sum-exp,
and a second small kernel merges them, one program per output row. So a call
is one or two kernel launches and nothing else: at small shapes launches, not
bytes, set the time. The split count is static: enough programs to fill one
wave of the H200's 132 SMs when B * K is small, never more splits than blocks.

Lowering: see the package docstring (pallas_kernels/__init__.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static tuning. Defaults: fastest wall time at B = 1 in the H200 sweep.

    block_k 128 x 3 stages of K and V tiles is 192 KB of shared memory, so one
    program fits per SM: hence wave_slots 132 (block_k 64 fits two: use 264).
    """

    block_k: int = 128  # keys per loop step (a power of 2, >= 16)
    # Programs the GPU runs at once (132 SMs x resident programs per SM). Splits
    # are chosen so B * K * splits fills one wave without spilling into a
    # second, nearly empty one.
    wave_slots: int = 132
    num_splits: int | None = None  # forces the split count when set
    num_warps: int = 4
    num_stages: int = 3  # Triton's software pipelining depth over KV blocks

    def __post_init__(self):
        if not (_common.is_power_of_2(self.block_k) and self.block_k >= 16):
            raise ValueError(f"{self.block_k=} must be a power of 2 >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.wave_slots < 1:
            raise ValueError(f"{self.wave_slots=} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad {self.num_warps=} or {self.num_stages=}")

    @classmethod
    def for_dtype(cls, dtype, **tuning) -> "DecodeConfig":
        """The defaults for K/V of this dtype, then the given fields. The defaults fill the shared memory
        with 2-byte K/V tiles; 4-byte (float32) K/V take half the keys per step to fit the same bytes
        (block_k 128 would ask for more than Hopper's 227 KB per block)."""
        defaults = {"block_k": 64} if jnp.dtype(dtype).itemsize > 2 else {}
        return cls(**{**defaults, **tuning})

    def splits_for(self, batch: int, kv_heads: int, capacity: int) -> int:
        wanted = self.num_splits or self.wave_slots // (batch * kv_heads)
        return max(1, min(wanted, -(-capacity // self.block_k)))


def _decode_kernel(start_ref, q_ref, k_ref, v_ref, *out_refs, scale, block_k, num_splits, num_rows):
    # start_ref: [B] int32, cache length before this step
    # q_ref: [T, G, H] the queries of KV head h's G query heads, row b
    # k_ref, v_ref: [S, H] this (b, h)'s cache; read only below start + T
    # out_refs, one split: [T, G, H] q.dtype, the output
    #   several: [M, H] f32 this split's normalized partial output, and
    #            [M] f32 its log-sum-exp (-inf if it saw no key)
    T, G, H = q_ref.shape
    b, split = pl.program_id(0), pl.program_id(2)
    start = start_ref[b]
    # Rows past capacity (start + T > S) are don't-care: clamp, never read OOB.
    length = jnp.minimum(start + T, k_ref.shape[0])
    num_blocks = pl.cdiv(length, block_k)
    # Balanced split of the blocks in use; the split holding key 0 is never
    # empty and every row sees key 0, so the merge's max lse is finite.
    lo = split * num_blocks // num_splits
    hi = (split + 1) * num_blocks // num_splits
    rows = jnp.arange(num_rows)
    step = functools.partial(
        _common.masked_kv_step,
        _common.gather_rows(q_ref, rows),
        k_ref,
        v_ref,
        block_k=block_k,
        length=length,
        scale=scale,
        last_key=start + _common.token_of(rows, T, G),
    )
    acc, m, l = lax.fori_loop(lo, hi, step, _common.init_carry(num_rows, H))
    if num_splits == 1:  # all blocks seen, key 0 among them: l > 0
        _common.scatter_rows(out_refs[0], rows, acc / l[:, None])
        return
    o_ref, lse_ref = out_refs
    real = rows < T * G  # padding rows are not stored: write bandwidth
    pltriton.store(o_ref, acc / jnp.where(l > 0, l, 1.0)[:, None], mask=real[:, None])
    pltriton.store(lse_ref, m + jnp.log(l), mask=real)


def _decode_call(q, k_cache, v_cache, start, *, scale, num_splits, config, interpret):
    """One split: the output [B, T, N, H]; else partials [B, K, J', M, H], lse.

    J' is num_splits rounded up to a power of 2 for the merge's loads.
    """
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    # Triton dots need >= 16 rows and power-of-2 shapes.
    num_rows = max(16, _common.next_power_of_2(T * G))
    kernel = functools.partial(
        _decode_kernel, scale=scale, block_k=config.block_k, num_splits=num_splits, num_rows=num_rows
    )
    q_spec = pl.BlockSpec((None, T, G, H), lambda b, h, j: (b, 0, h, 0))
    # The whole [S, H] slab of a head is the block: the kernel's loop, not the
    # BlockSpec, decides which rows get loaded.
    kv_spec = pl.BlockSpec((None, None, S, H), lambda b, h, j: (b, h, 0, 0))
    if num_splits == 1:
        out_specs, out_shape = q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        splits = _common.next_power_of_2(num_splits)
        out_specs = [
            pl.BlockSpec((None, None, None, num_rows, H), lambda b, h, j: (b, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda b, h, j: (b, h, j, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((B, K, splits, num_rows, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, num_rows), jnp.float32),
        ]
    return pl.pallas_call(
        kernel,
        grid=(B, K, num_splits),
        in_specs=[pl.BlockSpec((B,), lambda b, h, j: (0,)), q_spec, kv_spec, kv_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(start, q, k_cache, v_cache)


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits):
    # o_ref: [J', H] f32 the partial outputs of one row (b, h, r), per split
    # lse_ref: [J'] f32 their log-sum-exps; splits >= num_splits are unwritten
    # out_ref: [H] the row's output, out[b, r // G, h * G + r % G]
    used = jnp.arange(lse_ref.shape[0]) < num_splits
    lse = pltriton.load(lse_ref, mask=used, other=-jnp.inf)
    w = jnp.exp(lse - lse.max())  # [J'], the max is finite (see the kernel)
    o = pltriton.load(o_ref, mask=used[:, None], other=0.0)
    out_ref[...] = ((w[:, None] * o).sum(axis=0) / w.sum()).astype(out_ref.dtype)


def _merge_call(o, lse, out_shape, *, num_splits, interpret):
    """Partials [B, K, J', M, H] and lse -> the output [B, T, N, H]."""
    B, K, splits, _, H = o.shape
    _, T, N, _ = out_shape.shape
    G = N // K
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits),
        grid=(B, K, T * G),  # one program per real row
        in_specs=[
            pl.BlockSpec((None, None, splits, None, H), lambda b, h, r: (b, h, 0, r, 0)),
            pl.BlockSpec((None, None, splits, None), lambda b, h, r: (b, h, 0, r)),
        ],
        out_specs=pl.BlockSpec((None, None, None, H), lambda b, h, r: (b, r // G, h * G + r % G, 0)),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="decode_attention_merge",
    )(o, lse)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _decode(q, k_cache, v_cache, start, *, scale, interpret, config):
    B, K, S = k_cache.shape[:3]
    num_splits = config.splits_for(B, K, S)
    out = _decode_call(
        q, k_cache, v_cache, start, scale=scale, num_splits=num_splits, config=config, interpret=interpret
    )
    if num_splits == 1:
        return out
    return _merge_call(*out, jax.ShapeDtypeStruct(q.shape, q.dtype), num_splits=num_splits, interpret=interpret)


def decode_attention(q, k_cache, v_cache, start, *, scale, interpret=False, **static_tuning):
    """Causal GQA attention of T (small) new tokens over a KV cache.

    q: [B, T, N, H], RoPE applied; k_cache, v_cache: [B, K, S, H] already
    holding the new tokens at start .. start + T - 1; start: [B] int32.
    static_tuning: fields of DecodeConfig. Returns [B, T, N, H] in q.dtype.
    """
    _common.check_shapes(q, k_cache, v_cache, start)
    return _decode(
        q,
        k_cache,
        v_cache,
        start.astype(jnp.int32),
        scale=float(scale),
        interpret=interpret,
        config=DecodeConfig.for_dtype(k_cache.dtype, **static_tuning),
    )
