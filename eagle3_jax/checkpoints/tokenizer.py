"""A checkpoint folder's tokenizer, when it ships one, and the stop ids it implies."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_jax.checkpoints.common import read_json
from eagle3_jax.errors import CheckpointError


def load_tokenizer(folder: str | os.PathLike | None):
    """transformers' AutoTokenizer for `folder`, or None when the folder ships no tokenizer (or is None).
    A tokenizer that does not load raises CheckpointError naming the file at fault where one is."""
    if folder is None:
        return None
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # tokenizers and transformers raise many types for a bad file
        _name_bad_file(folder)
        raise CheckpointError(f"{folder}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


def _name_bad_file(folder: Path) -> None:
    """Raises CheckpointError naming tokenizer_config.json or tokenizer.json when one of them is unreadable."""
    if (folder / "tokenizer_config.json").exists():
        read_json(folder / "tokenizer_config.json")
    file = folder / "tokenizer.json"
    if file.exists():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from None


def eos_stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id as default stop ids; none without a tokenizer or an eos."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (tokenizer.eos_token_id,)
