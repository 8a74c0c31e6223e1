"""Skinny matmuls for decode and verify: x [M, D] with few rows (M <= 64) times a weight [N, D].

At batch 1 a decode step is a chain of matrix-vector products. Each reads its
weight once and does 2 FLOPs per weight element, so its time is the weight's
bytes over HBM bandwidth. XLA's GEMM for a few rows splits D across thread
blocks and reduces the partial sums in a second kernel. This kernel does one
pass: one program per block of block_n weight rows walks D in block_k steps,
with Triton pipelining the weight tiles (num_stages deep) into tensor-core dots.

Rows go in tiles of 16, because Triton dots need at least 16 rows. A short
tile repeats its last row; the repeats are never stored. Every tile runs the
same instructions whatever M is, so a row's result does not depend on how many
rows ride along: the T = 1 decode step and the T = gamma + 1 verify step round
each row alike. All tiles share each weight tile, so the weight is read once.

Two optional fusions each remove a kernel and a round trip of the activation:
- norm_weight: the RMSNorm of x, rounded as transformers rounds it, is applied
  inside the kernel (each program recomputes the norm of the few rows from L2);
- gated: the weight is the fused [2 I, D] gate/up weight, and the kernel
  returns silu(x Wg^T) * (x Wu^T), [M, I], reading both halves in place.

Lowering: Pallas' Triton backend, like the attention kernels (see
pallas_kernels/__init__.py); interpret=True runs it on the CPU for the tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

ROW_TILE = 16  # rows per dot: Triton's minimum
MAX_ROWS = 64  # beyond this the rows' accumulators crowd the registers; use a GEMM


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Static tuning (see pallas_kernels/bench_matmul.py for the H200 sweep)."""

    block_n: int = 32  # weight rows per program (a power of 2 >= 16)
    block_k: int = 256  # columns per loop step (a power of 2 >= 16)
    num_warps: int = 4
    num_stages: int = 4
    # False: one row only, multiply-adds on the CUDA cores into a [block_n, block_k] accumulator
    # summed at the end, instead of tensor-core dots of 16-row tiles.
    dot: bool = True

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if not (_common.is_power_of_2(value) and value >= (16 if self.dot else 1)):
                raise ValueError(f"{name}={value} must be a power of 2 >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad {self.num_warps=} or {self.num_stages=}")

    def blocks_for(self, n: int, d: int) -> tuple[int, int]:
        """The largest power-of-2 blocks, at most the configured ones, dividing n and d."""
        return _largest_dividing_block(self.block_n, n), _largest_dividing_block(self.block_k, d)


def _largest_dividing_block(block: int, size: int) -> int:
    while size % block:
        block //= 2
    return block


def supports(rows: int, out_features: int, in_features: int) -> bool:
    """Whether skinny_matmul takes these shapes: few rows, features in multiples of 16."""
    return 1 <= rows <= MAX_ROWS and out_features % 16 == 0 and in_features % 16 == 0


