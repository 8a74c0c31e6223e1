"""One row times a weight, x [D] @ w[N, D]^T, in one kernel: the batch-1 decode step's o, down and q/k/v
projections.

For one row XLA's GEMM splits D across thread blocks and adds the partial sums in a second kernel
(a "split-K" reduce), which cannot fuse into a Pallas consumer: three such reduces per layer, plus
the silu(gate) * up that XLA runs as its own kernel before the down projection, are about 1.6 us
of GPU time each (start-up and launch gap included) at batch 1. This kernel needs neither:

- many small programs, each owning block_n weight rows and walking D in block_k steps, so the
  grid fills the GPU several times over without splitting D;
- multiply-adds on the CUDA cores into a [block_n, block_k] float32 accumulator, summed once at
  the end (a single row gives a tensor-core dot nothing to do; see BENCHMARKS.md for the
  tensor-core version this replaced, which was slower than XLA's GEMMs);
- gated_input: x is the gate/up projection [2 D] and the kernel forms silu(gate) * up on the
  fly, rounded as eagle3_jax.layers.gated_mlp rounds it, so the activation is never written.

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


@dataclasses.dataclass(frozen=True)
class MatvecConfig:
    """Static tuning; defaults from the H200 sweep in pallas_kernels/bench_matvec.py."""

    block_n: int = 4  # weight rows per program (a power of 2)
    block_k: int = 1024  # columns per loop step (a power of 2; shrunk to divide D)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if not (_common.is_power_of_2(self.block_n) and _common.is_power_of_2(self.block_k)):
            raise ValueError(f"{self.block_n=} and {self.block_k=} must be powers of 2")


def supports(out_features: int, in_features: int, config: MatvecConfig = MatvecConfig()) -> bool:
    """Whether the kernel takes a weight [out_features, in_features] (blocks must divide it)."""
    return out_features % config.block_n == 0 and in_features % 16 == 0


def _silu_times(gate, up):
    """silu(gate) * up rounded like XLA's ops on gate and up: logistic in f32, each product in their dtype."""
    sigmoid = 1 / (1 + jnp.exp(-gate.astype(jnp.float32)))
    return gate * sigmoid.astype(gate.dtype) * up


def _kernel(x_ref, w_ref, o_ref, *, block_k, gated_input):
    # x_ref: [D] the row (gated_input: [2 D], gate then up); w_ref: [bn, D]; o_ref: [bn]
    bn, D = w_ref.shape

    def step(i, acc):
        window = pl.ds(i * block_k, block_k)
        x = _silu_times(x_ref[window], x_ref[pl.ds(D + i * block_k, block_k)]) if gated_input else x_ref[window]
        w = pltriton.load(w_ref.at[:, window])
        return acc + w.astype(jnp.float32) * x.astype(jnp.float32)[None, :]

    acc = lax.fori_loop(0, D // block_k, step, jnp.zeros((bn, block_k), jnp.float32))
    o_ref[...] = acc.sum(axis=1).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("gated_input", "config", "interpret"))
def _matvec(x, w, *, gated_input, config, interpret):
    N, D = w.shape
    block_k = config.block_k
    while D % block_k:
        block_k //= 2
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, gated_input=gated_input),
        grid=(N // config.block_n,),
        in_specs=[pl.BlockSpec(x.shape, lambda n: (0,)), pl.BlockSpec((config.block_n, D), lambda n: (n, 0))],
        out_specs=pl.BlockSpec((config.block_n,), lambda n: (n,)),
        out_shape=jax.ShapeDtypeStruct((N,), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="matvec_silu" if gated_input else "matvec",
    )(x, w)


def matvec(x, w, *, gated_input: bool = False, interpret: bool = False, **static_tuning):
    """x [..., D] holding one row (every leading dimension 1) times w [N, D] -> [..., N] in x's dtype,
    float32 accumulation. gated_input: x is [..., 2 D], gate then up, and the product is taken
    with silu(gate) * up. static_tuning: fields of MatvecConfig."""
    config = MatvecConfig(**static_tuning)
    *lead, width = x.shape
    N, D = w.shape
    if any(size != 1 for size in lead):
        raise ValueError(f"matvec takes one row, got x {x.shape}")
    if width != (2 * D if gated_input else D):
        raise ValueError(f"weight {w.shape} does not fit x {x.shape} (gated_input={gated_input})")
    if not supports(N, D, config):
        raise ValueError(f"weight {w.shape}: rows must be a multiple of block_n={config.block_n}, columns of 16")
    out = _matvec(x.reshape(width), w, gated_input=gated_input, config=config, interpret=interpret)
    return out.reshape(*lead, N)
