"""The Mosaic GPU prefill kernel on a CPU: its tiling plan and mask, its lowering, its refusals.

The kernel cannot run in jax 0.10.2's Mosaic GPU interpreter (see the module docstring); its
numbers are checked on the GPU by `bench_attention.py mosaic_check`.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.attention import uses_mosaic_prefill
from pallas_kernels.prefill_attention_mgpu import MosaicPrefillConfig, causal_visible, prefill_attention_mgpu, tile_plan

# (start, tokens, capacity): whole and partial tiles and pairs, a key tail, start > 0 off and on a
# block edge, a cache just big enough, a prompt overflowing the cache (start + T > S).
CASES = [
    (0, 8, 128),
    (0, 64, 128),
    (0, 128, 128),
    (0, 136, 264),
    (37, 136, 264),
    (64, 200, 512),
    (127, 72, 256),
    (128, 256, 512),
    (300, 520, 1024),
    (100, 256, 256),
    (250, 24, 256),
]
CONFIGS = [MosaicPrefillConfig(), MosaicPrefillConfig(block_kv=64, num_stages=3)]


def kernel_reads(start, num_tokens, capacity, config):
    """What the kernel reads, walking its tiles with its own plan and mask: [T, slots] int,
    0 = not read, 1 = read with no mask, 2 = read and visible under the mask, 3 = read and hidden.

    Slots run one block past the cache: the TMA fills those with zeros.
    """
    bq, bkv = config.block_q, config.block_kv
    num_tiles = -(-num_tokens // bq)
    reads = np.zeros((num_tiles * bq, -(-capacity // bkv) * bkv + bkv), np.int32)
    rows, keys = np.arange(bq)[:, None], np.arange(bkv)[None, :]
    for tile in range(num_tiles):
        first = tile * bq
        full, steps = (int(x) for x in tile_plan(start, first, num_tokens=num_tokens, capacity=capacity, block_q=bq,
                                                     block_kv=bkv))
        assert 0 <= full <= steps
        for step in range(steps):
            window = (slice(first, first + bq), slice(step * bkv, (step + 1) * bkv))
            if step < full:
                reads[window] = 1
            else:
                visible = causal_visible(rows, keys, start=start, first_token=first, step=step, block_kv=bkv)
                reads[window] = np.where(visible, 2, 3)
    return reads[:num_tokens]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
@pytest.mark.parametrize("start,num_tokens,capacity", CASES)
def test_each_query_reads_exactly_the_keys_it_sees(start, num_tokens, capacity, config):
    reads = kernel_reads(start, num_tokens, capacity, config)
    slots = np.arange(reads.shape[1])[None, :]
    position = start + np.arange(num_tokens)[:, None]
    sees = (slots <= position) & (slots < min(start + num_tokens, capacity))  # the reference's mask
    real = position[:, 0] < capacity  # rows past the cache are don't-care
    assert real.any()
    read_and_visible = (reads == 1) | (reads == 2)
    np.testing.assert_array_equal(read_and_visible[real], sees[real])


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
def test_every_start_offset_of_a_key_block(config):
    """Starts on, before and after every key-block edge: the off-by-ones of the plan."""
    for start in range(2 * config.block_kv + 2):
        test_each_query_reads_exactly_the_keys_it_sees(start, 136, 512, config)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
def test_the_loader_fills_every_step_of_both_tiles_of_a_pair(config):
    """The loader fills as many steps as the pair's second tile takes; the first takes no more."""
    bq, bkv = config.block_q, config.block_kv
    for start, num_tokens, capacity in CASES:
        for pair in range(-(-num_tokens // (2 * bq))):
            plan = [tile_plan(start, (2 * pair + i) * bq, num_tokens=num_tokens, capacity=capacity, block_q=bq,
                              block_kv=bkv) for i in range(2)]
            (_, first_steps), (_, pair_steps) = plan
            assert 1 <= first_steps <= pair_steps <= -(-capacity // bkv)


def _lower(B, T, S, N, K, H, **tuning):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((B, K, S, H), jnp.bfloat16)
    start = jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = jax.jit(lambda q, k, v, s: prefill_attention_mgpu(q, k, v, s, scale=H**-0.5, **tuning))
    return fn.trace(q, cache, cache, start).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape,tuning",
    [
        ((1, 8192, 8192, 32, 8, 128), {}),
        ((2, 136, 264, 32, 8, 128), {}),
        ((3, 384, 512, 8, 8, 64), {}),
        ((1, 256, 256, 16, 2, 128), {"ping_pong": False}),
        ((1, 520, 1024, 64, 8, 128), {"block_kv": 64, "num_stages": 3}),
        ((1, 32, 128, 32, 8, 128), {"num_stages": 3}),
    ],
)
def test_lowers_to_one_mosaic_gpu_kernel(shape, tuning):
    text = _lower(*shape, **tuning)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_refuses_what_it_cannot_take_and_says_why():
    start = jnp.zeros((1,), jnp.int32)

    def operands(T=128, S=256, H=128, dtype=jnp.bfloat16, cache_dtype=None):
        q = jnp.ones((1, T, 8, H), dtype)
        cache = jnp.ones((1, 2, S, H), cache_dtype or dtype)
        return q, cache, cache

    for kwargs, message in [
        ({"dtype": jnp.float32}, "all bf16 or all f16"),
        ({"cache_dtype": jnp.float16}, "all bf16 or all f16"),
        ({"H": 256}, "head_dim 64 or 128, got 256"),
        ({"T": 100}, "T=100"),
        ({"S": 100}, "S=100"),
        ({"S": 64}, ">= 128 slots"),
    ]:
        with pytest.raises(ValueError, match=message):
            prefill_attention_mgpu(*operands(**kwargs), start, scale=1.0)
        assert not uses_mosaic_prefill(*operands(**kwargs), interpret=False)
    with pytest.raises(ValueError, match="block_kv"):
        prefill_attention_mgpu(*operands(), start, scale=1.0, block_kv=96)


def test_the_model_takes_mosaic_gpu_for_prefill_only_where_it_runs():
    q, cache = jnp.ones((1, 128, 8, 128), jnp.bfloat16), jnp.ones((1, 2, 256, 128), jnp.bfloat16)
    assert uses_mosaic_prefill(q, cache, cache, interpret=False)
    assert not uses_mosaic_prefill(q, cache, cache, interpret=True)  # the CPU interprets Triton's


def test_the_plan_is_the_same_on_traced_values():
    """The kernel calls tile_plan on traced int32 scalars: same answers as on Python ints."""
    for num_tokens, capacity in ((8, 128), (200, 640), (520, 512)):
        plan = jax.jit(lambda s, f: tile_plan(s, f, num_tokens=num_tokens, capacity=capacity, block_q=64,
                                              block_kv=128))
        for start, first in itertools.product((0, 37, 128), (0, 64, 448)):
            expected = tile_plan(start, first, num_tokens=num_tokens, capacity=capacity, block_q=64, block_kv=128)
            assert [int(x) for x in plan(start, first)] == [int(x) for x in expected]
