"""Sanity tests of the outside oracle in tests/drafter_oracle.py (not of the JAX code).

Needs torch (CPU), transformers, safetensors, SpecForge 0.2.0 and speculators 0.9.0 (both --no-deps, as the Makefile
installs them); a missing or broken one fails the module's import, never skips.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))

import drafter_oracle as O  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:flash_attn is not found")

# The oracles import, or the module fails.
O.import_specforge()
O.import_speculators()

BASE = O.DraftSpec(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                   target_hidden_size=64, target_vocab_size=120, draft_vocab_size=48, rope_theta=10000.0)
# head_dim * num_heads != hidden_size and Ht != H, like published configs that set head_dim
ODD = O.DraftSpec(hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=1, head_dim=24,
                  target_hidden_size=40, target_vocab_size=100, draft_vocab_size=30, rope_theta=1e6,
                  rms_norm_eps=1e-5)
NBR = O.DraftSpec(**{**BASE.__dict__, "norm_before_residual": True})
FCN = O.DraftSpec(**{**BASE.__dict__, "fc_norm": True})
QWEN = O.DraftSpec(**{**BASE.__dict__, "qk_norm": True, "norm_before_residual": True})


def _spec(base, **kw):
    return O.DraftSpec(**{**base.__dict__, **kw})


def _inputs(spec, B=2, T=9, seed=3, offsets=None):
    g = torch.Generator().manual_seed(seed)
    feats = O.random_features(spec, B, T, seed)
    toks = torch.randint(0, spec.target_vocab_size, (B, T), generator=g)
    off = torch.zeros(B, dtype=torch.long) if offsets is None else torch.tensor(offsets)
    pos = torch.arange(T)[None].expand(B, T) + off[:, None]
    return feats, toks, pos


def _oracles_for(spec):
    return [n for n in O.ORACLES if O.oracle_supports(spec, n)]


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize("spec", [BASE, ODD, FCN, QWEN], ids=["base", "odd", "fc_norm", "qwen"])
def test_random_state_shapes_and_vocab_mapping(spec):
    s = O.random_drafter_state(spec, seed=7)
    H, Ht, hd = spec.hidden_size, spec.target_hidden_size, spec.head_dim
    assert s["fc.weight"].shape == (H, 3 * Ht)
    assert s["midlayer.self_attn.q_proj.weight"].shape == (spec.num_heads * hd, 2 * H)
    assert s["midlayer.self_attn.k_proj.weight"].shape == (spec.num_kv_heads * hd, 2 * H)
    assert s["midlayer.self_attn.o_proj.weight"].shape == (H, spec.num_heads * hd)
    assert s["lm_head.weight"].shape == (spec.draft_vocab_size, H)
    assert ("fc_norm.0.weight" in s) == spec.fc_norm
    assert ("midlayer.self_attn.q_norm.weight" in s) == spec.qk_norm
    d2t, t2d = s["d2t"], s["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (spec.draft_vocab_size,)
    assert t2d.dtype == torch.bool and t2d.shape == (spec.target_vocab_size,)
    used = torch.arange(spec.draft_vocab_size) + d2t
    assert used.min() >= 0 and used.max() < spec.target_vocab_size
    assert bool((used[1:] > used[:-1]).all()), "draft ids must map to strictly increasing target ids"
    assert bool((d2t != 0).any()), "mapping must be non-trivial"
    assert torch.equal(torch.nonzero(t2d).flatten(), used)
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency

    validate_vocab_mapping_consistency(t2d, d2t)  # SpecForge's own check
    # deterministic in the seed
    assert torch.equal(O.random_drafter_state(spec, seed=7)["fc.weight"], s["fc.weight"])
    assert not torch.equal(O.random_drafter_state(spec, seed=8)["fc.weight"], s["fc.weight"])


# ----------------------------------------------------------------------------- writers


def _st_dtypes(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.parametrize("dtype,fname", [(None, "F32"), (torch.bfloat16, "BF16")])
def test_write_specforge_layout(tmp_path, dtype, fname):
    s = O.random_drafter_state(ODD, 1)
    O.write_specforge(tmp_path, ODD, s, dtype=dtype)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == ODD.target_vocab_size
    assert cfg["draft_vocab_size"] == ODD.draft_vocab_size and cfg["head_dim"] == ODD.head_dim
    assert cfg["rope_theta"] == ODD.rope_theta and cfg["target_hidden_size"] == ODD.target_hidden_size
    dt = _st_dtypes(tmp_path / "model.safetensors")
    assert set(dt) == set(s)
    assert dt["d2t"] == "I64" and dt["t2d"] == "BOOL"
    assert {v for k, v in dt.items() if k not in ("d2t", "t2d")} == {fname}
    back = load_file(tmp_path / "model.safetensors")
    for k, v in s.items():
        assert back[k].shape == v.shape
        if dtype is None:
            assert torch.equal(back[k], v)


@pytest.mark.parametrize("spec", [BASE, ODD, FCN], ids=["base", "odd", "fc_norm"])
def test_specforge_loads_written_checkpoint(tmp_path, spec):
    """SpecForge's own config loader + model class accept the files; same logits as the oracle."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    s = O.random_drafter_state(spec, 2)
    E = O.random_target_embed(spec, 3)
    O.write_specforge(tmp_path, spec, s)
    cfg = AutoDraftModelConfig.from_file(str(tmp_path / "config.json"))
    model = AutoDraftModel.from_config(cfg).float().eval()
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    feats, toks, pos = _inputs(spec)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        model.embed_tokens.weight.copy_(E)
        out = model.backbone(input_embeds=model.embed_input_ids(toks),
                             hidden_states=model.project_hidden_states(feats),
                             cache_hidden=None, attention_mask=None, position_ids=pos)
        got = model.compute_logits(out)
    want, _ = O.reference_forward(s, spec, E, feats, toks, pos, oracle="specforge")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_write_angelslim_layout(tmp_path):
    s = O.random_drafter_state(BASE, 4)
    O.write_angelslim(tmp_path, BASE, s)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"] and cfg["draft_vocab_size"] == 48
    assert not (tmp_path / "model.safetensors").exists()
    back = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(back) == set(s)
    for k in s:
        assert back[k].dtype == s[k].dtype and torch.equal(back[k], s[k])


