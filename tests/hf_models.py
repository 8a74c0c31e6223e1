"""Tiny random Qwen3 checkpoints built with transformers, the target's outside oracle."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

# Between them: head_dim != hidden/heads, GQA ratios 1, 2 and 4, tied and untied embeddings, shards, YaRN.
CONFIGS = {
    "gqa2_headdim": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         tie_word_embeddings=False),
    "mha_tied": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                     tie_word_embeddings=True),
    "gqa4_sharded": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=False, shard="12KB"),
    "gqa4_tied_yarn": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64}),
}


def build_model(name: str = "gqa2_headdim", seed: int = 0, num_layers: int = 8, vocab: int = 160,
                hidden: int | None = None) -> Qwen3ForCausalLM:
    """A float32 random Qwen3 with weights scaled so that logits are decisive and norms are not all ones."""
    opts = dict(CONFIGS[name])
    opts.pop("shard", None)
    if hidden is not None:
        opts["hidden_size"] = hidden
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, intermediate_size=2 * opts["hidden_size"] + 8, num_hidden_layers=num_layers,
                      max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6, **opts)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def save_model(model: Qwen3ForCausalLM, folder: Path, name: str, dtype=torch.float32) -> Path:
    shard = CONFIGS[name].get("shard")
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(dtype).save_pretrained(folder, **kwargs)
    model.to(torch.float32)
    return folder


# Qwen3-MoE: between them norm_topk_prob on and off, top-1 and top-k routing, dense layers mixed in by
# mlp_only_layers and by decoder_sparse_step, the hub's per-expert layout (one file and shards) and the
# fused layout of transformers 5.
MOE_CONFIGS = {
    "moe_top1_step2_sharded": dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                                   decoder_sparse_step=2, layout="per_expert", shard="40KB"),
    "moe_top3_norm_fused": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
                                layout="fused"),
}


def build_moe_model(name: str, seed: int = 0, num_layers: int = 4, vocab: int = 160, hidden: int = 32):
    """A float32 random Qwen3-MoE (GQA 2, head_dim 16 != hidden / heads) with decisive logits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    opts = {k: v for k, v in MOE_CONFIGS[name].items() if k not in ("layout", "shard")}
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=40, moe_intermediate_size=24,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, **opts)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "mlp.gate." in pname:  # a wider router spread: routing far from ties
                p.mul_(4.0)
    return model


def save_moe_model(model, folder: Path, name: str) -> Path:
    """save_pretrained (per-expert keys, as on the hub), or the fused in-memory state dict as it is."""
    opts = MOE_CONFIGS[name]
    if opts["layout"] == "fused":
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        return folder
    kwargs = {"max_shard_size": opts["shard"]} if "shard" in opts else {}
    model.save_pretrained(folder, **kwargs)
    return folder
