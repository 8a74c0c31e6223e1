"""Speculation on a Qwen3-MoE target: drafters in SpecForge's flat format with aux layer ids in its
output-of-layer convention (as SpecBundle's Qwen3-30B-A3B drafter) load for the MoE target, and
speculative output equals spec-off output for gamma 1 to 5, up to the cache edge."""

import json

import numpy as np
import pytest
import torch

import eagle3_jax

import drafter_oracle as oracle
import spec_worlds as worlds
from hf_models import build_moe_model, save_moe_model

LAYERS, V, MAX_LEN = 7, worlds.V, 40
AUX_IDS = [1, LAYERS // 2 - 1, LAYERS - 4]  # SpecBundle's [1, 23, 44] for 48 layers
# SpecBundle's 30B-A3B drafter at tiny scale: the target's width, GQA 8 (its 32 / 4 heads), a draft
# vocabulary smaller than the target's.
SPECBUNDLE = oracle.DraftSpec(hidden_size=V, intermediate_size=64, num_heads=8, num_kv_heads=1, head_dim=8,
                              target_hidden_size=V, target_vocab_size=V, draft_vocab_size=40)


def moe_permutation_target(folder):
    """spec_worlds' permutation target with the experts left random: attention outputs zeroed, one-hot
    embeddings, lm_head a permuted identity, so the next token is pi(x) unless the MoE layers move it
    (they do at about one step in ten, so the pi2 drafter's first draft is accepted or not)."""
    name = "moe_top3_norm_fused"
    model = build_moe_model(name, seed=3, num_layers=LAYERS, vocab=V, hidden=V)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(V) * 0.7)
        head = torch.zeros(V, V)
        head[torch.as_tensor(worlds.PI), torch.arange(V)] = 1.0
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.copy_(0.5 + torch.rand(V))
    return eagle3_jax.load_target(save_moe_model(model, folder, name), dtype="float32", progress=False)


def write_drafter(folder, spec, state):
    oracle.write_specforge(folder, spec, state)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX_IDS}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_spec")
    target = moe_permutation_target(root / "target")
    spec, state = worlds.drafter_state("pi2")
    drafter = eagle3_jax.load_drafter(write_drafter(root / "pi2", spec, state), target, dtype="float32")
    return target, drafter, root


def test_specbundle_layout_drafter_captures_the_default_layers(pair):
    target, _, root = pair
    folder = write_drafter(root / "specbundle", SPECBUNDLE, oracle.random_drafter_state(SPECBUNDLE, seed=4))
    drafter = eagle3_jax.load_drafter(folder, target, dtype="float32")
    assert target.config.moe is not None and drafter.config.draft_vocab_size == 40
    assert drafter.config.capture_layers == target.config.default_capture_layers == (2, LAYERS // 2, LAYERS - 3)
    with pytest.raises(ValueError, match="dense targets"):  # no row-invariant expert kernels
        eagle3_jax.Engine(target, drafter, max_len=MAX_LEN, exact=True)


def test_lossless_for_every_gamma_up_to_the_cache_edge(pair):
    """One batch: a short prompt, and every start length within gamma + 2 of max_len for gamma up to 5."""
    target, drafter, _ = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, size=n).tolist() for n in [5] + list(range(MAX_LEN - 7, MAX_LEN))]
    expected = eagle3_jax.Engine(target, max_len=MAX_LEN).generate(prompts, 50)
    for gamma in (1, 2, 3, 4, 5):
        got = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=MAX_LEN).generate(prompts, 50)
        for prompt, e, g in zip(prompts, expected, got):
            assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason == "length", gamma
            assert len(prompt) + len(g.token_ids) == MAX_LEN and all(0 <= a <= 1 for a in g.accept_lengths)
        # pi2's first draft is right wherever the MoE layers keep the next token at pi(x)
        assert {0, 1} <= set(got[0].accept_lengths), gamma
