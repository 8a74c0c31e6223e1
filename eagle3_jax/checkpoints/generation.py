"""A checkpoint folder's `generation_config.json`: the sampling settings transformers' generate takes from it."""

from __future__ import annotations

from pathlib import Path

from eagle3_jax.checkpoints.common import read_json
from eagle3_jax.models.config_fields import Fields

GENERATION_CONFIG = "generation_config.json"
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
# What transformers' generate uses for a sampling setting its GenerationConfig leaves unset.
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def generation_sampling(folder: str | Path) -> dict | None:
    """The sampling settings of folder's generation_config.json: None without the file, greedy without
    `do_sample`, else its temperature, top_k and top_p with transformers' defaults for any it leaves out.
    Every field is type-checked, used or not: a malformed file or field raises CheckpointError naming it."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.exists():
        return None
    fields = Fields.of(read_json(path), path)
    settings = {"temperature": fields.float("temperature", HF_DEFAULTS["temperature"]),
                "top_k": fields.int("top_k", HF_DEFAULTS["top_k"], minimum=0),
                "top_p": fields.float("top_p", HF_DEFAULTS["top_p"])}
    return settings if fields.bool("do_sample", False) else dict(GREEDY)


def generation_eos(folder: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids of folder's generation_config.json (`eos_token_id`: an id or a list); () without the
    file or the field. A malformed field raises CheckpointError naming it."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.exists():
        return ()
    raw = read_json(path)
    value = raw.get("eos_token_id")
    if value is None:
        return ()
    return Fields.of({"eos_token_id": [value] if isinstance(value, int) else value}, path).ints("eos_token_id")
