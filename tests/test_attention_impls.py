"""The model with each kernel choice (eagle3_jax/models/kernels.py; the Pallas kernels in interpret mode on
the CPU) against the model with XLA's: same logits, same greedy and speculative output. The kernels
themselves are checked against their references in test_ragged_paged_attention.py and test_fused_kernels.py."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.kernels import ABLATION, CHOICES

import drafter_oracle as oracle
from hf_models import build_model, save_model

# head_dim 16 (a power of two, which the kernels need) on both sides.
SPEC = oracle.DraftSpec(hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16,
                        target_hidden_size=32, target_vocab_size=96, draft_vocab_size=96)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("impls")
    save_model(build_model("gqa4_tied_yarn", seed=5, num_layers=4, vocab=96), root / "t", "gqa4_tied_yarn")
    target = eagle3_jax.load_target(root / "t", dtype="float32", progress=False)
    oracle.write_specforge(root / "d", SPEC, oracle.random_drafter_state(SPEC, seed=5))
    return target, eagle3_jax.load_drafter(root / "d", target, dtype="float32")


def test_forward_logits_agree(models):
    target, _ = models
    cfg = target.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 20)), jnp.int32)
    out = {}
    for impl in CHOICES + (ABLATION,):
        cache = target_lib.new_row_cache(cfg, 2, 40, jnp.float32)
        hidden, cache, _ = target_lib.forward_rows(target.params, cfg, tokens, cache, (), impl)
        cache = cache.with_lengths(jnp.array([20, 13], jnp.int32))
        step, _, _ = target_lib.forward_rows(target.params, cfg, tokens[:, :3], cache, (), impl)  # a verify's shape
        out[impl] = np.concatenate([hidden, step], axis=1)
    for impl in out:
        np.testing.assert_allclose(out[impl], out["xla"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kernels must be one of"):  # a typo is not silently XLA
        target_lib.forward_rows(target.params, cfg, tokens, target_lib.new_row_cache(cfg, 2, 40, jnp.float32), (),
                                "palas")


def test_engine_output_agrees(models):
    target, drafter = models
    prompts = [[5, 17, 3, 9], list(range(1, 21))]
    for d in (None, drafter):
        results = {impl: eagle3_jax.Engine(target, d, num_draft_tokens=2, max_len=48, kernels=impl).generate(prompts, 6)
                   for impl in CHOICES}
        assert results["pallas"] == results["xla"]


def test_engine_refuses_unsupported_kernels(models):
    """The ablation is the benchmark's only; a head_dim the paged kernel does not take runs with kernels="pallas"
    (attention then takes the XLA path), where exact=True's attention kernel refuses it."""
    target, _ = models
    with pytest.raises(ValueError, match="kernels must be one of"):
        eagle3_jax.Engine(target, max_len=32, kernels=ABLATION)
    odd = dataclasses.replace(target, config=dataclasses.replace(target.config, head_dim=24))
    assert eagle3_jax.Engine(odd, max_len=32, kernels="pallas").spec.kernels == "pallas"
    with pytest.raises(ValueError, match="exact=True needs a power-of-two head_dim"):
        eagle3_jax.Engine(odd, max_len=32, exact=True)
