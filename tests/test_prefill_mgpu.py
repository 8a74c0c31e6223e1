"""The Mosaic GPU prefill kernel on a CPU: its tiling plan and mask, its lowering, its refusals.

The kernel cannot run in jax 0.12's Mosaic GPU interpreter (see the module docstring); its
numbers are checked on the GPU by `bench_attention.py mosaic_check`.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from eagle3_jax.models import attention, kernels
from eagle3_jax.models.attention import uses_mosaic_prefill
from pallas_kernels.prefill_attention_mgpu import (
    BLOCK_Q,
    MosaicPrefillConfig,
    causal_visible,
    pair_plan,
    prefill_attention_mgpu,
    tile_plan,
)

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


def start_sweep(config):
    """Starts on, before and after every key-block edge: the off-by-ones of the plan."""
    return [(start, 136, 512) for start in range(2 * config.block_kv + 2)]


def kernel_plans(start, num_tokens, capacity, config):
    """(first_token, full, steps, pair_steps) of every compute warpgroup, as the kernel's CTAs plan."""
    num_pairs = -(-num_tokens // (2 * BLOCK_Q))
    return [[int(x) for x in pair_plan(start, pair, warpgroup, num_tokens=num_tokens, capacity=capacity,
                                       block_kv=config.block_kv)]
            for pair in range(num_pairs) for warpgroup in (0, 1)]


def kernel_reads(start, num_tokens, capacity, config):
    """What the kernel reads, walking its tiles with its own plan and mask: [T, slots] int,
    0 = not read, 1 = read with no mask, 2 = read and visible under the mask, 3 = read and hidden.

    Slots run one block past the cache: the TMA fills those with zeros.
    """
    bkv = config.block_kv
    plans = kernel_plans(start, num_tokens, capacity, config)
    reads = np.zeros((len(plans) * BLOCK_Q, -(-capacity // bkv) * bkv + bkv), np.int32)
    rows, keys = np.arange(BLOCK_Q)[:, None], np.arange(bkv)[None, :]
    for first, full, steps, _ in plans:
        for step in range(steps):
            window = (slice(first, first + BLOCK_Q), slice(step * bkv, (step + 1) * bkv))
            if step < full:
                reads[window] = 1
            else:
                visible = causal_visible(rows, keys, start=start, first_token=first, step=step, block_kv=bkv)
                reads[window] = np.where(visible, 2, 3)
    return reads[:num_tokens]


def check_reads(start, num_tokens, capacity, config):
    """Each real query row reads exactly the keys the reference lets it see."""
    reads = kernel_reads(start, num_tokens, capacity, config)
    slots = np.arange(reads.shape[1])[None, :]
    position = start + np.arange(num_tokens)[:, None]
    sees = (slots <= position) & (slots < min(start + num_tokens, capacity))  # the reference's mask
    real = position[:, 0] < capacity  # rows past the cache are don't-care
    assert real.any()
    read_and_visible = (reads == 1) | (reads == 2)
    np.testing.assert_array_equal(read_and_visible[real], sees[real])


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
@pytest.mark.parametrize("start,num_tokens,capacity", CASES)
def test_each_query_reads_exactly_the_keys_it_sees(start, num_tokens, capacity, config):
    check_reads(start, num_tokens, capacity, config)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
def test_every_start_offset_of_a_key_block(config):
    for case in start_sweep(config):
        check_reads(*case, config)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
def test_each_tile_reads_no_block_it_does_not_need(config):
    """Every block a tile reads holds a key one of its real rows sees, and its first masked block
    holds a key one of them does not see (else that block could have gone unmasked)."""
    bkv = config.block_kv
    for start, num_tokens, capacity in CASES + start_sweep(config):
        for first, full, steps, _ in kernel_plans(start, num_tokens, capacity, config):
            position = start + np.arange(first, first + BLOCK_Q)[:, None]
            position = position[(position[:, 0] < start + num_tokens) & (position[:, 0] < capacity)]
            if not len(position):
                continue  # a tile wholly past T or past the cache: don't-care rows
            for step in range(steps):
                keys = step * bkv + np.arange(bkv)[None, :]
                sees = keys <= position
                assert sees.any(), (start, num_tokens, capacity, first, step)
                if step == full:
                    assert not sees.all(), (start, num_tokens, capacity, first, step)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "kv64"])
def test_the_loader_fills_every_step_of_both_tiles_of_a_pair(config):
    """The loader fills as many steps as the pair's second tile takes; the first takes no more."""
    for start, num_tokens, capacity in CASES:
        plans = kernel_plans(start, num_tokens, capacity, config)
        for (_, _, first_steps, pair_steps), (_, _, second_steps, pair_steps_1) in zip(plans[::2], plans[1::2]):
            assert pair_steps == pair_steps_1 == second_steps
            assert 1 <= first_steps <= pair_steps <= -(-capacity // config.block_kv)


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
        ({"S": 260}, "capacity that is a multiple of 8, got S=260"),
        ({"S": 64}, "at least 128 slots"),
    ]:
        with pytest.raises(ValueError, match=message):
            prefill_attention_mgpu(*operands(**kwargs), start, scale=1.0)
        assert not uses_mosaic_prefill(*operands(**kwargs), on_hopper=True)
    with pytest.raises(ValueError, match="block_kv"):
        prefill_attention_mgpu(*operands(), start, scale=1.0, block_kv=96)


@pytest.mark.parametrize("on_hopper", [True, False])
def test_the_model_takes_mosaic_gpu_for_prefill_only_on_hopper(monkeypatch, on_hopper):
    """attend's prefill branch: the Mosaic GPU kernel on a Hopper GPU, the Triton kernel elsewhere
    (here: spies, since neither a Hopper GPU nor the interpreter's prefill is the point)."""
    called = []

    def spy(name):
        return lambda q, *args, **kwargs: called.append(name) or jnp.zeros_like(q)

    monkeypatch.setattr(kernels, "hopper", lambda: on_hopper)
    monkeypatch.setattr(pallas_kernels, "prefill_attention_mgpu", spy("mosaic"))
    monkeypatch.setattr(pallas_kernels, "prefill_attention", spy("triton"))
    q, cache = jnp.ones((1, 128, 8, 128), jnp.bfloat16), jnp.ones((1, 2, 256, 128), jnp.bfloat16)
    attention.attend(q, cache, cache, jnp.zeros((1,), jnp.int32), "pallas")
    assert called == ["mosaic" if on_hopper else "triton"]


@pytest.mark.parametrize(
    "platform,capability,expected",
    [("gpu", "9.0", True), ("gpu", "8.0", False), ("gpu", "10.0", False), ("gpu", None, False), ("cpu", None, False)],
)
def test_hopper_means_compute_capability_9(monkeypatch, platform, capability, expected):
    """Ampere has no wgmma, Blackwell replaced it, ROCm devices carry no compute capability."""
    device = type("Device", (), {"platform": platform})()
    if capability is not None:
        device.compute_capability = capability
    monkeypatch.setattr(jax, "devices", lambda: [device])
    assert kernels.hopper() is expected


def test_the_plan_is_the_same_on_traced_values():
    """The kernel calls tile_plan on traced int32 scalars: same answers as on Python ints."""
    for num_tokens, capacity in ((8, 128), (200, 640), (520, 512)):
        plan = jax.jit(lambda s, f: tile_plan(s, f, num_tokens=num_tokens, capacity=capacity, block_kv=128))
        for start, first in itertools.product((0, 37, 128), (0, 64, 448)):
            expected = tile_plan(start, first, num_tokens=num_tokens, capacity=capacity, block_kv=128)
            assert [int(x) for x in plan(start, first)] == [int(x) for x in expected]
