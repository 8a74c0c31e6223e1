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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE writes for each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0, 0xAD) take the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    inverse, extra = {}, 0
    for b in range(256):
        if b in printable:
            inverse[chr(b)] = b
        else:
            inverse[chr(256 + extra)] = b
            extra += 1
    return inverse


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes (None for an added or special token, which no text produces) of a byte-level BPE
    tokenizer (Qwen3's); ValueError for any other kind, whose tokens' bytes this cannot read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        raise ValueError("structured outputs need a byte-level BPE tokenizer (as Qwen3's): this one's tokens "
                         "cannot be read as bytes")
    alphabet = _byte_level_alphabet()
    added = set(tokenizer.get_added_vocab().values())
    out: list[bytes | None] = [None] * len(tokenizer)
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        if i in added or i >= len(out):
            continue
        try:
            out[i] = bytes(alphabet[c] for c in text)
        except KeyError:
            raise ValueError(f"token {i} ({text!r}) is not in the byte-level alphabet") from None
    return out
