"""The live pool's scheduler: host bookkeeping of requests that arrive and leave while the pool runs, and the
decision of each step as data (`Step`) for a runner to execute (live.py).

A request waits in arrival order until a slot and its pages are free; `plan` then admits it (prefill into a
slot's pages), frees the slots of aborted requests, resizes the pool to the batch it needs, gives the running
rows the pages the next call of rounds may write into, and picks that call. The pool holds `size` slots, a power
of four up to max_batch: enough for the running and waiting requests, so that a lone request runs rounds of one
row, not of max_batch. A pool that does not `shrink` (Engine.generate's, whose requests all arrive at once) keeps
its size to the end, so its tail compiles no smaller pool.

Pages (page_pool.py): a sequence holds the pages of its committed KV and of every position its dispatched calls
may write (a call of R rounds of gamma G writes at most R (G + 1) positions past the committed ones; nothing past
max_len). An admission takes its prompt's pages, and is made only while the running rows' next call and its own
first one fit beside it. When the running rows' next call does not fit, the youngest running sequence is
preempted: its pages are freed and it waits again, ahead of the others, to be recomputed from its prompt and the
tokens it already emitted (spec_round.Admission's resume token: the recompute rebuilds the caches and draws
nothing, so a sampled row goes on with its own random stream). A preemption needs the host to know every token:
it happens only when nothing is in flight; until then the call waits.

While some running row surely needs another call (more tokens left than the call in flight can emit), the
next call is planned before the one in flight is read, so the device does not idle on the host. While requests
wait for slots, only when every running row needs it: a slot freed by the call in flight is then refilled
before another call runs without it. `read` attributes one operation's transfer to the
requests that held its rows when it was dispatched (the owner snapshot travels with the operation), so a row
that finished or was aborted while the operation was in flight is ignored.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import numpy as np

from eagle3_jax.decoding.page_pool import PagePool, pages_for
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
    """Sequences prefilled together into slots: request i of `requests` goes to slot `slots[i]`, its KV into the
    pages of row i of `page_table`."""

    requests: tuple[int, ...]  # request ids
    slots: tuple[int, ...]
    rows: int  # the prefill's rows (admission_rows of the count): padding rows are dropped
    page_table: np.ndarray  # [rows, W] int32; -1 past each row's pages, and for the padding rows
    resume_token: np.ndarray  # [rows] int32: a recompute's newest token, -1 for a new prompt (spec_round.Admission)
    generated: np.ndarray  # [rows] int32: tokens each row emitted before (a recompute's), 0 for a new prompt


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the live pool, in the order the runner executes it."""

    release: tuple[int, ...]  # slots (before the resize) whose aborted rows stop: marked done on the device
    # The pool's new layout: new slot i takes old slot resize[i]; an index >= the old size is a free slot.
    # None: the layout is unchanged. The first step of a pool (no state yet) allocates `size` free slots.
    resize: np.ndarray | None
    size: int  # the pool's slots after the resize
    preempt: tuple[int, ...]  # slots (after the resize) whose preempted rows stop, before the admissions
    admissions: tuple[Admission, ...]
    rounds: object | None  # the call of rounds to dispatch (gamma_policy.Call), None: none this step
    sampling: bool  # whether the call's rows include a sampled one (the sampling build); else the greedy one
    page_table: np.ndarray | None  # [size, W] every slot's pages, to load before the call; None: unchanged


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
    row: Request  # the request's one row as submitted: stop ids at the pool's width, sampling settings always set
    left: int  # tokens it may still emit
    length: int  # its sequence length as read (prompt + emitted)
    slot: int = -1  # -1 while waiting
    prefilled: bool = False  # its KV is on the device (or dispatched) and its newest token is known
    tokens: list[int] = dataclasses.field(default_factory=list)  # what it emitted: a recompute's input
    pages: list[int] = dataclasses.field(default_factory=list)  # the pages it holds, in position order
    unread: collections.deque = dataclasses.field(default_factory=collections.deque)  # dispatched calls' R (G + 1)
    order: int = -1  # when it was last admitted: the youngest running sequence is preempted first

    @property
    def committed(self) -> int:
        """KV positions it holds once what is dispatched has run, before any call in flight: its sequence but the
        newest token (not yet in any cache), or while its first token is unread, the prompt."""
        return self.length - 1 if self.prefilled else self.length

    @property
    def horizon(self) -> int:
        """The most positions its dispatched operations can have written."""
        return self.committed + sum(self.unread)


