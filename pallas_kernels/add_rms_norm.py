"""The residual add and the RMSNorm that follows it, in one kernel.

Between the matmuls of a decoder layer, XLA runs `x + delta`, the mean of
squares and the scaling as three kernels, twice per layer. At batch 1 each is
a few kilobytes of work and costs about 1.4 us of GPU time, mostly its own
start-up: 3 x 2 x 36 of them are 0.3 ms of a Qwen3-8B decode step. This kernel
does the three in one pass: one program per row, the whole row in registers.
16 warps per program: at hidden 4096 on the H200 a call took 1.52 us against
1.67 us with 4 warps (batch 1; 1.62 against 1.70 at batch 32; BENCHMARKS.md).

Rounding follows transformers (and eagle3_jax.models.layers.rms_norm): the sum is
rounded to x's dtype; the norm is taken in float32, cast back, then scaled.

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


def _kernel(*refs, eps, with_delta):
    # x_ref, delta_ref (with_delta): [D] one row; w_ref: [D]
    # sum_ref (with_delta): [D] x + delta; normed_ref: [D]
    x_ref, delta_ref, w_ref, sum_ref, normed_ref = _common.norm_refs(refs, with_delta)
    D = x_ref.shape[0]
    # Triton vectors have power-of-2 lengths. The columns index the row as an array (a gather that the mask
    # keeps inside it): a static slice wider than the row is refused by jax's bounds check.
    cols = jnp.arange(_common.next_power_of_2(D))
    in_row = cols < D
    window = cols
    x = pltriton.load(x_ref.at[window], mask=in_row, other=0)
    if with_delta:
        x = x + pltriton.load(delta_ref.at[window], mask=in_row, other=0)
        pltriton.store(sum_ref.at[window], x, mask=in_row)
    x32 = x.astype(jnp.float32)
    inv_rms = lax.rsqrt((x32 * x32).sum() / D + eps)
    w = pltriton.load(w_ref.at[window], mask=in_row, other=0)
    pltriton.store(normed_ref.at[window], w * (x32 * inv_rms).astype(x.dtype), mask=in_row)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm(x, delta, weight, *, eps, interpret):
    M, D = x.shape
    row = pl.BlockSpec((None, D), lambda m: (m, 0))
    with_delta = delta is not None
    operands = (x, delta, weight) if with_delta else (x, weight)
    out = jax.ShapeDtypeStruct((M, D), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, with_delta=with_delta),
        grid=(M,),
        in_specs=[row] * (len(operands) - 1) + [pl.BlockSpec((D,), lambda m: (0,))],
        out_specs=[row, row] if with_delta else [row],
        out_shape=[out, out] if with_delta else [out],
        compiler_params=pltriton.CompilerParams(num_warps=16, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*operands)


def add_rms_norm(x, delta, weight, *, eps: float, interpret: bool = False):
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [..., D], weight [D].

    delta None: (x, rms_norm(x) * weight), the sum skipped.
    """
    _common.check_norm_operands(x, delta, weight)
    kernel = functools.partial(_add_rms_norm, eps=float(eps), interpret=interpret)
    return _common.norm_over_rows(kernel, x, delta, weight)

