"""`layers.linear`: which rows take the row-reduction path, and that both paths give the matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.layers import linear


def primitives(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


@pytest.mark.parametrize("lead, out_features, in_features, path", [
    ((1,), 48, 32, "reduce_sum"),      # one row, a tall weight: row reduction
    ((1, 1), 32, 32, "reduce_sum"),    # square counts as tall
    ((1, 1), 16, 48, "dot_general"),   # a wide weight (like down): GEMM
    ((1, 2), 48, 32, "dot_general"),   # two rows: GEMM
    ((3, 1), 48, 32, "dot_general"),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_paths(lead, out_features, in_features, path, dtype):
    x = jax.random.normal(jax.random.key(0), lead + (in_features,)).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (out_features, in_features)).astype(dtype)
    assert path in primitives(linear, x, w)
    got = linear(x, w)
    assert got.shape == lead + (out_features,) and got.dtype == dtype
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: one rounding of an f32-accumulated result
    assert np.max(np.abs(np.asarray(got, np.float64) - exact)) <= tol * np.max(np.abs(exact))
