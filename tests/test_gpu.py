"""Numerical checks on a GPU at real shapes (`pytest -m gpu`; skipped, with the reason, without one).

Every GPU kernel against its plain-jnp reference in every dtype the API offers (bfloat16, float16,
float32), at Qwen3-8B head shapes: the Triton decode/verify and prefill attention, the Mosaic GPU prefill
(bf16/f16; float32 takes the Triton kernel), the fused add + RMSNorm (Mosaic GPU on Hopper, Triton elsewhere)
and q/k norm + RoPE + cache write.
Then the engine at a Qwen3-1.7B shape (random weights): in float32 the Pallas kernels give XLA's tokens,
spec and spec-off alike; in every dtype speculation runs at batch 8, and the rate at which 16-bit
speculative output agrees with spec-off output is printed (it can differ at near-ties: README).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
import pallas_kernels
from eagle3_jax.models import layers
from eagle3_jax.models.attention import rotate_and_cache, uses_mosaic_prefill
from eagle3_jax.models.config import RopeConfig
from eagle3_jax.models.kernels import hopper
from eagle3_jax.models.layers import add_rms_norm, norm_lowering, rope_tables
from eagle3_jax_bench import inputs, presets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run: pytest -m gpu on one)"),
]

DTYPES = ["bfloat16", "float16", "float32"]
# Relative max error against a float32 reference.
TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
N, K, H = 32, 8, 128  # Qwen3-8B attention heads


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def _attention_inputs(B, T, S, lengths, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(x, (B, K, S, H), jnp.float32).astype(dtype) for x in (kk, kv))
    return q, k, v, jnp.asarray(lengths, jnp.int32) - T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,S", [(1, 1, 16384), (1, 4, 16384), (8, 8, 4096), (32, 1, 2048)])
def test_decode_attention(dtype, B, T, S):
    lengths = np.linspace(T, S, B).astype(int) if B > 1 else [S - 7]
    q, k, v, start = _attention_inputs(B, T, S, lengths, dtype)
    out = pallas_kernels.decode_attention(q, k, v, start, scale=H**-0.5)
    ref = pallas_kernels.attention_reference(q, k, v, start, scale=H**-0.5)
    assert _rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,S,start", [(1, 2048, 2048, 0), (2, 1000, 4096, 37), (1, 8192, 8192, 0)])
def test_prefill_attention(dtype, B, T, S, start):
    """The kernel the model takes for a prompt (Mosaic GPU on Hopper for bf16/f16, else Triton) and the
    Triton kernel itself, both against the reference."""
    q, k, v, starts = _attention_inputs(B, T, S, [start + T] * B, dtype, seed=T)
    ref = pallas_kernels.attention_reference(q, k, v, starts, scale=H**-0.5)
    triton = pallas_kernels.prefill_attention(q, k, v, starts, scale=H**-0.5)
    assert _rel_err(triton, ref) < TOLERANCE[dtype]
    if uses_mosaic_prefill(q, k, v, on_hopper=hopper()):
        mosaic = pallas_kernels.prefill_attention_mgpu(q, k, v, starts, scale=H**-0.5)
        assert _rel_err(mosaic, ref) < TOLERANCE[dtype]
    else:
        assert dtype == "float32" or not hopper()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels(dtype):
    B, T, D = 8, 4, 4096
    keys = jax.random.split(jax.random.key(1), 8)
    x, delta = (jax.random.normal(k, (B, T, D), jnp.float32).astype(dtype) for k in keys[:2])
    w = (1 + 0.1 * jax.random.normal(keys[2], (D,))).astype(dtype)
    for got, want in zip(add_rms_norm(x, delta, w, 1e-6, "pallas"), add_rms_norm(x, delta, w, 1e-6, "xla")):
        assert _rel_err(got, want) < TOLERANCE[dtype]
    mosaic = hopper() and pallas_kernels.add_rms_norm_mgpu_unsupported(x, delta, w) is None  # Hopper, jax 0.12
    chosen = "mosaic_gpu" if mosaic and layers.MOSAIC_NORM_ON_HOPPER else "triton"
    assert norm_lowering(x, delta, w, "pallas", on_hopper=hopper()) == chosen
    wide = [(jax.random.normal(k, (3, 5120), jnp.float32) + 1).astype(dtype) for k in keys[:3]]  # Qwen3-32B
    cases = ((x, delta, w), (x[:1, :3], None, w), (x[:3, :1], delta[:3, :1], w), (wide[0], wide[1], wide[2][0]))
    # The Mosaic GPU kernel where it runs (Hopper, jax 0.12), else the Triton one
    kernel = pallas_kernels.add_rms_norm_mgpu if mosaic else pallas_kernels.add_rms_norm
    for rows, d, weight in cases:
        for got, want in zip(kernel(rows, d, weight, eps=1e-6), add_rms_norm(rows, d, weight, 1e-6, "xla")):
            assert _rel_err(got, want) < TOLERANCE[dtype]
    S = 1024
    qkv = jax.random.normal(keys[3], (B, T, (N + 2 * K) * H), jnp.float32).astype(dtype)
    positions = jax.random.randint(keys[4], (B, T), 0, 40000)
    cos, sin = rope_tables(positions, RopeConfig(theta=1e6, head_dim=H), jnp.dtype(dtype))  # the halves repeat
    k_cache, v_cache = (jax.random.normal(k, (B, K, S, H), jnp.float32).astype(dtype)
                        for k in jax.random.split(keys[6]))
    norms = (1 + 0.1 * jax.random.normal(keys[7], (2, H))).astype(dtype)
    start = jnp.arange(B, dtype=jnp.int32) * 100
    args = (qkv, cos, sin, k_cache, v_cache, start)
    kwargs = dict(num_heads=N, q_norm=norms[0], k_norm=norms[1], eps=1e-6)
    for got, want in zip(rotate_and_cache(*args, **kwargs, kernels="pallas"),
                         rotate_and_cache(*args, **kwargs, kernels="xla")):
        assert _rel_err(got, want) < TOLERANCE[dtype]


def _models(dtype):
    """A Qwen3-1.7B-shaped target and a drafter of its width, random weights (eagle3_jax_bench/presets.py)."""
    return inputs.random_models(presets.pair("qwen3-1.7b"), jnp.dtype(dtype))


PROMPTS = [list(range(3, 3 + n)) for n in (16, 200, 37, 500, 64, 90, 128, 300)]


def _generate(target, drafter, kernels, gamma=3, new=48):
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=1024, kernels=kernels)
    return [r.token_ids for r in engine.generate(PROMPTS, new)]


def test_float32_engine_pallas_equals_xla():
    target, drafter = _models("float32")
    for d in (None, drafter):
        assert _generate(target, d, "pallas") == _generate(target, d, "xla")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_engine_speculates_at_batch_8(dtype):
    target, drafter = _models(dtype)
    spec_off, spec = _generate(target, None, "pallas"), _generate(target, drafter, "pallas")
    assert all(len(s) == 48 for s in spec)
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(spec_off, spec)]
    identical = sum(a == len(x) for a, x in zip(agreed, spec_off))
    print(f"\n{dtype}: {identical}/8 rows identical to spec-off; first differences at {agreed}")
    assert all(a >= 1 for a in agreed)  # the first token comes from the shared prefill


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_sampling_build_at_top_k_1_is_greedy(proposal):
    """The sampling program at real shapes (the filter over 151,936 tokens, the rejection sampler, both
    proposals): with top_k 1 the target's distribution is its argmax, so the tokens are greedy's."""
    target, drafter = _models("bfloat16")
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=1024, proposal=proposal)
    greedy = [r.token_ids for r in engine.generate(PROMPTS, 32)]
    sampled = [r.token_ids for r in engine.generate(PROMPTS, 32, temperature=0.8, top_k=1, seed=list(range(8)))]
    assert sampled == greedy
