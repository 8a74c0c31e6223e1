"""The live pool's scheduler: host bookkeeping of requests that arrive and leave while the pool runs, and the
decision of each step as data (`Step`) for a runner to execute (live.py).

A request waits in arrival order until a slot is free; `plan` then admits it (prefill into a slot), frees the
slots of aborted requests, resizes the pool to the batch it needs, and picks the next call of rounds. The pool
holds `size` slots, a power of four up to max_batch: enough for the running and waiting requests, so that a
lone request runs rounds of one row, not of max_batch. A pool that does not `shrink` (Engine.generate's, whose
requests all arrive at once) keeps its size to the end, so its tail compiles no smaller pool.

While some running row surely needs another call (more tokens left than the call in flight can emit), the
next call is planned before the one in flight is read, so the device does not idle on the host. While requests
wait for slots, only when every running row needs it: a slot freed by the call in flight is then refilled
before another call runs without it. `read` attributes one operation's transfer to the
requests that held its rows when it was dispatched (the owner snapshot travels with the operation), so a row
that finished or was aborted while the operation was in flight is ignored.

Admission is its own decision (`Step.admissions`): a paged KV cache needs it to reserve pages, and chunked
prefill to split a prompt across steps; `Step.release` lists the slots whose rows the device must stop, where
a paged cache would return their pages.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import numpy as np

from eagle3_jax.decoding.request import Request, bucket_length
from eagle3_jax.decoding.round_output import RoundOutput
from eagle3_jax.decoding.sampling import SamplingParams


class Policy(Protocol):
    """Which gamma each call of rounds runs (gamma_policy.py)."""

    # The next call (gamma_policy.Call) at this mean KV length of the running rows; nothing changes until
    # `dispatched` says it ran.
    def choose(self, length: float): ...

    def dispatched(self, call) -> None: ...

    def observe(self, gamma: int, out: RoundOutput) -> None: ...  # one round's output, read

    # Whether a call may be chosen before the one in flight is read: a policy with no evidence yet would
    # choose the second call from its prior too.
    def may_choose_ahead(self) -> bool: ...


def admission_rows(count: int, pool: int) -> int:
    """The rows a prefill of `count` prompts runs: a power of four, at most the pool, so that few shapes
    compile (a prefill compiles per rows x prompt bucket) while padding stays under 3/4 of a prefill."""
    rows = 1
    while rows < count:
        rows *= 4
    return min(rows, pool)


def admission_shapes(pool: int, bucket: int, prefill_tokens: int) -> list[int]:
    """The row counts admissions of prompts of one bucket can run (`LiveScheduler._admit`'s rule): every
    admission_rows(n) that one prefill of prefill_tokens holds, and 1 always."""
    return sorted({admission_rows(n, pool) for n in range(1, pool + 1)
                   if n == 1 or admission_rows(n, pool) * bucket <= prefill_tokens})


@dataclasses.dataclass(frozen=True)
class Admission:
    """Prompts prefilled together into slots: request i of `requests` goes to slot `slots[i]`."""

    requests: tuple[int, ...]  # request ids
    slots: tuple[int, ...]
    rows: int  # the prefill's rows (admission_rows of the count): padding rows are dropped


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the live pool, in the order the runner executes it."""

    release: tuple[int, ...]  # slots whose (aborted) rows stop: marked done on the device
    # The pool's new layout: new slot i takes old slot resize[i]; an index >= the old size is a free slot.
    # None: the layout is unchanged. The first step of a pool (no state yet) allocates `size` free slots.
    resize: np.ndarray | None
    size: int  # the pool's slots after the resize
    admissions: tuple[Admission, ...]
    rounds: object | None  # the call of rounds to dispatch (gamma_policy.Call), None: none this step
    sampling: bool  # whether the call's rows include a sampled one (the sampling build); else the greedy one


@dataclasses.dataclass(frozen=True)
class Event:
    """What one operation reported for one request."""

    request: int
    tokens: list[int]
    accepted: int  # drafts committed (0 for prefill and plain rounds)
    drafted: int  # drafts the round proposed for this row (its gamma; 0 for prefill and plain rounds)
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    gamma: int | None = None  # a speculative round's drafts per round (0 included); None for prefill, spec off
    trace: tuple[list[int], list[int]] | None = None  # with trace: a speculative round's (drafts, target choices)


@dataclasses.dataclass
class _Live:
    row: Request  # the request's one row, stop ids at the pool's width, sampling settings always set
    left: int  # tokens it may still emit
    length: int  # its sequence length on the device (prompt + emitted)
    slot: int = -1  # -1 while waiting
    prefilled: bool = False  # its prefill's first token has been read


class LiveScheduler:
    """The host state of a live pool: waiting and running requests, the slot each holds, the gamma policy."""

    def __init__(self, max_batch: int, max_len: int, prefill_tokens: int, rounds_per_call: int, policy: Policy,
                 speculative: bool, shrink: bool = True, trace: bool = False):
        self.max_batch, self.max_len, self.prefill_tokens = max_batch, max_len, prefill_tokens
        self.rounds_per_call, self.policy, self.speculative = rounds_per_call, policy, speculative
        self.shrink, self.trace = shrink, trace
        self.size = 0  # the pool's slots (0: no pool yet)
        self.owner = np.zeros((0,), np.int64)  # request id per slot, -1 free
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Live] = {}
        self._release: list[int] = []

    @property
    def running(self) -> int:
        return int(np.sum(self.owner >= 0))

    def add(self, request_id: int, row: Request) -> None:
        """Queues a checked one-row request (`live.LivePool.submit` builds it)."""
        self.requests[request_id] = _Live(row, int(row.budget(self.max_len)[0]), int(row.lengths[0]))
        self.waiting.append(request_id)

    def abort(self, request_id: int) -> Event | None:
        """Drops a waiting or running request at once, its slot free for the next admission; None when it is no
        longer live."""
        live = self.requests.pop(request_id, None)
        if live is None:
            return None
        if live.slot < 0:
            self.waiting.remove(request_id)
        else:
            self.owner[live.slot] = -1
            self._release.append(live.slot)
        return Event(request_id, [], 0, 0, True, "abort")

    def samples(self) -> bool:
        """Whether some running request samples."""
        return any(float(self.requests[r].row.sampling.temperature[0]) > 0 for r in self.owner if r >= 0)

    def busy_settings(self) -> Request:
        """The running rows as one request (a template for the build and its round costs)."""
        rows = [self.requests[r].row for r in self.owner if r >= 0] or [next(iter(self.requests.values())).row]
        return stack(rows, len(rows), self.max_len)

    def plan(self, rounds_in_flight: int) -> Step:
        """The next step. rounds_in_flight: calls dispatched and not read yet (at most one more is planned then,
        and only when no running row can finish in the one in flight and nothing waits)."""
        release, self._release = tuple(self._release), []
        resize, size = self._resize(rounds_in_flight)
        admissions = self._admit()
        rounds = None
        busy = self.owner[self.owner >= 0]
        # Tokens each running row may still emit once what is in flight arrives (its prefill's first token).
        left = np.array([self.requests[r].left - (not self.requests[r].prefilled) for r in busy])
        if rounds_in_flight == 0 and np.any(left > 0):
            rounds = self._choose()
        elif rounds_in_flight == 1 and len(busy) and self.policy.may_choose_ahead():
            ahead = self._choose()
            need = left > self.rounds_per_call * (ahead.gamma + 1)
            if need.all() if self.waiting else need.any():
                rounds = ahead
        if rounds is not None:
            self.policy.dispatched(rounds)
        return Step(release, resize, size, admissions, rounds, rounds is not None and self.samples())

    def _choose(self):
        busy = self.owner[self.owner >= 0]
        return self.policy.choose(float(np.mean([self.requests[r].length for r in busy])))

    def _resize(self, rounds_in_flight: int) -> tuple[np.ndarray | None, int]:
        """Grows the pool to hold the running and waiting requests (up to max_batch), or shrinks it when they
        fill a quarter of it and nothing is in flight; running rows move to the front on a shrink."""
        busy = np.flatnonzero(self.owner >= 0)
        need = min(self.max_batch, len(busy) + len(self.waiting))
        if need == 0:
            return None, self.size
        if need > self.size:
            new = pool_size(need, self.max_batch)
            index = np.concatenate([np.arange(self.size), np.full((new - self.size,), self.size)])
        elif self.shrink and need <= self.size // 4 and rounds_in_flight == 0:
            new = pool_size(need, self.max_batch)
            index = np.concatenate([busy, np.full((new - len(busy),), self.size)])
        else:
            return None, self.size
        owner = np.full((new,), -1, np.int64)
        kept = index < self.size
        owner[kept] = self.owner[index[kept]]
        for slot, r in enumerate(owner):
            if r >= 0:
                self.requests[int(r)].slot = slot
        self.owner, self.size = owner, new
        return index.astype(np.int32), new

    def _admit(self) -> tuple[Admission, ...]:
        """Waiting requests into free slots, in arrival order, each prefill at most prefill_tokens padded tokens
        (one prompt always fits)."""
        admissions = []
        free = list(np.flatnonzero(self.owner < 0))
        while free and self.waiting:
            take, longest = [], 0
            for r in self.waiting:
                length = max(longest, int(self.requests[r].row.lengths[0]))
                if take and (len(take) == len(free) or admission_rows(len(take) + 1, self.size)
                             * bucket_length(length, self.max_len) > self.prefill_tokens):
                    break
                take.append(r)
                longest = length
            slots = free[: len(take)]
            for r, slot in zip(take, slots):
                self.waiting.popleft()
                self.owner[slot] = r
                self.requests[r].slot = int(slot)
            free = free[len(take):]
            admissions.append(Admission(tuple(take), tuple(int(s) for s in slots),
                                        admission_rows(len(take), self.size)))
        return tuple(admissions)

    def read(self, kind: str, gamma: int, owners: np.ndarray, outputs: np.ndarray) -> list[Event]:
        """The events of one operation's transfer: kind "admit" (prefill's first tokens, one row per admitted
        request) or "rounds" ([R, size, ...]); owners: the request id of each output row when it was
        dispatched (-1: none)."""
        events = []
        speculative = kind == "rounds" and self.speculative
        for packed in ([outputs] if kind == "admit" else list(outputs)):
            out = RoundOutput.unpack(packed, gamma)
            if speculative:
                self.policy.observe(gamma, out)
            accepted, done = out.accepted.tolist(), out.done.tolist()
            drafts, choices = (out.drafts.tolist(), out.choices.tolist()) if self.trace and speculative else ((), ())
            for row, r in enumerate(owners.tolist()):
                live = self.requests.get(r)
                if live is None or live.slot < 0 or self.owner[live.slot] != r:
                    continue
                new = out.tokens[row]
                live.left -= len(new)
                live.length += len(new)
                live.prefilled = True
                drafted = gamma if speculative and new else 0
                reason = None
                if done[row]:
                    reason = "stop" if new and live.row.is_stop(0, new[-1]) else "length"
                    self.owner[live.slot] = -1
                    del self.requests[r]
                events.append(Event(r, new, accepted[row] if speculative else 0, drafted, done[row], reason,
                                    gamma if speculative else None, (drafts[row], choices[row]) if drafts else None))
        return events


