"""The training step: the target's forward with EAGLE-3 capture, the TTT loss, an optax update; one jit.

Master parameters and the optimizer state are float32; the forward and backward run in `compute_dtype`
(bfloat16 on the GPU): the cast sits inside the differentiated function, so gradients arrive in float32.
The embedding is the target's and is not trained (SpecForge loads it from the target and freezes it).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import qwen3
from eagle3_jax.models.config import Qwen3Config, RopeConfig
from eagle3_jax.models.eagle3 import DrafterConfig
from eagle3_jax.training import ttt

_NORMS = ("hidden_norm", "embed_norm", "mlp_norm", "final_norm")
INIT_STD = 0.02  # transformers' initializer_range, which SpecForge's drafter keeps (lm_head included)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about the jitted step (hashable)."""

    target: Qwen3Config
    drafter: DrafterConfig
    ttt_steps: int
    loss_decay: float
    compute_dtype: str
    kernels: str
    learning_rate: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    max_grad_norm: float


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32 scalar: updates done
    params: dict  # float32 trainable drafter parameters (no d2t)
    opt_state: optax.OptState
    d2t: jax.Array  # [Vd] int32, fixed by the draft vocabulary


def drafter_config(target: Qwen3Config, draft_vocab_size: int) -> DrafterConfig:
    """SpecForge's drafter for a target: one Llama layer of the target's widths and heads, the target's
    RoPE base without scaling, capture at the default layers (2, N // 2, N - 3)."""
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
        rope=RopeConfig(theta=target.rope.theta, head_dim=target.head_dim), draft_vocab_size=draft_vocab_size,
        target_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
        capture_layers=target.default_capture_layers,
    )


def init_params(cfg: DrafterConfig, seed: int) -> dict:
    """Linear weights ~ N(0, 0.02), norms at one: the transformers initialisation SpecForge starts from."""
    shapes = {k: v for k, v in drafter_lib.abstract_params(cfg, jnp.float32).items() if k != "d2t"}
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: jnp.ones(s.shape, jnp.float32) if name in _NORMS
            else INIT_STD * jax.random.normal(key, s.shape, jnp.float32)
            for key, (name, s) in zip(keys, sorted(shapes.items()))}


def learning_rate(spec: StepSpec):
    """SpecForge's CosineAnnealingWarmupLR as an optax schedule of the update count i: (i + 1) / W * lr
    for i < W, then a cosine from lr to 0 over the remaining total - W updates."""
    warmup, total, peak = spec.warmup_steps, spec.total_steps, spec.learning_rate

    def schedule(i):
        warm = (i + 1) / max(warmup, 1) * peak
        progress = (i - warmup) / max(total - warmup, 1)
        return jnp.where(i < warmup, warm, 0.5 * peak * (1 + jnp.cos(math.pi * progress)))

    return schedule


def optimizer(spec: StepSpec) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with torch's defaults (betas 0.9 / 0.999, eps 1e-8), as SpecForge's
    BF16Optimizer."""
    return optax.chain(optax.clip_by_global_norm(spec.max_grad_norm),
                       optax.adamw(learning_rate(spec), b1=0.9, b2=0.999, eps=1e-8, weight_decay=spec.weight_decay))


def init_state(spec: StepSpec, params: dict, d2t) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer(spec).init(params), jnp.asarray(d2t, jnp.int32))


def target_teacher(tparams, spec: StepSpec, tokens):
    """The target's captured features [B, T, C] and logits [B, T, V] of tokens [B, T], without gradients."""
    B, T = tokens.shape
    cache = qwen3.new_cache(spec.target, B, T, tparams["embed"].dtype)
    hidden, _, features = qwen3.forward(tparams, spec.target, tokens, cache, spec.drafter.capture_layers,
                                        spec.kernels)
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(qwen3.logits(tparams, hidden))


def loss_and_metrics(params, d2t, tparams, spec: StepSpec, tokens, loss_mask):
    """(weighted loss, (per-step losses, per-step accuracies)) of one batch."""
    with jax.named_scope("target"):
        features, logits = target_teacher(tparams, spec, tokens)
    ids, teacher_logits, mask = ttt.specforge_layout(tokens, logits, loss_mask)
    dtype = jnp.dtype(spec.compute_dtype)
    p = {**jax.tree.map(lambda x: x.astype(dtype), params), "d2t": d2t}
    with jax.named_scope("ttt"):
        losses, accs = ttt.ttt_losses(p, spec.drafter, tparams["embed"].astype(dtype), features.astype(dtype), ids,
                                      teacher_logits, mask, spec.ttt_steps)
    return ttt.weighted_loss(losses, spec.loss_decay), (losses, accs)


def train_step(state: TrainState, tparams, tokens, loss_mask, *, spec: StepSpec):
    """One update. Returns the new state and the metrics of the batch (before the update)."""
    grad_fn = jax.value_and_grad(loss_and_metrics, has_aux=True)
    (loss, (losses, accs)), grads = grad_fn(state.params, state.d2t, tparams, spec, tokens, loss_mask)
    updates, opt_state = optimizer(spec).update(grads, state.opt_state, state.params)
    metrics = {"loss": loss, "ploss": losses, "acc": accs, "grad_norm": optax.tree.norm(grads),
               "lr": learning_rate(spec)(state.step)}
    new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state, state.d2t)
    return new, metrics


jit_train_step = jax.jit(train_step, static_argnames=("spec",), donate_argnames=("state",))
