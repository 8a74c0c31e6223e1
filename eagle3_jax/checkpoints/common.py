"""What every checkpoint reader shares: JSON files read with errors that name them, the refusal of tensors
that a config does not account for, and the dtypes a checkpoint loads in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from eagle3_jax.errors import CheckpointError

DTYPES = ("bfloat16", "float16", "float32")


def read_json(path: Path) -> dict[str, Any]:
    """Reads a JSON file, turning every failure into a CheckpointError that names the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def refuse_unused(where: Path, names, used: set[str]) -> None:
    """A tensor that the config does not account for (`used` lists every name it does, and those the format
    may ship for nothing) means config and weights disagree: refused, naming the tensors. Rotary
    `inv_freq` buffers, which older transformers saved, are ignored anywhere."""
    unused = sorted(n for n in names if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise CheckpointError(f"{where}: unused tensors: {shown} (the config does not account for them)")


def check_dtype(dtype: str) -> jnp.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return jnp.dtype(dtype)
