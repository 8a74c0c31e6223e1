"""Frozen, hashable model configs read from a Hugging Face `config.json`.

Configs are static arguments of the jitted steps, so every field is an int, a float, a bool,
a string or a tuple of those.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from eagle3_jax.errors import CheckpointError
from eagle3_jax.models.config_fields import Fields

_ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM",), "qwen3_moe": ("Qwen3MoeForCausalLM",)}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: the inverse frequencies and the cos/sin scale (YaRN's attention factor)."""

    theta: float
    head_dim: int
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def inverse_frequencies(self) -> tuple[float, ...]:
        """The per-pair inverse frequencies, computed in float64 on the host (as transformers does)."""
        half = self.head_dim // 2
        base = [self.theta ** (2 * i / self.head_dim) for i in range(half)]
        if self.kind == "default":
            return tuple(1.0 / b for b in base)
        # YaRN: interpolate the low frequencies, keep the high ones, ramp between.
        low, high = _yarn_correction_range(self)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        out = []
        for i, b in enumerate(base):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1.0 - ramp
            out.append((1.0 / (self.factor * b)) * ramp + (1.0 / b) * extrapolation)
        return tuple(out)


def _yarn_correction_range(rope: RopeConfig) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        ratio = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return rope.head_dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope.head_dim - 1)


def parse_rope(fields: Fields, head_dim: int, max_positions: int) -> RopeConfig:
    """Reads rope settings from either the transformers 4 (`rope_theta`, `rope_scaling`) or the
    transformers 5 (`rope_parameters`) spelling; refuses scaling types we do not implement."""
    where = fields.where
    params = Fields(where, (fields.obj("rope_scaling"), "rope_scaling."),
                    (fields.obj("rope_parameters"), "rope_parameters."))
    theta = params.float("rope_theta") if params.has("rope_theta") else fields.float("rope_theta", 10000.0)
    kind = params.str("rope_type") if params.has("rope_type") else params.str("type", "default")
    if kind == "default":
        return RopeConfig(theta=theta, head_dim=head_dim)
    if kind != "yarn":
        raise CheckpointError(f"{where}: rope scaling type {kind!r} is not supported (only 'default' and 'yarn')")
    if params.float("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    factor = params.float("factor")
    original = params.int("original_max_position_embeddings", 0) or max_positions
    attention_factor = params.float("attention_factor", None)
    if attention_factor is None:
        mscale, mscale_all_dim = params.float("mscale", 0.0), params.float("mscale_all_dim", 0.0)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        head_dim=head_dim,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=params.float("beta_fast", 0.0) or 32.0,
        beta_slow=params.float("beta_slow", 0.0) or 1.0,
        attention_factor=float(attention_factor),
        truncate=params.bool("truncate", True),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP of a Qwen3-MoE target (transformers' `Qwen3MoeSparseMoeBlock`).

    Layer i is sparse when it is not in mlp_only_layers and (i + 1) is a multiple of
    decoder_sparse_step (transformers' `Qwen3MoeDecoderLayer`); other layers keep the dense MLP of the
    target's intermediate_size.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Shape and numerics of a Qwen3 target: dense, or with a mixture-of-experts MLP when `moe` is set."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe: MoeConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` runs the mixture of experts (else the dense gated MLP)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def default_capture_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's low/mid/high features: the residual stream entering these layers."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "Qwen3Config":
        fields = Fields.of(raw, where)
        model_type = fields.str("model_type", None)
        architectures = fields.strs("architectures", ())
        known = _ARCHITECTURES.get(model_type)
        if known is None or (architectures and not set(architectures) & set(known)):
            raise CheckpointError(f"{where}: not a Qwen3 or Qwen3-MoE model (model_type={model_type!r}, "
                                  f"architectures={list(architectures)})")
        _refuse_unsupported(fields)
        heads = fields.int("num_attention_heads", minimum=1)
        hidden = fields.int("hidden_size", minimum=1)
        head_dim = fields.int("head_dim", 0) or hidden // heads
        max_positions = fields.int("max_position_embeddings", 32768)
        return cls(
            vocab_size=fields.int("vocab_size", minimum=1),
            hidden_size=hidden,
            intermediate_size=fields.int("intermediate_size", minimum=1),
            num_layers=fields.int("num_hidden_layers", minimum=1),
            num_heads=heads,
            num_kv_heads=fields.int("num_key_value_heads", 0, minimum=0) or heads,
            head_dim=head_dim,
            rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
            rope=parse_rope(fields, head_dim, max_positions),
            tie_word_embeddings=fields.bool("tie_word_embeddings", False),
            max_position_embeddings=max_positions,
            moe=_parse_moe(fields) if model_type == "qwen3_moe" else None,
        )

def _refuse_unsupported(fields: Fields) -> None:
    """Flags that change the computation and that we do not implement are refused, never ignored."""
    if fields.bool("use_sliding_window", False):
        raise CheckpointError(f"{fields.where}: use_sliding_window=true is not supported")
    refuse_unsupported_layer(fields, ("attention_bias",))


def refuse_unsupported_layer(fields: Fields, biases: tuple[str, ...]) -> None:
    """A decoder layer (target's or drafter's) with biases or an activation other than SiLU is refused."""
    for flag in biases:
        if fields.bool(flag, False):
            raise CheckpointError(f"{fields.where}: {flag}=true is not supported")
    act = fields.str("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{fields.where}: hidden_act={act!r} is not supported (only 'silu')")


def _parse_moe(fields: Fields) -> MoeConfig:
    """The MoE fields of a `qwen3_moe` config.json. transformers 5 writes `num_local_experts` for
    `num_experts`. `output_router_logits` and `router_aux_loss_coef` only add a training loss, so
    inference ignores them; what would change the computation and is not implemented is refused."""
    where = fields.where
    layers = fields.int("num_hidden_layers")
    experts = fields.int("num_experts") if fields.has("num_experts") else fields.int("num_local_experts")
    top_k, step = fields.int("num_experts_per_tok"), fields.int("decoder_sparse_step", 1)
    mlp_only = tuple(sorted(fields.ints("mlp_only_layers", ())))
    if fields.int("shared_expert_intermediate_size", 0):
        raise CheckpointError(f"{where}: shared_expert_intermediate_size (a Qwen2-MoE shared expert) is not supported")
    if experts < 1:
        raise CheckpointError(f"{where}: num_experts={experts} is not supported (a MoE target needs experts)")
    if not 1 <= top_k <= experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    if step < 1:
        raise CheckpointError(f"{where}: decoder_sparse_step={step} must be >= 1")
    bad = [i for i in mlp_only if not 0 <= i < layers]
    if bad:
        raise CheckpointError(f"{where}: mlp_only_layers holds {bad[0]}, outside the {layers} layers")
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=fields.int("moe_intermediate_size", minimum=1),
                     norm_topk_prob=fields.bool("norm_topk_prob", False), decoder_sparse_step=step,
                     mlp_only_layers=mlp_only)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    capture_layers: tuple[int, ...]  # residual stream ENTERING these target layers, low to high
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h (speculators flag)
    qk_norm: bool = False  # Qwen3-style layer: RMSNorm on q and k per head before RoPE
    fc_norm: bool = False  # RMSNorm each captured feature chunk before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    norm_output: bool = False  # speculators: carry norm(h), not h, to the next draft step

    @property
    def feature_width(self) -> int:
        return len(self.capture_layers) * self.target_hidden_size
