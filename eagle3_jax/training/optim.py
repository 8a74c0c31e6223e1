"""What both trainers update with (the drafter's step.py and pre-training's pretrain.py): the initial
parameters, the learning-rate schedule, the optimizer, and one update of a training state from a loss.

A training state is a registered dataclass with at least `step` (int32 updates done), `params` (float32) and
`opt_state`; `update` keeps its other fields (the drafter's d2t) as they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import optax

INIT_STD = 0.02  # transformers' initializer_range: Qwen3's, and SpecForge's drafter's (lm_head included)


def leaf_name(path) -> str:
    """The last key of a pytree path: the parameter's name in its dict."""
    last = path[-1]
    return getattr(last, "key", getattr(last, "name", str(last)))


def init_params(abstract, seed: int, norms: Collection[str]):
    """Float32 parameters of the abstract tree's shapes: the leaves named in `norms` at one, every other
    ~ N(0, INIT_STD) (transformers' initialisation), one key of `seed` split per leaf in the tree's order."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def init(path, leaf, key):
        if leaf_name(path) in norms:
            return jnp.ones(leaf.shape, jnp.float32)
        return INIT_STD * jax.random.normal(key, leaf.shape, jnp.float32)

    return jax.tree_util.tree_unflatten(treedef, [init(p, x, k) for (p, x), k in zip(leaves, keys)])


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, end_value: float = 0.0,
                  warmup_from_one: bool = False) -> Callable:
    """A linear warmup to `peak` over warmup_steps updates, then a cosine from peak to end_value at update
    total_steps. The warmup's update i gets i / W of the peak, or (i + 1) / W with warmup_from_one (SpecForge's
    CosineAnnealingWarmupLR, whose first update is not at zero)."""
    if not warmup_from_one:
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup_steps,
                                                  decay_steps=total_steps, end_value=end_value)

    def schedule(i):
        warm = (i + 1) / max(warmup_steps, 1) * peak
        progress = (i - warmup_steps) / max(total_steps - warmup_steps, 1)
        cosine = end_value + 0.5 * (peak - end_value) * (1 + jnp.cos(math.pi * progress))
        return jnp.where(i < warmup_steps, warm, cosine)

    return schedule


def adamw(schedule: Callable, max_grad_norm: float, weight_decay: float, b2: float = 0.999,
          decay_mask: Callable | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (b1 0.9, eps 1e-8: torch's defaults), weight decay where decay_mask
    (params -> bools) says, everywhere without it."""
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.adamw(schedule, b1=0.9, b2=b2, eps=1e-8, weight_decay=weight_decay, mask=decay_mask))


def update(state, loss_fn: Callable, tx: optax.GradientTransformation, schedule: Callable, *batch):
    """One update: the gradient of loss_fn(params, *batch) -> (loss, metrics) through tx. Returns the new
    state and the batch's metrics (before the update) with its loss, gradient norm and learning rate."""
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, *batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    metrics = {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
    new = dataclasses.replace(state, step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)
    return new, metrics
