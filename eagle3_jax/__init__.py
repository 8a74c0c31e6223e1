"""eagle3-jax: lossless EAGLE-3 speculative decoding of Qwen3 targets in JAX."""

from eagle3_jax.checkpoints.drafter import Drafter, convert_drafter, load_drafter
from eagle3_jax.checkpoints.target import Target, convert, load_target
from eagle3_jax.decoding.engine import Engine, Result
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.training.trainer import TrainConfig, train_drafter

__all__ = [
    "CheckpointError", "Drafter", "Engine", "Qwen3Config", "Result", "Target", "TrainConfig",
    "convert", "convert_drafter", "load_drafter", "load_target", "train_drafter",
]