def test_flat_writers_refuse_flags_they_cannot_express(tmp_path):
    for spec in (QWEN, _spec(BASE, norm_before_fc=True), _spec(BASE, norm_output=True)):
        with pytest.raises(ValueError):
            O.write_specforge(tmp_path / "x", spec, O.random_drafter_state(spec, 0))


@pytest.mark.parametrize("spec", [BASE, QWEN, ODD], ids=["llama", "qwen3", "odd"])
def test_write_speculators_layout(tmp_path, spec):
    s = O.random_drafter_state(spec, 5)
    E = O.random_target_embed(spec, 6)
    O.write_speculators(tmp_path, spec, s, target_layer_ids=[2, 18, 33], include_embed=E)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is spec.norm_before_residual  # always explicit
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 18, 33]
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == ("qwen3" if spec.qk_norm else "llama")
    assert tl["vocab_size"] == spec.target_vocab_size and tl["num_hidden_layers"] == 1
    assert cfg["target_hidden_size"] == (None if spec.target_hidden_size == spec.hidden_size
                                         else spec.target_hidden_size)
    dt = _st_dtypes(tmp_path / "model.safetensors")
    assert not any(k.startswith("midlayer.") for k in dt)
    assert "layers.0.self_attn.q_proj.weight" in dt and dt["d2t"] == "I64" and dt["t2d"] == "BOOL"
    assert ("layers.0.self_attn.q_norm.weight" in dt) == spec.qk_norm
    back = load_file(tmp_path / "model.safetensors")
    assert torch.equal(back["embed_tokens.weight"], E)
    assert torch.equal(back["layers.0.mlp.down_proj.weight"], s["midlayer.mlp.down_proj.weight"])

    O.write_speculators(tmp_path / "noembed", spec, s)
    cfg2 = json.load(open(tmp_path / "noembed" / "config.json"))
    assert cfg2["eagle_aux_hidden_state_layer_ids"] is None
    assert "embed_tokens.weight" not in _st_dtypes(tmp_path / "noembed" / "model.safetensors")


