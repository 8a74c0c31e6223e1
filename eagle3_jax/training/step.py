"""The training step: the target's forward with EAGLE-3 capture, the TTT loss, an optax update; one jit.

Master parameters and the optimizer state are float32; the forward and backward run in `compute_dtype`
(bfloat16 on the GPU): the cast sits inside the differentiated function, so gradients arrive in float32.
The embedding is the target's and is not trained (SpecForge loads it from the target and freezes it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import qwen3
from eagle3_jax.models.config import DrafterConfig, Qwen3Config, RopeConfig
from eagle3_jax.training import optim, ttt

_NORMS = ("hidden_norm", "embed_norm", "mlp_norm", "final_norm")


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
    return optim.init_params(shapes, seed, _NORMS)


def _schedule(spec: StepSpec):
    """SpecForge's CosineAnnealingWarmupLR: (i + 1) / W * lr for update i < W, then a cosine from lr to 0
    over the remaining total - W updates."""
    return optim.warmup_cosine(spec.learning_rate, spec.warmup_steps, spec.total_steps, warmup_from_one=True)


def _optimizer(spec: StepSpec) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with torch's defaults, as SpecForge's BF16Optimizer."""
    return optim.adamw(_schedule(spec), spec.max_grad_norm, spec.weight_decay)


def init_state(spec: StepSpec, params: dict, d2t) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, _optimizer(spec).init(params), jnp.asarray(d2t, jnp.int32))


def target_teacher(tparams, spec: StepSpec, tokens):
    """The target's captured features [B, T, C] and logits [B, T, V] of tokens [B, T], without gradients."""
    B, T = tokens.shape
    cache = qwen3.new_row_cache(spec.target, B, T, tparams["embed"].dtype)
    hidden, _, features = qwen3.forward_rows(tparams, spec.target, tokens, cache, spec.drafter.capture_layers,
                                             spec.kernels)
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(qwen3.logits(tparams, hidden))


def loss_and_metrics(params, d2t, tparams, spec: StepSpec, tokens, loss_mask):
    """(weighted loss, {"ploss": per-step losses, "acc": per-step accuracies}) of one batch."""
    with jax.named_scope("target"):
        features, logits = target_teacher(tparams, spec, tokens)
    ids, teacher_logits, mask = ttt.specforge_layout(tokens, logits, loss_mask)
    dtype = jnp.dtype(spec.compute_dtype)
    p = {**jax.tree.map(lambda x: x.astype(dtype), params), "d2t": d2t}
    with jax.named_scope("ttt"):
        losses, accs = ttt.ttt_losses(p, spec.drafter, tparams["embed"].astype(dtype), features.astype(dtype), ids,
                                      teacher_logits, mask, spec.ttt_steps)
    return ttt.weighted_loss(losses, spec.loss_decay), {"ploss": losses, "acc": accs}


def train_step(state: TrainState, tparams, tokens, loss_mask, *, spec: StepSpec):
    """One update. Returns the new state and the metrics of the batch (before the update)."""
    def loss_fn(params, tokens, loss_mask):
        return loss_and_metrics(params, state.d2t, tparams, spec, tokens, loss_mask)

    return optim.update(state, loss_fn, _optimizer(spec), _schedule(spec), tokens, loss_mask)


jit_train_step = jax.jit(train_step, static_argnames=("spec",), donate_argnames=("state",))
