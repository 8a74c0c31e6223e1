"""The target against transformers' Qwen3 (float32, CPU): logits at prefill and every decode step,
and the EAGLE-3 features, for a batch of prompts of different lengths."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax.models import qwen3 as target_lib

from hf_models import CONFIGS, build_model, save_model

PROMPTS = [[5, 17, 3, 99, 42, 8, 11], [150, 2], [7, 7, 7, 21, 64]]
STEPS = [[12, 77, 140], [1, 159, 30], [45, 45, 0]]  # teacher-forced decode tokens per row


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(ours - ref)) / np.max(np.abs(ref))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    model = build_model(request.param)
    folder = save_model(model, tmp_path_factory.mktemp(request.param), request.param)
    return request.param, model, eagle3_jax.load_target(folder, dtype="float32", progress=False)


def hf_reference(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def test_prefill_decode_and_features_match_transformers(case):
    name, model, tgt = case
    cfg = tgt.config
    capture = cfg.default_capture_layers
    B, Tp = len(PROMPTS), 8
    tokens = np.zeros((B, Tp), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = p
    lengths = jnp.array([len(p) for p in PROMPTS], jnp.int32)
    cache = target_lib.new_row_cache(cfg, B, 32, jnp.float32)
    hidden, cache, feats = target_lib.forward_rows(tgt.params, cfg, jnp.asarray(tokens), cache, capture)
    logits = target_lib.logits(tgt.params, hidden)
    cache = cache.with_lengths(lengths)
    step_logits = []
    for s in range(len(STEPS[0])):
        step_tokens = jnp.array([[row[s]] for row in STEPS], jnp.int32)
        h, cache, _ = target_lib.forward_rows(tgt.params, cfg, step_tokens, cache, capture)
        step_logits.append(np.asarray(target_lib.logits(tgt.params, h))[:, 0])
        cache = cache.with_lengths(cache.lengths + 1)
    for i, prompt in enumerate(PROMPTS):
        ref_logits, ref_hidden = hf_reference(model, prompt + STEPS[i])
        P = len(prompt)
        assert rel_err(logits[i, :P], ref_logits[:P]) < 1e-4, name
        for s in range(len(STEPS[i])):
            assert rel_err(step_logits[s][i], ref_logits[P + s]) < 1e-4, (name, s)
        ref_feats = np.concatenate([ref_hidden[layer][:P] for layer in capture], axis=-1)
        assert rel_err(feats[i, :P], ref_feats) < 1e-4, name


def test_batch_one_decode_matches_transformers(case):
    """One sequence, one token a step: the shapes for which `linear` takes its reduction form on CUDA
    (tests/test_layers.py checks that form; here, on the CPU, XLA's dot)."""
    name, model, tgt = case
    cfg, prompt, steps = tgt.config, PROMPTS[0], STEPS[0]
    cache = target_lib.new_row_cache(cfg, 1, 16, jnp.float32)
    _, cache, _ = target_lib.forward_rows(tgt.params, cfg, jnp.asarray([prompt]), cache)
    cache = cache.with_lengths(cache.lengths + len(prompt))
    ref_logits, _ = hf_reference(model, prompt + steps)
    for s, token in enumerate(steps):
        h, cache, _ = target_lib.forward_rows(tgt.params, cfg, jnp.asarray([[token]]), cache)
        cache = cache.with_lengths(cache.lengths + 1)
        assert rel_err(target_lib.logits(tgt.params, h)[0, 0], ref_logits[len(prompt) + s]) < 1e-4, (name, s)
