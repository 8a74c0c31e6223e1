"""Training a Qwen3 target from scratch: next-token cross-entropy through our own `qwen3.forward`, optax AdamW,
orbax checkpoints with exact resume. It is how the demo pair's target is made (tools/build_demo_pair.py); a
drafter for a real target is trained with `train_drafter` instead.

The loop, its output folder (run record, metrics.jsonl, checkpoints) and its stop on SIGINT/SIGTERM are
the drafter trainer's (`loop.py`). The data is one token stream (documents joined by an end-of-text id);
update i reads `batch_size` windows of `seq_len + 1` tokens at offsets drawn from (seed, i) alone, so a
resumed run reads what an uninterrupted one would. Master parameters and the optimizer state are float32; the
forward and backward run in compute_dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle3_jax.models import qwen3
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.training import loop, optim

_NORMS = ("attn_norm", "q_norm", "k_norm", "mlp_norm", "final_norm")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Pre-training settings (hashable: part of the jitted step's static spec)."""

    seq_len: int = 1024
    batch_size: int = 64
    steps: int = 3000
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at this fraction of the peak
    weight_decay: float = 0.1
    b2: float = 0.95
    max_grad_norm: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"PretrainConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError("PretrainConfig.warmup_steps must be in [0, steps)")
        if self.learning_rate <= 0 or self.max_grad_norm <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("PretrainConfig needs learning_rate > 0, max_grad_norm > 0, 0 <= min_lr_ratio <= 1")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError("PretrainConfig.compute_dtype must be 'bfloat16' or 'float32'")


def init_params(cfg: Qwen3Config, seed: int) -> dict:
    """Weights ~ N(0, 0.02) and norms at one, as transformers initialises a Qwen3; float32."""
    return optim.init_params(qwen3.abstract_params(cfg, jnp.float32), seed, _NORMS)


def _schedule(config: PretrainConfig):
    """Linear warmup to the peak, then a cosine down to min_lr_ratio of it at the last update."""
    return optim.warmup_cosine(config.learning_rate, config.warmup_steps, config.steps,
                               end_value=config.learning_rate * config.min_lr_ratio)


def _optimizer(config: PretrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; norms are not decayed."""
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: optim.leaf_name(p) not in _NORMS, params)

    return optim.adamw(_schedule(config), config.max_grad_norm, config.weight_decay, b2=config.b2,
                       decay_mask=decay_mask)


def next_token_loss(params: dict, cfg: Qwen3Config, windows: jax.Array, compute_dtype: str = "float32"):
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1] (windows [B, T + 1] int32),
    the logits in float32; transformers' Qwen3ForCausalLM(labels=...) loss when every label counts."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    B, T = inputs.shape
    p = jax.tree.map(lambda x: x.astype(jnp.dtype(compute_dtype)), params)
    hidden, _, _ = qwen3.forward_rows(p, cfg, inputs, qwen3.new_row_cache(cfg, B, T, p["embed"].dtype), kernels="xla")
    return optax.softmax_cross_entropy_with_integer_labels(qwen3.logits(p, hidden), labels).mean()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PretrainState:
    step: jax.Array  # int32 scalar: updates done
    params: dict  # float32
    opt_state: optax.OptState


def init_state(cfg: Qwen3Config, config: PretrainConfig) -> PretrainState:
    params = init_params(cfg, config.seed)
    return PretrainState(jnp.zeros((), jnp.int32), params, _optimizer(config).init(params))


def train_step(state: PretrainState, windows, *, cfg: Qwen3Config, config: PretrainConfig):
    """One update; returns the new state and the batch's loss (before the update), gradient norm and
    learning rate."""
    def loss_fn(params, windows):
        return next_token_loss(params, cfg, windows, config.compute_dtype), {}

    return optim.update(state, loss_fn, _optimizer(config), _schedule(config), windows)


jit_train_step = jax.jit(train_step, static_argnames=("cfg", "config"), donate_argnames=("state",))
_jit_loss = jax.jit(next_token_loss, static_argnames=("cfg", "compute_dtype"))


def windows_at(stream: np.ndarray, config: PretrainConfig, index: int) -> np.ndarray:
    """The [batch_size, seq_len + 1] windows of update `index`: a pure function of (seed, index)."""
    span = config.seq_len + 1
    if len(stream) < span:
        raise ValueError(f"the token stream has {len(stream)} tokens, fewer than seq_len + 1 = {span}")
    offsets = np.random.default_rng([config.seed, index]).integers(0, len(stream) - span + 1, config.batch_size)
    return np.stack([stream[o:o + span] for o in offsets]).astype(np.int32)


def evaluate_loss(params: dict, cfg: Qwen3Config, stream: np.ndarray, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over the first max_windows consecutive, non-overlapping windows of a held-out
    stream, computed in float32 from the parameters given."""
    span = seq_len + 1
    count = min(len(stream) // span, max_windows)
    if count == 0:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than seq_len + 1 = {span}")
    windows = stream[:count * span].reshape(count, span).astype(np.int32)
    losses = [float(_jit_loss(params, cfg, jnp.asarray(windows[i:i + 8]))) for i in range(0, count, 8)]
    sizes = [min(8, count - i) for i in range(0, count, 8)]
    return float(np.average(losses, weights=sizes))


def pretrain(cfg: Qwen3Config, stream: np.ndarray, out_dir: str | Path, config: PretrainConfig,
             time_budget_s: float = math.inf, log_every: int = 50, checkpoint_every: int = 500,
             held_out: np.ndarray | None = None) -> PretrainState:
    """Trains from the latest checkpoint in out_dir (or from scratch) until config.steps updates are done or
    time_budget_s has passed, then checkpoints; a run in out_dir with another model or settings is refused.
    metrics.jsonl gets a line every log_every updates, and the loss on the held_out stream (`evaluate_loss`)
    at every checkpoint. SIGINT and SIGTERM checkpoint and raise `loop.Interrupted`. Returns the state; its
    step says whether the run is complete."""
    out_dir = Path(out_dir)
    loop.open_run(out_dir, {"model": repr(cfg), **dataclasses.asdict(config)}, resume=True, overwrite=False)
    start = time.perf_counter()

    def update(state, index):
        windows = jnp.asarray(windows_at(stream, config, index))
        return (*jit_train_step(state, windows, cfg=cfg, config=config), config.batch_size * config.seq_len)

    def after_save(state):
        if held_out is not None:
            loss = evaluate_loss(state.params, cfg, held_out, config.seq_len)
            line = {"step": int(state.step), "held_out_loss": loss}
            loop.append_jsonl(out_dir / "metrics.jsonl", line)
            _print(line)

    spec = loop.LoopSpec(total=config.steps, log_every=log_every, checkpoint_every=checkpoint_every,
                         on_log=_print, after_save=after_save,
                         out_of_time=lambda: time.perf_counter() - start > time_budget_s,
                         resume_hint="pre-train into the same folder again to continue")
    return loop.run(init_state(cfg, config), out_dir, update, spec, resume=True)


def _print(line: dict) -> None:
    print(json.dumps(line), flush=True)
