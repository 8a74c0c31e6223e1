"""Engine(exact=True): a token's result is bit-identical whether it is computed alone (decode, T = 1) or as
one of T tokens (verify), at any batch size, so speculative output is spec-off output bit for bit in
bfloat16. Checked at each kernel (row i of a T-row call against a one-row call, and against the kernel's
reference), at the target's step (a verify of T tokens against T one-token steps), and through the Engine.
A kernel whose key runs follow the call's T fails the same kernel check: the check can fail. On the CPU the exact
kernels run in Pallas' interpreter; tests/test_exact_gpu.py runs the same checks on a GPU.
"""

import dataclasses
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
import pallas_kernels
from eagle3_jax.models import qwen3
from eagle3_jax_bench import exact as bench_exact
from eagle3_jax_bench import inputs

DTYPES = ["bfloat16", "float32"]
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-5}  # against the float32 references, relative to the max


def bits(x) -> np.ndarray:
    """The bit patterns of an array: equality of these is bit-identity (-0 != 0, NaN == same NaN)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _close(got, want, dtype) -> bool:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_matmul_rows_do_not_depend_on_the_row_count(dtype, monkeypatch):
    """20 rows (two row tiles, the second partial), K = 48 (a partial K block), N = 80 (16-row weight
    blocks): every row equals the same row computed alone or among 5."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (20, 48), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (80, 48), jnp.float32).astype(dtype)
    full = pallas_kernels.skinny_matmul(x, w, interpret=True, block_k=32)
    assert _close(full, pallas_kernels.skinny_matmul_reference(x, w), dtype)
    for m in (0, 7, 19):
        np.testing.assert_array_equal(bits(pallas_kernels.skinny_matmul(x[m:m + 1], w, interpret=True, block_k=32)),
                                      bits(full[m:m + 1]))
    np.testing.assert_array_equal(bits(pallas_kernels.skinny_matmul(x[:5], w, interpret=True, block_k=32)),
                                  bits(full[:5]))
    wide = pallas_kernels.skinny_matmul(x.reshape(4, 5, 48), w, out_dtype=jnp.float32, interpret=True, block_k=32)
    assert wide.shape == (4, 5, 80) and wide.dtype == jnp.float32
    # More rows than one call takes (MAX_ROWS, here lowered to 8) go through further calls, bit for bit the same.
    monkeypatch.setattr(importlib.import_module("pallas_kernels.skinny_matmul"), "MAX_ROWS", 8)
    np.testing.assert_array_equal(bits(pallas_kernels.skinny_matmul(x, w, interpret=True, block_k=32)), bits(full))


def test_row_tunings_fit_shared_memory_and_count_it_as_the_gpu_does():
    """The shared-memory count against the two figures the H200 quoted when it refused a tuning (block_k 512:
    q/k/v at 64 rows, gate/up at one row); every tuning row_tuning picks, at Qwen3 dense shapes from 0.6B to
    32B and every row count of a call, fits; the buckets are the sweep's."""
    sm = importlib.import_module("pallas_kernels.skinny_matmul")

    def asked(n, k, rows, **tuning):
        return sm.shared_bytes(sm.SkinnyConfig.for_weight(n, k, 2, **tuning), n, k, 2, rows)

    assert asked(6144, 4096, 64, block_k=512) == 294912 and asked(24576, 4096, 1, block_k=512) == 245760
    # hidden, intermediate, q/k/v rows: Qwen3-0.6B, 8B, 32B; the lm_head's vocabulary
    for d, i, qkv in ((1024, 3072, 4096), (4096, 12288, 6144), (5120, 25600, 10240)):
        for n, k in ((qkv, d), (d, d * 2), (2 * i, d), (d, i), (151936, d)):
            for itemsize in (2, 4):
                for rows in range(1, sm.MAX_ROWS + 1):
                    config = sm.SkinnyConfig.for_weight(n, k, itemsize, **sm.row_tuning(n, k, itemsize, rows))
                    assert sm.shared_bytes(config, n, k, itemsize, rows) <= sm.SHARED_BYTES, (n, k, itemsize, rows)
    assert sm.row_tuning(4096, 12288, 2, 16) == {} and sm.row_tuning(4096, 12288, 4, 64) == {}
    assert sm.row_tuning(4096, 12288, 2, 32) == {"block_k": 512}
    assert sm.row_tuning(24576, 4096, 2, 64) == {"block_n": 256, "block_k": 64}
    assert sm.row_tuning(6144, 4096, 2, 40) == {"block_n": 64}
    assert sm.row_tuning(16384, 16384, 2, 32) == {}  # block_k 512 beside 64-row weight blocks would not fit


def _attention_case(dtype):
    """4 rows of 8 new tokens over a cache of 100, 4 / 2 heads of 16, 16-key blocks: rows start at 0, 29, 37
    and 90, so their queries span 1 to 7 key blocks, in up to 3 runs."""
    B, T, N, K, H, S = 4, 8, 4, 2, 16, 100
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(x, (B, K, S, H), jnp.float32).astype(dtype) for x in (kk, kv))
    return q, k, v, jnp.array([0, 29, 37, 90], jnp.int32)


