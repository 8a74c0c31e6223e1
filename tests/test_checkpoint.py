"""Loading, conversion round trip, and every bad-checkpoint case raising CheckpointError."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax import CheckpointError

from hf_models import build_model, save_model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = build_model("gqa4_sharded", seed=2, num_layers=4)
    folder = save_model(model, tmp_path_factory.mktemp("hf"), "gqa4_sharded", dtype=torch.bfloat16)
    return folder, model.to(torch.bfloat16).state_dict()


def bits(x):
    return np.asarray(x).view(np.uint16)


def test_bf16_loads_bit_exact_and_fused(hf_folder):
    folder, state = hf_folder
    assert len(list(folder.glob("*.safetensors"))) > 1  # really sharded
    tgt = eagle3_jax.load_target(folder, progress=False)
    layer = tgt.params["layers"][1]
    assert layer["wqkv"].dtype == jax.numpy.bfloat16
    q, k, v = (state[f"model.layers.1.self_attn.{x}_proj.weight"].view(torch.int16).numpy() for x in "qkv")
    assert np.array_equal(bits(layer["wqkv"]), np.concatenate([q, k, v]).view(np.uint16))
    head_bits = state["lm_head.weight"].view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits(tgt.params["lm_head"]), head_bits)


def test_convert_round_trip_is_bit_identical(hf_folder, tmp_path):
    folder, _ = hf_folder
    original = eagle3_jax.load_target(folder, progress=False)
    dst = eagle3_jax.convert(folder, tmp_path / "orbax")
    restored = eagle3_jax.load_target(dst, progress=False)
    assert restored.config == original.config
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(bits(a), bits(b)),
                        original.params, restored.params)
    assert all(jax.tree.leaves(same)) and len(jax.tree.leaves(same)) == len(jax.tree.leaves(original.params))
    with pytest.raises(CheckpointError, match="already exists"):
        eagle3_jax.convert(folder, dst)


def test_float32_load_of_bf16_checkpoint(hf_folder):
    folder, state = hf_folder
    tgt = eagle3_jax.load_target(folder, dtype="float32", progress=False)
    assert tgt.params["embed"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(tgt.params["embed"]), state["model.embed_tokens.weight"].float().numpy())


def copy_of(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def a_shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[1]


def add_tensor(folder, name, tensor):
    """Adds a tensor to the second shard and lists it in the index."""
    from safetensors.torch import load_file, save_file

    shard = a_shard(folder)
    save_file({**load_file(shard), name: tensor}, shard, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def break_missing_folder(f):
    shutil.rmtree(f)
    return "checkpoint folder not found|config.json: file not found"


def break_missing_config(f):
    (f / "config.json").unlink()
    return "config.json: file not found"


def break_missing_shard(f):
    s = a_shard(f)
    s.unlink()
    return f"{s.name}: shard file not found"


def break_corrupt_shard(f):
    s = a_shard(f)
    s.write_bytes(b"\x07garbage" * 10)
    return f"{s.name}: not a readable safetensors file"


def break_truncated_shard(f):
    s = a_shard(f)
    s.write_bytes(s.read_bytes()[:-100])
    return f"{s.name}: not a readable safetensors file"


def break_missing_tensor(f):
    index = json.loads((f / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return "missing tensor 'model.layers.2.mlp.up_proj.weight'"


def break_wrong_shape(f):
    edit_config(f, intermediate_size=100)
    return r"'model.layers.0.mlp.gate_proj.weight' has shape \(136, 64\), expected \(100, 64\)"


def break_corrupt_index(f):
    (f / "model.safetensors.index.json").write_text("{not json")
    return "model.safetensors.index.json: not valid JSON"


def break_index_file_name(f):
    index = json.loads((f / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = 3
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json: weight_map.model.norm.weight must be a file name, got 3"


def break_not_qwen3(f):
    edit_config(f, model_type="llama", architectures=["LlamaForCausalLM"])
    return "not a Qwen3 or Qwen3-MoE model"


def break_sliding_window(f):
    edit_config(f, use_sliding_window=True)
    return "use_sliding_window"


def break_rope_type(f):
    edit_config(f, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    return "rope scaling type 'dynamic' is not supported"


def break_missing_key(f):
    cfg = json.loads((f / "config.json").read_text())
    del cfg["hidden_size"]
    (f / "config.json").write_text(json.dumps(cfg))
    return "missing required key 'hidden_size'"


def break_fewer_layers(f):
    edit_config(f, num_hidden_layers=2)  # the checkpoint holds 4
    return (r"unused tensors: model\.layers\.2\.input_layernorm\.weight, model\.layers\.2\.mlp\.down_proj\.weight, "
            r".* and 14 more \(the config does not account for them\)")


def break_extra_tensor_in_a_shard(f):
    add_tensor(f, "model.layers.1.self_attn.q_proj.bias", torch.zeros(64))
    return r"unused tensors: model\.layers\.1\.self_attn\.q_proj\.bias \("


BREAKERS = [break_missing_folder, break_missing_config, break_missing_shard, break_corrupt_shard,
            break_truncated_shard, break_missing_tensor, break_wrong_shape, break_corrupt_index,
            break_not_qwen3, break_sliding_window, break_rope_type, break_missing_key, break_fewer_layers,
            break_extra_tensor_in_a_shard, break_index_file_name]


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda b: b.__name__[6:])
def test_bad_checkpoints_raise_checkpoint_error(hf_folder, tmp_path, breaker, monkeypatch):
    folder = copy_of(hf_folder[0], tmp_path)
    message = breaker(folder)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("device work before the checks"))
    with pytest.raises(CheckpointError, match=message):
        eagle3_jax.load_target(folder, progress=False)


def test_tensors_transformers_ignores_are_ignored(hf_folder, tmp_path):
    """Older transformers saved rotary inv_freq buffers; a tied checkpoint may hold the lm_head it never reads."""
    folder = copy_of(hf_folder[0], tmp_path)
    add_tensor(folder, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))
    assert "lm_head" in eagle3_jax.load_target(folder, progress=False).params
    edit_config(folder, tie_word_embeddings=True)
    assert "lm_head" not in eagle3_jax.load_target(folder, progress=False).params


def test_corrupt_orbax_checkpoint(hf_folder, tmp_path):
    dst = eagle3_jax.convert(hf_folder[0], tmp_path / "orbax")
    for f in (dst / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="cannot restore"):
        eagle3_jax.load_target(dst, progress=False)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        eagle3_jax.load_target("/nonexistent", dtype="int8")


@pytest.mark.parametrize("name,text,message", [
    ("tokenizer.json", "{not json", "tokenizer.json: not a readable tokenizer"),
    ("tokenizer.json", '{"version": "1.0"}', "tokenizer.json: not a readable tokenizer"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json: not valid JSON"),
])
def test_corrupt_tokenizer_names_the_file(tmp_path, name, text, message):
    from eagle3_jax.checkpoints.tokenizer import load_tokenizer

    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(tmp_path)


def test_orbax_config_with_fewer_layers_names_the_unused_tensors(hf_folder, tmp_path):
    dst = eagle3_jax.convert(hf_folder[0], tmp_path / "orbax")
    edit_config(dst, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"params: unused tensors: layers\.3\.attn_norm, layers\.3\.k_norm, "):
        eagle3_jax.load_target(dst, progress=False)
    edit_config(dst, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"params: missing tensor 'layers\.4\.attn_norm'"):
        eagle3_jax.load_target(dst, progress=False)
