"""Decode/verify attention whose result for a query does not depend on how many tokens (T) or rows (B)
share the call: the attention of `Engine(exact=True)`.

A split-K kernel that divides the keys in use, [0, start + T), evenly over a number of splits chosen from
the work (as the ragged paged kernel does from its rows and keys) sums the same query's keys in other groups
when it is computed alone (decode, T = 1), as token t of a verify (T = gamma + 1) or at another batch size,
and rounds apart. Here the partition is a
function of the query's own position p alone: its p // block_k + 1 key blocks are split into
min(blocks, max_splits) contiguous runs (run j holds blocks [j n / J, (j + 1) n / J)), each run is one
online softmax over its blocks in order, and the runs are merged in split order. A program (b, KV head h,
row tile, split j) walks the union of its rows' runs j; a block outside a row's own run, or keys past its
position, are masked to -inf for that row, which leaves its running max, sum and output exactly as they
were (exp(-inf) = 0, alpha = exp(0) = 1). Query rows (t * G + g, as in _common) are gathered into tiles
of a fixed `rows` count, padded, so every dot and row reduction has the same shape whatever T. Every
split goes through the merge kernel, one program per output row, which reads only that row's runs.

The cost against a split-K kernel: short rows split into many one-block runs at every batch size (such a
kernel stops splitting once the batch fills the GPU), so a wide batch writes and merges partial outputs that
it skips; measured in BENCHMARKS.md.

Lowering: Pallas' Triton backend (see pallas_kernels/__init__.py). The engine gathers each row's pages into
the contiguous caches this kernel reads (eagle3_jax/models/paged_attention.py).
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
class InvariantConfig:
    """Static tuning; none of it may depend on T or B."""

    block_k: int = 128  # keys per loop step (a power of 2, >= 16)
    max_splits: int = 16  # runs per query at most (a long context's keys in 16 runs)
    rows: int = 32  # query rows per program (a power of 2 >= 16): Qwen3's 4 heads per KV head x 8 tokens
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_k", "rows"):
            value = getattr(self, name)
            if not (_common.is_power_of_2(value) and value >= 16):
                raise ValueError(f"{name}={value} must be a power of 2 >= 16")
        if self.max_splits < 1:
            raise ValueError(f"{self.max_splits=} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad {self.num_warps=} or {self.num_stages=}")

    @classmethod
    def for_dtype(cls, dtype, **tuning) -> "InvariantConfig":
        """4-byte K/V take 64-key blocks to fit Hopper's shared memory."""
        defaults = {"block_k": 64} if jnp.dtype(dtype).itemsize > 2 else {}
        return cls(**{**defaults, **tuning})


