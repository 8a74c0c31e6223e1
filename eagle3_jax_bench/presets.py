"""The model shapes every benchmark, the GPU checks and the notebook build random weights for: each a Qwen3
target's config and an EAGLE-3 drafter's of the same width and layer shape, capturing the target's default
layers. Real shapes from the models' Hugging Face config.json; the drafters' as SpecBundle ships them.

`pair(name)` gives the (Qwen3Config, DrafterConfig) of one preset; PRESETS names them all.
"""

from __future__ import annotations

from eagle3_jax.models.config import DrafterConfig, MoeConfig, Qwen3Config, RopeConfig


def dense_pair(*, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
               head_dim: int, theta: float, draft_vocab: int, tied: bool = False,
               max_positions: int = 40960) -> tuple[Qwen3Config, DrafterConfig]:
    """A dense Qwen3 target and a drafter with the target's width, intermediate size and heads."""
    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                         rope=RopeConfig(theta=theta, head_dim=head_dim), tie_word_embeddings=tied,
                         max_position_embeddings=max_positions)
    return target, drafter_for(target, intermediate, draft_vocab)


def moe_pair(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, experts: int,
             top_k: int, moe_intermediate: int, draft_intermediate: int, draft_vocab: int,
             max_positions: int = 40960) -> tuple[Qwen3Config, DrafterConfig]:
    """A Qwen3-MoE target (every layer sparse) and a dense drafter of its width."""
    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * moe_intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, head_dim=head_dim), tie_word_embeddings=False,
                         max_position_embeddings=max_positions,
                         moe=MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                                       moe_intermediate_size=moe_intermediate, norm_topk_prob=True))
    return target, drafter_for(target, draft_intermediate, draft_vocab)


def drafter_for(target: Qwen3Config, intermediate: int, draft_vocab: int) -> DrafterConfig:
    return DrafterConfig(hidden_size=target.hidden_size, intermediate_size=intermediate, num_heads=target.num_heads,
                         num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=1e-6,
                         rope=target.rope, draft_vocab_size=draft_vocab, target_vocab_size=target.vocab_size,
                         target_hidden_size=target.hidden_size, capture_layers=target.default_capture_layers)


PRESETS = {
    "qwen3-1.7b": lambda: dense_pair(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8,
                                     head_dim=128, theta=1e6, draft_vocab=32000, tied=True),
    "qwen3-8b": lambda: dense_pair(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                                   head_dim=128, theta=1e6, draft_vocab=32000),
    "qwen3-32b": lambda: dense_pair(vocab=151936, hidden=5120, intermediate=25600, layers=64, heads=64, kv_heads=8,
                                    head_dim=128, theta=1e6, draft_vocab=32000),
    # SpecBundle's drafter for it: hidden 2048, intermediate 12288, 32 / 4 heads (head_dim 128 assumed).
    "qwen3-30b-a3b": lambda: moe_pair(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                                      experts=128, top_k=8, moe_intermediate=768, draft_intermediate=12288,
                                      draft_vocab=32000),
    "qwen3-235b-a22b": lambda: moe_pair(vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128,
                                        experts=128, top_k=8, moe_intermediate=1536, draft_intermediate=24576,
                                        draft_vocab=32000),
    "tiny": lambda: dense_pair(vocab=256, hidden=64, intermediate=128, layers=6, heads=4, kv_heads=2, head_dim=16,
                               theta=1e4, draft_vocab=64, max_positions=1024),
    "tiny-moe": lambda: moe_pair(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, experts=16,
                                 top_k=4, moe_intermediate=32, draft_intermediate=128, draft_vocab=64,
                                 max_positions=1024),
}


def pair(name: str) -> tuple[Qwen3Config, DrafterConfig]:
    """The (target, drafter) configs of a preset; a name not in PRESETS is refused, naming the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
