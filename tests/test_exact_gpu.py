"""Engine(exact=True) on a GPU (`pytest -m gpu`; skipped, with the reason, without one): the checks of
tests/test_exact.py at real shapes, compiled for the GPU instead of interpreted.

The skinny matmul at Qwen3-8B's five weight shapes and the invariant attention at Qwen3-8B's heads: row i
of a call of many rows (tokens, batch rows) is bit-identical to the same row computed alone, and close
to the float32 reference. A two-layer Qwen3-8B-shaped target: a verify of 4 tokens at batch 4 gives the
logits and cache of 4 one-token steps, and of the same row verified alone. End to end, a random
Qwen3-1.7B-shaped target in bf16, 8 prompts x 128 tokens: speculative output is spec-off output at gamma
1, 3 and 5 (without exact they differ: eagle3_jax_bench/exact.py's agreement section, BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
import pallas_kernels
from eagle3_jax.models import qwen3
from eagle3_jax_bench import exact as bench_exact
from eagle3_jax_bench import inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run: pytest -m gpu on one)"),
]

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}  # relative max error against the float32 references
N, K, H = 32, 8, 128  # Qwen3-8B attention heads
WEIGHTS = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w_gate_up": (24576, 4096), "w_down": (4096, 12288),
           "lm_head": (151936, 4096)}


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("dtype,name", [("bfloat16", w) for w in WEIGHTS] + [("float32", "wo"), ("float32", "w_down")])
def test_skinny_matmul_rows_do_not_depend_on_the_row_count(dtype, name):
    n, k = WEIGHTS[name]
    out_dtype = jnp.float32 if name == "lm_head" else None
    x = jax.random.normal(jax.random.key(0), (64, k), jnp.float32).astype(dtype)
    w = (0.02 * jax.random.normal(jax.random.key(1), (n, k), jnp.float32)).astype(dtype)
    full = pallas_kernels.skinny_matmul(x, w, out_dtype=out_dtype)
    assert _rel_err(full, pallas_kernels.skinny_matmul_reference(x, w, out_dtype=out_dtype)) < TOLERANCE[dtype]
    full = bits(full)
    for m in (4, 8, 20, 33):  # each call at its row count's tuning (skinny_matmul.row_tuning)
        np.testing.assert_array_equal(bits(pallas_kernels.skinny_matmul(x[:m], w, out_dtype=out_dtype)), full[:m])
    for i in (0, 17, 63):
        np.testing.assert_array_equal(bits(pallas_kernels.skinny_matmul(x[i:i + 1], w, out_dtype=out_dtype)),
                                      full[i:i + 1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_invariant_attention_rows_do_not_depend_on_T_or_B(dtype):
    """Batch 4 x 8 tokens over a cache of 8192, the rows starting at 0, 127 (across a key block), 1000 and
    8100 (16 runs of up to 64 blocks): each query against itself alone (B = 1, T = 1) and in a call of 3
    tokens at batch 2."""
    B, T, S = 4, 8, 8192
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(x, (B, K, S, H), jnp.float32).astype(dtype) for x in (kk, kv))
    start = jnp.array([0, 127, 1000, 8100], jnp.int32)
    full = pallas_kernels.invariant_attention(q, k, v, start, scale=H**-0.5)
    assert _rel_err(full, pallas_kernels.attention_reference(q, k, v, start, scale=H**-0.5)) < TOLERANCE[dtype]
    full = bits(full)
    for b in range(B):
        for t in range(T):
            alone = pallas_kernels.invariant_attention(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1],
                                                       start[b:b + 1] + t, scale=H**-0.5)
            np.testing.assert_array_equal(bits(alone[0, 0]), full[b, t])
    pair = pallas_kernels.invariant_attention(q[1:3, 2:5], k[1:3], v[1:3], start[1:3] + 2, scale=H**-0.5)
    np.testing.assert_array_equal(bits(pair), full[1:3, 2:5])


def test_exact_verify_equals_one_token_steps_at_qwen3_8b_shapes():
    """Two Qwen3-8B layers and its lm_head, bf16, batch 4 at lengths 5, 130, 1000 and 2040 of a cache of
    2048: a verify of 4 tokens leaves the logits and cache of 4 one-token steps, and its row 2 equals the
    same row verified alone."""
    plan = bench_exact.qwen3_8b_plan()
    cfg = dataclasses.replace(plan.models.target, num_layers=2)
    capture = (0, 1, 1)
    params = inputs.random_tree(qwen3.abstract_params(cfg, jnp.bfloat16), seed=1)
    lengths = jnp.array([5, 130, 1000, 2040], jnp.int32)
    cache = inputs.random_cache(2, 4, K, 2048, H, 0, jnp.bfloat16, 5).with_lengths(lengths)
    tokens = jax.random.randint(jax.random.key(3), (4, 4), 0, cfg.vocab_size)

    def step(tokens, cache):
        return bench_exact.jit_verify(params, tokens, cache, cfg=cfg, capture=capture, kernels="exact")

    # Row 2 alone: its page-table row over a copy of the pool (the step donates its cache).
    alone = dataclasses.replace(jax.tree.map(jnp.copy, cache), table=cache.table[2:3], lengths=cache.lengths[2:3])
    _, (row_logits, _) = step(tokens[2:3], alone)
    verify_cache, (verify_logits, _) = step(tokens, jax.tree.map(jnp.copy, cache))
    np.testing.assert_array_equal(bits(row_logits[0]), bits(verify_logits[2]))
    for t in range(4):
        cache, (logits, _) = step(tokens[:, t:t + 1], cache)
        np.testing.assert_array_equal(bits(logits[:, 0]), bits(verify_logits[:, t]))
        cache = cache.with_lengths(cache.lengths + 1)
    for mine, theirs in zip(cache.pages.k + cache.pages.v, verify_cache.pages.k + verify_cache.pages.v):
        np.testing.assert_array_equal(bits(mine), bits(theirs))


@pytest.fixture(scope="module")
def qwen3_1p7b():
    """The random Qwen3-1.7B-shaped pair, its 8 prompts and their spec-off exact output, built once."""
    plan = bench_exact.qwen3_8b_plan()
    target, drafter = bench_exact.random_models(plan.agreement_models, jnp.bfloat16)
    prompts = bench_exact.prompts_for(plan)
    engine = eagle3_jax.Engine(target, max_len=plan.max_len, exact=True)
    return plan, target, drafter, prompts, [r.token_ids for r in engine.generate(prompts, plan.new_tokens)]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_exact_speculation_is_spec_off_bit_for_bit_at_a_qwen3_1p7b_shape(qwen3_1p7b, gamma):
    plan, target, drafter, prompts, spec_off = qwen3_1p7b
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=plan.max_len, exact=True)
    spec = [r.token_ids for r in engine.generate(prompts, plan.new_tokens)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(spec_off, spec)]
    assert first == [None] * len(prompts), f"first differences per prompt: {first}"
    assert all(len(s) == plan.new_tokens for s in spec)
