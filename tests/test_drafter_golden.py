"""The drafter against SpecForge's / speculators' own PyTorch modules (float32): the teacher-forced
extend and every step of the draft chain, for each checkpoint format and flag."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models.config import Qwen3Config

import drafter_oracle as oracle

HT, VT, LAYERS = 48, 200, 8

BASE = oracle.DraftSpec(hidden_size=HT, intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=16,
                        target_hidden_size=HT, target_vocab_size=VT, draft_vocab_size=120, rope_theta=1e4)
# (name, spec, writer): between them head_dim != hidden/heads, GQA, draft vocab < target vocab with a
# non-trivial d2t, norm_before_residual, target_hidden_size != hidden_size, fc_norm, the Qwen3 layer.
CASES = [
    ("specforge_gqa_headdim", BASE, oracle.write_specforge),
    ("angelslim_bin_mha", dataclasses.replace(BASE, num_heads=3, num_kv_heads=3, head_dim=24), oracle.write_angelslim),
    ("specforge_wide_target", dataclasses.replace(BASE, hidden_size=32, intermediate_size=64, num_heads=4,
                                                  num_kv_heads=1, head_dim=8), oracle.write_specforge),
    ("specforge_fc_norm", dataclasses.replace(BASE, fc_norm=True), oracle.write_specforge),
    ("specforge_norm_before_residual", dataclasses.replace(BASE, norm_before_residual=True), oracle.write_specforge),
    ("speculators_norm_before_residual", dataclasses.replace(BASE, norm_before_residual=True),
     oracle.write_speculators),
    ("speculators_qwen3_layer", dataclasses.replace(BASE, qk_norm=True, num_kv_heads=1), oracle.write_speculators),
    ("speculators_norm_before_fc_output", dataclasses.replace(BASE, norm_before_fc=True, norm_output=True),
     oracle.write_speculators),
    ("speculators_identity_vocab", dataclasses.replace(BASE, draft_vocab_size=VT), oracle.write_speculators),
]


def fake_target(embed: np.ndarray) -> Target:
    cfg = Qwen3Config.from_dict(dict(model_type="qwen3", vocab_size=VT, hidden_size=HT, intermediate_size=64,
                                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=12))
    return Target(cfg, {"embed": jnp.asarray(embed)}, folder=None)


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(ours - ref)) / np.max(np.abs(ref))


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path):
    name, spec, writer = request.param
    needs = "speculators" if writer is oracle.write_speculators or spec.qk_norm else "auto"
    if needs == "speculators" and not oracle.oracle_supports(spec, "speculators"):
        pytest.skip(oracle.unsupported_reason(spec, "speculators"))
    state = oracle.random_drafter_state(spec, seed=3)
    target_embed = torch.randn(VT, HT, generator=torch.Generator().manual_seed(4)) * 0.5
    own_embed = None
    if spec.hidden_size != HT:
        own_embed = torch.randn(VT, spec.hidden_size, generator=torch.Generator().manual_seed(5)) * 0.5
    kwargs = {"include_embed": own_embed} if writer is oracle.write_speculators else {"embed": own_embed}
    writer(tmp_path / name, spec, state, **kwargs)
    target = fake_target(target_embed.numpy())
    drafter = eagle3_jax.load_drafter(tmp_path / name, target, dtype="float32")
    embed_used = own_embed if own_embed is not None else target_embed
    return spec, state, embed_used, target, drafter, (oracle.ORACLES[2] if needs == "speculators" else "auto")


def inputs(spec, B=2, P=9, seed=6):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, P, 3 * spec.target_hidden_size, generator=g)
    tokens = torch.randint(0, spec.target_vocab_size, (B, P), generator=g)
    return features, tokens


def test_loaded_config_matches_spec(case):
    spec, state, _, _, drafter, _ = case
    cfg = drafter.config
    shape = lambda c: (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads)  # noqa: E731
    assert shape(cfg) == shape(spec)
    assert cfg.draft_vocab_size == spec.draft_vocab_size and cfg.capture_layers == (2, LAYERS // 2, LAYERS - 3)
    assert (cfg.norm_before_residual, cfg.qk_norm, cfg.fc_norm, cfg.norm_before_fc, cfg.norm_output) == (
        spec.norm_before_residual, spec.qk_norm, spec.fc_norm, spec.norm_before_fc, spec.norm_output)
    np.testing.assert_array_equal(np.asarray(drafter.params["d2t"]), state["d2t"].numpy())


def run_extend(drafter, target, features, tokens, capacity=32):
    cfg, params = drafter.config, drafter.params
    embed = params.get("embed", target.params["embed"])
    B = tokens.shape[0]
    cache = drafter_lib.new_row_cache(cfg, B, capacity, jnp.float32)
    h = drafter_lib.project_features(params, cfg, jnp.asarray(features.numpy()))
    out, cache = drafter_lib.forward_rows(params, cfg, embed, h, jnp.asarray(tokens.numpy(), jnp.int32), cache, "xla")
    return out, cache.with_lengths(jnp.full((B,), tokens.shape[1], jnp.int32)), embed


def test_teacher_forced_extend_matches_reference(case):
    spec, state, embed, target, drafter, which = case
    features, tokens = inputs(spec)
    out, _, _ = run_extend(drafter, target, features, tokens)
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    ref_logits, ref_hidden = oracle.reference_forward(state, spec, embed, features, tokens, positions, oracle=which)
    assert rel_err(out, ref_hidden.numpy()) < 1e-4
    assert rel_err(drafter_lib.draft_logits(drafter.params, drafter.config, out), ref_logits.numpy()) < 1e-4


@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_chain_matches_reference(case, gamma):
    spec, state, embed, target, drafter, which = case
    features, tokens = inputs(spec, seed=7)
    out, cache, embed_j = run_extend(drafter, target, features, tokens)
    drafts, _ = drafter_lib.draft_chain(drafter.params, drafter.config, embed_j, out[:, -1], cache.pages, cache.table,
                                        cache.lengths, gamma, "xla")
    ref = oracle.reference_chain(state, spec, embed, features, tokens, gamma, oracle=which)
    assert float(ref.margins.min()) > 1e-3, "argmax too close to call; pick another seed"
    np.testing.assert_array_equal(np.asarray(drafts), ref.draft_ids.numpy())
    # Per-step logits: re-run each step's hidden through the head.
    hidden, carry, tok = [], out[:, -1], None
    for k in range(gamma):
        hidden.append(carry)
        tok = drafts[:, k]
        if k + 1 < gamma:
            h_in = drafter_lib.carried(drafter.params, drafter.config, carry)
            carry, cache = drafter_lib.forward_rows(drafter.params, drafter.config, embed_j, h_in[:, None],
                                                    tok[:, None], cache, "xla")
            carry = carry[:, 0]
            cache = cache.with_lengths(cache.lengths + 1)
    for k in range(gamma):
        logits = drafter_lib.draft_logits(drafter.params, drafter.config, hidden[k])
        assert rel_err(logits, ref.logits[:, k].numpy()) < 1e-4, k