def test_write_speculators_full_vocab_has_no_mapping(tmp_path):
    spec = _spec(BASE, draft_vocab_size=BASE.target_vocab_size)
    s = O.random_drafter_state(spec, 0)
    assert not s["d2t"].any() and s["t2d"].all()
    O.write_speculators(tmp_path, spec, s)
    assert not {"d2t", "t2d"} & set(_st_dtypes(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("spec", [BASE, QWEN, _spec(FCN, norm_output=True), _spec(BASE, norm_before_fc=True)],
                         ids=["llama", "qwen3", "fc_norm+norm_output", "norm_before_fc"])
def test_speculators_loads_written_checkpoint(tmp_path, spec):
    """speculators' own config class parses the file and its model takes every tensor."""
    mod = O.import_speculators()
    s = O.random_drafter_state(spec, 8)
    O.write_speculators(tmp_path, spec, s, target_layer_ids=[1, 2, 3])
    cfg = mod.Eagle3SpeculatorConfig.from_pretrained(str(tmp_path))
    assert cfg.norm_before_residual == spec.norm_before_residual and cfg.fc_norm == spec.fc_norm
    assert cfg.norm_before_fc == spec.norm_before_fc and cfg.norm_output == spec.norm_output
    assert cfg.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert cfg.transformer_layer_config.model_type == ("qwen3" if spec.qk_norm else "llama")
    assert cfg.target_vocab_size == spec.target_vocab_size
    cfg.transformer_layer_config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mod.Eagle3DraftModel(cfg)
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert unexpected == []
    assert sorted(missing) == ["embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"]


# ----------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("spec", [BASE, ODD, NBR, FCN, _spec(BASE, draft_vocab_size=BASE.target_vocab_size)],
                         ids=["base", "odd", "norm_before_residual", "fc_norm", "identity_vocab"])
def test_independent_oracles_agree(spec):
    names = _oracles_for(spec)
    if len(names) < 2:
        pytest.skip(f"only {names} cover {spec}")
    s = O.random_drafter_state(spec, 11)
    E = O.random_target_embed(spec, 12)
    feats, toks, pos = _inputs(spec, offsets=(0, 37))  # second row starts at position 37
    ref_lg, ref_h = O.reference_forward(s, spec, E, feats, toks, pos, oracle=names[0])
    for n in names[1:]:
        lg, h = O.reference_forward(s, spec, E, feats, toks, pos, oracle=n)
        torch.testing.assert_close(lg, ref_lg, rtol=0, atol=2e-5, msg=f"{names[0]} vs {n}")
        torch.testing.assert_close(h, ref_h, rtol=0, atol=2e-5, msg=f"{names[0]} vs {n}")


def test_unsupported_flags_are_refused():
    s = O.random_drafter_state(NBR, 0)
    E = O.random_target_embed(NBR, 0)
    feats, toks, pos = _inputs(NBR)
    with pytest.raises(ValueError):
        O.reference_forward(s, NBR, E, feats, toks, pos, oracle="specforge")
    with pytest.raises(ValueError):
        O.reference_forward(O.random_drafter_state(FCN, 0), FCN, E, feats, toks, pos, oracle="specforge_peagle")
    with pytest.raises(ValueError):
        O.reference_forward(O.random_drafter_state(ODD, 0), ODD, O.random_target_embed(ODD, 0),
                            *_inputs(ODD), oracle="speculators")
    with pytest.raises(ValueError):  # embedding of the target width when Ht != H
        O.reference_forward(O.random_drafter_state(ODD, 0), ODD,
                            torch.randn(ODD.target_vocab_size, ODD.target_hidden_size), *_inputs(ODD))


@pytest.mark.parametrize("oracle", O.ORACLES)
def test_embedding_first_then_hidden(oracle):
    """The concat is [input_layernorm(embed), hidden_norm(h)]: with the q/k/v columns that read
    the second half zeroed, hidden_norm's weight cannot matter (h still enters the residual)."""
    if not O.oracle_supports(BASE, oracle):
        pytest.skip(O.unsupported_reason(BASE, oracle))
    s = O.random_drafter_state(BASE, 13)
    H = BASE.hidden_size
    for p in ("q", "k", "v"):
        s[f"midlayer.self_attn.{p}_proj.weight"][:, H:] = 0
    E = O.random_target_embed(BASE, 14)
    feats, toks, pos = _inputs(BASE)
    a, _ = O.reference_forward(s, BASE, E, feats, toks, pos, oracle=oracle)
    s2 = dict(s, **{"midlayer.hidden_norm.weight": s["midlayer.hidden_norm.weight"] * 3 + 1})
    b, _ = O.reference_forward(s2, BASE, E, feats, toks, pos, oracle=oracle)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    s3 = dict(s, **{"midlayer.input_layernorm.weight": s["midlayer.input_layernorm.weight"] * 3 + 1})
    c, _ = O.reference_forward(s3, BASE, E, feats, toks, pos, oracle=oracle)
    assert (a - c).abs().max() > 1e-2


@pytest.mark.parametrize("spec,oracle", [(BASE, "specforge"), (NBR, "specforge_peagle"), (NBR, "speculators")])
def test_residual_is_h_or_hidden_norm_h(spec, oracle):
    """With o_proj and down_proj zeroed the layer is the identity on its residual:
    fc(g) normally, hidden_norm(fc(g)) with norm_before_residual."""
    if not O.oracle_supports(spec, oracle):
        pytest.skip(O.unsupported_reason(spec, oracle))
    s = O.random_drafter_state(spec, 15)
    s["midlayer.self_attn.o_proj.weight"].zero_()
    s["midlayer.mlp.down_proj.weight"].zero_()
    E = O.random_target_embed(spec, 16)
    feats, toks, pos = _inputs(spec)
    _, h = O.reference_forward(s, spec, E, feats, toks, pos, oracle=oracle)
    x = feats @ s["fc.weight"].T
    if spec.norm_before_residual:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps) * s["midlayer.hidden_norm.weight"]
    torch.testing.assert_close(h, x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flag", ["norm_before_residual", "fc_norm", "qk_norm", "norm_before_fc"])
def test_each_flag_changes_the_output(flag):
    spec = _spec(BASE, **{flag: True})
    s = O.random_drafter_state(spec, 17)
    E = O.random_target_embed(spec, 18)
    feats, toks, pos = _inputs(spec)
    on, _ = O.reference_forward(s, spec, E, feats, toks, pos, oracle="speculators")
    base_state = {k: v for k, v in s.items() if k in O.random_drafter_state(BASE, 0)}
    off, _ = O.reference_forward(base_state, BASE, E, feats, toks, pos, oracle="speculators")
    assert (on - off).abs().max() > 1e-2


def test_norm_output_changes_only_later_steps():
    spec = _spec(BASE, norm_output=True)
    s = O.random_drafter_state(spec, 19)
    E = O.random_target_embed(spec, 20)
    feats, toks, _ = _inputs(spec)
    a = O.reference_chain(s, spec, E, feats, toks, 3, oracle="speculators")
    b = O.reference_chain(s, BASE, E, feats, toks, 3, oracle="speculators")
    torch.testing.assert_close(a.logits[:, 0], b.logits[:, 0], rtol=0, atol=1e-6)
    assert (a.logits[:, 1:] - b.logits[:, 1:]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- causality, degeneracy


@pytest.mark.parametrize("spec", [BASE, QWEN], ids=["llama", "qwen3"])
def test_causality(spec):
    for oracle in _oracles_for(spec):
        s = O.random_drafter_state(spec, 21)
        E = O.random_target_embed(spec, 22)
        feats, toks, pos = _inputs(spec, T=10)
        a, ha = O.reference_forward(s, spec, E, feats, toks, pos, oracle=oracle)
        j = 6
        toks2 = toks.clone()
        toks2[:, j] = (toks2[:, j] + 1) % spec.target_vocab_size
        feats2 = feats.clone()
        feats2[:, j + 1] += 1.0
        for t2, f2 in ((toks2, feats), (toks, feats2)):
            b, hb = O.reference_forward(s, spec, E, f2, t2, pos, oracle=oracle)
            k = j if t2 is toks2 else j + 1
            torch.testing.assert_close(b[:, :k], a[:, :k], rtol=0, atol=1e-6, msg=oracle)
            assert (hb[:, k:] - ha[:, k:]).abs().amax(-1).min() > 1e-4, oracle  # every later row moves


def test_logits_are_not_degenerate():
    s = O.random_drafter_state(BASE, 23)
    E = O.random_target_embed(BASE, 24)
    feats, toks, pos = _inputs(BASE, B=4, T=16)
    lg, h = O.reference_forward(s, BASE, E, feats, toks, pos)
    assert torch.isfinite(lg).all() and torch.isfinite(h).all()
    assert lg.std() > 1.0
    top2 = lg.topk(2, -1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.05
    assert lg.argmax(-1).unique().numel() > 8  # argmax is not stuck on one draft id
    # attention is not uniform: the same input at position 5 gives different outputs
    # depending on what came before
    feats2 = feats.clone()
    feats2[:, :5] = torch.randn_like(feats2[:, :5])
    lg2, _ = O.reference_forward(s, BASE, E, feats2, toks, pos)
    assert (lg2[:, 5:] - lg[:, 5:]).abs().max() > 0.1
    # RoPE matters: shifting all positions is a no-op (relative), but changing spacing is not
    lg3, _ = O.reference_forward(s, BASE, E, feats, toks, pos + 100)
    torch.testing.assert_close(lg3, lg, rtol=0, atol=1e-4)
    lg4, _ = O.reference_forward(s, BASE, E, feats, toks, pos * 3)
    assert (lg4 - lg).abs().max() > 1e-2


# ----------------------------------------------------------------------------- chain


@pytest.mark.parametrize("spec", [BASE, ODD, FCN], ids=["base", "odd", "fc_norm"])
def test_chain_full_recompute_equals_specforge_ttt_cache(spec):
    s = O.random_drafter_state(spec, 25)
    E = O.random_target_embed(spec, 26)
    feats, toks, _ = _inputs(spec, B=3, T=7)
    full = O.reference_chain(s, spec, E, feats, toks, 4, oracle="specforge", mode="full")
    ttt = O.reference_chain(s, spec, E, feats, toks, 4, oracle="specforge", mode="ttt")
    assert torch.equal(full.draft_ids, ttt.draft_ids)
    torch.testing.assert_close(full.logits, ttt.logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(full.hidden, ttt.hidden, rtol=0, atol=2e-5)
    assert full.draft_ids.shape == (3, 4) and full.logits.shape == (3, 4, spec.draft_vocab_size)
    # draft ids are target ids: d + d2t[d]
    assert torch.equal(full.draft_ids, full.draft_vocab_ids + s["d2t"][full.draft_vocab_ids])
    assert s["t2d"][full.draft_ids].all()


@pytest.mark.parametrize("spec", [BASE, QWEN, _spec(NBR, norm_output=True, fc_norm=True)],
                         ids=["llama", "qwen3+nbr", "nbr+norm_output+fc_norm"])
def test_chain_incremental_kv_cache_equals_full_recompute(spec):
    s = O.random_drafter_state(spec, 27)
    E = O.random_target_embed(spec, 28)
    feats, toks, _ = _inputs(spec, B=2, T=6)
    full = O.reference_chain(s, spec, E, feats, toks, 5, oracle="speculators", mode="full")
    inc = O.reference_chain(s, spec, E, feats, toks, 5, oracle="speculators", mode="cache")
    assert torch.equal(full.draft_ids, inc.draft_ids)
    torch.testing.assert_close(full.logits, inc.logits, rtol=0, atol=2e-5)


def test_chain_oracles_agree_and_first_step_is_the_extend_output():
    spec = BASE
    s = O.random_drafter_state(spec, 29)
    E = O.random_target_embed(spec, 30)
    feats, toks, pos = _inputs(spec, B=2, T=8)
    chains = {n: O.reference_chain(s, spec, E, feats, toks, 3, oracle=n) for n in _oracles_for(spec)}
    ref = chains["specforge"]
    for n, c in chains.items():
        assert torch.equal(c.draft_ids, ref.draft_ids), n
        torch.testing.assert_close(c.logits, ref.logits, rtol=0, atol=2e-5, msg=n)
    lg, h = O.reference_forward(s, spec, E, feats, toks, pos)
    torch.testing.assert_close(ref.logits[:, 0], lg[:, -1], rtol=0, atol=1e-5)
    torch.testing.assert_close(ref.hidden[:, 0], h[:, -1], rtol=0, atol=1e-5)
    # step 2 by hand: one causal pass with the carried hidden appended at position P
    P = feats.shape[1]
    h_in = torch.cat([feats @ s["fc.weight"].T, h[:, -1:]], 1)
    t_in = torch.cat([toks, ref.draft_ids[:, :1]], 1)
    lg2, _ = O.reference_forward(s, spec, E, h_in, t_in, torch.arange(P + 1)[None].expand(2, -1))
    torch.testing.assert_close(ref.logits[:, 1], lg2[:, -1], rtol=0, atol=1e-5)
