"""`layers.linear`: which shapes take the row-reduction form on CUDA (checked in the StableHLO exported
for CUDA and for the CPU, no GPU needed), and that the reduction form computes the matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from eagle3_jax.models.layers import linear, matvec_by_rows


def lowered(platform, x, w) -> str:
    return export.export(jax.jit(linear), platforms=[platform])(x, w).mlir_module()


@pytest.mark.parametrize("lead, out_features, in_features, reduction_on_cuda", [
    ((1,), 48, 32, True),       # one row, a tall weight
    ((1, 1), 32, 32, True),     # square counts as tall
    ((1, 1), 16, 48, False),    # a wide weight (like down): the dot
    ((1, 2), 48, 32, False),    # two rows: the dot
    ((3, 1), 48, 32, False),
])
def test_linear_lowers_to_a_reduction_only_where_measured_faster(lead, out_features, in_features,
                                                                  reduction_on_cuda):
    x = jnp.ones(lead + (in_features,), jnp.bfloat16)
    w = jnp.ones((out_features, in_features), jnp.bfloat16)
    cuda = lowered("cuda", x, w)
    assert ("dot_general" not in cuda) == reduction_on_cuda and ("stablehlo.reduce" in cuda) == reduction_on_cuda
    assert "dot_general" in lowered("cpu", x, w)  # the CPU runs the reduction form far slower


@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                    (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("lead", [(1,), (1, 1)])
def test_matvec_by_rows_is_the_matmul(dtypes, lead):
    x_dtype, w_dtype = dtypes
    x = jax.random.normal(jax.random.key(0), lead + (64,)).astype(x_dtype)
    w = jax.random.normal(jax.random.key(1), (96, 64)).astype(w_dtype)
    got, dot = matvec_by_rows(x, w), jnp.einsum("...i,oi->...o", x, w)
    assert got.shape == dot.shape == lead + (96,) and got.dtype == dot.dtype  # einsum's promotion
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    tol = 1e-5 if got.dtype == jnp.float32 else 2e-2  # bf16: one rounding of an f32-accumulated result
    assert np.max(np.abs(np.asarray(got, np.float64) - exact)) <= tol * np.max(np.abs(exact))
