"""Drafter loading: the capture-layer conventions, conversion, and every mismatch or unsupported
flag refused with a CheckpointError that names it."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle3_jax
from eagle3_jax import CheckpointError

import drafter_oracle as oracle
from test_drafter_golden import BASE, HT, LAYERS, VT, fake_target


@pytest.fixture
def target():
    return fake_target(np.random.default_rng(0).standard_normal((VT, HT)).astype(np.float32))


@pytest.fixture
def flat(tmp_path):
    state = oracle.random_drafter_state(BASE, seed=1)
    return oracle.write_specforge(tmp_path / "flat", BASE, state), state


def edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def test_capture_layer_conventions(tmp_path, target, flat):
    from pathlib import Path

    path = Path(flat[0])
    edit(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})  # SGLang: output of layer k
    assert eagle3_jax.load_drafter(path, target).config.capture_layers == (1, 4, 7)
    edit(path, eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 3, 5])  # vLLM/speculators: entering k
    assert eagle3_jax.load_drafter(path, target).config.capture_layers == (1, 3, 5)
    state = oracle.random_drafter_state(BASE, seed=1)
    spec_path = oracle.write_speculators(tmp_path / "spec", BASE, state, target_layer_ids=[2, 4, 7])
    assert eagle3_jax.load_drafter(spec_path, target).config.capture_layers == (2, 4, 7)


@pytest.mark.parametrize("variant", ["plain", "fc_norm", "speculators_all_flags"])
def test_convert_round_trip(tmp_path, target, variant):
    if variant == "speculators_all_flags":  # Qwen3 layer, norm_before_fc, norm_output, its own embedding
        spec = dataclasses.replace(BASE, qk_norm=True, norm_before_fc=True, norm_output=True, norm_before_residual=True)
        embed = torch.randn(VT, HT)
        path = oracle.write_speculators(tmp_path / "src", spec, oracle.random_drafter_state(spec, 1),
                                        include_embed=embed)
    else:
        spec = dataclasses.replace(BASE, fc_norm=variant == "fc_norm")
        path = oracle.write_specforge(tmp_path / "src", spec, oracle.random_drafter_state(spec, 1))
    original = eagle3_jax.load_drafter(path, target)
    out = eagle3_jax.convert_drafter(path, tmp_path / "converted", target)
    restored = eagle3_jax.load_drafter(out, target)
    assert restored.config == original.config
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)),
                        original.params, restored.params)
    assert jax.tree.structure(restored.params) == jax.tree.structure(original.params) and all(jax.tree.leaves(same))


def test_angelslim_bin_in_bf16_loads(tmp_path, target):
    state = oracle.random_drafter_state(BASE, seed=2)
    path = oracle.write_angelslim(tmp_path / "bin", BASE, state, dtype=torch.bfloat16)
    drafter = eagle3_jax.load_drafter(path, target, dtype="bfloat16")
    assert drafter.params["lm_head"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(drafter.params["lm_head"]).astype(np.float32),
                                  state["lm_head.weight"].to(torch.bfloat16).float().numpy())


def test_config_head_dim_disagreeing_with_weights_warns_and_uses_weights(target, flat):
    from pathlib import Path

    edit(Path(flat[0]), head_dim=BASE.head_dim * 2)
    with pytest.warns(UserWarning, match="disagrees with the weights"):
        assert eagle3_jax.load_drafter(flat[0], target).config.head_dim == BASE.head_dim


def bad_vocab(p):
    edit(p, vocab_size=VT + 1)
    return "vocab_size 201 does not match the target's 200"


def bad_target_hidden(p):
    edit(p, target_hidden_size=HT + 16)
    return "expects target hidden size 64, the target has 48"


def bad_capture(p):
    edit(p, eagle_aux_hidden_state_layer_ids=[2, 4, LAYERS])
    return "capture layer 8 is out of range for a 8-layer target"


def bad_two_layers(p):
    edit(p, num_hidden_layers=2)
    return "only one-layer drafters"


def bad_act(p):
    edit(p, hidden_act="gelu")
    return "hidden_act='gelu'"


def bad_norm_output(p):
    edit(p, norm_output=False)
    return "norm_output=false"


def bad_arch(p):
    edit(p, architectures=["MistralForCausalLM"])
    return "not an EAGLE-3 drafter"


def bad_rope(p):
    edit(p, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    return "rope scaling type 'llama3' is not supported"


def bad_missing_tensor(p):
    edit_tensors(p, lambda t: t.pop("midlayer.mlp.up_proj.weight"))
    return "missing tensor 'midlayer.mlp.up_proj.weight'"


def bad_shape(p):
    edit_tensors(p, lambda t: t.update({"norm.weight": torch.ones(HT + 1)}))
    return r"'norm.weight' has shape \(49,\), expected \(48,\)"


def bad_d2t(p):
    edit_tensors(p, lambda t: t.update({"d2t": t["d2t"] + VT}))
    return "'d2t' maps draft ids outside the target vocabulary"


def bad_no_d2t(p):
    edit_tensors(p, lambda t: t.pop("d2t"))
    return "no 'd2t' tensor"


def bad_extra_tensor(p):
    edit_tensors(p, lambda t: t.update({"layers.1.self_attn.q_proj.weight": torch.ones(2)}))
    return "unused tensors: layers.1.self_attn.q_proj.weight"


def bad_corrupt_file(p):
    (p / "model.safetensors").write_bytes(b"\x01" * 64)
    return "model.safetensors: not a readable safetensors file"


def bad_no_weights(p):
    (p / "model.safetensors").unlink()
    return "no model.safetensors"


def bad_config_json(p):
    (p / "config.json").write_text("{")
    return "config.json: not valid JSON"


BREAKERS = [bad_vocab, bad_target_hidden, bad_capture, bad_two_layers, bad_act, bad_norm_output, bad_arch, bad_rope,
            bad_missing_tensor, bad_shape, bad_d2t, bad_no_d2t, bad_extra_tensor, bad_corrupt_file, bad_no_weights,
            bad_config_json]


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda b: b.__name__[4:])
def test_bad_drafters_raise_checkpoint_error(target, flat, breaker, monkeypatch):
    from pathlib import Path

    path = Path(flat[0])
    message = breaker(path)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("device work before the checks"))
    with pytest.raises(CheckpointError, match=message):
        eagle3_jax.load_drafter(path, target)


def extra(name, shape=(2,)):
    """Adds a tensor to the drafter's weights file, safetensors or .bin."""
    def change(path):
        bin_file = path / "pytorch_model.bin"
        if not bin_file.exists():
            return edit_tensors(path, lambda t: t.update({name: torch.ones(shape)}))
        state = torch.load(bin_file)
        state[name] = torch.ones(shape)
        torch.save(state, bin_file)

    return change


