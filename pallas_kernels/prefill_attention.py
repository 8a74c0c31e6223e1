"""Causal GQA flash attention for prefill (large T), also onto a cache prefix.

One program per (query tile, KV head h, batch row b). A tile is block_q rows
t * G + g (see _common), so the G query heads of h share each K/V block it
loads. Keys every row of the tile sees (below start + its first token + 1)
run through an unmasked loop; the diagonal blocks run through a masked one.
Tiles are launched longest first. One kernel launch per call.

On the GPU the model prefers prefill_attention_mgpu (Mosaic GPU, 1.46x faster
at 8k tokens); this kernel runs where that one cannot: in Pallas's interpreter
on the CPU (the tests), on GPUs other than Hopper, on float32, on sizes it does
not take. See the package docstring (pallas_kernels/__init__.py).
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
class PrefillConfig:
    block_q: int = 128  # rows (tokens x heads of a group) per program
    block_k: int = 64  # keys per loop step
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def for_dtype(cls, dtype, **tuning) -> "PrefillConfig":
        """The defaults for operands of this dtype, then the given fields: with 4-byte (float32) operands
        the query tile and 3 stages of 64-key K/V tiles ask for 272 KB of shared memory, over Hopper's
        227 KB per block, so each K/V step takes 32 keys."""
        defaults = {"block_k": 32} if jnp.dtype(dtype).itemsize > 2 else {}
        return cls(**{**defaults, **tuning})

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not (_common.is_power_of_2(size) and size >= 16):
                raise ValueError(f"{name}={size} must be a power of 2 >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad {self.num_warps=} or {self.num_stages=}")


def _prefill_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, scale, block_q, block_k, num_tiles):
    # start_ref: [B] int32, cache length before this step
    # q_ref: [T, G, H] the queries of KV head h's G query heads, row b
    # k_ref, v_ref: [S, H] this (b, h)'s cache; read only below start + T
    # o_ref: [T, G, H] q.dtype; this program writes its tile's rows
    T, G, H = q_ref.shape
    tile = num_tiles - 1 - pl.program_id(0)  # longest tiles launch first
    start = start_ref[pl.program_id(2)]
    # Rows past capacity (start + T > S) are don't-care: clamp, never read OOB.
    length = jnp.minimum(start + T, k_ref.shape[0])
    rows = tile * block_q + jnp.arange(block_q)
    last_key = start + _common.token_of(rows, T, G)  # [BQ]
    # Keys every row of the tile sees run unmasked, in whole blocks.
    num_full = jnp.minimum(start + tile * block_q // G + 1, length) // block_k
    last_row = jnp.minimum(tile * block_q + block_q, T * G) - 1
    num_blocks = pl.cdiv(jnp.minimum(start + last_row // G + 1, length), block_k)
    q = _common.gather_rows(q_ref, rows)
    full = functools.partial(_common.full_kv_step, q, k_ref, v_ref, block_k=block_k, scale=scale)
    carry = lax.fori_loop(0, num_full, full, _common.init_carry(block_q, H))
    masked = functools.partial(
        _common.masked_kv_step, q, k_ref, v_ref, block_k=block_k, length=length, last_key=last_key, scale=scale
    )
    acc, _, l = lax.fori_loop(num_full, num_blocks, masked, carry)
    # Every row sees key 0, so l > 0.
    _common.scatter_rows(o_ref, rows, acc / l[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _prefill(q, k_cache, v_cache, start, *, scale, interpret, config):
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    num_tiles = -(-T * G // config.block_q)
    kernel = functools.partial(
        _prefill_kernel, scale=scale, block_q=config.block_q, block_k=config.block_k, num_tiles=num_tiles
    )
    # Every tile of (b, h) maps q and the output's whole [T, G, H] block; the
    # kernel gathers and scatters its rows. The tile axis varies fastest so the
    # tiles of one head run together and share its K/V in L2.
    row_spec = pl.BlockSpec((None, T, G, H), lambda i, h, b: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, None, S, H), lambda i, h, b: (b, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, K, B),
        in_specs=[pl.BlockSpec((B,), lambda i, h, b: (0,)), row_spec, kv_spec, kv_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(start, q, k_cache, v_cache)


def prefill_attention(q, k_cache, v_cache, start, *, scale, interpret=False, **static_tuning):
    """Causal GQA attention of T new tokens (a prompt) over a KV cache.

    Same contract as decode_attention, tuned for large T; start may be > 0
    (a prompt appended to a cache). static_tuning: fields of PrefillConfig.
    """
    _common.check_shapes(q, k_cache, v_cache, start)
    return _prefill(
        q,
        k_cache,
        v_cache,
        start.astype(jnp.int32),
        scale=float(scale),
        interpret=interpret,
        config=PrefillConfig.for_dtype(k_cache.dtype, **static_tuning),
    )
