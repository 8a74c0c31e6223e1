"""Rewriting training data with the target's own answers (what SpecForge's regenerate_train_data.py does),
through our Engine's pool of slots (continuous batching), greedy or sampled (`temperature`, `top_p`, `seed`).

* conversations: every assistant turn is replaced, in order, by the target's continuation of the
  conversation so far (earlier turns already rewritten), rendered with the chat template;
* pre-tokenized records: the prompt (`data.prompt_length`: the tokens before the first loss-masked one, or
  the whole record when there is no prompt/answer split) is kept and the rest becomes the target's
  continuation, with the loss on it;
* text records, and conversations without an assistant turn, have nothing to rewrite and are copied.
A turn whose prompt does not fit max_len is kept, with every later turn of its record. Records of every kind
may share a window. The output is written record by record in input order after each window, so an
interrupted run resumes after the last complete line of OUT.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from eagle3_jax.checkpoints.target import Target
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids
from eagle3_jax.decoding.engine import Engine
from eagle3_jax.training.data import DataError, jsonl_objects, parse_record, prompt_length, render_chat


@dataclasses.dataclass(frozen=True)
class RegenerateStats:
    written: int  # records written by this run: regenerated + copied + too_long
    resumed_after: int  # records found complete in OUT and skipped
    regenerated: int  # records whose every turn is the target's
    copied: int  # records with nothing to rewrite (text, or no assistant turn), copied as they are
    too_long: int  # records kept from the first turn whose prompt does not fit max_len (earlier turns rewritten)


def _done_lines(out: Path) -> int:
    """Complete lines already in OUT; a partial last line (an interrupted write) is cut off."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        out.write_bytes(keep)
    return keep.count(b"\n")


def _prompts(record, raw: dict, turn: int, tokenizer) -> list[int] | None:
    """The prompt for a record's `turn`-th rewrite, or None when it has no such turn."""
    if record.input_ids is not None:
        if turn > 0:
            return None
        return list(record.input_ids[:prompt_length(record.loss_mask)])
    if record.messages is None:
        return None
    messages = raw["conversations_rewritten"]
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turn >= len(at):
        return None
    text = render_chat(tokenizer, messages[:at[turn]], record.source, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _apply(record, raw: dict, turn: int, prompt: list[int], generated: list[int], tokenizer) -> None:
    if record.input_ids is not None:
        raw["input_ids"] = prompt + generated
        raw["loss_mask"] = [0] * len(prompt) + [1] * len(generated)
        return
    messages = raw["conversations_rewritten"]
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"][turn]
    messages[at] = {"role": "assistant", "content": tokenizer.decode(generated, skip_special_tokens=True).strip()}


def _record_seed(seed: int, record: int, turn: int) -> int:
    """A row's seed from the run's, its record's index in the file and the turn: what a row draws depends on
    nothing else (not the window, nor where a resumed run started)."""
    return (seed * 1_000_003 + record * 1_009 + turn) % 2**63


def _rewrite_window(engine: Engine, items: list, tokenizer, max_new_tokens: int, stops: tuple,
                    sampling: dict, seed: int | None) -> tuple[set, set]:
    """Rewrites the items' ((index, record, raw) of any kinds) turns in place, turn by turn across the window,
    each turn's prompts through the engine's pool in one request; returns the ids of the raw records with a
    turn rewritten and of those with a turn too long for the engine."""
    rewritten, too_long = set(), set()
    for turn in range(max((len(r.messages) if r.messages else 1 for _, r, _ in items), default=0)):
        jobs = [(i, r, raw, p) for i, r, raw in items if id(raw) not in too_long
                and (p := _prompts(r, raw, turn, tokenizer)) is not None]
        fits = [job for job in jobs if len(job[3]) < engine.max_len]
        too_long.update(id(raw) for _, _, raw, p in jobs if len(p) >= engine.max_len)
        if not fits:
            continue
        seeds = None if seed is None else [_record_seed(seed, i, turn) for i, _, _, _ in fits]
        results = engine.generate([p for *_, p in fits], max_new_tokens, stops, seed=seeds, progress=False,
                                  **sampling)
        for (_, r, raw, p), res in zip(fits, results):
            _apply(r, raw, turn, list(p), res.token_ids, tokenizer)
            rewritten.add(id(raw))
    return rewritten, too_long


# Records rewritten between two writes of OUT, in pool slots (--batch-size): the pool refills within a window,
# and only a window's last rows run with slots left empty.
WINDOW_SLOTS = 16


def regenerate(target: Target, data_in: str | os.PathLike, out: str | os.PathLike, *, tokenizer=None,
               max_new_tokens: int = 512, batch_size: int = 8, max_len: int | None = None, drafter=None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               progress: bool = True) -> RegenerateStats:
    """Rewrites the assistant turns of the JSON-lines file data_in into out (see the module docstring),
    through an Engine pool of batch_size slots, WINDOW_SLOTS x batch_size records between two writes of out.
    Every record is checked before the first generation. temperature 0 is greedy; otherwise each row samples
    with `Engine.generate`'s temperature and top_p, its seed derived from `seed`, its record's index and the
    turn (so a resumed run draws what an uninterrupted one would)."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be positive")
    data_in, out = Path(data_in), Path(out)
    if data_in.suffix != ".jsonl" or not data_in.is_file():
        raise DataError(f"{data_in}: regeneration reads one .jsonl file")
    records = [(parse_record(raw, where), raw) for where, raw in jsonl_objects(data_in)]
    if not records:
        raise DataError(f"{data_in}: no records")
    conversation = next((r for r, _ in records if r.messages is not None), None)
    if conversation is not None and tokenizer is None:
        raise DataError(f"{conversation.source}: conversations need the target's tokenizer (tokenizer.json in "
                        "the target folder)")
    if conversation is not None:  # a missing or broken chat template, before any generation
        render_chat(tokenizer, list(conversation.messages), conversation.source)
    done = _done_lines(out)
    engine = Engine(target, drafter, num_draft_tokens=3 if drafter is not None else 0,
                    max_len=None if max_len is None else min(max_len, target.config.max_position_embeddings),
                    max_batch=batch_size)
    stops = eos_stop_ids(tokenizer)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(records), initial=done, desc="regenerating", unit="record")
    regenerated = too_long = written = 0
    window = WINDOW_SLOTS * batch_size
    for start in range(done, len(records), window):
        items = records[start:start + window]
        for r, raw in items:
            if r.messages is not None:
                raw["conversations_rewritten"] = [dict(m) for m in r.messages]
        indexed = [(start + k, r, raw) for k, (r, raw) in enumerate(items)]
        rewritten, long = _rewrite_window(engine, indexed, tokenizer, max_new_tokens, stops,
                                          {"temperature": temperature, "top_p": top_p}, seed)
        too_long += len(long)
        regenerated += len(rewritten - long)
        with open(out, "a", encoding="utf-8") as f:
            for r, raw in items:
                if r.messages is not None:
                    raw["conversations"] = raw.pop("conversations_rewritten")
                f.write(json.dumps(raw, ensure_ascii=False) + "\n")
        written += len(items)
        if bar is not None:
            bar.update(len(items))
    if bar is not None:
        bar.close()
    return RegenerateStats(written=written, resumed_after=done, regenerated=regenerated,
                           copied=written - regenerated - too_long, too_long=too_long)
