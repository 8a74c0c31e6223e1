"""The residual add and the RMSNorm that follows it, in one Mosaic GPU kernel.

Same contract and rounding as pallas_kernels/add_rms_norm.py (the Triton kernel, which Pallas deprecates):
(x + delta, rms_norm(x + delta) * weight) for rows of hidden size D; the sum is rounded to x's dtype, the
norm taken in float32, cast back, then scaled (transformers' order, eagle3_jax.models.layers.rms_norm).

Structure: one CTA of one warpgroup (128 threads) per row. Each thread loads its strided share of the row
straight from global memory into registers (vectors of up to 16 bytes), the warpgroup sums the squares
through a few bytes of shared memory, and each thread stores its share of the two outputs. No TMA: a row
is a few kilobytes and one load of it is all the kernel reads, so a barrier-tracked copy would add
latency and nothing else. Every row is computed by a CTA of its own, so a row's result does not depend on
the number of rows (the exact decode needs this, eagle3_jax/models/kernels.py).

What it takes (unsupported says why not): jax 0.12 (plgpu.store), D a multiple of 128 (one warpgroup's
lanes; every Qwen3 hidden size, 1024 to 5120), and bf16, f16 or f32. The model takes it on Hopper only with
eagle3_jax.models.layers.MOSAIC_NORM_ON_HOPPER (off: slower than Triton's in a step's chain of calls), else the
Triton kernel.

Testing: the kernel runs in jax 0.12's Mosaic GPU interpreter on the CPU (tests/test_fused_kernels.py),
lowers for CUDA on a CPU host, and `pytest -m gpu` compares it with XLA on the H200.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common

_LANES = 128  # threads of the one warpgroup
_VECTOR_BYTES = 16  # the widest load a thread issues
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def unsupported(x, delta, weight) -> str | None:
    """Why this kernel cannot take these operands, or None when it can."""
    if not hasattr(plgpu, "store"):  # jax 0.11 has no register-to-GMEM store in Mosaic GPU
        return "needs jax 0.12's plgpu.store"
    D = x.shape[-1]
    if D % _LANES:
        return f"needs a hidden size that is a multiple of {_LANES}, got {D}"
    dtypes = {jnp.dtype(a.dtype) for a in (x, weight) + (() if delta is None else (delta,))}
    if len(dtypes) != 1 or dtypes.pop() not in _DTYPES:
        kinds = [str(a.dtype) for a in (x, delta, weight) if a is not None]
        return f"needs x, delta and weight all bf16, f16 or f32, got {', '.join(kinds)}"
    if x.size == 0:
        return f"needs at least one row, got x {x.shape}"
    return None


def vector_size(D: int, dtype) -> int:
    """Elements per thread load: the widest of 16 bytes and below that splits D across 128 lanes."""
    vec = _VECTOR_BYTES // jnp.dtype(dtype).itemsize
    while (D // _LANES) % vec:
        vec //= 2
    return vec


def _kernel(*refs, eps, with_delta):
    # x_ref, delta_ref (with_delta): [M, D]; w_ref: [D]; sum_ref (with_delta), normed_ref: [M, D]
    x_ref, delta_ref, w_ref, sum_ref, normed_ref = _common.norm_refs(refs, with_delta)
    D = x_ref.shape[1]
    layout = plgpu.Layout.WG_STRIDED((D,), vector_size(D, x_ref.dtype))
    row = lax.axis_index("rows")

    def load(ref):
        return plgpu.load(ref, layout=layout, optimized=True)

    w = load(w_ref)  # issued with the row's loads, not after the reduction's barrier
    x = load(x_ref.at[row])
    if with_delta:
        x = x + load(delta_ref.at[row])
        plgpu.store(sum_ref.at[row], x)
    x32 = x.astype(jnp.float32)
    inv_rms = lax.rsqrt(jnp.sum(x32 * x32) / D + eps)
    normed = w * (x32 * inv_rms).astype(x.dtype)
    plgpu.store(normed_ref.at[row], normed)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm(x, delta, weight, *, eps, interpret):
    M, D = x.shape
    with_delta = delta is not None
    out = jax.ShapeDtypeStruct((M, D), x.dtype)
    return plgpu.kernel(
        functools.partial(_kernel, eps=eps, with_delta=with_delta),
        out_type=(out, out) if with_delta else (out,),
        grid=(M,),
        grid_names=("rows",),
        kernel_name="add_rms_norm_mgpu",  # eagle3_jax_bench/profile.py groups kernels by name
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*((x, delta, weight) if with_delta else (x, weight)))


def add_rms_norm_mgpu(x, delta, weight, *, eps: float, interpret: bool = False):
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [..., D], weight [D], in Mosaic GPU.

    delta None: (x, rms_norm(x) * weight), the sum skipped. interpret: jax's Mosaic GPU interpreter
    (the CPU tests). Operands that unsupported refuses raise ValueError.
    """
    _common.check_norm_operands(x, delta, weight)
    if reason := unsupported(x, delta, weight):
        raise ValueError(f"Mosaic GPU add_rms_norm {reason}")
    kernel = functools.partial(_add_rms_norm, eps=float(eps), interpret=interpret)
    return _common.norm_over_rows(kernel, x, delta, weight)
