"""The routed experts of a Qwen3-MoE layer for few rows (decode and verify), each routed expert's weights
streamed once, straight from the stored [E, 2I, D] / [E, D, I] arrays: no gathered copy of the weights.

Inputs come from the routing: `slots` [S] the distinct routed expert ids, padded at the end with E (no
expert); `count` [1] how many are real; `combine` [S, M] each row's routing weight on each slot (zero
where the row did not choose it). On the GPU there is no scalar prefetch into an index map, so the expert
ids are an input ref and each program indexes the weight ref with its expert id; the padded slots' programs
load nothing.

Two pallas_calls, neither with atomics:
  1. grid (slot, block of I): the program streams its expert's gate and up rows [block_i, D] once and
     writes SwiGLU(x gate^T, x up^T) for every row: h [S, M, I] in x's dtype (a few KiB per slot; the
     SwiGLU in float32, rounded once, where the gathered path rounds gate and up first; half the shared memory
     of float32 in stage 2's pipeline).
  2. grid (block of D, group of slots): the program walks its group's real slots in order, streams each
     expert's down rows [block_d, I] once and accumulates (combine[s, m] h[s, m]) down^T in float32 for
     every row. One group (down_groups=1) keeps the sum over experts inside one program and writes y in x's
     dtype; more groups write float32 partial sums [G, M, D] that XLA adds (a few MiB at most), so that a
     step of few experts still has G x D / block_d programs to spread its weights over the GPU's SMs (with
     one group, 128 programs each walk all 8 experts of a token: an H200 measured the down stage, a third of
     the bytes, at 25 us against the gate/up stage's 15 us).
Every row is multiplied by every slot's expert (a row's zero combine weight drops the ones it did not
choose): M x S rows of a matvec, free while a step of few rows is bound by the weights' bytes.

Rows are padded to a power of 2 of at least 16 (Triton's smallest tensor-core tile), and every dimension to
its blocks, by masked loads (zeros, no memory traffic) and stores. Lowering: Pallas' Triton backend, like
the other decode kernels (pallas_kernels/__init__.py); interpret=True runs it on the CPU for the tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

# Rows per call: a program holds every row's tile in registers / shared memory, and past this many rows the
# tiled batched GEMMs (eagle3_jax.models.moe.experts_tiled), which multiply each expert by its own rows only,
# do less work.
MAX_ROWS = 64
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """Static tuning (each block a power of 2 >= 16, capped at its dimension rounded up to a power of 2)."""

    block_i: int = 32  # stage 1: intermediate columns (gate and up rows each) per program
    block_d: int = 16  # stage 2: output columns (down rows) per program
    block_k: int = 256  # columns of the contracted dimension per loop step, both stages
    down_groups: int = 8  # stage 2: groups the slots are split into (capped at the slots), each its programs
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_i", "block_d", "block_k"):
            value = getattr(self, name)
            if not (_common.is_power_of_2(value) and value >= 16):
                raise ValueError(f"{name}={value} must be a power of 2 >= 16")
        if self.down_groups < 1:
            raise ValueError(f"down_groups={self.down_groups} must be >= 1")


def unsupported(rows: int, dtype) -> str | None:
    """Why the kernel cannot take these shapes (None when it can): the caller falls back or refuses."""
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (the expert kernel takes 1 to {MAX_ROWS})"
    if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
        return f"dtype {jnp.dtype(dtype).name} (the expert kernel takes bfloat16, float16, float32)"
    return None


def _row_window(rows: int):
    """Rows 0 .. rows - 1, past M masked on load and store. The start is a traced value so that the window may
    overhang M (a static window past the end is refused at trace time)."""
    return pl.ds(jnp.int32(0), rows)


def _window(i, block: int, n: int):
    """Block i of `block` indices along a dimension of n, and which of them are < n (loaded, stored)."""
    return pl.ds(i * block, block), i * block + jnp.arange(block) < n


def _block(block: int, n: int) -> int:
    """A tuning's block, capped at n rounded up to a power of 2 (and at least 16, Triton's smallest dot)."""
    return min(block, max(16, _common.next_power_of_2(n)))


def _gate_up_kernel(slots_ref, count_ref, x_ref, w_ref, h_ref, *, rows, block_i, block_k, precision):
    # x_ref [M, D]; w_ref [E, 2I, D] whole; h_ref [S, M, I] whole
    s, j = pl.program_id(0), pl.program_id(1)
    M, D = x_ref.shape
    I = h_ref.shape[2]
    row, in_rows = _row_window(rows), (jnp.arange(rows) < M)[:, None]
    out_cols, in_i = _window(j, block_i, I)

    @pl.when(s < count_ref[0])
    def _():
        e = slots_ref[s]
        up_rows = pl.ds(I + j * block_i, block_i)

        def step(k, carry):
            acc_g, acc_u = carry
            cols, in_k = _window(k, block_k, D)
            x = pltriton.load(x_ref.at[row, cols], mask=in_rows & in_k[None, :], other=jnp.zeros((), x_ref.dtype))
            zero, mask = jnp.zeros((), w_ref.dtype), in_i[:, None] & in_k[None, :]
            g = pltriton.load(w_ref.at[e, out_cols, cols], mask=mask, other=zero)
            u = pltriton.load(w_ref.at[e, up_rows, cols], mask=mask, other=zero)
            acc_g += pltriton.dot(x, g, trans_b=True, precision=precision)
            acc_u += pltriton.dot(x, u, trans_b=True, precision=precision)
            return acc_g, acc_u

        zeros = jnp.zeros((rows, block_i), jnp.float32)
        g, u = lax.fori_loop(0, pl.cdiv(D, block_k), step, (zeros, zeros))
        h = g / (1.0 + jnp.exp(-g)) * u
        pltriton.store(h_ref.at[s, row, out_cols], h.astype(h_ref.dtype), mask=in_rows & in_i[None, :])


def _down_kernel(slots_ref, count_ref, combine_ref, h_ref, w_ref, o_ref, *, rows, block_d, block_k, group,
                 precision):
    # combine_ref [S, M]; h_ref [S, M, I]; w_ref [E, D, I] whole; o_ref [G, M, D] whole (this group's sum)
    _, M, D = o_ref.shape
    I = h_ref.shape[2]
    row, in_rows = _row_window(rows), jnp.arange(rows) < M
    out_cols, in_d = _window(pl.program_id(0), block_d, D)
    g = pl.program_id(1)
    first = g * group
    steps = pl.cdiv(I, block_k)

    # One loop over this group's (slot, K step) pairs, so Triton pipelines the weight loads across experts
    # too; each row's activations are scaled by its combine weight before the dot (the sum is linear).
    def step(i, acc):
        # i >= 0: no sign fix-up (jnp's //, %); one slot a group: the slot is a loop invariant
        s = first if group == 1 else first + lax.div(i, jnp.int32(steps))
        cols, in_k = _window(lax.rem(i, jnp.int32(steps)), block_k, I)
        h = pltriton.load(h_ref.at[s, row, cols], mask=in_rows[:, None] & in_k[None, :],
                          other=jnp.zeros((), h_ref.dtype))
        weight = pltriton.load(combine_ref.at[s, row], mask=in_rows, other=jnp.zeros((), combine_ref.dtype))
        w = pltriton.load(w_ref.at[slots_ref[s], out_cols, cols], mask=in_d[:, None] & in_k[None, :],
                          other=jnp.zeros((), w_ref.dtype))
        h = (h.astype(jnp.float32) * weight.astype(jnp.float32)[:, None]).astype(w.dtype)
        return acc + pltriton.dot(h, w, trans_b=True, precision=precision)

    real = jnp.clip(count_ref[0] - first, 0, group)  # the group's real slots (padded ones: none, zeros out)
    acc = lax.fori_loop(0, real * steps, step, jnp.zeros((rows, block_d), jnp.float32))
    pltriton.store(o_ref.at[g, row, out_cols], acc.astype(o_ref.dtype), mask=in_rows[:, None] & in_d[None, :])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _experts(x, combine, slots, count, w_gate_up, w_down, *, config, interpret):
    M, D = x.shape
    S = slots.shape[0]
    I = w_down.shape[2]
    rows = max(16, _common.next_power_of_2(M))
    block_i, block_d = _block(config.block_i, I), _block(config.block_d, D)
    # float32 operands: IEEE products (the GPU's default for a float32 dot is TF32).
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    params = pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, rows=rows, block_i=block_i, block_k=_block(config.block_k, D),
                          precision=precision),
        grid=(S, pl.cdiv(I, block_i)),
        out_shape=jax.ShapeDtypeStruct((S, M, I), x.dtype),
        compiler_params=params, interpret=interpret, name="moe_gate_up",
    )(slots, count, x, w_gate_up)
    group = pl.cdiv(S, min(config.down_groups, S))  # slots per group; then no group is empty by shape
    groups = pl.cdiv(S, group)
    y = pl.pallas_call(
        functools.partial(_down_kernel, rows=rows, block_d=block_d, block_k=_block(config.block_k, I),
                          group=group, precision=precision),
        grid=(pl.cdiv(D, block_d), groups),
        out_shape=jax.ShapeDtypeStruct((groups, M, D), x.dtype if groups == 1 else jnp.float32),
        compiler_params=params, interpret=interpret, name="moe_down",
    )(slots, count, combine, h, w_down)
    return y[0] if groups == 1 else jnp.sum(y, axis=0).astype(x.dtype)


def moe_experts(x, combine, slots, count, w_gate_up, w_down, *, interpret: bool = False, **static_tuning):
    """x [M, D], combine [S, M], slots [S] int32 (distinct expert ids, then E), count [1] int32 (real slots),
    w_gate_up [E, 2I, D], w_down [E, D, I] -> sum over slots of combine * expert(x): [M, D] in x's dtype.
    Shapes the kernel cannot take raise ValueError naming them (`unsupported` says so without raising).
    static_tuning: fields of ExpertsConfig."""
    M, D = x.shape
    E, I2, D2 = w_gate_up.shape
    I = I2 // 2
    if (D2, w_down.shape) != (D, (E, D, I)) or combine.shape != (slots.shape[0], M) or count.shape != (1,):
        raise ValueError(f"shapes do not fit: x {x.shape}, combine {combine.shape}, slots {slots.shape}, "
                         f"count {count.shape}, w_gate_up {w_gate_up.shape}, w_down {w_down.shape}")
    reason = unsupported(M, x.dtype)
    if reason:
        raise ValueError(f"moe_experts cannot take {reason}")
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"x is {x.dtype} but the weights are {w_gate_up.dtype} / {w_down.dtype}")
    return _experts(x, combine, slots.astype(jnp.int32), count.astype(jnp.int32), w_gate_up, w_down,
                    config=ExpertsConfig(**static_tuning), interpret=interpret)
