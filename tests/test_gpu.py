"""Numerical checks on a GPU at real shapes (`pytest -m gpu`; skipped, with the reason, without one).

The fused add + RMSNorm against XLA's in every dtype the API offers (bfloat16, float16, float32). The paged
attention kernel's own checks are tests/test_ragged_paged_attention.py's GPU cases.
Then the engine at a Qwen3-1.7B shape and at a 6-layer Qwen3-30B-A3B one (random weights): in float32 the
Pallas kernels are to give XLA's tokens, spec and spec-off alike (the MoE one at IEEE float32 products); in
every dtype speculation runs at batch 8 (the ragged paged kernel in 16-bit), and the rate at which 16-bit
speculative output agrees with spec-off output is printed (it can differ at near-ties: README).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
import pallas_kernels
from eagle3_jax.models import layers, moe
from eagle3_jax.models.kernels import hopper
from eagle3_jax.models.layers import add_rms_norm, norm_lowering
from eagle3_jax_bench import inputs, presets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run: pytest -m gpu on one)"),
]

DTYPES = ["bfloat16", "float16", "float32"]
# Relative max error against a float32 reference.
TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


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


def _models(dtype):
    """A Qwen3-1.7B-shaped target and a drafter of its width, random weights (eagle3_jax_bench/presets.py)."""
    return inputs.random_models(presets.pair("qwen3-1.7b"), jnp.dtype(dtype))


PROMPTS = [list(range(3, 3 + n)) for n in (16, 200, 37, 500, 64, 90, 128, 300)]


def _generate(target, drafter, kernels, gamma=3, new=48, **tree):
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=1024, kernels=kernels,
                               kv_tokens=len(PROMPTS) * 1024, **tree)
    return [r.token_ids for r in engine.generate(PROMPTS, new)]


def test_float32_engine_pallas_equals_xla():
    target, drafter = _models("float32")
    for d in (None, drafter):
        assert _generate(target, d, "pallas") == _generate(target, d, "xla")


@pytest.mark.parametrize("M", [1, 8, 32])
def test_moe_kernels_equal_xla_at_qwen3_30b_a3b_widths(M):
    """One Qwen3-30B-A3B layer's routing and routed experts (128 experts, 8 a token, D 2048, I 768; random
    weights) at 1, 8 and 32 tokens, compiled: the router kernel and the XLA path's ranks give lax.top_k's ids and
    weights (unbarred, the ranks collided at 8 and 32 tokens: models/moe.py, top_k_ranked), and the expert
    kernel the gathered path's output, in float32 at IEEE products (both sides) and in bfloat16."""
    keys = jax.random.split(jax.random.key(M), 4)
    E, D, Ie, k = 128, 2048, 768, 8
    x = jax.random.normal(keys[0], (M, D))
    router = jax.random.normal(keys[1], (E, D)) / np.sqrt(D)
    w_gate_up = jax.random.normal(keys[2], (E, 2 * Ie, D)) / np.sqrt(D)
    w_down = jax.random.normal(keys[3], (E, D, Ie)) / np.sqrt(Ie)
    with jax.default_matmul_precision("highest"):
        weights, ids = jax.jit(lambda x: moe.route(x, router, k, True, "sort"))(x)  # lax.top_k
        for select in ("kernel", "rank"):
            got_weights, got_ids = jax.jit(lambda x: moe.route(x, router, k, True, select))(x)
            np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids), err_msg=select)
            np.testing.assert_allclose(np.asarray(got_weights), np.asarray(weights), rtol=1e-6, err_msg=select)
        got = jax.jit(moe.experts_kernel)(x, weights, ids, w_gate_up, w_down)
        want = jax.jit(moe.experts_gathered)(x, weights, ids, w_gate_up, w_down)
        assert _rel_err(got, want) < 1e-5
    low = [a.astype(jnp.bfloat16) for a in (x, weights, w_gate_up, w_down)]
    got = jax.jit(moe.experts_kernel)(low[0], low[1], ids, low[2], low[3])
    assert _rel_err(got, moe.experts_gathered(low[0], low[1], ids, low[2], low[3])) < 2e-2


