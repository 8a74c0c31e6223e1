"""Which part of each weight a device holds under tensor parallelism over `tp` devices, and the config
its shard computes with.

The layout (Megatron's): q/k/v and gate/up are column-parallel (a device holds its heads' rows, its part of
the intermediate), o and down are row-parallel (the matching columns; their outputs are summed across
devices), the embedding and lm_head are split over the vocabulary, norms and the router are replicated.
A Qwen3-MoE target splits every expert's intermediate the same way (TP inside the experts, not expert
parallelism: docs/tensor-parallel.md has the arithmetic). The drafter is replicated but for its embedding.

The fused weights are not split into contiguous blocks: wqkv's rows are [q | k | v] and w_gate_up's
[gate | up], so device d holds the rows [q_d; k_d; v_d] and [gate_d; up_d], and the model runs unchanged on
each device with the per-device config (`local_config`). A sharded parameter's global array is its
devices' shards concatenated along the split axis: a container for the shards, never computed with whole.

KV heads: with tp <= K each device holds K / tp of them. With tp > K (Qwen3-32B has 8, Qwen3-235B-A22B
has 4) the KV heads are replicated as vLLM does: each device holds the one KV head its query heads read,
so tp must be a multiple of K, and tp / K devices hold each head (and its KV cache).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.collectives import TP_AXIS
from eagle3_jax.models.config import Qwen3Config

Ranges = tuple[tuple[int, int], ...]  # [start, stop) blocks of one axis, concatenated in order

# Logical axis -> mesh axis (models/weights.py's rules tables).
TARGET_RULES = {**weights_lib.DEFAULT_RULES, **{a: TP_AXIS for a in ("vocab", "qkv", "heads", "gate_up", "mlp")}}
DRAFTER_RULES = {**weights_lib.DEFAULT_RULES, "vocab": TP_AXIS}


def check(cfg: Qwen3Config, tp: int) -> None:
    """Refuses a tp that does not split the target evenly, naming each size it does not divide."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    N, K = cfg.num_heads, cfg.num_kv_heads
    sizes = {"num_attention_heads": N, "vocab_size": cfg.vocab_size}
    if cfg.moe is None or any(not cfg.is_sparse(i) for i in range(cfg.num_layers)):
        sizes["intermediate_size"] = cfg.intermediate_size
    if cfg.moe is not None:
        sizes["moe_intermediate_size"] = cfg.moe.moe_intermediate_size
    bad = [f"{name}={n}" for name, n in sizes.items() if n % tp]
    if K % tp and tp % K:
        bad.append(f"num_key_value_heads={K} (tp must divide it, or be a multiple of it to replicate KV heads)")
    if bad:
        raise ValueError(f"tp={tp} does not divide the target's {', '.join(bad)}")


def local_kv_heads(cfg: Qwen3Config, tp: int) -> int:
    return max(cfg.num_kv_heads // tp, 1)


def local_config(cfg: Qwen3Config, tp: int) -> Qwen3Config:
    """The config one device's shard computes with: its heads, its KV heads, its part of each
    intermediate, its slice of the vocabulary (`check` first)."""
    moe = cfg.moe and dataclasses.replace(cfg.moe, moe_intermediate_size=cfg.moe.moe_intermediate_size // tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=local_kv_heads(cfg, tp),
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp,
                               moe=moe)


def _blocks(size: int, tp: int, d: int, offset: int = 0) -> Ranges:
    n = size // tp
    return ((offset + d * n, offset + (d + 1) * n),)


def _kv_rows(cfg: Qwen3Config, tp: int, d: int, offset: int) -> Ranges:
    """Device d's rows of k (or v) in the [K H] rows starting at `offset`."""
    K, H = cfg.num_kv_heads, cfg.head_dim
    if K >= tp:
        return _blocks(K * H, tp, d, offset)
    head = d * K // tp  # the KV head device d's query heads read
    return ((offset + head * H, offset + (head + 1) * H),)


def axis_ranges(axis: str, size: int, cfg: Qwen3Config, tp: int, d: int) -> Ranges:
    """Device d's part of one sharded logical axis of extent `size` (along which rows it holds)."""
    if axis == "qkv":
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        return _blocks(N * H, tp, d) + _kv_rows(cfg, tp, d, N * H) + _kv_rows(cfg, tp, d, (N + K) * H)
    if axis == "gate_up":
        return _blocks(size // 2, tp, d) + _blocks(size // 2, tp, d, size // 2)
    return _blocks(size, tp, d)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a parameter's shards go: its split axis (None: replicated) and each device's blocks of it."""

    weight: weights_lib.Weight
    dim: int | None
    ranges: tuple[Ranges, ...]  # per device; empty when replicated

    @property
    def spec(self) -> PartitionSpec:
        return PartitionSpec(*(TP_AXIS if i == self.dim else None for i in range(len(self.weight.shape))))

    @property
    def global_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.weight.shape
        shape = list(self.weight.shape)
        shape[self.dim] = len(self.ranges) * sum(b - a for a, b in self.ranges[0])
        return tuple(shape)

    def device_of(self, index: tuple[slice, ...]) -> int:
        """The device whose shard sits at `index` of the global array (jax.make_array_from_callback's)."""
        local = self.global_shape[self.dim] // len(self.ranges)
        return (index[self.dim].start or 0) // local


def placements(described, cfg: Qwen3Config, tp: int, rules) -> tuple[Placement, ...]:
    """Every parameter's placement under `rules` (TARGET_RULES or DRAFTER_RULES), in the description's order."""
    out = []
    for w in described:
        split = [i for i, a in enumerate(w.axes) if rules[a] == TP_AXIS]
        if not split:
            out.append(Placement(w, None, ()))
            continue
        (dim,) = split
        out.append(Placement(w, dim, tuple(axis_ranges(w.axes[dim], w.shape[dim], cfg, tp, d) for d in range(tp))))
    return tuple(out)


def target_placements(cfg: Qwen3Config, tp: int) -> tuple[Placement, ...]:
    check(cfg, tp)
    return placements(weights_lib.target_weights(cfg), cfg, tp, TARGET_RULES)


def drafter_placements(described, target: Qwen3Config, tp: int) -> tuple[Placement, ...]:
    return placements(described, target, tp, DRAFTER_RULES)
