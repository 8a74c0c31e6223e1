"""Writing a dense Qwen3 target as a Hugging Face folder (`config.json`, `model.safetensors`), the layout
`load_target` and transformers' `Qwen3ForCausalLM.from_pretrained` both read: our fused q/k/v and gate/up
weights are split back into transformers' tensors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from eagle3_jax.checkpoints.target import hf_layer_keys
from eagle3_jax.models.config import Qwen3Config


def hf_config(cfg: Qwen3Config, dtype: str, eos_token_id: int | None = None) -> dict:
    """transformers' Qwen3 config.json for cfg (dense, plain RoPE: what `training/pretrain.py` trains)."""
    if cfg.rope.kind != "default" or cfg.moe is not None:
        raise ValueError("exporting a target with rope scaling or experts is not supported")
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "initializer_range": 0.02,
        "torch_dtype": dtype, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
    }


def hf_tensors(cfg: Qwen3Config, params: dict, dtype: str) -> dict[str, np.ndarray]:
    """Our parameter pytree -> transformers' tensor names and shapes, on the host, in dtype."""
    def host(x):
        return np.asarray(jax.device_get(jnp.asarray(x).astype(jnp.dtype(dtype))))

    tensors = {"model.embed_tokens.weight": host(params["embed"]), "model.norm.weight": host(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = host(params["lm_head"])
    N, K, H, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    splits = {"wqkv": [N * H, (N + K) * H], "w_gate_up": [I]}
    for i, layer in enumerate(params["layers"]):
        for ours, theirs in hf_layer_keys(cfg, i).items():
            parts = np.split(host(layer[ours]), splits[ours], axis=0) if ours in splits else [host(layer[ours])]
            tensors.update(zip(theirs, parts))
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def export_hf(folder: str | Path, cfg: Qwen3Config, params: dict, dtype: str = "bfloat16",
              eos_token_id: int | None = None) -> Path:
    """Writes config.json and model.safetensors into folder (created if needed); returns folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, dtype, eos_token_id), indent=2))
    save_file(hf_tensors(cfg, params, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
