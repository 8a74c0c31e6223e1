"""Acceptance of a drafter in training: tau (mean tokens per speculative round, the bonus token included)
of greedy speculative decoding through our Engine, on held-out prompts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding.engine import Engine
from eagle3_jax.models.config import DrafterConfig
from eagle3_jax.training.data import Sample, prompt_length


def prompts_of(samples: list[Sample], max_prompt: int) -> list[list[int]]:
    """Each sample's prompt (`data.prompt_length`), at most max_prompt tokens of it, the latest kept."""
    return [s.tokens[:prompt_length(s.loss_mask)][-max_prompt:].tolist() for s in samples]


def as_drafter(cfg: DrafterConfig, params: dict, d2t, dtype) -> Drafter:
    """The training parameters as a loaded drafter, cast to the target's dtype."""
    return Drafter(cfg, {**jax.tree.map(lambda x: x.astype(dtype), params), "d2t": jnp.asarray(d2t)}, folder=None)


def tau(target: Target, drafter: Drafter, prompts: list[list[int]], gamma: int, max_new_tokens: int,
        stop_token_ids=(), kernels: str | None = None, temperature: float = 0.0, seed: int | None = None) -> float:
    """Mean accepted drafts + 1 over every round of speculative decoding of the prompts: greedy, or sampled at
    `temperature` (seeded)."""
    max_len = min(max(len(p) for p in prompts) + max_new_tokens + gamma + 2, target.config.max_position_embeddings)
    engine = Engine(target, drafter, num_draft_tokens=gamma, max_len=max_len, kernels=kernels)
    results = engine.generate(prompts, max_new_tokens, stop_token_ids, temperature=temperature, seed=seed)
    rounds = [a for r in results for a in r.accept_lengths]
    return float(np.mean(rounds) + 1) if rounds else float("nan")
