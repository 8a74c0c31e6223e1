"""The weight descriptions (models/weights.py): their HF tensors are transformers' and SpecForge's own,
their abstract params and partition specs share the parameter pytree's structure, and logical-axis rules
give the specs tensor parallelism will use. Pure Python and shapes: nothing is compiled."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.checkpoints import hf_layout
from eagle3_jax.models import eagle3, qwen3, weights
from eagle3_jax.models.config import DrafterConfig, Qwen3Config

import drafter_oracle as oracle
from test_drafter_golden import BASE, HT, LAYERS, VT

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])


def hf_model(moe: bool, tied: bool = False):
    if moe:
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SMALL, **MOE, tie_word_embeddings=tied))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, tie_word_embeddings=tied))


@pytest.mark.parametrize("moe,tied", [(False, False), (False, True), (True, False)], ids=["dense", "tied", "moe"])
def test_target_tensors_are_transformers_state_dict(moe, tied):
    """transformers 5's in-memory layout (experts fused) is the description's first layout, tensor for tensor."""
    model = hf_model(moe, tied)
    cfg = Qwen3Config.from_dict(model.config.to_dict())
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    layout = hf_layout.plan(weights.target_weights(cfg), state)
    assert hf_layout.expected_shapes(layout) == state


def test_drafter_tensors_are_specforge_and_speculators_names():
    spec = dataclasses.replace(BASE, fc_norm=True)
    cfg = _drafter_config(spec)
    state = {k: tuple(v.shape) for k, v in oracle.random_drafter_state(spec, seed=0).items()}
    flat = hf_layout.expected_shapes(hf_layout.plan(weights.drafter_weights(cfg, "midlayer."), ()))
    assert flat == {k: s for k, s in state.items() if k != "t2d"}
    speculators = {k: tuple(v.shape) for k, v in oracle.to_speculators_keys(oracle.random_drafter_state(
        dataclasses.replace(BASE, qk_norm=True, norm_before_fc=True), seed=0)).items()}
    cfg = _drafter_config(dataclasses.replace(BASE, qk_norm=True, norm_before_fc=True))
    described = hf_layout.expected_shapes(hf_layout.plan(weights.drafter_weights(cfg, "layers.0."), ()))
    assert described == {k: s for k, s in speculators.items() if k != "t2d"}


def _drafter_config(spec) -> DrafterConfig:
    from eagle3_jax.models.config import RopeConfig

    return DrafterConfig(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
        rope=RopeConfig(theta=spec.rope_theta, head_dim=spec.head_dim), draft_vocab_size=spec.draft_vocab_size,
        target_vocab_size=VT, target_hidden_size=HT, capture_layers=(1, 3, LAYERS - 3), qk_norm=spec.qk_norm,
        fc_norm=spec.fc_norm, norm_before_fc=spec.norm_before_fc)


def test_default_rules_leave_every_parameter_unsharded():
    cfg = Qwen3Config.from_dict(hf_model(moe=True).config.to_dict())
    described = weights.target_weights(cfg)
    specs = weights.partition_specs(described)
    abstract = qwen3.abstract_params(cfg, np.float32)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(abstract)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert all(spec == P(*[None] * leaf.ndim) for spec, leaf in zip(flat_specs, jax.tree.leaves(abstract)))
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    for spec in flat_specs:
        NamedSharding(mesh, spec)  # a valid spec for a mesh
    rules = {k: v for k, v in weights.DEFAULT_RULES.items() if k != "experts"}
    with pytest.raises(ValueError, match="no mesh axis for logical axis 'experts'"):
        weights.partition_specs(described, rules)


TP = {**weights.DEFAULT_RULES, "vocab": "tp", "heads": "tp", "qkv": "tp", "gate_up": "tp", "mlp": "tp",
      "experts": "ep"}


def test_tp_rules_give_megatron_specs():
    """Column-parallel in (q/k/v, gate/up, embedding rows), row-parallel out (o, down), experts on their own
    axis, norms replicated."""
    cfg = Qwen3Config.from_dict(hf_model(moe=True).config.to_dict())
    specs = weights.partition_specs(weights.target_weights(cfg), TP)
    assert specs["embed"] == specs["lm_head"] == P("tp", None) and specs["final_norm"] == P(None)
    dense, sparse = specs["layers"][1], specs["layers"][0]
    assert dense == {"attn_norm": P(None), "wqkv": P("tp", None), "q_norm": P(None), "k_norm": P(None),
                     "wo": P(None, "tp"), "mlp_norm": P(None), "w_gate_up": P("tp", None), "w_down": P(None, "tp")}
    assert sparse["router"] == P("ep", None)
    assert sparse["w_gate_up"] == P("ep", "tp", None) and sparse["w_down"] == P("ep", None, "tp")
    drafter = weights.partition_specs(weights.drafter_weights(_drafter_config(BASE)), TP)
    assert drafter["wqkv"] == P("tp", None) and drafter["wo"] == P(None, "tp") and drafter["fc"] == P(None, None)
    assert drafter["lm_head"] == P(None, None) and drafter["d2t"] == P(None)
    assert jax.tree.structure(drafter, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        eagle3.abstract_params(_drafter_config(BASE), np.float32))
