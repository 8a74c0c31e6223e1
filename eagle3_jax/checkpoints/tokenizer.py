"""A checkpoint folder's tokenizer, when it ships one, and the stop ids it implies."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(folder: str | os.PathLike | None):
    """transformers' AutoTokenizer for `folder`, or None when the folder ships no tokenizer (or is None)."""
    if folder is None:
        return None
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id as default stop ids; none without a tokenizer or an eos."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (tokenizer.eos_token_id,)