@pytest.mark.parametrize("writer,spec,change,message", [
    (oracle.write_specforge, dataclasses.replace(BASE, fc_norm=True), lambda p: edit(p, fc_norm=False),
     r"unused tensors: fc_norm\.0\.weight, fc_norm\.1\.weight, fc_norm\.2\.weight \("),
    (oracle.write_angelslim, BASE, extra("midlayer.self_attn.q_norm.weight"),
     r"unused tensors: midlayer\.self_attn\.q_norm\.weight \("),
    (oracle.write_speculators, BASE, extra("layers.1.mlp.up_proj.weight"),
     r"unused tensors: layers\.1\.mlp\.up_proj\.weight \("),
    (oracle.write_speculators, dataclasses.replace(BASE, qk_norm=True),
     lambda p: edit(p, transformer_layer_config={**json.loads((p / "config.json").read_text())[
         "transformer_layer_config"], "model_type": "llama"}),
     r"unused tensors: layers\.0\.self_attn\.k_norm\.weight, layers\.0\.self_attn\.q_norm\.weight \("),
], ids=["specforge_fc_norm_off", "angelslim_bin_extra", "speculators_second_layer", "speculators_qk_norm_off"])
def test_unused_tensors_in_every_format(tmp_path, target, writer, spec, change, message, monkeypatch):
    from pathlib import Path

    path = Path(writer(tmp_path / "d", spec, oracle.random_drafter_state(spec, seed=1)))
    change(path)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("device work before the checks"))
    with pytest.raises(CheckpointError, match=message):
        eagle3_jax.load_drafter(path, target)


def test_tensors_drafter_formats_ship_for_nothing_are_ignored(tmp_path, target):
    """speculators may keep the target's final norm and lm_head (training only), SpecForge its t2d buffer."""
    from pathlib import Path

    path = Path(oracle.write_speculators(tmp_path / "spec", BASE, oracle.random_drafter_state(BASE, seed=1)))
    reference = eagle3_jax.load_drafter(path, target)
    edit_tensors(path, lambda t: t.update({"verifier_lm_head.weight": torch.ones(VT, HT),
                                           "verifier_norm.weight": torch.ones(HT),
                                           "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    loaded = eagle3_jax.load_drafter(path, target)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(reference.params)


def test_different_hidden_without_embedding_is_refused(tmp_path, target):
    spec = dataclasses.replace(BASE, hidden_size=32, intermediate_size=64, head_dim=8)
    path = oracle.write_specforge(tmp_path / "narrow", spec, oracle.random_drafter_state(spec, seed=3))
    with pytest.raises(CheckpointError, match="ships no embed_tokens.weight"):
        eagle3_jax.load_drafter(path, target)


def test_bad_engine_settings_with_drafter(target, flat):
    drafter = eagle3_jax.load_drafter(flat[0], target)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        eagle3_jax.Engine(target, drafter, num_draft_tokens=0, max_len=64)


def test_orbax_marker_disagreeing_with_its_params_names_the_unused_tensors(tmp_path, target):
    state = oracle.random_drafter_state(BASE, 1)
    path = oracle.write_specforge(tmp_path / "src", BASE, state, embed=torch.randn(VT, HT))
    out = eagle3_jax.convert_drafter(path, tmp_path / "converted", target)
    marker = json.loads((out / "eagle3_jax.json").read_text())
    (out / "eagle3_jax.json").write_text(json.dumps({**marker, "has_embed": False}))
    with pytest.raises(CheckpointError, match=r"params: unused tensors: embed \("):
        eagle3_jax.load_drafter(out, target)
