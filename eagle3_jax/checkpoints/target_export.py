"""Writing a dense Qwen3 target as a Hugging Face folder (`config.json`, `model.safetensors`), the layout
`load_target` and transformers' `Qwen3ForCausalLM.from_pretrained` both read: our fused q/k/v and gate/up
weights are split back into transformers' tensors as the target's weight description (models/weights.py) says."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.numpy import save_file

from eagle3_jax.checkpoints import hf_layout
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.models.weights import target_weights


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


def export_hf(folder: str | Path, cfg: Qwen3Config, params: dict, dtype: str = "bfloat16",
              eos_token_id: int | None = None) -> Path:
    """Writes config.json and model.safetensors into folder (created if needed); returns folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, dtype, eos_token_id), indent=2))
    tensors = hf_layout.to_hf(target_weights(cfg), params, dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
