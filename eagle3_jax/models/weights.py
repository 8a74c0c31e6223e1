"""Each model's weights described once: for every parameter its place in the pytree, shape, dtype, logical
axes and the Hugging Face tensors it is made of. Loading, orbax conversion, export, abstract params and
partition specs are all derived from these descriptions (`checkpoints/` does the I/O).

Fusion: a parameter made of several HF tensors concatenates them along `HFSource.axis` in order (q, k, v
into wqkv; gate, up into w_gate_up). A per-expert source (`experts` > 0, keys holding `{e}`) also stacks
expert e's tensors at index e of a new leading axis.

Partition specs come from a table of rules, logical axis -> mesh axis (or None). flax's
`logical_to_mesh_axes` is this same lookup, but flax is not a dependency and its `LogicallyPartitioned`
/ nnx variable metadata belong to flax modules, while these models are pure functions over plain dict
pytrees; the few lines below give the same specs without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from eagle3_jax.models.config import DrafterConfig, Qwen3Config

TreePath = tuple  # a pytree path: dict keys (str) and tuple indices (int)


@dataclasses.dataclass(frozen=True)
class HFSource:
    """The HF tensors a parameter is made of, concatenated along `axis` (of each HF tensor); `sizes` are
    their extents along it. With `experts` > 0 each key holds `{e}` and experts stack on a leading axis.
    `present_if`: this source is the file's layout when the file holds that key (else the next source)."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    axis: int = 0
    experts: int = 0
    present_if: str | None = None

    def names(self) -> tuple[str, ...]:
        """Every HF tensor name, expert by expert."""
        if not self.experts:
            return self.keys
        return tuple(k.format(e=e) for e in range(self.experts) for k in self.keys)


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter: pytree path, shape, logical axes (one per dim), dtype (None: the model's float dtype)
    and its HF sources (first one first: the layout exported)."""

    path: TreePath
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    sources: tuple[HFSource, ...]
    dtype: str | None = None

    def hf_shape(self, source: HFSource, part: int) -> tuple[int, ...]:
        """The shape of `source`'s part-th tensor (of one expert for a per-expert source)."""
        shape = list(self.shape[1:] if source.experts else self.shape)
        shape[source.axis] = source.sizes[part]
        return tuple(shape)


def _one(path: TreePath, shape: tuple[int, ...], axes: tuple[str, ...], *keys: str, dtype: str | None = None,
         sizes: tuple[int, ...] | None = None) -> Weight:
    """A weight from one HF tensor, or several concatenated along the first axis (`sizes` their rows)."""
    return Weight(path, shape, axes, (HFSource(tuple(keys), sizes or (shape[0],)),), dtype)


def _attention_and_mlp(path: TreePath, hf: str, D: int, H: int, N: int, K: int, I: int, in_width: int,
                       qk_norm: bool) -> list[Weight]:
    """A Llama / Qwen3 decoder layer's attention and dense MLP (`hf`: its key prefix)."""
    out = [
        _one(path + ("wqkv",), ((N + 2 * K) * H, in_width), ("qkv", "embed"),
             *(hf + f"self_attn.{x}_proj.weight" for x in "qkv"), sizes=(N * H, K * H, K * H)),
        _one(path + ("wo",), (D, N * H), ("embed", "heads"), hf + "self_attn.o_proj.weight"),
        _one(path + ("mlp_norm",), (D,), ("embed",), hf + "post_attention_layernorm.weight"),
        _one(path + ("w_gate_up",), (2 * I, D), ("gate_up", "embed"), hf + "mlp.gate_proj.weight",
             hf + "mlp.up_proj.weight", sizes=(I, I)),
        _one(path + ("w_down",), (D, I), ("embed", "mlp"), hf + "mlp.down_proj.weight"),
    ]
    if qk_norm:
        out += [_one(path + ("q_norm",), (H,), ("head_dim",), hf + "self_attn.q_norm.weight"),
                _one(path + ("k_norm",), (H,), ("head_dim",), hf + "self_attn.k_norm.weight")]
    return out


def _sparse_mlp(path: TreePath, hf: str, cfg: Qwen3Config) -> list[Weight]:
    """A Qwen3-MoE sparse layer's router and experts, in the fused layout or per expert (the hub's)."""
    D, E, Ie = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    fused = hf + "mlp.experts.gate_up_proj"
    gate_up = (HFSource((fused,), (2 * Ie,), axis=1, present_if=fused),
               HFSource((hf + "mlp.experts.{e}.gate_proj.weight", hf + "mlp.experts.{e}.up_proj.weight"),
                        (Ie, Ie), experts=E))
    down = (HFSource((hf + "mlp.experts.down_proj",), (D,), axis=1, present_if=fused),
            HFSource((hf + "mlp.experts.{e}.down_proj.weight",), (D,), experts=E))
    return [_one(path + ("router",), (E, D), ("experts", "embed"), hf + "mlp.gate.weight"),
            Weight(path + ("w_gate_up",), (E, 2 * Ie, D), ("experts", "gate_up", "embed"), gate_up),
            Weight(path + ("w_down",), (E, D, Ie), ("experts", "embed", "mlp"), down)]


def target_weights(cfg: Qwen3Config) -> tuple[Weight, ...]:
    """Every parameter of a Qwen3 / Qwen3-MoE target (models/qwen3.py), with its transformers tensors."""
    D, H, I, N, K = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads
    out = [_one(("embed",), (cfg.vocab_size, D), ("vocab", "embed"), "model.embed_tokens.weight"),
           _one(("final_norm",), (D,), ("embed",), "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        out.append(_one(("lm_head",), (cfg.vocab_size, D), ("vocab", "embed"), "lm_head.weight"))
    for i in range(cfg.num_layers):
        path, hf = ("layers", i), f"model.layers.{i}."
        out.append(_one(path + ("attn_norm",), (D,), ("embed",), hf + "input_layernorm.weight"))
        layer = _attention_and_mlp(path, hf, D, H, N, K, I, D, qk_norm=True)
        if cfg.is_sparse(i):
            layer = [w for w in layer if w.path[-1] not in ("w_gate_up", "w_down")] + _sparse_mlp(path, hf, cfg)
        out += layer
    return tuple(out)


def drafter_weights(cfg: DrafterConfig, prefix: str = "midlayer.", with_embed: bool = False) -> tuple[Weight, ...]:
    """Every parameter of an EAGLE-3 drafter (models/eagle3.py), its layer's HF keys
    under `prefix` ("midlayer." for SpecForge's flat format, "layers.0." for speculators')."""
    D, H, I, N, K = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads
    Ht, C = cfg.target_hidden_size, cfg.feature_width
    out = [_one(("fc",), (D, C), ("embed", "features"), "fc.weight"),
           _one(("hidden_norm",), (D,), ("embed",), prefix + "hidden_norm.weight"),
           _one(("embed_norm",), (D,), ("embed",), prefix + "input_layernorm.weight"),
           *_attention_and_mlp((), prefix, D, H, N, K, I, 2 * D, qk_norm=cfg.qk_norm),
           _one(("final_norm",), (D,), ("embed",), "norm.weight"),
           _one(("lm_head",), (cfg.draft_vocab_size, D), ("draft_vocab", "embed"), "lm_head.weight")]
    if with_embed:
        out.append(_one(("embed",), (cfg.target_vocab_size, D), ("vocab", "embed"), "embed_tokens.weight"))
    if cfg.norm_before_fc:
        out.append(_one(("feature_norm",), (C,), ("features",), "input_norm.weight"))
    if cfg.fc_norm:
        out += [_one(("fc_norms", i), (Ht,), ("target_embed",), f"fc_norm.{i}.weight")
                for i in range(len(cfg.capture_layers))]
    out.append(_one(("d2t",), (cfg.draft_vocab_size,), ("draft_vocab",), "d2t", dtype="int32"))
    return tuple(out)


def build_tree(items: Iterable[tuple[TreePath, object]]) -> dict:
    """(path, leaf) pairs -> the pytree: dict keys become dicts, int indices tuples."""
    root: dict = {}
    for path, leaf in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return _tuples(root)


def _tuples(node):
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return tuple(_tuples(node[i]) for i in range(len(node)))
    return {k: _tuples(v) for k, v in node.items()}


def abstract_params(weights: Iterable[Weight], dtype) -> dict:
    """Every parameter's shape and dtype (jax.ShapeDtypeStruct; floats in `dtype`), in the pytree's structure."""
    return build_tree((w.path, jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype or dtype))) for w in weights)


# Every logical axis a weight uses. "qkv" and "gate_up" are fused output axes (q | k | v heads, gate | up
# rows): sharding one splits the fused rows into contiguous blocks, so a tensor-parallel layout must order
# each shard's heads or rows together first.
LOGICAL_AXES = ("vocab", "draft_vocab", "embed", "target_embed", "features", "qkv", "heads", "head_dim",
                "gate_up", "mlp", "experts")
# Unsharded: every logical axis on no mesh axis (one device).
DEFAULT_RULES: Mapping[str, str | None] = {axis: None for axis in LOGICAL_AXES}


def partition_specs(weights: Iterable[Weight], rules: Mapping[str, str | None] = DEFAULT_RULES) -> dict:
    """The PartitionSpec of every parameter, in the pytree's structure: each logical axis mapped to the mesh
    axis (or None) that `rules` gives it; a rules table must name every axis the weights use."""
    def spec(w: Weight) -> PartitionSpec:
        missing = [a for a in w.axes if a not in rules]
        if missing:
            raise ValueError(f"partition rules name no mesh axis for logical axis {missing[0]!r} ({w.path})")
        return PartitionSpec(*(rules[a] for a in w.axes))

    return build_tree((w.path, spec(w)) for w in weights)
