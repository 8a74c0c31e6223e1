"""Targets and drafters built so that the speculative engine's acceptance is known in advance.

* permutation world: a target whose greedy next token is pi(current token) exactly (one-hot
  embeddings, zeroed attention and MLP outputs, lm_head a permuted identity; pi is one long cycle),
  and drafters whose head predicts pi^k of the token captured at the drafter's position. With the
  right pairing (g_t, x_{t+1}) at position t the drafter's first draft from the newest pair is
  pi^2(x_{N-1}) = x_{N+1}: accepted. pi^1 or pi^3 (what an off-by-one pairing would need) never is.
* constant world: a target whose logits are all zero (argmax 0) and a drafter that always drafts 0:
  every draft is accepted.
* random world: random weights on both sides.
* arc drafter (permutation world): predicts pi^2 of the captured token on the first half of the cycle
  (`ARC`; right) and pi^1 elsewhere (never right), so text walking the cycle alternates between stretches
  where the drafter is good and stretches where it is useless: the best gamma changes mid-request.
* ladder drafter (permutation world), for draft trees: its distribution after every pair puts nearly all its
  mass, nearly evenly, on pi^1 of the captured token, then pi^2, ..., pi^LADDER, in that order. Its output is the
  captured one-hot at every step, so every node of a tree has those same children, and a tree's best candidates
  are whole levels: the top-1 chain is never right (pi^1), while the tree path pi^2, pi^3, ... (the second
  child, then the third, ...) is, to depth LADDER - 1.
Drafters are written in SpecForge's real layout by tests/drafter_oracle.py and loaded through the
public API.
"""

from __future__ import annotations

import numpy as np
import torch

import eagle3_jax

import drafter_oracle as oracle
from hf_models import build_model

V = D = 48
LAYERS = 8


def _cycle(seed: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(V)
    pi = np.empty(V, np.int64)
    pi[order] = np.roll(order, -1)  # one cycle through every token
    return pi


PI = _cycle(0)
ORDER = np.random.default_rng(0).permutation(V)  # the cycle's order: PI[ORDER[i]] = ORDER[i + 1]
ARC = set(ORDER[: V // 2].tolist())  # where the arc drafter is right


def power(k: int) -> np.ndarray:
    out = np.arange(V)
    for _ in range(k):
        out = PI[out]
    return out


def _hf_target(kind: str, layers: int):
    if kind == "random2":  # another shape: GQA 4, head_dim 8 != hidden / heads
        return build_model("gqa4_sharded", seed=12, num_layers=layers, vocab=V, hidden=D)
    model = build_model("gqa2_headdim", seed=11, num_layers=layers, vocab=V, hidden=D)
    if kind == "random":
        return model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(V) * 0.7)
        head = torch.zeros(V, D)
        head[torch.as_tensor(PI), torch.arange(V)] = 1.0  # logit pi(x) reads the one-hot of x
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.copy_(torch.zeros(D) if kind == "constant" else 0.5 + torch.rand(D))
    return model


def save_target(kind: str, folder, layers: int = LAYERS):
    """The target of a world, `layers` deep (fewer compile faster; the drafters capture the defaults)."""
    model = _hf_target(kind, layers)
    model.save_pretrained(folder)
    return model, eagle3_jax.load_target(folder, dtype="float32", progress=False)


SPEC = oracle.DraftSpec(hidden_size=D, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        target_hidden_size=D, target_vocab_size=V, draft_vocab_size=V)
RANDOM_SPEC = oracle.DraftSpec(hidden_size=D, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                               target_hidden_size=D, target_vocab_size=V, draft_vocab_size=32)
# A speculators-format drafter with a Qwen3-style layer and norm_before_residual, MHA, head_dim 12.
RANDOM2_SPEC = oracle.DraftSpec(hidden_size=D, intermediate_size=40, num_heads=2, num_kv_heads=2, head_dim=12,
                                target_hidden_size=D, target_vocab_size=V, draft_vocab_size=40,
                                norm_before_residual=True, qk_norm=True)


LADDER = 3  # the ladder drafter's powers of pi: a tree accepts up to LADDER - 1 drafts a round


def drafter_state(kind: str, seed: int = 1) -> tuple[oracle.DraftSpec, dict]:
    """kind: "random", "constant" (always drafts 0), "pi2" / "pi1" / "pi3" (predicts pi^k(x_t)), "arc"
    (pi^2 on ARC, pi^1 elsewhere) or "ladder" (pi^1 > pi^2 > ... > pi^LADDER)."""
    if kind == "random":
        return RANDOM_SPEC, oracle.random_drafter_state(RANDOM_SPEC, seed)
    if kind == "random2":
        return RANDOM2_SPEC, oracle.random_drafter_state(RANDOM2_SPEC, seed)
    state = oracle.random_drafter_state(SPEC, seed)
    state["midlayer.self_attn.o_proj.weight"].zero_()
    state["midlayer.mlp.down_proj.weight"].zero_()
    fc = torch.zeros(D, 3 * D)
    fc[:, :D] = torch.eye(D)  # h = the low feature = one-hot of the captured token x_t
    state["fc.weight"] = fc
    head = torch.zeros(V, D)
    if kind == "ladder":
        for k in range(1, LADDER + 1):
            head[torch.as_tensor(power(k)), torch.arange(V)] = 1.0 - 0.01 * (k - 1)
    elif kind == "arc":
        on_arc = np.isin(np.arange(V), list(ARC))
        head[torch.as_tensor(np.where(on_arc, power(2), power(1))), torch.arange(V)] = 1.0
    elif kind != "constant":
        head[torch.as_tensor(power(int(kind[2:]))), torch.arange(V)] = 1.0
    state["lm_head.weight"] = head
    state["norm.weight"] = 0.5 + torch.rand(D, generator=torch.Generator().manual_seed(seed))
    return SPEC, state


def save_drafter(kind: str, folder, target, seed: int = 1):
    spec, state = drafter_state(kind, seed)
    writer = oracle.write_speculators if kind == "random2" else oracle.write_specforge
    writer(folder, spec, state)
    return spec, state, eagle3_jax.load_drafter(folder, target, dtype="float32")
