"""x [M, K] times a weight stored as [N, K], for few rows (decode and verify: M = batch x tokens), with a
result for each row that does not depend on M.

Why: a decode step (one row per sequence) and a verify step (gamma + 1 rows per sequence) must give the
same hidden state for the same position, bit for bit, or greedy speculative output can leave spec-off
output at near-ties in 16-bit (BENCHMARKS.md, "Losslessness and bf16"). XLA picks a row reduction for one
row, a GEMM with a row-dependent tiling (and split-K) for more, so the rounding depends on M. Here every
output element is computed the same way whatever M: rows are padded to tiles of ROW_TILE (16, the
smallest tensor-core dot Triton emits), each tile is its own dot of the same shape, and the K loop runs
in one fixed order with one accumulator per tile; there is no split-K. Row m's result depends only on
x[m] and the weight.

Tunings: on the GPU, where Triton walks K in the tensor cores' 16-wide steps into one accumulator, a row's
bits do not depend on the tuning either: an H200 probe (jax 0.11.2, bf16, Qwen3-8B's q/k/v, o, gate/up and
down weights at 1, 8, 32 and 64 rows) found every block_n, block_k, num_warps and num_stages it tried
bit-identical to the default, and tests/test_exact_gpu.py checks the rows of the tuned calls against each
other. So a call takes the tuning measured fastest for its row count (`row_tuning`). The interpreter (the
CPU tests) adds each block_k chunk's product separately, so there one tuning serves every row count.

One program per block of `block_n` weight rows: it streams its [block_n, K] slab once, block_k columns at
a time, and multiplies each slab tile into every row tile, so the weight is read once for all the rows of
a call (up to MAX_ROWS).
Rows past M are masked off on load (zeros, no memory traffic) and on store.

Lowering: Pallas' Triton backend, like the attention kernels (see pallas_kernels/__init__.py);
interpret=True runs it on the CPU for the tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

ROW_TILE = 16  # rows per dot: Triton's smallest tensor-core tile
# Rows per call: a program holds every row tile of a K step in shared memory, (rows + block_n) x block_k
# elements per pipeline stage, so the rows are bounded. More rows take further calls, each row computed as in
# any other call, each call reading the weight again (a verify of more than 64 rows pays the weight's bytes
# more than once). Triton keeps num_stages - 1 = 3 stages in flight: with 64 rows that is 192 KiB, inside
# Hopper's 227 KiB, in bf16 (block_k 256) and in float32 (block_k 128); float32 at block_k 256 asked the H200
# for 288 KiB and was refused.
MAX_ROWS = 64
SHARED_BYTES = 232448  # what the H200 offers one program (its refusals quote it)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Static tuning (see the module docstring for why, on the GPU, it may depend on the row count)."""

    block_n: int = 64  # weight rows per program (a power of 2 >= 16; halved until it divides N)
    block_k: int = 256  # columns per loop step (a power of 2 >= 16; capped at K rounded up to a power of 2)
    num_warps: int = 4
    num_stages: int = 4  # Triton's software pipelining depth over the K loop

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if not (_common.is_power_of_2(value) and value >= 16):
                raise ValueError(f"{name}={value} must be a power of 2 >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad {self.num_warps=} or {self.num_stages=}")

    @classmethod
    def for_weight(cls, n: int, k: int, itemsize: int = 2, **tuning) -> "SkinnyConfig":
        """The defaults for an [n, k] weight of itemsize-byte elements, then the given fields. Narrow weights
        (n <= 8192) take 32-row blocks so that their programs fill the H200's 132 SMs (4096 / 32 = 128
        programs); 4-byte elements take half the columns per step (shared memory, see MAX_ROWS)."""
        defaults = {"block_n": 32} if n <= 8192 else {}
        if itemsize > 2:
            defaults["block_k"] = 128
        return cls(**{**defaults, **tuning})


def row_tuning(n: int, k: int, itemsize: int, rows: int) -> dict:
    """The fields the GPU takes for an [n, k] weight at `rows` rows (one call: at most MAX_ROWS), over
    SkinnyConfig.for_weight's defaults. From the H200 sweep (`python -m eagle3_jax_bench.exact --sections
    matmul --tunings ...`, BENCHMARKS.md table (j)): up to 16 rows the defaults are fastest; from 17 rows
    wider weight blocks, which re-read the rows less often (each program reads every row), win, and long
    rows (down, K 12288) take longer K steps instead. 4-byte elements keep the defaults: wider blocks do
    not fit Hopper's shared memory at 32 rows and up (see MAX_ROWS)."""
    if itemsize != 2 or rows <= 16:
        return {}
    if rows <= 32:
        tuning = {"block_k": 512} if k > 8192 else {"block_n": 128, "block_k": 128}
    elif k > 8192:
        tuning = {"block_k": 128}
    else:
        tuning = {"block_n": 256, "block_k": 64} if n > 8192 else {"block_n": 64}
    fits = shared_bytes(SkinnyConfig.for_weight(n, k, itemsize, **tuning), n, k, itemsize, rows) <= SHARED_BYTES
    return tuning if fits else {}


