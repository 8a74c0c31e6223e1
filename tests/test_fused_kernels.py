"""The fused Pallas kernels (interpret mode: Pallas' for the Triton kernels, jax's Mosaic GPU interpreter for
add_rms_norm_mgpu) against the plain-jnp ops they replace (eagle3_jax.models.layers, and the XLA path of
eagle3_jax.models.paged_attention.attention_block), and their lowering for CUDA on this host. Random inputs;
interpret mode starts outputs as NaN, so a finite output was fully written; page slots the kernel must not touch
hold NaN or random data and must come back bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.models import kv_cache, layers
from eagle3_jax.models.layers import add_rms_norm, norm_lowering
from eagle3_jax.models.paged_attention import write_pages
from pallas_kernels import add_rms_norm as pallas_add_rms_norm
from pallas_kernels import add_rms_norm_mgpu, rope_page_write
from pallas_kernels.add_rms_norm_mgpu import vector_size

from cuda_lowering import lower_for_cuda

TOLERANCE = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "unwritten output"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOLERANCE[dtype], err


def _check_norm_kernel(kernel, rows, D, dtype):
    """kernel(x, delta or None, w, eps, interpret=True) against the XLA op on random rows [*rows, D], with and
    without a delta: the sum bit for bit, the normed rows within the dtype's tolerance. Returns (x, delta, w)."""
    kx, kd, kw = jax.random.split(jax.random.key(D), 3)
    x = jax.random.normal(kx, (*rows, D), jnp.float32).astype(dtype)
    delta = jax.random.normal(kd, (*rows, D), jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (D,), jnp.float32)).astype(dtype)
    for d in (delta, None):
        got = kernel(x, d, w, eps=1e-6, interpret=True)
        want = add_rms_norm(x, d, w, 1e-6, "xla")
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
        _close(got[1], want[1], dtype)
    return x, delta, w


@pytest.mark.parametrize("D", [32, 48, 4096])  # 48: not a power of 2 (masked columns)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm(D, dtype):
    x, delta, w = _check_norm_kernel(pallas_add_rms_norm, (2, 3), D, dtype)
    with pytest.raises(ValueError, match="does not fit"):
        pallas_add_rms_norm(x, delta[..., :16], w, eps=1e-6)


# 128: one element per lane; 640: a vector of 5 halves into 2-wide loads (not a power of 2); 5120: Qwen3-32B.
@pytest.mark.parametrize("rows, D, dtype", [((3,), 128, jnp.bfloat16), ((1, 5), 640, jnp.float32),
                                            ((2,), 640, jnp.float16), ((1, 3), 5120, jnp.bfloat16)])
def test_add_rms_norm_mgpu(rows, D, dtype):
    """In jax's Mosaic GPU interpreter, which starts outputs as NaN: every element written, the sum exact."""
    _check_norm_kernel(add_rms_norm_mgpu, rows, D, dtype)


