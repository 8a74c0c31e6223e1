"""The Pallas skinny matmul (interpret mode) against plain jnp: the product, the fused RMSNorm, the
fused gate/up with SiLU. Random inputs; interpret mode starts outputs as NaN, so a finite output was
fully written. Rows that do not fill a 16-row tile, several tiles, and blocks smaller than the
configured ones (when they do not divide the features) are all covered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.layers import rms_norm
from pallas_kernels.skinny_matmul import MAX_ROWS, SkinnyConfig, skinny_matmul, supports

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, lead, D, N, dtype):
    kx, kw, kn = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (*lead, D), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (N, D), jnp.float32) * D**-0.5).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(kn, (D,), jnp.float32)).astype(dtype)
    return x, w, norm


def _matmul(x, w):
    return jnp.einsum("...d,nd->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")


def _check(out, ref, dtype, shape):
    assert out.shape == shape
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten output"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize(
    "lead,D,N,dtype,tuning",
    [
        ((1,), 64, 96, jnp.float32, dict(block_n=32, block_k=32)),  # N not a multiple of block_n: 16 is used
        ((3,), 128, 64, jnp.bfloat16, {}),  # blocks above the features shrink to fit
        ((2, 8), 48, 32, jnp.float32, dict(block_k=64)),  # exactly one tile; D = 3 * 16
        ((17,), 64, 48, jnp.float32, dict(block_n=16, block_k=16)),  # two tiles, the second of one row
        ((2, 20), 32, 32, jnp.bfloat16, dict(block_n=16)),  # three tiles
        ((MAX_ROWS,), 32, 16, jnp.float32, {}),
    ],
)
def test_products(lead, D, N, dtype, tuning):
    x, w, norm = _inputs(sum(lead) + D + N, lead, D, N, dtype)
    shape = (*lead, N)
    _check(skinny_matmul(x, w, interpret=True, **tuning), _matmul(x, w), dtype, shape)
    normed = rms_norm(x.astype(jnp.float32), norm.astype(jnp.float32), 1e-6)
    _check(skinny_matmul(x, w, norm_weight=norm, eps=1e-6, interpret=True, **tuning), _matmul(normed, w), dtype, shape)
    f32 = skinny_matmul(x, w, out_dtype=jnp.float32, interpret=True, **tuning)
    assert f32.dtype == jnp.float32


@pytest.mark.parametrize("lead,dtype", [((1,), jnp.float32), ((5,), jnp.bfloat16), ((20,), jnp.float32)])
def test_gated(lead, dtype):
    D, I = 64, 48
    x, w, norm = _inputs(len(lead), lead, D, 2 * I, dtype)
    normed = rms_norm(x.astype(jnp.float32), norm.astype(jnp.float32), 1e-5)
    gate, up = jnp.split(_matmul(normed, w), 2, axis=-1)
    out = skinny_matmul(x, w, norm_weight=norm, eps=1e-5, gated=True, interpret=True, block_n=16)
    _check(out, jax.nn.silu(gate) * up, dtype, (*lead, I))


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """What keeps decode (1 row) and verify (gamma + 1 rows) rounding alike: bit-identical rows."""
    x, w, norm = _inputs(0, (5,), 64, 32, jnp.bfloat16)
    together = skinny_matmul(x, w, norm_weight=norm, interpret=True)
    alone = jnp.concatenate([skinny_matmul(x[i : i + 1], w, norm_weight=norm, interpret=True) for i in range(5)])
    np.testing.assert_array_equal(np.asarray(together, np.float32), np.asarray(alone, np.float32))


def test_refuses_what_it_cannot_take():
    x, w, _ = _inputs(0, (2,), 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_matmul(x, w[:, :48])
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul(jnp.ones((MAX_ROWS + 1, 64)), w)
    with pytest.raises(ValueError, match="norm weight"):
        skinny_matmul(x, w, norm_weight=jnp.ones((32,)))
    with pytest.raises(ValueError, match="block_k"):
        SkinnyConfig(block_k=24)
    assert supports(1, 4096, 4096) and not supports(1, 4095, 4096) and not supports(MAX_ROWS + 1, 16, 16)


def test_lowers_to_triton_for_the_gpu():
    """The kernel's Triton lowering runs on a CPU too: catches ops the GPU backend lacks."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4, 4096), (2 * 12288, 4096), (4096,))]
    fn = jax.jit(lambda x, w, n: skinny_matmul(x, w, norm_weight=n, gated=True))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "skinny_matmul" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_row_on_cuda_cores(dtype):
    D, I = 64, 48
    x, w, norm = _inputs(3, (1,), D, 2 * I, dtype)
    tuning = dict(dot=False, block_n=8, block_k=16)
    _check(skinny_matmul(x, w, interpret=True, **tuning), _matmul(x, w), dtype, (1, 2 * I))
    normed = rms_norm(x.astype(jnp.float32), norm.astype(jnp.float32), 1e-6)
    gate, up = jnp.split(_matmul(normed, w), 2, axis=-1)
    out = skinny_matmul(x, w, norm_weight=norm, eps=1e-6, gated=True, interpret=True, **tuning)
    _check(out, jax.nn.silu(gate) * up, dtype, (1, I))