def shared_bytes(config: SkinnyConfig, n: int, k: int, itemsize: int, rows: int) -> int:
    """The shared memory a call asks for: every row tile and the weight block of a K step, for each of the
    num_stages - 1 steps in flight (the H200's refusals of larger tunings matched this count)."""
    block_n, block_k = _blocks(config, n, k)
    return (pl.cdiv(rows, ROW_TILE) * ROW_TILE + block_n) * block_k * itemsize * (config.num_stages - 1)


def _blocks(config: SkinnyConfig, n: int, k: int) -> tuple[int, int]:
    """The block_n and block_k a call runs: block_n halved until it divides n, block_k capped at k's power of 2."""
    block_n = config.block_n
    while n % block_n:
        block_n //= 2
    return block_n, min(config.block_k, _common.next_power_of_2(k))


def _kernel(x_ref, w_ref, o_ref, *, block_k, precision):
    # x_ref: [M, K] every row; w_ref: [bn, K] this program's weight rows; o_ref: [M, bn]
    M, K = x_ref.shape
    bn = w_ref.shape[0]
    tiles = pl.cdiv(M, ROW_TILE)
    rows = jnp.arange(ROW_TILE)
    cols = jnp.arange(block_k)

    def step(i, accs):
        window = pl.ds(i * block_k, block_k)
        in_k = (i * block_k + cols) < K
        w = pltriton.load(w_ref.at[:, window], mask=in_k[None, :], other=jnp.zeros((), w_ref.dtype))
        out = []
        for t, acc in enumerate(accs):
            x = pltriton.load(x_ref.at[_row_window(t), window], mask=(t * ROW_TILE + rows < M)[:, None] & in_k[None, :],
                              other=jnp.zeros((), x_ref.dtype))
            out.append(acc + pltriton.dot(x, w, trans_b=True, precision=precision))
        return tuple(out)

    init = tuple(jnp.zeros((ROW_TILE, bn), jnp.float32) for _ in range(tiles))
    accs = lax.fori_loop(0, pl.cdiv(K, block_k), step, init)
    for t, acc in enumerate(accs):
        pltriton.store(o_ref.at[_row_window(t), :], acc.astype(o_ref.dtype), mask=(t * ROW_TILE + rows < M)[:, None])


def _row_window(tile: int):
    """Rows of one tile. The start is a traced value so that the last tile may overhang M (a static window
    past the end is refused at trace time); the loads and stores mask the rows past M."""
    return pl.ds(jnp.int32(tile * ROW_TILE), ROW_TILE)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _skinny(x, w, *, out_dtype, config, interpret):
    M, K = x.shape
    N = w.shape[0]
    block_n, block_k = _blocks(config, N, K)
    # float32 operands: IEEE products (the GPU's default for a float32 dot is TF32).
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, precision=precision),
        grid=(N // block_n,),
        in_specs=[pl.BlockSpec((M, K), lambda n: (0, 0)), pl.BlockSpec((block_n, K), lambda n: (n, 0))],
        out_specs=pl.BlockSpec((M, block_n), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)


def skinny_matmul(x, w, *, out_dtype=None, interpret: bool = False, **static_tuning):
    """x [..., K] @ w.T for w [N, K] (transformers' [out, in]) -> [..., N] in out_dtype (default: x and w's
    result type), accumulated in float32. Every row's result is the same whatever the number of rows.
    static_tuning: fields of SkinnyConfig (defaults from the weight's shape and, on the GPU, each call's
    row count: `row_tuning`)."""
    N, K = w.shape
    if x.shape[-1] != K or x.size == 0:
        raise ValueError(f"x {x.shape} does not fit weight {w.shape}, or has no rows")
    if N % 16 or K < 16:
        raise ValueError(f"weight {w.shape}: N must be a multiple of 16 and K >= 16 (Triton block shapes)")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {w.dtype}")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, w))
    flat = x.reshape(-1, K)
    parts = []
    for i in range(0, flat.shape[0], MAX_ROWS):
        rows = flat[i:i + MAX_ROWS]
        by_rows = {} if interpret else row_tuning(N, K, w.dtype.itemsize, rows.shape[0])
        config = SkinnyConfig.for_weight(N, K, w.dtype.itemsize, **{**by_rows, **static_tuning})
        parts.append(_skinny(rows, w, out_dtype=out_dtype, config=config, interpret=interpret))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return out.reshape(*x.shape[:-1], N)


def skinny_matmul_reference(x, w, *, out_dtype=None):
    """The same product in plain jnp: float32 products and sums."""
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, w))
    out = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype)
