"""Training data: reading, validating and tokenizing records into (tokens, loss mask) samples.

Accepted inputs (a list of files and folders; folders are read recursively, in name order, hidden names
skipped):
  * `.jsonl`, one record per line (blank lines skipped):
      conversations  {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                     or ShareGPT's {"from": "system"|"human"|"gpt", "value": "..."}; rendered with the
                     target's chat template; the loss falls on assistant turns only;
      text           {"text": "..."}; the loss falls on every token;
      pre-tokenized  {"input_ids": [...], "loss_mask": [...]} (loss_mask optional: all ones).
  * any other file: one plain-text document (UTF-8), the loss on every token.
Every problem is refused with the file and line before any device work (`DataError`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Training data that cannot be used; the message names the file and, for JSON lines, the line."""


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] int8, 1 where the loss falls
    source: str  # "file:line", or "file" for a plain-text document


@dataclasses.dataclass(frozen=True)
class Record:
    """One parsed record before tokenization: exactly one of messages, text, input_ids is set."""

    source: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None


def data_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The files behind the given files and folders, in order; refuses a missing path or an empty folder."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise DataError(f"{p}: folder holds no data files")
            files.extend(found)
        else:
            raise DataError(f"{p}: no such file or folder")
    return files


def read_records(paths: Sequence[str | os.PathLike]) -> Iterator[Record]:
    """Every record of the given files and folders, parsed and checked for shape (not yet for the vocabulary)."""
    for file in data_files(paths):
        if file.suffix == ".jsonl":
            yield from _jsonl_records(file)
        else:
            yield Record(source=str(file), text=_read_text(file))


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{file}: not a UTF-8 text file") from None


def jsonl_objects(file: Path) -> Iterator[tuple[str, Any]]:
    """("file:line", parsed JSON value) for every non-blank line of a JSON-lines file."""
    try:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise DataError(f"{file}: not a UTF-8 text file") from None


def _jsonl_records(file: Path) -> Iterator[Record]:
    for where, raw in jsonl_objects(file):
        yield parse_record(raw, where)


def parse_record(raw: Any, where: str) -> Record:
    """One JSON value -> a Record, or a DataError saying what is wrong with it."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(raw).__name__}")
    if "conversations" in raw:
        return Record(source=where, messages=_messages(raw["conversations"], where))
    if "text" in raw:
        if not isinstance(raw["text"], str) or not raw["text"]:
            raise DataError(f"{where}: 'text' must be a non-empty string")
        return Record(source=where, text=raw["text"])
    if "input_ids" in raw:
        ids = _int_list(raw["input_ids"], "input_ids", where)
        if not ids:
            raise DataError(f"{where}: 'input_ids' is empty")
        mask = raw.get("loss_mask")
        if mask is None:
            return Record(source=where, input_ids=ids, loss_mask=(1,) * len(ids))
        mask = _int_list(mask, "loss_mask", where)
        if len(mask) != len(ids):
            raise DataError(f"{where}: 'loss_mask' has {len(mask)} entries, 'input_ids' {len(ids)}")
        if any(m not in (0, 1) for m in mask):
            raise DataError(f"{where}: 'loss_mask' entries must be 0 or 1")
        return Record(source=where, input_ids=ids, loss_mask=mask)
    raise DataError(f"{where}: a record needs 'conversations', 'text' or 'input_ids' (keys: {sorted(raw)})")


def _int_list(value: Any, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: '{name}' must be a list of integers")
    return tuple(value)


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} must be an object")
        role, content = (m.get("role"), m.get("content")) if "role" in m else (m.get("from"), m.get("value"))
        role = _SHAREGPT_ROLES.get(role) if "role" not in m else role
        if role not in _ROLES:
            raise DataError(f"{where}: message {i} has role {m.get('role', m.get('from'))!r}; expected "
                            f"{list(_ROLES)} (or ShareGPT's 'from': system / human / gpt)")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} needs a string 'content' (or ShareGPT 'value')")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn to learn from")
    return tuple(out)


def tokenize(record: Record, tokenizer, vocab_size: int) -> Sample:
    """A record -> tokens and loss mask, every id checked against the target's vocabulary."""
    if record.input_ids is not None:
        tokens, mask = np.asarray(record.input_ids, np.int64), np.asarray(record.loss_mask, np.int8)
    else:
        if tokenizer is None:
            raise DataError(f"{record.source}: text and conversations need a tokenizer in the target folder "
                            "(tokenizer.json); pre-tokenize the data ('input_ids') instead")
        tokens, mask = (_conversation(record, tokenizer) if record.messages is not None
                        else _text(record.text, tokenizer))
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if bad.size:
        raise DataError(f"{record.source}: token id {int(bad[0])} is outside the target vocabulary [0, {vocab_size})")
    return Sample(tokens.astype(np.int32), mask, record.source)


def _text(text: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)
    return tokens, np.ones(tokens.shape, np.int8)


def _conversation(record: Record, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Rendered with the chat template; the loss mask covers each assistant turn's content and the token
    right after it (the end-of-turn token), as SpecForge's `_apply_loss_mask_from_chat_template` marks
    tokens that overlap [content start, content end]."""
    text = render_chat(tokenizer, list(record.messages), record.source)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2)
    mask = np.zeros((len(offsets),), np.int8)
    cursor = 0
    for m in record.messages:
        if m["role"] != "assistant" or not m["content"]:
            continue
        start, end = _find_content(text, m["content"], cursor, record.source)
        mask[(offsets[:, 1] > start) & (offsets[:, 0] <= end)] = 1
        cursor = end
    return np.asarray(encoded["input_ids"], np.int64), mask


def render_chat(tokenizer, messages: list[dict[str, str]], where: str, **kwargs) -> str:
    """The messages rendered with the tokenizer's chat template; DataError naming `where` (file:line) when it
    has none or the template fails on them."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a conversation needs a chat template, and the target's tokenizer has none "
                        "(tokenizer_config.json's chat_template)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja2's errors from the template itself, whatever their class
        raise DataError(f"{where}: the chat template failed on this conversation: {e}") from e


def _find_content(text: str, content: str, cursor: int, where: str) -> tuple[int, int]:
    """Where an assistant turn's content sits in the rendered text, searched after the previous turn.
    Templates that drop a past turn's reasoning (Qwen3's) keep the part after '</think>'."""
    for candidate in (content, content.split("</think>")[-1].strip()):
        at = text.find(candidate, cursor) if candidate else -1
        if at >= 0:
            return at, at + len(candidate)
    raise DataError(f"{where}: an assistant turn does not appear in the chat template's rendering; "
                    "pre-tokenize this record ('input_ids', 'loss_mask')")


def load_samples(paths: Sequence[str | os.PathLike], tokenizer, vocab_size: int) -> list[Sample]:
    """Every record of the data, tokenized and checked; refuses data with nothing to learn from."""
    samples = [tokenize(r, tokenizer, vocab_size) for r in read_records(paths)]
    if not samples:
        raise DataError(f"{', '.join(map(str, paths))}: no records")
    if not any(s.loss_mask.any() for s in samples):
        raise DataError(f"{', '.join(map(str, paths))}: no token carries the loss (every loss_mask is 0)")
    return samples


def prompt_length(loss_mask) -> int:
    """Where a sample's prompt ends, for evaluation and regeneration: before its first loss-masked token when
    it starts unmasked (a prompt, then an answer); the whole sample when every token or none carries the
    loss (no prompt/answer split to go by). At least one token."""
    mask = [int(m) for m in loss_mask]
    first = mask.index(1) if mask and mask[0] == 0 and 1 in mask else len(mask)
    return max(first, 1)