def runs(last_key, capacity: int, *, block_k: int, max_splits: int):
    """For queries at positions last_key (clamped below capacity): (their block count n, their run count J)."""
    blocks = jnp.minimum(last_key, capacity - 1) // block_k + 1
    return blocks, jnp.minimum(blocks, max_splits)


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, config):
    # start_ref: [B] int32 cache length before this step; q_ref: [T, G, H] row b, KV head h's query heads
    # k_ref, v_ref: [S, H] this (b, h)'s cache, read only below start + T
    # o_ref: [R, H] f32 this tile's normalised output of run j; lse_ref: [R] f32 its log-sum-exp
    T, G, H = q_ref.shape
    S = k_ref.shape[0]
    R, bk = config.rows, config.block_k
    b, tile, split = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    start = start_ref[b]
    rows = tile * R + jnp.arange(R)
    real = rows < T * G
    last_key = jnp.minimum(start + _common.token_of(rows, T, G), S - 1)  # past capacity: don't-care rows
    blocks, num_runs = runs(last_key, S, block_k=bk, max_splits=config.max_splits)
    mine = real & (split < num_runs)
    lo_r = jnp.where(mine, split * blocks // num_runs, jnp.iinfo(jnp.int32).max)
    hi_r = jnp.where(mine, (split + 1) * blocks // num_runs, 0)
    lo, hi = lo_r.min(), hi_r.max()
    length = jnp.minimum(start + T, S)
    q = _common.gather_rows(q_ref, rows)

    def step(i, carry):
        keys = i * bk + jnp.arange(bk)
        in_use = keys < length
        window = pl.ds(i * bk, bk)
        k = pltriton.load(k_ref.at[window, :], mask=in_use[:, None], other=jnp.zeros((), k_ref.dtype))
        v = pltriton.load(v_ref.at[window, :], mask=in_use[:, None], other=jnp.zeros((), v_ref.dtype))
        in_run = (i >= lo_r) & (i < hi_r)
        visible = (keys[None, :] <= last_key[:, None]) & in_use[None, :] & in_run[:, None]
        return _common.online_softmax_step(carry, _common.qk_logits(q, k, scale), v, visible)

    @pl.when(lo < hi)  # a split no row of the tile has: nothing to write, and the merge never reads it
    def _():
        acc, m, l = lax.fori_loop(lo, hi, step, _common.init_carry(R, H))
        written = real & (split < num_runs)
        pltriton.store(o_ref, acc / jnp.where(l > 0, l, 1.0)[:, None], mask=written[:, None])
        pltriton.store(lse_ref, m + jnp.log(l), mask=written)


def _merge_kernel(start_ref, o_ref, lse_ref, out_ref, *, num_tokens, group, capacity, config):
    # o_ref: [J', H] f32 one row's run outputs; lse_ref: [J'] their log-sum-exps; out_ref: [H] the row's output.
    # Only the row's own runs are read (the others were never written for it).
    b, r = pl.program_id(0), pl.program_id(2)
    last_key = start_ref[b] + jnp.minimum(r // group, num_tokens - 1)
    _, num_runs = runs(last_key, capacity, block_k=config.block_k, max_splits=config.max_splits)
    used = jnp.arange(lse_ref.shape[0]) < num_runs
    lse = pltriton.load(lse_ref, mask=used, other=-jnp.inf)
    w = jnp.exp(lse - lse.max())  # run 0 holds key 0, which every query sees: the max is finite
    o = pltriton.load(o_ref, mask=used[:, None], other=0.0)
    out_ref[...] = ((w[:, None] * o).sum(axis=0) / w.sum()).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _invariant(q, k_cache, v_cache, start, *, scale, interpret, config):
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G, R = N // K, config.rows
    tiles = pl.cdiv(T * G, R)
    splits = _common.next_power_of_2(config.max_splits)  # the merge loads a power-of-2 vector of runs
    params = pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    o, lse = pl.pallas_call(
        functools.partial(_kernel, scale=scale, config=config),
        grid=(B, K, tiles, config.max_splits),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, i, j: (0,)),
            pl.BlockSpec((None, T, G, H), lambda b, h, i, j: (b, 0, h, 0)),
            pl.BlockSpec((None, None, S, H), lambda b, h, i, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, H), lambda b, h, i, j: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, R, H), lambda b, h, i, j: (b, h, j, i, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, i, j: (b, h, j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, splits, tiles * R, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, tiles * R), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="invariant_attention",
    )(start, q, k_cache, v_cache)
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_tokens=T, group=G, capacity=S, config=config),
        grid=(B, K, T * G),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, r: (0,)),
            pl.BlockSpec((None, None, splits, None, H), lambda b, h, r: (b, h, 0, r, 0)),
            pl.BlockSpec((None, None, splits, None), lambda b, h, r: (b, h, 0, r)),
        ],
        out_specs=pl.BlockSpec((None, None, None, H), lambda b, h, r: (b, r // G, h * G + r % G, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="invariant_attention_merge",
    )(start, o, lse)


def invariant_attention(q, k_cache, v_cache, start, *, scale, interpret=False, **static_tuning):
    """Decode/verify attention (q [B, T, N, H] with RoPE applied; caches [B, K, S, H] already holding
    the T new tokens at start .. start + T - 1; start [B] int32; returns [B, T, N, H] in q.dtype), with
    each query's result independent of T and B. static_tuning: fields of InvariantConfig."""
    _common.check_shapes(q, k_cache, v_cache, start)
    return _invariant(q, k_cache, v_cache, start.astype(jnp.int32), scale=float(scale), interpret=interpret,
                      config=InvariantConfig.for_dtype(k_cache.dtype, **static_tuning))
