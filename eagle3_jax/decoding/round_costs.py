"""What one call of rounds costs for each gamma 0 .. G, by its rows and KV length, measured on this device
and cached on disk: the cost side of the gamma policy (gamma_policy.py).

A table holds, per key (a row bucket, and whether its calls carry a chunk of prompt tokens in every round: the
engine's keys are "8" and "8+chunks"), the seconds of one call at a few KV lengths (`grid_lengths`), for every
gamma; between lengths it is interpolated linearly (attention's cost grows about linearly in the length;
the weights' cost does not move). Gamma 0's entry is the mean over a cycle of gamma_policy.FLUSH_CALLS
calls, one of which brings the drafter up to date (Engine.time_call). A key is measured the first time
a request runs at it (the engine compiles every gamma of that bucket then anyway), or ahead by
`eagle3-jax bench --calibrate` or Engine.compile.

Where it lives: round_costs/<key>.json beside jax's compilation cache folder (its parent, so
~/.cache/eagle3_jax/round_costs for the CLI's default cache), or in ~/.cache/eagle3_jax/round_costs when no
compilation cache is set. The key hashes everything a call's cost depends on: the step configuration (target
and drafter configs, dtype, kernels, exact, max_len, sampling build, proposal, the held pairs' room), rounds
per call, the gammas, the device kind and the jax, jaxlib and eagle3_jax versions. What the key cannot see
(another process on the GPU, a changed clock or driver) is caught by a spot check: the first use of a stored
key in a process times its costliest entry again, and a result off by more than STALE_RATIO from the
stored one re-measures that key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

STALE_RATIO = 1.25  # a spot check this far off the stored cost (either way) re-measures the key
TIMED_CALLS = 3  # per entry, after one untimed call


def margin(rounds_per_call: int, max_gamma: int) -> int:
    """The KV positions a call of rounds can advance a row by, and one to spare: a measured length leaves them."""
    return rounds_per_call * (max_gamma + 1) + 1


def grid_lengths(max_len: int, room: int) -> list[int]:
    """The KV lengths a key is measured at: short, half and nearly full, each leaving `room`
    positions (`margin`) for what a call's rounds add."""
    top = max(1, max_len - room)
    return sorted({max(1, min(top, x)) for x in (max_len // 16, max_len // 2, top)})


def cache_key(fields: dict) -> str:
    """A short hash of what a call's cost depends on (`fields`, any JSON-able dict) and of this machine's
    device kind and jax, jaxlib and eagle3_jax versions."""
    full = {**fields, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"), "eagle3_jax": _version()}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=repr).encode()).hexdigest()[:20]


def _version() -> str:
    try:
        return importlib.metadata.version("eagle3-jax")
    except importlib.metadata.PackageNotFoundError:
        return "source"


def default_folder() -> Path:
    """round_costs beside jax's compilation cache folder, else in the user's cache folder."""
    compile_cache = jax.config.jax_compilation_cache_dir
    if compile_cache:
        return Path(compile_cache).expanduser().parent / "round_costs"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3_jax" / "round_costs"


TimeCall = Callable[[str, int, int], float]  # (key, KV length, gamma) -> seconds per call of rounds


class RoundCosts:
    """Seconds per call of rounds for each gamma, by key (the calls' rows, and whether they carry prompt tokens) and
    KV length. What is missing is measured through `time_call(key, length, gamma)` (the engine's: it runs calls of
    that gamma on a dummy pool's bucket at that KV length and returns seconds per call)."""

    def __init__(self, key: str, folder: Path | None, lengths: list[int], num_gammas: int):
        self.path = None if folder is None else Path(folder) / f"{key}.json"
        self.lengths, self.num_gammas = list(lengths), num_gammas
        self._table: dict[str, np.ndarray] = {}  # key -> seconds [len(lengths), num_gammas], checked
        self.measured: list[str] = []  # the keys this object measured (not loaded)

    def seconds(self, key: str, length: float, time_call: TimeCall) -> np.ndarray:
        """A call's seconds for each gamma [num_gammas] of `key` at KV `length` (interpolated)."""
        table = self.table(key, time_call)
        return np.array([np.interp(length, self.lengths, table[:, g]) for g in range(self.num_gammas)])

    def table(self, key: str, time_call: TimeCall) -> np.ndarray:
        """The seconds [len(lengths), num_gammas] of a key: from memory, from disk (spot-checked), or
        measured now and stored."""
        if key not in self._table:
            stored = self._load().get(key)
            fresh = stored is not None and self._fresh(key, stored, time_call)
            self._table[key] = stored if fresh else self._measure(key, time_call)
        return self._table[key]

    def _fresh(self, key: str, stored: np.ndarray, time_call: TimeCall) -> bool:
        """Whether the costliest stored entry still times within STALE_RATIO of what is stored."""
        at, gamma = np.unravel_index(np.argmax(stored), stored.shape)
        ratio = time_call(key, self.lengths[at], int(gamma)) / stored[at, gamma]
        return 1 / STALE_RATIO <= ratio <= STALE_RATIO

    def _measure(self, key: str, time_call: TimeCall) -> np.ndarray:
        table = np.array([[time_call(key, length, g) for g in range(self.num_gammas)] for length in self.lengths])
        self.measured.append(key)
        if self.path is not None:
            self._store(key, table)
        return table

    def _store(self, key: str, table: np.ndarray) -> None:
        """Adds a key's table to the file; a folder that cannot be written leaves it in memory only."""
        stored = self._load()
        stored[key] = table
        document = {"lengths": self.lengths, "seconds": {b: t.tolist() for b, t in stored.items()}}
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(document, indent=1))
            temporary.replace(self.path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            return

    def _load(self) -> dict[str, np.ndarray]:
        """The stored tables by key; a missing, unreadable or differently shaped file holds none."""
        if self.path is None or not self.path.exists():
            return {}
        try:
            document = json.loads(self.path.read_text())
            if document["lengths"] != self.lengths:
                return {}
            shape = (len(self.lengths), self.num_gammas)
            tables = {b: np.asarray(t, float) for b, t in document["seconds"].items()}
            return {b: t for b, t in tables.items() if t.shape == shape and np.all(t > 0)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}


def timing_table(batch: int, num_pages: int, width: int) -> np.ndarray:
    """The page table [batch, width] of a timed pool: each row reads its own pages where the pool's num_pages
    allow (rows wrap around them past that), so a call reads as many distinct bytes as a pool of sequences does.
    The pages are whatever sequences hold: a timed call's rows write nothing (timing_pool)."""
    return ((np.arange(batch)[:, None] * width + np.arange(width)[None, :]) % num_pages).astype(np.int32)


def timing_pool(state, page_table, length: int, vocab_size: int, max_len: int):
    """A pool state (spec_round.DecodeState: slots.empty's rows with the engine's pages) turned into one whose every
    row sits at KV `length` over `page_table` (timing_table), with random newest tokens (so that expert routing
    spreads as real text's does): what a timed call runs on. The rows are done: a call computes everything for
    them as for live rows (its shapes are static; attention reads each row's keys up to its length) but writes
    nothing into the pages, which may hold a live pool's sequences, and moves no row, so every timed call runs at
    `length`."""
    B = state.done.shape[0]

    def lengths():  # one buffer per use: the call donates each
        return jnp.full((B,), length, jnp.int32)

    return dataclasses.replace(
        state,
        page_table=page_table,
        lengths=lengths(),
        draft_lengths=None if state.draft_lengths is None else lengths(),
        last_token=jax.random.randint(jax.random.key(length), (B,), 0, vocab_size, jnp.int32),
        num_generated=jnp.zeros((B,), jnp.int32),
        max_new=jnp.full((B,), max_len, jnp.int32),
        stop_ids=jnp.full(state.stop_ids.shape, -1, jnp.int32),
        done=jnp.ones((B,), bool),
    )


def time_calls(run_call: Callable, state, calls: int = TIMED_CALLS) -> tuple[float, object]:
    """(seconds per call of `run_call(state) -> (state, packed)`, the last call's state): one untimed call first
    (it compiles, on first use), then `calls` back to back, timed to the last one's output."""
    state, packed = run_call(state)
    jax.block_until_ready(packed)
    start = time.perf_counter()
    for _ in range(calls):
        state, packed = run_call(state)
    jax.block_until_ready(packed)
    return (time.perf_counter() - start) / calls, state
