"""Lowering kernels for CUDA on a host without a GPU.

Pallas' Triton lowering asks the device for its compute capability. jax 0.12 takes it from an abstract GPU
device when no GPU is present (`jax.sharding.AbstractDevice` on an abstract mesh); jax 0.11 lowered without one.
The tests lower for the H200 the project is measured on."""

import contextlib

import jax
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def lower_for_cuda(jitted, *args, **kwargs):
    """The StableHLO text of `jitted` (a `jax.jit` function) traced on these arguments and lowered for CUDA, for an
    H200. Both happen under the abstract device: the trace records it."""
    try:
        mesh = AbstractMesh((), (), abstract_device=H200)
    except TypeError:  # jax 0.11: no abstract devices, and the lowering needs none
        context = contextlib.nullcontext()
    else:
        context = jax.sharding.use_abstract_mesh(mesh)
    with context:
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