class LiveScheduler:
    """The host state of a live pool: waiting and running requests, the slot and pages each holds, the gamma
    policy. pages: the engine's page pool (page_pool.PagePool), whose free pages this scheduler hands out; width:
    the page table's columns (kv_cache.table_width)."""

    def __init__(self, max_batch: int, max_len: int, prefill_tokens: int, rounds_per_call: int, policy: Policy,
                 speculative: bool, pages: PagePool, width: int, max_gamma: int, shrink: bool = True,
                 trace: bool = False):
        self.max_batch, self.max_len, self.prefill_tokens = max_batch, max_len, prefill_tokens
        self.rounds_per_call, self.policy, self.speculative = rounds_per_call, policy, speculative
        self.pages, self.width, self.max_gamma = pages, width, max_gamma
        self.shrink, self.trace = shrink, trace
        self.size = 0  # the pool's slots (0: no pool yet)
        self.owner = np.zeros((0,), np.int64)  # request id per slot, -1 free
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Live] = {}
        self.preemptions = 0  # sequences preempted so far
        self._release: list[int] = []  # slots of aborted rows, for the next step's `release`
        self._admitted = 0  # admissions so far (_Live.order)
        self._table_changed = True

    @property
    def running(self) -> int:
        return int(np.sum(self.owner >= 0))

    def add(self, request_id: int, row: Request) -> None:
        """Queues a checked one-row request (`live.LivePool.submit` builds it)."""
        self.requests[request_id] = _Live(row, int(row.budget(self.max_len)[0]), int(row.lengths[0]))
        self.waiting.append(request_id)

    def abort(self, request_id: int) -> Event | None:
        """Drops a waiting or running request at once, its slot and pages free for the next admission; None when it
        is no longer live."""
        live = self.requests.pop(request_id, None)
        if live is None:
            return None
        if live.slot < 0:
            self.waiting.remove(request_id)
        else:
            self._release.append(live.slot)
            self._free_slot(live)
        return Event(request_id, [], 0, 0, True, "abort")

    def close(self) -> None:
        """Every page this scheduler handed out, back to the page pool (the pool is shutting down)."""
        for live in self.requests.values():
            self.pages.give_back(live.pages)
            live.pages = []

    def samples(self) -> bool:
        """Whether some running request samples."""
        return any(float(self.requests[r].row.sampling.temperature[0]) > 0 for r in self.owner if r >= 0)

    def busy_settings(self) -> Request:
        """The running rows as one request (a template for the build and its round costs)."""
        rows = [self.requests[r].row for r in self.owner if r >= 0] or [next(iter(self.requests.values())).row]
        return stack(rows, len(rows), self.max_len)

    def plan(self, rounds_in_flight: int, idle: bool | None = None) -> Step:
        """The next step. rounds_in_flight: calls dispatched and not read yet (at most one more is planned then,
        and only when no running row can finish in the one in flight and nothing waits); idle: whether nothing at
        all is in flight (None: no call in flight), which a preemption needs."""
        idle = rounds_in_flight == 0 if idle is None else idle
        release, self._release = tuple(self._release), []
        resize, size = self._resize(rounds_in_flight)
        admissions = self._admit()
        preempted: list[int] = []
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
        # The call's pages (an admission above kept them free for its rows); when the running rows' are not free,
        # the call waits for what is in flight to be read, or preempts when nothing is.
        if rounds is not None and not self._grow(self.rounds_per_call * (rounds.gamma + 1), idle, preempted):
            rounds = None
        if rounds is not None:
            self.policy.dispatched(rounds)
            for r in self.owner[self.owner >= 0]:
                self.requests[int(r)].unread.append(self.rounds_per_call * (rounds.gamma + 1))
        table = None
        if rounds is not None and self._table_changed:
            table, self._table_changed = self.page_table(), False
        return Step(release, resize, size, tuple(preempted), admissions, rounds,
                    rounds is not None and self.samples(), table)

    def page_table(self) -> np.ndarray:
        """[size, W] every slot's pages (-1 past them, and for a free slot)."""
        table = np.full((self.size, self.width), -1, np.int32)
        for slot, r in enumerate(self.owner.tolist()):
            if r >= 0:
                pages = self.requests[r].pages
                table[slot, : len(pages)] = pages
        return table

    def _need(self, live: _Live, tail: int) -> int:
        """More pages `live` needs for a call that may write `tail` positions past its horizon."""
        return pages_for(min(live.horizon + tail, self.max_len), self.pages.page_size) - len(live.pages)

    def _grow(self, tail: int, idle: bool, preempted: list[int]) -> bool:
        """Gives every running row the pages a call writing `tail` positions past its horizon needs; when they are
        not free and `idle`, preempts the youngest running sequences (their slots into `preempted`) until they are.
        False (nothing taken) when they are not free and a preemption must wait."""
        while True:
            running = [self.requests[int(r)] for r in self.owner[self.owner >= 0]]
            need = {id(live): self._need(live, tail) for live in running}
            if sum(max(n, 0) for n in need.values()) <= self.pages.free:
                break
            if not idle or len(running) <= 1:
                return False
            victim = max(running, key=lambda live: live.order)
            preempted.append(victim.slot)
            self._preempt(victim)
        for live in running:
            if need[id(live)] > 0:
                live.pages += self.pages.take(need[id(live)])
                self._table_changed = True
        return True

    def _preempt(self, live: _Live) -> None:
        """Frees a running sequence's slot and pages and puts it first in line, to be recomputed from its tokens."""
        request_id = int(self.owner[live.slot])
        self._free_slot(live)
        live.slot = -1
        self.waiting.appendleft(request_id)
        self.preemptions += 1

    def _free_slot(self, live: _Live) -> None:
        """The slot and pages of `live` free (the caller says whether its row must be stopped on the device)."""
        self.owner[live.slot] = -1
        self.pages.give_back(live.pages)
        live.pages, live.unread = [], collections.deque()
        self._table_changed = True

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
        self._table_changed = True
        return index.astype(np.int32), new

    def _sequence(self, live: _Live) -> tuple[int, int]:
        """(KV length an admission of `live` prefills, its resume token or -1): a new prompt's length, or a
        recompute's tokens but the newest."""
        if live.prefilled:
            return live.committed, live.tokens[-1]
        return live.length, -1

    def _admit(self) -> tuple[Admission, ...]:
        """Waiting requests into free slots and free pages, in line order, each prefill at most prefill_tokens
        padded tokens (one sequence always fits); a request is admitted only while the running rows' next call
        (at the largest gamma) and its own first one fit in the free pages beside it."""
        admissions = []
        free = list(np.flatnonzero(self.owner < 0))
        tail = self.rounds_per_call * (self.max_gamma + 1)
        reserved = sum(max(self._need(self.requests[int(r)], tail), 0) for r in self.owner[self.owner >= 0])
        while free and self.waiting:
            take, longest = [], 0
            for r in self.waiting:
                live = self.requests[r]
                length = self._sequence(live)[0]
                longest_with = max(longest, length)
                if take and (len(take) == len(free) or admission_rows(len(take) + 1, self.size)
                             * bucket_length(longest_with, self.max_len) > self.prefill_tokens):
                    break
                cost = pages_for(min(length + tail, self.max_len), self.pages.page_size)
                if reserved + cost > self.pages.free:
                    break
                reserved += cost
                take.append(r)
                longest = longest_with
            if not take:
                break
            rows = admission_rows(len(take), self.size)
            table = np.full((rows, self.width), -1, np.int32)
            resume, generated = np.full((rows,), -1, np.int32), np.zeros((rows,), np.int32)
            slots = free[: len(take)]
            for i, (r, slot) in enumerate(zip(take, slots)):
                self.waiting.popleft()
                live = self.requests[r]
                length, resume[i] = self._sequence(live)
                generated[i] = len(live.tokens)
                live.pages = self.pages.take(pages_for(length, self.pages.page_size))
                table[i, : len(live.pages)] = live.pages
                live.order, self._admitted = self._admitted, self._admitted + 1
                self.owner[slot] = r
                live.slot = int(slot)
            free = free[len(take):]
            self._table_changed = True
            admissions.append(Admission(tuple(take), tuple(int(s) for s in slots), rows, table, resume, generated))
        return tuple(admissions)

    def admission_request(self, admission: Admission) -> Request:
        """The sequences of an admission as one request of its rows (prefill's input): a new prompt as submitted,
        a recompute's prompt and emitted tokens but the newest."""
        rows = []
        for r in admission.requests:
            live = self.requests[r]
            row = live.row
            if live.prefilled:
                sequence = np.concatenate([row.tokens[0, : int(row.lengths[0])], live.tokens[:-1]]).astype(np.int32)
                row = dataclasses.replace(row, tokens=sequence[None, :], lengths=np.array([len(sequence)], np.int32))
            rows.append(row)
        return stack(rows, admission.rows, self.max_len)

    def read(self, kind: str, gamma: int, owners: np.ndarray, outputs: np.ndarray) -> list[Event]:
        """The events of one operation's transfer: kind "admit" (prefill's first tokens, one row per admitted
        request) or "rounds" ([R, size, ...]); owners: the request id of each output row when it was
        dispatched (-1: none). A recompute's admission reports nothing."""
        events = []
        speculative = kind == "rounds" and self.speculative
        if kind == "rounds":
            for r in set(owners.tolist()):
                live = self.requests.get(r)
                if live is not None and live.slot >= 0 and self.owner[live.slot] == r and live.unread:
                    live.unread.popleft()
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
                if kind == "admit" and live.prefilled:  # a recompute: its caches are back, nothing emitted
                    continue
                new = out.tokens[row]
                live.left -= len(new)
                live.length += len(new)
                live.tokens += new
                live.prefilled = True
                drafted = gamma if speculative and new else 0
                reason = None
                if done[row]:
                    reason = "stop" if new and live.row.is_stop(0, new[-1]) else "length"
                    self._free_slot(live)  # done on the device already: nothing to release
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