def test_add_rms_norm_mgpu_refuses_what_it_cannot_take():
    f32 = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    with pytest.raises(ValueError, match="multiple of 128, got 48"):
        add_rms_norm_mgpu(f32(2, 48), f32(2, 48), f32(48), eps=1e-6)
    with pytest.raises(ValueError, match="bfloat16, float32"):
        add_rms_norm_mgpu(f32(2, 128).astype(jnp.bfloat16), f32(2, 128), f32(128), eps=1e-6)
    with pytest.raises(ValueError, match="int32"):
        add_rms_norm_mgpu(f32(2, 128).astype(jnp.int32), None, f32(128).astype(jnp.int32), eps=1e-6)
    with pytest.raises(ValueError, match="at least one row"):
        add_rms_norm_mgpu(f32(0, 128), None, f32(128), eps=1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        add_rms_norm_mgpu(f32(2, 128), f32(2, 64), f32(128), eps=1e-6)
    with pytest.raises(ValueError, match="norm weight"):
        add_rms_norm_mgpu(f32(2, 128), None, f32(64), eps=1e-6)


def test_add_rms_norm_mgpu_vector_size():
    """Each thread's loads: 16 bytes where the row's share per lane allows, narrower where it does not."""
    assert [vector_size(D, jnp.bfloat16) for D in (4096, 5120, 2560, 1024, 640)] == [8, 8, 4, 8, 1]
    assert [vector_size(D, jnp.float32) for D in (4096, 5120, 384)] == [4, 4, 1]


def test_norm_lowering(monkeypatch):
    """By default Hopper takes the Triton kernel, as other devices do; with MOSAIC_NORM_ON_HOPPER it takes Mosaic GPU
    where the kernel takes the operands and Triton where not; kernels="xla" always XLA."""
    x, w = jnp.zeros((1, 4096), jnp.bfloat16), jnp.zeros((4096,), jnp.bfloat16)
    small, small_w = jnp.zeros((1, 48), jnp.bfloat16), jnp.zeros((48,), jnp.bfloat16)
    assert norm_lowering(x, x, w, "pallas", on_hopper=True) == "triton"
    monkeypatch.setattr(layers, "MOSAIC_NORM_ON_HOPPER", True)
    for kernels in ("pallas", "exact"):
        assert norm_lowering(x, x, w, kernels, on_hopper=True) == "mosaic_gpu"
        assert norm_lowering(x, None, w, kernels, on_hopper=True) == "mosaic_gpu"
        assert norm_lowering(small, small, small_w, kernels, on_hopper=True) == "triton"
        assert norm_lowering(x, x, w, kernels, on_hopper=False) == "triton"
    for kernels in ("xla", "pallas_attention"):
        assert norm_lowering(x, x, w, kernels, on_hopper=True) == "xla"
        assert norm_lowering(x, x, w, kernels, on_hopper=False) == "xla"


def _page_inputs(dtype, N, K, H=16, page_size=8):
    """A batch of 2 rows x 3 tokens: row 0 at positions 6-8 (across the edge of its first page), row 1 at 14-16,
    whose first two tokens' page is unallocated (-1: dropped); a page no token writes holds NaN."""
    ks = jax.random.split(jax.random.key(N * 10 + K), 5)
    qkv = jax.random.normal(ks[0], (2, 3, (N + 2 * K) * H), jnp.float32).astype(dtype)
    angles = jax.random.uniform(ks[1], (2, 3, H // 2), maxval=6.0)
    angles = jnp.concatenate([angles, angles], axis=-1)  # as rope_tables builds them
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    pages = jax.random.normal(ks[2], (K, 6, page_size, H), jnp.float32).astype(dtype).at[:, 4].set(jnp.nan)
    norms = [(1 + 0.1 * jax.random.normal(k, (H,), jnp.float32)).astype(dtype) for k in ks[3:]]
    table = jnp.array([[2, 0, 5], [3, -1, 1]], jnp.int32)
    layout = kv_cache.Layout.uniform(table, jnp.array([6, 14], jnp.int32), 3)
    return qkv, cos, sin, pages, norms, layout


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_norms", [True, False])
# Programs hold 8 heads: (6, 2) straddles q/k in the first program and leaves a partial second one; (6, 3)
# straddles k/v; (4, 1) has q, k and v in one partial program; (8, 8) puts k and v in later programs.
@pytest.mark.parametrize("N,K", [(6, 2), (6, 3), (4, 1), (8, 8), (12, 2)])  # (12, 2): q heads in a later program
def test_rope_page_write(dtype, with_norms, N, K):
    qkv, cos, sin, pages, (q_norm, k_norm), layout = _page_inputs(dtype, N, K)
    norms = dict(q_norm=q_norm, k_norm=k_norm) if with_norms else dict(q_norm=None, k_norm=None)
    want_q, want_k, want_v = _xla_rope_write(qkv, cos, sin, pages, layout, N, norms)
    got = rope_page_write(qkv.reshape(6, -1), cos.reshape(6, -1), sin.reshape(6, -1), pages, pages,
                          layout.page_table, layout.seq, layout.write_positions, num_heads=N, eps=1e-6,
                          interpret=True, **norms)
    _close(got[0].reshape(want_q.shape), want_q, dtype)
    for g, w in zip(got[1:], (want_k, want_v)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        written = np.zeros(w.shape, bool)
        written[:, 2, 6:] = written[:, 0, 0] = written[:, 1, 0] = True  # row 1's tokens at 14, 15: no page
        np.testing.assert_array_equal(g[~written], w[~written])  # untouched, NaN included
        _close(g[written], w[written], dtype)


def _xla_rope_write(qkv, cos, sin, pages, layout, N, norms):
    """The q/k norm, RoPE and page write in XLA, as the XLA path runs them (layers, paged_attention.write_pages)."""
    B, T, _ = qkv.shape
    K, H = pages.shape[0], pages.shape[3]
    q, k, v = jnp.split(qkv.reshape(B, T, N + 2 * K, H), [N, N + K], axis=2)
    if norms["q_norm"] is not None:
        q, k = layers.rms_norm(q, norms["q_norm"], 1e-6), layers.rms_norm(k, norms["k_norm"], 1e-6)
    q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    k_pages, v_pages = write_pages(pages, pages, layout.page_table, layout.seq, layout.write_positions,
                                   k.reshape(B * T, K, H), v.reshape(B * T, K, H))
    return q.reshape(B * T, N, H), k_pages, v_pages


def test_rope_page_write_refuses_what_does_not_fit():
    qkv, cos, sin, pages, (q_norm, _), layout = _page_inputs(jnp.float32, 6, 2)
    flat = qkv.reshape(6, -1), cos.reshape(6, -1), sin.reshape(6, -1)
    args = (pages, pages, layout.page_table, layout.seq, layout.write_positions)
    with pytest.raises(ValueError, match="does not fit"):
        rope_page_write(*flat, *args, num_heads=5)
    with pytest.raises(ValueError, match="both"):
        rope_page_write(*flat, *args, num_heads=6, q_norm=q_norm)
    with pytest.raises(ValueError, match="cos"):
        rope_page_write(flat[0], flat[1][:1], flat[2], *args, num_heads=6)


@pytest.mark.parametrize("D", [4096, 5120])  # Qwen3-8B, Qwen3-32B
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_mgpu_lowers_for_cuda(D, with_delta):
    """The Mosaic GPU lowering runs on a CPU host (its layout and shape checks; not ptxas), with no device."""
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    if with_delta:
        norm = jax.jit(lambda x, d, w: add_rms_norm_mgpu(x, d, w, eps=1e-6))
        args = (bf16(8, 4, D), bf16(8, 4, D), bf16(D))
    else:
        norm = jax.jit(lambda x, w: add_rms_norm_mgpu(x, None, w, eps=1e-6))
        args = (bf16(8, 4, D), bf16(D))
    text = norm.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "triton" not in text


def test_fused_kernels_lower_to_triton():
    """The Triton lowering runs on a CPU too: catches ops the GPU backend lacks, at Qwen3-8B shapes (and a hidden
    size that is not a power of 2)."""
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    norm = jax.jit(lambda x, d, w: pallas_add_rms_norm(x, d, w, eps=1e-6))
    assert "add_rms_norm" in lower_for_cuda(norm, bf16(1, 4, 5120), bf16(1, 4, 5120), bf16(5120))
    rope = jax.jit(lambda qkv, c, s, k, v, table, seq, pos, qn, kn: rope_page_write(
        qkv, c, s, k, v, table, seq, pos, num_heads=32, q_norm=qn, k_norm=kn))
    args = (bf16(4, 6144), bf16(4, 128), bf16(4, 128), bf16(8, 1001, 64, 128), bf16(8, 1001, 64, 128), i32(1, 21),
            i32(4), i32(4), bf16(128), bf16(128))
    assert "rope_page_write" in lower_for_cuda(rope, *args)
