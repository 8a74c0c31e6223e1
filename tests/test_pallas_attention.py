"""Pallas attention kernels against attention_reference, in interpret mode.

Caches hold random data below each row's length start + T and NaN above it:
a kernel that reads (or fails to mask) a garbage slot turns the output NaN.
Interpret mode starts outputs as NaN, so a finite output was fully written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention_reference, decode_attention, prefill_attention
from pallas_kernels.decode_attention import DecodeConfig
from pallas_kernels.prefill_attention import PrefillConfig

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, lengths, *, T, G, H, K=2, S, dtype):
    """Random q and NaN-poisoned caches; row b has lengths[b] keys in use."""
    lengths = jnp.asarray(lengths, jnp.int32)
    B = lengths.shape[0]
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, K * G, H), jnp.float32).astype(dtype)
    in_use = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, :, None]
    k = jax.random.normal(kk, (B, K, S, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, K, S, H), jnp.float32).astype(dtype)
    poison = jnp.asarray(jnp.nan, dtype)
    start = jnp.maximum(lengths - T, 0)
    return q, jnp.where(in_use, k, poison), jnp.where(in_use, v, poison), start


def _check(out, q, k, v, start, dtype):
    H = q.shape[-1]
    ref = attention_reference(q, k, v, start, scale=H**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten output or garbage slot leaked"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < TOLERANCE[dtype], err


# Lengths (start + T) per batch row: T itself (the shortest cache), a block
# boundary -1 / 0 / +1, and the full capacity, all in one batch.
def _edge_lengths(T, block_k, S):
    return [max(n, T) for n in (1, block_k - 1, block_k, block_k + 1, S)]


@pytest.mark.parametrize(
    "T,G,H,dtype,num_splits",
    [
        (1, 4, 128, jnp.bfloat16, None),
        (1, 1, 64, jnp.float32, 3),
        (2, 8, 64, jnp.float32, None),
        (2, 2, 128, jnp.bfloat16, 1),
        (4, 2, 128, jnp.float32, 2),
        (4, 4, 64, jnp.bfloat16, None),
        (8, 4, 64, jnp.bfloat16, 3),
        (8, 8, 128, jnp.float32, None),
    ],
)
def test_decode_matches_reference(T, G, H, dtype, num_splits):
    block_k, S = 16, 48
    q, k, v, start = _inputs(T * 10 + G, _edge_lengths(T, block_k, S), T=T, G=G, H=H, S=S, dtype=dtype)
    out = decode_attention(q, k, v, start, scale=H**-0.5, interpret=True, block_k=block_k, num_splits=num_splits)
    _check(out, q, k, v, start, dtype)


def test_decode_capacity_not_multiple_of_block():
    q, k, v, start = _inputs(1, [5, 37, 40], T=4, G=2, H=64, S=40, dtype=jnp.float32)
    out = decode_attention(q, k, v, start, scale=0.125, interpret=True, block_k=16, num_splits=2)
    _check(out, q, k, v, start, jnp.float32)


def test_decode_rows_past_capacity_stay_finite():
    """start + T > S: past-capacity queries are don't-care, but finite."""
    T, S, H = 4, 32, 64
    q, k, v, _ = _inputs(2, [S, 9], T=T, G=2, H=H, S=S, dtype=jnp.float32)
    start = jnp.array([S - 2, 5], jnp.int32)  # row 0: tokens 2, 3 overflow
    out = decode_attention(q, k, v, start, scale=H**-0.5, interpret=True, block_k=16)
    assert np.isfinite(np.asarray(out)).all()
    ref = attention_reference(q, k, v, start, scale=H**-0.5)
    np.testing.assert_allclose(out[0, :2], ref[0, :2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "T,G,H,dtype,starts",
    [
        (40, 1, 64, jnp.float32, [0, 0]),
        (40, 2, 128, jnp.float32, [0, 23]),
        (24, 4, 64, jnp.bfloat16, [17, 0]),
        (19, 8, 128, jnp.bfloat16, [3, 60]),
        (3, 4, 64, jnp.float32, [0, 45]),
    ],
)
def test_prefill_matches_reference(T, G, H, dtype, starts):
    S = 96
    lengths = [s + T for s in starts]
    q, k, v, start = _inputs(T + G, lengths, T=T, G=G, H=H, S=S, dtype=dtype)
    out = prefill_attention(q, k, v, start, scale=H**-0.5, interpret=True, block_q=32, block_k=16)
    _check(out, q, k, v, start, dtype)


def test_prefill_rows_past_capacity_stay_finite():
    T, S, H = 24, 64, 64
    q, k, v, _ = _inputs(3, [S, 30], T=T, G=2, H=H, S=S, dtype=jnp.float32)
    start = jnp.array([S - 8, 6], jnp.int32)
    out = prefill_attention(q, k, v, start, scale=H**-0.5, interpret=True, block_q=16, block_k=16)
    assert np.isfinite(np.asarray(out)).all()
    ref = attention_reference(q, k, v, start, scale=H**-0.5)
    np.testing.assert_allclose(out[0, :8], ref[0, :8], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5, atol=1e-5)


def test_split_count():
    config = DecodeConfig(block_k=128, wave_slots=132)
    assert config.splits_for(batch=1, kv_heads=8, capacity=32768) == 16
    assert config.splits_for(batch=8, kv_heads=8, capacity=32768) == 2
    assert config.splits_for(batch=32, kv_heads=8, capacity=32768) == 1
    assert config.splits_for(batch=1, kv_heads=8, capacity=256) == 2  # blocks
    assert DecodeConfig(num_splits=4).splits_for(1, 8, 32768) == 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_tunings_fit_hopper_shared_memory_in_every_dtype(dtype):
    """A block may use 227 KB of shared memory on Hopper: the default tuning of each dtype must fit at
    head_dim 128 (K and V tiles, num_stages deep; prefill also holds its query tile). float32 with the
    2-byte defaults asks for more (the failure `pytest -m gpu` met at real shapes), so it takes its own."""
    limit, itemsize = 227 * 1024, jnp.dtype(dtype).itemsize
    decode = DecodeConfig.for_dtype(dtype)
    prefill = PrefillConfig.for_dtype(dtype)
    decode_bytes = 2 * decode.block_k * 128 * itemsize * decode.num_stages
    prefill_bytes = (prefill.block_q + 2 * prefill.block_k * prefill.num_stages) * 128 * itemsize
    assert decode_bytes <= limit and prefill_bytes <= limit
    assert DecodeConfig.for_dtype(jnp.float32, block_k=128).block_k == 128  # given fields win
    if itemsize == 2:
        assert decode == DecodeConfig() and prefill == PrefillConfig()  # the measured defaults
    else:
        assert 2 * DecodeConfig().block_k * 128 * itemsize * DecodeConfig().num_stages > limit


@pytest.mark.parametrize(
    "make",
    [
        lambda: DecodeConfig(block_k=96),
        lambda: DecodeConfig(num_splits=0),
        lambda: PrefillConfig(block_q=8),
        lambda: PrefillConfig(num_warps=3),
    ],
)
def test_configs_reject_bad_values(make):
    with pytest.raises(ValueError):
        make()
