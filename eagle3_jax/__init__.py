"""eagle3-jax: lossless EAGLE-3 speculative decoding of Qwen3 targets in JAX, and drafter training.

Sub-packages in layers, each importing only those below it (tests/test_import_layers.py checks it):
  models       the pure forward functions of the target and drafter, their configs, KV pages, collectives
  parallel     tensor parallelism's mesh and per-device weight layout
  checkpoints  loading and converting Hugging Face and orbax checkpoints, onto one device or a mesh
  decoding     the engine: rounds, sampling, proposers, the live pool and its scheduler, the sharded steps
  training     the drafter's trainer and data regeneration
  serving      the OpenAI-compatible server
  demo         the shipped demo pair
"""

from eagle3_jax.checkpoints.drafter import Drafter, convert_drafter, load_drafter
from eagle3_jax.checkpoints.target import Target, convert, load_target
from eagle3_jax.decoding.engine import Engine, Result
from eagle3_jax.decoding.prompt_lookup import PromptLookup
from eagle3_jax.decoding.structured import Structured
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models.config import Qwen3Config

__all__ = [
    "CheckpointError", "Drafter", "Engine", "PromptLookup", "Qwen3Config", "Result", "Structured", "Target",
    "TrainConfig", "convert", "convert_drafter", "load_drafter", "load_target", "train_drafter",
]
_TRAINING = ("TrainConfig", "train_drafter")


def __getattr__(name: str):
    """The trainer on first use: decoding alone never imports optax or the training code."""
    if name in _TRAINING:
        from eagle3_jax.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'eagle3_jax' has no attribute {name!r}")
