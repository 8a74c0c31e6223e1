"""Writing a trained drafter in SpecForge's flat format (SGLang and vLLM read it too):
`config.json` (`LlamaForCausalLMEagle3`) and `model.safetensors` with fc, midlayer.*, norm, lm_head, d2t
(int64) and t2d (bool). No embedding is written: the drafter uses its target's, as SpecForge's export
drops every key containing "embed" when the embedding was frozen.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from eagle3_jax.checkpoints import hf_layout
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.config import DrafterConfig


def specforge_config(cfg: DrafterConfig, max_position_embeddings: int, dtype: str) -> dict:
    """The flat config; capture layers in SpecForge's "output of layer k" ids (we capture entering k + 1)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": cfg.target_vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": dtype, "initializer_range": 0.02, "pretraining_tp": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [c - 1 for c in cfg.capture_layers]},
    }


def specforge_tensors(cfg: DrafterConfig, params: dict, d2t, dtype: str) -> dict[str, np.ndarray]:
    """Our parameter pytree -> SpecForge's tensor names (the drafter's weight description under "midlayer."),
    q/k/v and gate/up split back apart; d2t as int64 and t2d, its inverse, as bool."""
    described = [w for w in weights_lib.drafter_weights(cfg, "midlayer.") if w.dtype is None]
    tensors = hf_layout.to_hf(described, params, dtype)
    d2t = np.asarray(jax.device_get(d2t), np.int64)
    t2d = np.zeros((cfg.target_vocab_size,), bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    return {**tensors, "d2t": d2t, "t2d": t2d}


def export_specforge(folder: Path, cfg: DrafterConfig, params: dict, d2t, max_position_embeddings: int,
                     dtype: str = "bfloat16") -> Path:
    """Writes config.json and model.safetensors into folder (created if needed); returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(specforge_config(cfg, max_position_embeddings, dtype), indent=2))
    save_file(specforge_tensors(cfg, params, d2t, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