def live_row(prompt, max_new_tokens, stop_token_ids=(), *, max_len: int, vocab_size: int, stop_width: int,
             temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Request:
    """One prompt checked as Engine.generate checks it (ValueError naming any bad value), as a one-row request
    whose stop ids are padded to the pool's `stop_width` (more are refused) and whose sampling settings are set
    even when greedy (temperature 0), so that every row of a live pool has the same fields."""
    stops = list(stop_token_ids) if isinstance(stop_token_ids, (list, tuple)) else stop_token_ids
    if isinstance(stops, list) and len(stops) > stop_width:
        raise ValueError(f"at most {stop_width} stop token ids per request, got {len(stops)}")
    row = Request.build([prompt], max_new_tokens, stops, max_len=max_len, vocab_size=vocab_size,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    stop_ids = np.full((1, stop_width), -1, np.int32)
    given = row.stop_ids[0][row.stop_ids[0] >= 0]
    stop_ids[0, : len(given)] = given
    return _with_settings(dataclasses.replace(row, stop_ids=stop_ids))


def request_rows(request: Request, max_len: int) -> list[Request]:
    """A checked request's rows (Engine.request) as the one-row requests a live pool takes, stop ids at the
    request's width, each prompt cut to its own bucket."""
    return [_with_settings(request.take([i], 1, max_len)) for i in range(request.num_rows)]


def free_rows(template: Request, rows: int, max_len: int) -> Request:
    """`rows` free slots with the widths of the template's first row (stop ids, prompt bucket), laid out as a live
    pool lays out its rows: what a pool's state is allocated from, and what timing a call of rounds must use to
    run the executable the pool runs."""
    return _with_settings(template.take([0], 1, max_len)).take([], rows, max_len)


def _with_settings(row: Request) -> Request:
    """The row with its sampling settings set even when greedy (temperature 0), so that every row of a live pool
    has the same fields."""
    sampling = row.sampling or SamplingParams(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                                              np.zeros((1, 2), np.uint32))
    return dataclasses.replace(row, sampling=sampling)


def pool_size(rows: int, max_batch: int) -> int:
    """The slots of a pool that holds `rows`: the power of four at or above, at most max_batch. Powers of four
    keep the compiled pool sizes few (each size compiles its calls of rounds) while a pool pads its live rows
    at most fourfold, which costs little where decoding reads weights, not rows."""
    size = 1
    while size < rows:
        size *= 4
    return min(size, max_batch)


def stack(rows: list[Request], num_rows: int, max_len: int) -> Request:
    """One-row requests (stop ids of one width, sampling settings set) as one request of num_rows rows, padded
    as `Request.take` pads an admission."""
    width = max(r.tokens.shape[1] for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.tokens.shape[1]] = r.tokens[0]

    def cat(get):
        return np.concatenate([get(r) for r in rows])

    sampling = SamplingParams(*(cat(lambda r, f=f: getattr(r.sampling, f)) for f in
                                ("temperature", "top_k", "top_p", "seed")))
    together = Request(tokens, cat(lambda r: r.lengths), cat(lambda r: r.max_new), cat(lambda r: r.stop_ids),
                       sampling)
    return together.take(list(range(len(rows))), num_rows, max_len)