def _rows_that_differ(attention, q, k, v, start) -> int:
    """How many (row, token) results of one call [B, T] differ from the same query computed alone (B = 1,
    T = 1)."""
    full = bits(attention(q, k, v, start))
    differ = 0
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            alone = attention(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], start[b:b + 1] + t)
            differ += not np.array_equal(bits(alone[0, 0]), full[b, t])
    return differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_rows_do_not_depend_on_T_or_B(dtype):
    q, k, v, start = _attention_case(dtype)

    def invariant(*args):
        return pallas_kernels.invariant_attention(*args, scale=0.25, interpret=True, block_k=16, max_splits=3,
                                                  rows=16)  # 8 tokens x 2 heads: one tile of 16

    assert _close(invariant(q, k, v, start), pallas_kernels.attention_reference(q, k, v, start, scale=0.25), dtype)
    assert _rows_that_differ(invariant, q, k, v, start) == 0
    if dtype == "bfloat16":  # a kernel whose key runs follow the call's T (as a split count set by the batch) fails
        def split_by_length(q, k, v, start):
            return pallas_kernels.invariant_attention(q, k, v, start, scale=0.25, interpret=True, block_k=16,
                                                      max_splits=q.shape[1] + 1, rows=16)

        assert _rows_that_differ(split_by_length, q, k, v, start) > 0


PLAN = bench_exact.tiny_plan()  # head_dim 16, GQA 2; its agreement run is the engine test's


def test_exact_verify_equals_one_token_steps():
    """bfloat16, batch 3 at lengths 3, 20 and 41 of a cache of 64: the logits and the cache a verify of 4
    tokens leaves are those of 4 one-token steps, bit for bit (the verify compiles as bench_exact's)."""
    cfg = PLAN.models.target
    params = inputs.random_tree(qwen3.abstract_params(cfg, jnp.bfloat16), seed=1)
    cache = inputs.random_cache(cfg.num_layers, 3, cfg.num_kv_heads, PLAN.capacity, cfg.head_dim, 0, jnp.bfloat16, 5)
    cache = cache.with_lengths(jnp.array([3, 20, 41], jnp.int32))
    tokens = jax.random.randint(jax.random.key(2), (3, PLAN.verify_tokens), 0, cfg.vocab_size)

    def step(tokens, cache):
        return bench_exact.jit_verify(params, tokens, cache, cfg=cfg, capture=PLAN.models.drafter.capture_layers,
                                      kernels="exact")

    verify_cache, (verify_logits, _) = step(tokens, jax.tree.map(jnp.copy, cache))
    for t in range(PLAN.verify_tokens):
        cache, (logits, _) = step(tokens[:, t:t + 1], cache)
        np.testing.assert_array_equal(bits(logits[:, 0]), bits(verify_logits[:, t]))
        cache = cache.with_lengths(cache.lengths + 1)
    for mine, theirs in zip(cache.pages.k + cache.pages.v, verify_cache.pages.k + verify_cache.pages.v):
        np.testing.assert_array_equal(bits(mine), bits(theirs))


def test_exact_engine_speculation_is_spec_off_bit_for_bit_in_bfloat16():
    """3 prompts, 40 tokens, gamma 3 (tests/test_exact_gpu.py: gamma 1, 3 and 5 at a Qwen3-1.7B shape)."""
    target, drafter = bench_exact.random_models(PLAN.agreement_models, jnp.bfloat16)
    prompts = bench_exact.prompts_for(PLAN)
    spec_off = eagle3_jax.Engine(target, max_len=PLAN.max_len, exact=True).generate(prompts, PLAN.new_tokens)
    spec = eagle3_jax.Engine(target, drafter, num_draft_tokens=PLAN.gamma, max_len=PLAN.max_len,
                             exact=True).generate(prompts, PLAN.new_tokens)
    assert [r.token_ids for r in spec] == [r.token_ids for r in spec_off]
    assert all(len(r.token_ids) == PLAN.new_tokens for r in spec)
    with pytest.raises(ValueError, match="exact must be a bool"):
        eagle3_jax.Engine(target, max_len=64, exact="yes")
    odd_vocab = dataclasses.replace(target, config=dataclasses.replace(target.config, vocab_size=250))
    with pytest.raises(ValueError, match=r"multiple of 16 .*lm_head 250"):  # refused before any tracing
        eagle3_jax.Engine(odd_vocab, max_len=64, exact=True)


def test_bench_exact_dry_run(tmp_path):
    """eagle3_jax_bench/exact.py at tiny shapes: every section runs and reports; its exact agreement row is
    the engine test's run (compiled once in this process)."""
    # block_n 8 is refused by the kernel's config: a row of its own, and the sweep goes on.
    assert bench_exact.main(["--tiny", "--out", str(tmp_path), "--tunings", '[{"block_n": 16}, {"block_n": 8}]',
                             "--matmul-shapes", "wo", "lm_head"]) == 0
    results = json.loads((tmp_path / "bench_exact.json").read_text())
    assert results["skipped"] == []
    assert {(r["batch"], r["exact"]) for r in results["step"]} == {(3, False), (3, True)}
    assert {(r["batch"], r["exact"]) for r in results["verify"]} == {(3, False), (3, True)}
    assert {(r["batch"], r["exact"], r["gamma"]) for r in results["round"]} == {(3, False, 3), (3, True, 3)}
    assert all(r["time_ms"] > 0 and r["floor_ms"] > 0 for r in results["step"] + results["verify"] + results["round"])
    matmuls = {(r["weight"], r["rows"], r["impl"], json.dumps(r["tuning"])) for r in results["matmul"]}
    assert matmuls == {(w, 4, impl, t) for w in ("wo", "lm_head")
                       for impl, t in (("xla", "null"), ("pallas", "{}"), ("pallas", '{"block_n": 16}'))}
    assert all(r["rel_err"] < 2e-2 for r in results["matmul"] if r["impl"] == "pallas")
    refused = results["matmul_refused"]
    assert [(r["weight"], r["tuning"]) for r in refused] == [("wo", {"block_n": 8}), ("lm_head", {"block_n": 8})]
    assert all("block_n=8" in r["error"] for r in refused)
    exact_rows = [r for r in results["agreement"] if r["exact"]]
    assert len(exact_rows) == 1 and exact_rows[0]["identical"] == 3