@pytest.mark.parametrize("M", [64, 2048])
def test_tiled_prefill_path_matches_the_dense_reference_at_qwen3_30b_a3b_widths(M):
    """The prefill chunks' expert path (models/moe.py, experts_tiled at tile_rows' tile: 128 rows at 64 tokens,
    256 at 2,048) on one Qwen3-30B-A3B layer's widths, random routing, compiled: in float32 at IEEE products
    against every expert run densely, and in bfloat16 against XLA's grouped GEMMs."""
    keys = jax.random.split(jax.random.key(M), 4)
    E, D, Ie, k = 128, 2048, 768, 8
    x = jax.random.normal(keys[0], (M, D))
    w_gate_up = jax.random.normal(keys[1], (E, 2 * Ie, D)) / np.sqrt(D)
    w_down = jax.random.normal(keys[2], (E, D, Ie)) / np.sqrt(Ie)
    weights, ids = moe.route(x, jax.random.normal(keys[3], (E, D)) / np.sqrt(D), k, True, "sort")
    with jax.default_matmul_precision("highest"):
        got = jax.jit(moe.experts_tiled)(x, weights, ids, w_gate_up, w_down)
        assert _rel_err(got, jax.jit(moe.moe_reference)(x, weights, ids, w_gate_up, w_down)) < 1e-5
    low = [a.astype(jnp.bfloat16) for a in (x, weights, w_gate_up, w_down)]
    got = jax.jit(moe.experts_tiled)(low[0], low[1], ids, low[2], low[3])
    assert _rel_err(got, jax.jit(moe.experts_grouped)(low[0], low[1], ids, low[2], low[3])) < 2e-2


def test_float32_moe_engine_pallas_equals_xla():
    """A Qwen3-MoE target at Qwen3-30B-A3B's widths cut to 6 layers (128 experts, 8 a token; random weights) in
    float32: the Pallas kernels (the router's top-k and the routed experts in their kernels; attention takes the XLA
    path in float32) give XLA's tokens (ranks, the gathered experts at decode and the tiled ones at prefill), spec
    and spec-off alike. Both at IEEE float32 products: the expert kernel's float32 dots are IEEE, while XLA's
    default on a GPU is TF32, and at XLA's default the two differed from the first decoded token on (random router
    logits sit close at the 8th and 9th expert). The message names the first difference."""
    models = presets.moe_pair(vocab=151936, hidden=2048, layers=6, heads=32, kv_heads=4, head_dim=128, experts=128,
                              top_k=8, moe_intermediate=768, draft_intermediate=6144, draft_vocab=32000)
    target, drafter = inputs.random_models(models, jnp.float32)
    for d in (None, drafter):
        with jax.default_matmul_precision("highest"):
            pallas, xla = _generate(target, d, "pallas"), _generate(target, d, "xla")
        differ = [(row, next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)) for row, (x, y)
                  in enumerate(zip(pallas, xla)) if x != y]
        assert not differ, f"{'spec' if d else 'spec-off'}: (row, first differing token) {differ}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_engine_speculates_at_batch_8(dtype):
    target, drafter = _models(dtype)
    spec_off, spec = _generate(target, None, "pallas"), _generate(target, drafter, "pallas")
    assert all(len(s) == 48 for s in spec)
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(spec_off, spec)]
    identical = sum(a == len(x) for a, x in zip(agreed, spec_off))
    print(f"\n{dtype}: {identical}/8 rows identical to spec-off; first differences at {agreed}")
    assert all(a >= 1 for a in agreed)  # the first token comes from the shared prefill


def test_16_bit_draft_tree_at_batch_8():
    """A (16, 5, 4) draft tree in bf16 (the ragged paged kernel with a tree mask, for the drafter's beams and the
    verify): its output against spec-off's, printed as the 16-bit chain's is; and in float32 (the XLA path for
    attention) the Pallas kernels give XLA's tokens."""
    tree = dict(draft_depth=5, draft_top_k=4)
    target, drafter = _models("bfloat16")
    spec_off, spec = _generate(target, None, "pallas"), _generate(target, drafter, "pallas", 16, **tree)
    assert all(len(s) == 48 for s in spec)
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(spec_off, spec)]
    print(f"\nbfloat16 tree: {sum(a == 48 for a in agreed)}/8 rows identical to spec-off; first differences {agreed}")
    assert all(a >= 1 for a in agreed)
    target, drafter = _models("float32")
    assert _generate(target, drafter, "pallas", 16, **tree) == _generate(target, drafter, "xla", 16, **tree)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_sampling_build_at_top_k_1_is_greedy(proposal):
    """The sampling program at real shapes (the filter over 151,936 tokens, the rejection sampler, both
    proposals): with top_k 1 the target's distribution is its argmax, so the tokens are greedy's."""
    target, drafter = _models("bfloat16")
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=1024, proposal=proposal,
                               kv_tokens=len(PROMPTS) * 1024)
    greedy = [r.token_ids for r in engine.generate(PROMPTS, 32)]
    sampled = [r.token_ids for r in engine.generate(PROMPTS, 32, temperature=0.8, top_k=1, seed=list(range(8)))]
    assert sampled == greedy