def _inverse_rms(x_ref, rows, *, block_k, eps):
    """1 / sqrt(mean(x^2) + eps) of the given rows of x_ref [M, D], in float32."""
    D = x_ref.shape[1]

    def add_block(i, total):
        x = x_ref[rows[:, None], (i * block_k + jnp.arange(block_k))[None, :]].astype(jnp.float32)
        return total + (x * x).sum(axis=1)

    total = lax.fori_loop(0, D // block_k, add_block, jnp.zeros(rows.shape, jnp.float32))
    return lax.rsqrt(total / D + eps)


def _kernel(x_ref, *refs, block_k, num_tiles, gated, normed, eps, dot):
    # x_ref: [M, D] all rows; norm_ref (when normed): [D]
    # w_refs: [bn, D] this program's block of weight rows (gated: the gate
    #   block and the matching up block, I rows further down the same array)
    # o_ref: [M, bn] this program's output columns
    norm_ref = refs[0] if normed else None
    w_refs, o_ref = refs[int(normed) : -1], refs[-1]
    M, D = x_ref.shape
    bn = w_refs[0].shape[0]
    tiles = [t * ROW_TILE + jnp.arange(ROW_TILE) for t in range(num_tiles)]
    loaded = [jnp.minimum(rows, M - 1) for rows in tiles]  # repeats of the last row past M
    inv_rms = [_inverse_rms(x_ref, rows, block_k=block_k, eps=eps) for rows in loaded] if normed else None

    def step(i, accs):
        window = pl.ds(i * block_k, block_k)
        cols = i * block_k + jnp.arange(block_k)
        ws = [pltriton.load(w.at[:, window]) for w in w_refs]
        new = []
        for t, rows in enumerate(loaded):
            x = x_ref[rows[:, None], cols[None, :]]
            if normed:  # transformers: normalise in f32, cast back, then scale
                normed_x = (x.astype(jnp.float32) * inv_rms[t][:, None]).astype(x.dtype)
                x = pltriton.load(norm_ref.at[window])[None, :] * normed_x
            for j, w in enumerate(ws):
                acc = accs[t * len(ws) + j]
                new.append(acc + pltriton.dot(x, w, trans_b=True, precision=lax.Precision.HIGHEST))
        return tuple(new)

    if not dot:
        _one_row(x_ref, norm_ref, w_refs, o_ref, block_k=block_k, gated=gated, eps=eps)
        return
    zeros = jnp.zeros((ROW_TILE, bn), jnp.float32)
    accs = lax.fori_loop(0, D // block_k, step, (zeros,) * (num_tiles * len(w_refs)))
    for t, rows in enumerate(tiles):
        if gated:  # rounded like XLA's ops: bf16 matmul outputs, then silu(gate) * up
            gate, up = (a.astype(o_ref.dtype) for a in accs[2 * t : 2 * t + 2])
            sigmoid = 1 / (1 + jnp.exp(-gate.astype(jnp.float32)))  # in f32, as XLA computes bf16 logistic
            out = gate * sigmoid.astype(gate.dtype) * up
        else:
            out = accs[t]
        window = o_ref.at[rows[:, None], jnp.arange(bn)[None, :]]
        pltriton.store(window, out.astype(o_ref.dtype), mask=(rows < M)[:, None])


def _one_row(x_ref, norm_ref, w_refs, o_ref, *, block_k, gated, eps):
    """The CUDA-core path for a single row (see SkinnyConfig.dot)."""
    D = x_ref.shape[1]
    bn = w_refs[0].shape[0]
    row = jnp.zeros((1,), jnp.int32)
    inv_rms = _inverse_rms(x_ref, row, block_k=block_k, eps=eps)[0] if norm_ref is not None else None

    def step(i, accs):
        window = pl.ds(i * block_k, block_k)
        x = x_ref[0, window]
        if norm_ref is not None:
            x = pltriton.load(norm_ref.at[window]) * (x.astype(jnp.float32) * inv_rms).astype(x.dtype)
        x = x.astype(jnp.float32)[None, :]
        return tuple(acc + pltriton.load(w.at[:, window]).astype(jnp.float32) * x for acc, w in zip(accs, w_refs))

    zeros = jnp.zeros((bn, block_k), jnp.float32)
    sums = [acc.sum(axis=1) for acc in lax.fori_loop(0, D // block_k, step, (zeros,) * len(w_refs))]
    if gated:
        gate, up = (a.astype(o_ref.dtype) for a in sums)
        out = gate * (1 / (1 + jnp.exp(-gate.astype(jnp.float32)))).astype(gate.dtype) * up
    else:
        out = sums[0]
    o_ref[0, :] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("gated", "eps", "out_dtype", "config", "interpret"))
def _skinny(x, w, norm_weight, *, gated, eps, out_dtype, config, interpret):
    M, D = x.shape
    N = w.shape[0] // 2 if gated else w.shape[0]
    block_n, block_k = config.blocks_for(N, D)
    normed = norm_weight is not None
    in_specs = [pl.BlockSpec((M, D), lambda n: (0, 0))]
    operands = [x]
    if normed:
        in_specs.append(pl.BlockSpec((D,), lambda n: (0,)))
        operands.append(norm_weight)
    in_specs.append(pl.BlockSpec((block_n, D), lambda n: (n, 0)))
    operands.append(w)
    if gated:  # the up block of output block n sits N // block_n blocks below its gate block
        in_specs.append(pl.BlockSpec((block_n, D), lambda n: (n + N // block_n, 0)))
        operands.append(w)
    kernel = functools.partial(
        _kernel, block_k=block_k, num_tiles=pl.cdiv(M, ROW_TILE), gated=gated, normed=normed, eps=eps, dot=config.dot
    )
    return pl.pallas_call(
        kernel,
        grid=(N // block_n,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((M, block_n), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="skinny_matmul_gated" if gated else "skinny_matmul",
    )(*operands)


def skinny_matmul(
    x,
    w,
    *,
    norm_weight=None,
    eps: float = 1e-6,
    gated: bool = False,
    out_dtype=None,
    interpret: bool = False,
    **static_tuning,
):
    """x [..., D] times w [N, D] (transformers' [out, in]) -> [..., N], float32 accumulation.

    norm_weight [D]: multiply by RMSNorm(x) * norm_weight instead of x (epsilon eps).
    gated: w is [2 I, D], gate rows then up rows; returns silu(gate) * up, [..., I].
    out_dtype: defaults to x's dtype. static_tuning: fields of SkinnyConfig.
    The rows (the product of x's leading dimensions) must number at most MAX_ROWS.
    """
    *lead, D = x.shape
    M = 1
    for size in lead:
        M *= size
    N = w.shape[0] // 2 if gated else w.shape[0]
    if w.ndim != 2 or w.shape[1] != D or (gated and w.shape[0] % 2):
        raise ValueError(f"weight {w.shape} does not fit x {x.shape} (gated={gated})")
    if not supports(M, N, D):
        raise ValueError(f"skinny_matmul takes 1..{MAX_ROWS} rows and features in multiples of 16, got {M=} {N=} {D=}")
    if not SkinnyConfig(**static_tuning).dot and M != 1:
        raise ValueError(f"dot=False takes one row, got {M}")
    if norm_weight is not None and norm_weight.shape != (D,):
        raise ValueError(f"norm weight {norm_weight.shape} does not fit x {x.shape}")
    out = _skinny(
        x.reshape(M, D),
        w,
        norm_weight,
        gated=gated,
        eps=float(eps),
        out_dtype=jnp.dtype(out_dtype or x.dtype),
        config=SkinnyConfig(**static_tuning),
        interpret=interpret,
    )
    return out.reshape(*lead, N)
