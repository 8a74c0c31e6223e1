"""The live pool's scheduler: host bookkeeping of requests that arrive and leave while the pool runs, and the
decision of each step as data (`Step`) for a runner to execute (live.py).

A request waits in arrival order until a slot and its pages are free. Its prompt is then prefilled in chunks
(`ChunkPlan`): every round of a call of rounds carries up to `prefill_chunk` prompt tokens, of one or more prompts
packed, in its target forward (a mixed call); a prompt longer than that goes on in the next round's chunk, of this
call or the next. When its last chunk has run in round r, its first token is drawn and its row joins the pool's
rows at once: it runs rounds r + 1 onwards of the same call (or, when r is the call's last round, the next call's
rounds). A call runs whenever some row runs or some prompt token can go, with no running row too. Only an exact
engine prefills in calls of their own (`ChunkPlan.alone`: one chunk a call, beside its calls of rounds), its kernels'
results not depending on rows beside them.

Rows: the pool holds `capacity` slots (the device's rows, allocated once); a call computes only a bucket of them
(`row_bucket`: a power of two, at most capacity), chosen by the rows that run in it: the running rows and those its
chunks join, then free slots to fill the bucket. So a lone request runs rounds of one row, and hundreds of waiting
prompts cost no round anything. `plan` also frees the slots of aborted requests, gives the running rows the pages
the next call may write into, and picks that call's gamma for its bucket and whether it carries prompt tokens.

Pages (page_pool.py): a sequence holds the pages of its prompt's KV as its chunks write it, then of its committed
KV and of every position its dispatched calls may write (a call of R rounds of gamma G writes at most R (G + 1)
positions past the committed ones; nothing past max_len; a row that joins in round r of a call takes the pages of
its R - 1 - r rounds there with its last chunk). A prompt is admitted only while the running rows' next call (at
the largest gamma) and its whole prompt and first call fit in the free pages beside them. When the running rows'
next call does not fit, the youngest sequence (running or prefilling) is preempted: its pages are freed and it waits
again, ahead of the others, to be recomputed from its prompt and the tokens it already emitted (a chunk's resume
token: the recompute rebuilds the caches and draws nothing, so a sampled row goes on with its own random stream). A
preemption needs the host to know every token: it happens only when nothing is in flight; until then the call waits.

Prefix caching (page_pool.py): a sequence admitted first takes the cached pages of its longest cached prefix of
whole pages (at least its last token is computed) and its chunks start after them; a sequence's full pages of
committed KV join the cache as its chunks write them, and as its rounds commit them once its drafter's KV is up to
date (every call that drafts, or that brings a held drafter up to date).

Penalties and logprobs: a call whose rows (or the rows its chunks install) have penalties or ask for logprobs runs
the build with them (`Step.penalties`, `Step.logprobs`); a call whose chunks hold a penalized sequence brings every
final segment's whole sequence (`ChunkPlan.history`), over which its penalties count. A prompt whose own logprobs are
asked for takes no cached prefix (a page holds no logits), and the rounds that carry its chunks report them
(`ChunkPlan.prompt_segments`, spec_round._prompt_rows); `read` keeps them on the request until its first token's
event carries them.

While some running row surely needs another call (more tokens left than the call in flight can emit), or some
prompt token can go, the next call is planned before the one in flight is read, so the device does not idle on the
host. While requests wait for a slot, only when every running row needs it: a slot freed by the call in flight is
then refilled before another call runs without it. `read` attributes one operation's transfer to the requests that
held its rows in each round when it was dispatched (the owner snapshots travel with the operation), so a row that
finished or was aborted while the operation was in flight is ignored.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import jax
import numpy as np

from eagle3_jax.decoding import grammar as grammar_lib
from eagle3_jax.decoding import logprobs as logprobs_lib
from eagle3_jax.decoding.page_pool import PagePool, chain_keys, pages_for
from eagle3_jax.decoding.penalties import Penalties
from eagle3_jax.decoding.request import Request
from eagle3_jax.decoding.round_output import RoundOutput
from eagle3_jax.decoding.sampling import SamplingParams


class Policy(Protocol):
    """Which gamma each call of rounds runs (gamma_policy.py)."""

    # The next call (gamma_policy.Call) at this mean KV length of its rows, for a call of `rows` rows (its bucket)
    # that carries prompt tokens or not (`mixed`); nothing changes until `dispatched` says it ran.
    def choose(self, length: float, rows: int, mixed: bool): ...

    def dispatched(self, call) -> None: ...

    def observe(self, gamma: int, out: RoundOutput) -> None: ...  # one round's output, read

    # Whether a call may be chosen before the one in flight is read: a policy with no evidence yet would
    # choose the second call from its prior too.
    def may_choose_ahead(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The prompt tokens of a call's rounds as the host lays them out (spec_round.Chunk's fields, numpy, one chunk
    per round on the leading axis R), and whose they are. Slots are the pool's (live.device_chunks turns them into
    positions in the call's rows)."""

    tokens: np.ndarray  # [R, C] int32
    cu: np.ndarray  # [R, P + 1] int32
    start: np.ndarray  # [R, P] int32
    table: np.ndarray  # [R, P, W] int32
    final: np.ndarray  # [R, P] bool
    slot: np.ndarray  # [R, P] int32 (the pool's capacity: none)
    next_token: np.ndarray  # [R, P] int32
    generated: np.ndarray  # [R, P] int32
    max_new: np.ndarray  # [R, P] int32
    stop_ids: np.ndarray  # [R, P, width] int32
    sampling: SamplingParams  # [R, P]
    owners: np.ndarray  # [R, P] int64: the request whose prompt each final segment ends (-1: none)
    alone: bool  # a call of its own (an exact engine's; R = 1), not riding in a call of rounds
    # [R, P, max_len] int32: a final segment's whole sequence (prompt lookup's; a penalized sequence's: penalties.py)
    history: np.ndarray | None = None
    grammar: grammar_lib.Rows | None = None  # [R, P] final segments' automata and states, while the pool has any
    penalties: Penalties | None = None  # [R, P] each sequence's penalties and logit_bias
    # (round, request id, offset in tokens, start position, tokens) of each segment whose prompt logprobs are asked for
    prompt_segments: tuple = ()

    @property
    def samples(self) -> bool:
        """Whether some final segment's row samples (a sampling build then: it draws its first token, and runs its
        rounds in the same call)."""
        return bool(np.any(self.final & (self.sampling.temperature > 0)))

    @property
    def prompt_tokens(self) -> int:
        """The real prompt tokens it carries, over all its rounds."""
        return int(self.cu[:, -1].sum())


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the live pool, in the order the runner executes it."""

    allocate: int  # the pool's slots to allocate first (its first step), else 0
    release: tuple[int, ...]  # slots whose aborted rows stop: marked done on the device
    preempt: tuple[int, ...]  # slots whose preempted rows stop
    rounds: object | None  # the call of rounds to dispatch (gamma_policy.Call), None: none this step
    # The slots the call computes, its row bucket (distinct; running rows, the rows its chunk joins, then free
    # slots); None: every slot, in order.
    rows: np.ndarray | None
    owners: np.ndarray  # [R, rows] int64: the request running in each of the call's rows in each round (-1: none)
    chunk: ChunkPlan | None  # prompt tokens: in the call's rounds, or (chunk.alone) in a call of their own after it
    sampling: bool  # whether the call's rows (or its chunk's rows) include a sampled one: the sampling build
    page_table: np.ndarray | None  # [capacity, W] every slot's pages, to load before the call; None: unchanged
    penalties: bool = False  # whether the call's rows or its chunk's rows have penalties: a penalty build
    logprobs: bool = False  # whether they ask for logprobs (or a chunk's prompt ones): a build with logprobs


@dataclasses.dataclass(frozen=True)
class Event:
    """What one operation reported for one request."""

    request: int
    tokens: list[int]
    accepted: int  # drafts committed (0 for a first token and plain rounds)
    # drafts the round proposed for this row (its gamma, a tree's nodes; 0 for a first token and plain rounds)
    drafted: int
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    gamma: int | None = None  # a speculative round's drafts per round (0 included); None for a first token, spec off
    # with trace: a speculative round's (drafts, target choices), and a draft tree's (its nodes' tokens, the choices
    # along its path, its nodes' parents, its path's nodes) (engine.round_trace)
    trace: tuple[list[int], ...] | None = None
    cached_tokens: int = 0  # with the first token: the prompt tokens served from the prefix cache
    logprobs: list | None = None  # a request that asks for them: each token's logprobs.TokenLogprobs
    # with the first token of a request that asks for them: each prompt token's (None for the first)
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class _Live:
    row: Request  # the request's one row as submitted: stop ids at the pool's width, sampling settings always set
    left: int  # tokens it may still emit
    length: int  # its sequence length as read (prompt + emitted)
    slot: int = -1  # -1 while waiting
    prefilled: bool = False  # its newest token is known (its first token read, or a recompute's)
    joined: bool = False  # its row is in the pool (its last chunk dispatched): it runs rounds
    computed: int = 0  # positions of its sequence to (re)compute that dispatched chunks write
    tokens: list[int] = dataclasses.field(default_factory=list)  # what it emitted: a recompute's input
    pages: list[int] = dataclasses.field(default_factory=list)  # the pages it holds, in position order
    unread: collections.deque = dataclasses.field(default_factory=collections.deque)  # dispatched calls' R (G + 1)
    order: int = -1  # when it was last admitted: the youngest sequence is preempted first
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its first pages' prefix-cache keys (page_pool)
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    counted: bool = False  # its first admission's cache hit is counted (a recompute's is not)
    placed: bool = False  # its constraint is laid out in the pool's automata (grammar.Registry) for its row
    prompt_logprobs: list | None = None  # its prompt tokens' logprobs as its chunks report them (when asked for)

    def asks(self, field: str) -> bool:
        """Whether its request asks for `field` ("logprobs", "prompt_logprobs")."""
        counts = getattr(self.row, field)
        return counts is not None and int(counts[0]) >= 0

    @property
    def penalized(self) -> bool:
        return self.row.penalties is not None and bool(self.row.penalties.active()[0])

    def known(self) -> np.ndarray:
        """Every token of its sequence the host knows: the prompt, then what it emitted."""
        prompt = self.row.tokens[0, : int(self.row.lengths[0])]
        return np.concatenate([prompt, np.asarray(self.tokens, np.int32)]).astype(np.int32)

    def sequence(self) -> tuple[np.ndarray, int]:
        """(the tokens whose KV it must hold before it runs rounds, its resume token or -1): a new prompt, or a
        recompute's prompt and emitted tokens but the newest, which is its resume token."""
        prompt = self.row.tokens[0, : int(self.row.lengths[0])]
        if not self.prefilled:
            return prompt, -1
        return np.concatenate([prompt, np.asarray(self.tokens[:-1], np.int32)]).astype(np.int32), self.tokens[-1]

    @property
    def committed(self) -> int:
        """KV positions it holds once what is dispatched has run, before any call in flight: while it prefills,
        what its chunks wrote; then its sequence but the newest token (not yet in any cache), or while its first
        token is unread, the prompt."""
        if not self.joined:
            return self.computed
        return self.length - 1 if self.prefilled else self.length

    @property
    def horizon(self) -> int:
        """The most positions its dispatched operations can have written."""
        return self.committed + sum(self.unread)


class LiveScheduler:
    """The host state of a live pool: waiting, prefilling and running requests, the slot and pages each holds,
    the gamma policy. capacity: the pool's slots; pages: the engine's page pool (page_pool.PagePool), whose free
    pages this scheduler hands out; width: the page table's columns (kv_cache.table_width); prefill_chunk,
    prefill_sequences: the prompt tokens one target forward carries and the most prompts it holds; alone: whether
    every chunk runs in a call of its own (an exact engine's: its kernels' results must not depend on rows beside
    it); prefix_caching, with_next: whether sequences share cached prefixes, and whether a page's key holds the token
    after it (page_pool.chain_keys); history: whether a chunk carries each final segment's whole sequence (prompt
    lookup's history, which a cached prefix would leave without the tokens no chunk holds); tree_nodes: a draft tree's
    nodes (its rounds' outputs carry the tree: round_output), 0 for a chain; scratch: positions a call's last round
    writes past the R (G + 1) its rounds may commit (a tree's nodes and beams past its depth: Engine.scratch), which
    its rows' pages must hold too."""

    def __init__(self, capacity: int, max_len: int, prefill_chunk: int, prefill_sequences: int,
                 rounds_per_call: int, policy: Policy, speculative: bool, pages: PagePool, width: int,
                 max_gamma: int, stop_width: int, trace: bool = False, alone: bool = False,
                 prefix_caching: bool = False, with_next: bool = False, history: bool = False, tree_nodes: int = 0,
                 scratch: int = 0):
        self.capacity, self.max_len, self.prefill_chunk = capacity, max_len, prefill_chunk
        self.rounds_per_call, self.policy, self.speculative = rounds_per_call, policy, speculative
        self.pages, self.width, self.max_gamma, self.stop_width = pages, width, max_gamma, stop_width
        self.trace, self.alone = trace, alone
        # with_next: the cache keys a page with the token after it (an EAGLE-3 drafter's last entry pairs with it)
        self.prefix_caching, self.with_next = prefix_caching, with_next
        self.history = history  # chunks carry a final segment's whole sequence (a proposer's token history)
        self.chunk_sequences = prefill_sequences
        self.tree_nodes, self.scratch = tree_nodes, scratch
        self.allocated = False  # whether the pool's rows exist on the device (its first step allocates them)
        self.owner = np.full((capacity,), -1, np.int64)  # request id per slot, -1 free
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Live] = {}
        self.preemptions = 0  # sequences preempted so far
        self.cached_tokens = 0  # prompt tokens first admissions took from the prefix cache so far
        self._release: list[int] = []  # slots of aborted rows, for the next step's `release`
        self._admitted = 0  # admissions so far (_Live.order)
        self._table_changed = True
        self._last_gamma = max_gamma  # the latest dispatched call's gamma: what a call in flight may emit
        self.grammar = grammar_lib.Registry()  # the constrained rows' automata, for the runner's tables

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or running rounds)."""
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

    def _running(self) -> list[int]:
        """The requests whose rows run rounds."""
        return [int(r) for r in self.owner if r >= 0 and self.requests[int(r)].joined]

    def samples(self) -> bool:
        """Whether some running request samples."""
        return any(float(self.requests[r].row.sampling.temperature[0]) > 0 for r in self._running())

    def busy_settings(self, chunk: ChunkPlan | None = None) -> Request:
        """The running rows (and a chunk's final segments) as one request: a template for the build and its round
        costs."""
        rows = [self.requests[r].row for r in self._running()]
        if chunk is not None:
            rows += [self.requests[int(r)].row for r in chunk.owners.ravel() if r >= 0 and int(r) in self.requests]
        rows = rows or [next(iter(self.requests.values())).row]
        return stack(rows, len(rows), self.max_len)

    def plan(self, rounds_in_flight: int, idle: bool | None = None) -> Step:
        """The next step. rounds_in_flight: calls dispatched and not read yet (at most one more is planned then:
        when the running rows surely need it, or some prompt token can go); idle: whether nothing at all is in
        flight (None: no call in flight), which a preemption needs."""
        idle = rounds_in_flight == 0 if idle is None else idle
        release, self._release = tuple(self._release), []
        allocate = 0 if self.allocated else self.capacity
        self.allocated = True
        preempted: list[int] = []
        busy = self._running()
        # Tokens each running row may still emit once what is in flight arrives (its first token).
        left = np.array([self.requests[r].left - (not self.requests[r].prefilled) for r in busy], np.int64)
        prompts = not self.alone and self._prompts_can_go()
        if rounds_in_flight == 0:
            needed = bool(np.any(left > 0))
        elif rounds_in_flight == 1 and self.policy.may_choose_ahead():
            need = left > self.rounds_per_call * (self._last_gamma + 1)
            needed = bool(need.all() if self.waiting and not self._free_slots() else need.any())
        else:
            needed = prompts = False
        go = needed or prompts
        # The running rows' pages for the call (at the largest gamma: the chunk planned next may admit prompts only
        # beside them); when they are not free, the call waits for what is in flight to be read, or preempts.
        if go and busy and not self._grow(self.rounds_per_call * (self.max_gamma + 1) + self.scratch, idle, preempted):
            go = False
        busy = self._running()  # not the preempted ones
        joiners: list[tuple[_Live, int]] = []
        chunk = self._chunks(self.rounds_per_call, joiners) if go and not self.alone else None
        rounds, rows, owners = None, None, np.full((self.rounds_per_call, 0), -1, np.int64)
        if go and (needed or chunk is not None):  # a call planned for prompt tokens carries some
            rows, owners = self._rows(busy, joiners)
            length = np.mean([self.requests[r].length for r in busy] or [len(live.sequence()[0]) for live, _ in joiners]
                             or [0.0])
            rounds = self.policy.choose(float(length), owners.shape[1], chunk is not None)
            self.policy.dispatched(rounds)
            self._last_gamma = rounds.gamma
            for r in busy:
                self.requests[r].unread.append(self.rounds_per_call * (rounds.gamma + 1))
            for live, j in joiners:  # a prompt ending in the last round runs none of this call's rounds
                if j < self.rounds_per_call - 1:
                    live.unread.append((self.rounds_per_call - 1 - j) * (rounds.gamma + 1))
        if self.alone:  # an exact engine: a chunk is a call of its own, after the call of rounds
            chunk = self._chunks(1, [], alone=True)
        table = None
        if rounds is not None and self._table_changed:
            table, self._table_changed = self.page_table(), False
        sampling = (rounds is not None and self.samples()) or (chunk is not None and chunk.samples)
        ran = (busy if rounds is not None else []) + ([int(r) for r in chunk.owners.ravel() if r >= 0] if chunk else [])
        penalties = any(self.requests[r].penalized for r in ran if r in self.requests)
        logprobs = any(self.requests[r].asks("logprobs") for r in ran if r in self.requests) or bool(
            chunk and chunk.prompt_segments)
        return Step(allocate, release, tuple(preempted), rounds, rows, owners, chunk, sampling, table, penalties,
                    logprobs)

    def _free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.owner < 0)]

    def _prompts_can_go(self) -> bool:
        """Whether some prompt token can be prefilled now: a prefilling sequence's, or a waiting one's with a free
        slot (pages permitting: `_chunks` decides)."""
        prefilling = any(not self.requests[int(r)].joined for r in self.owner if r >= 0)
        return prefilling or bool(self.waiting and self._free_slots())

    def _rows(self, busy: list[int], joiners: list) -> tuple[np.ndarray | None, np.ndarray]:
        """A call's rows (`Step.rows`) and their owners in each round: the running rows, the rows its chunks join
        (from the round after their last chunk), then free slots up to the bucket."""
        slots = [self.requests[r].slot for r in busy] + [live.slot for live, _ in joiners]
        bucket = row_bucket(len(slots), self.capacity)
        taken = set(slots)
        slots += [s for s in range(self.capacity) if s not in taken][: bucket - len(slots)]
        owners = np.full((self.rounds_per_call, bucket), -1, np.int64)
        for i, r in enumerate(busy):
            owners[:, i] = r
        for i, (live, j) in enumerate(joiners, start=len(busy)):
            owners[j + 1:, i] = self.owner[live.slot]
        if bucket == self.capacity:  # every slot: in slot order, no gather
            order = np.argsort(slots)
            return None, owners[:, order]
        return np.array(slots, np.int32), owners

    def page_table(self) -> np.ndarray:
        """[capacity, W] every running slot's pages (-1 past them, and for a slot with no running row)."""
        table = np.full((self.capacity, self.width), -1, np.int32)
        for r in self._running():
            live = self.requests[r]
            table[live.slot, : len(live.pages)] = live.pages
        return table

    def _need(self, live: _Live, tail: int) -> int:
        """More pages a running `live` needs for a call that may write `tail` positions past its horizon."""
        return pages_for(min(live.horizon + tail, self.max_len), self.pages.page_size) - len(live.pages)

    def _grow(self, tail: int, idle: bool, preempted: list[int]) -> bool:
        """Gives every running row the pages a call writing `tail` positions past its horizon needs; when they are
        not free and `idle`, preempts the youngest sequences, running or prefilling (their slots into `preempted`),
        until they are. False (nothing taken) when they are not free and a preemption must wait."""
        while True:
            running = [self.requests[r] for r in self._running()]
            need = {id(live): self._need(live, tail) for live in running}
            if sum(max(n, 0) for n in need.values()) <= self.pages.free:
                break
            holders = [self.requests[int(r)] for r in self.owner if r >= 0]
            if not idle or len(holders) <= 1:
                return False
            victim = max(holders, key=lambda live: live.order)
            preempted.append(victim.slot)
            self._preempt(victim)
        for live in running:
            if need[id(live)] > 0:
                live.pages += self.pages.take(need[id(live)])
                self._table_changed = True
        return True

    def _preempt(self, live: _Live) -> None:
        """Frees a sequence's slot and pages and puts it first in line, to be recomputed from its tokens."""
        request_id = int(self.owner[live.slot])
        self._free_slot(live)
        live.slot, live.joined, live.computed = -1, False, 0
        self.waiting.appendleft(request_id)
        self.preemptions += 1

    def _free_slot(self, live: _Live) -> None:
        """The slot and pages of `live` free (the caller says whether its row must be stopped on the device)."""
        self.owner[live.slot] = -1
        self.pages.give_back(live.pages)
        live.pages, live.unread = [], collections.deque()
        self._table_changed = True
        if live.placed:
            self.grammar.release(live.row.constraint(0))
            live.placed = False

    def _chunks(self, rounds: int, joiners: list, alone: bool = False) -> ChunkPlan | None:
        """The prompt tokens of a call's `rounds` rounds (one forward each), each round's segments planned after the
        one before (a prompt goes on where the last round left it); the rows whose last chunk runs in round j go to
        `joiners` as (live, j). None when no prompt token can go."""
        # A penalized sequence that may join brings its whole sequence (penalties count over it).
        history = self.history or any(live.penalized for live in self.requests.values() if not live.joined)
        plan = empty_chunk(self.prefill_chunk, self.chunk_sequences, self.width, self.stop_width, self.capacity,
                           alone, self.max_len if history else 0, rounds, grammar=True)
        laid = False
        for j in range(rounds):
            segments = self._segments(0 if alone else rounds - 1 - j)
            if not segments:
                break
            laid = True
            for live in self._lay_out(plan, j, segments):
                joiners.append((live, j))
        if not self.grammar.active:  # the chunk carries the constrained rows' states only while the pool has any
            plan = dataclasses.replace(plan, grammar=None)
        return dataclasses.replace(plan, prompt_segments=tuple(plan.prompt_segments)) if laid else None

    def _segments(self, after: int) -> list[tuple[_Live, int]]:
        """One forward's segments: up to prefill_chunk tokens of the prefilling sequences (oldest first), then of
        waiting ones admitted into free slots in line order. Pages: the running rows' next call (at the largest
        gamma) is kept free first; a prefilling sequence takes its segment's pages beside it; a waiting one is
        admitted only while its whole prompt and first call fit beside that and every prefilling sequence's rest, so
        a sequence admitted can always finish its prompt. A sequence whose last segment this is also takes the pages
        of the `after` rounds it runs in the same call."""
        tail = self.rounds_per_call * (self.max_gamma + 1) + self.scratch
        size = self.pages.page_size
        reach = after * (self.max_gamma + 1) + (self.scratch if after else 0)  # a joining row's rounds in the call

        def wanted(sequence, end: int) -> int:  # positions to hold once a segment ends at `end`
            return min(end + reach if end == len(sequence) else end, self.max_len)

        reserved = sum(max(self._need(self.requests[r], tail), 0) for r in self._running())
        prefilling = sorted((self.requests[int(r)] for r in self.owner if r >= 0 and not self.requests[int(r)].joined),
                            key=lambda live: live.order)
        budget, segments = self.prefill_chunk, []
        for live in prefilling:
            if budget == 0 or len(segments) == self.chunk_sequences:
                break
            sequence, _ = live.sequence()
            take = min(len(sequence) - live.computed, budget)
            more = max(pages_for(wanted(sequence, live.computed + take), size) - len(live.pages), 0)
            if reserved + more > self.pages.free:
                continue
            live.pages += self.pages.take(more)
            segments.append((live, take))
            budget -= take
        # What the prefilling sequences have yet to take, for their prompts and first calls.
        reserved += sum(max(pages_for(min(len(live.sequence()[0]) + tail, self.max_len), size) - len(live.pages), 0)
                        for live in prefilling)
        free_slots = self._free_slots()
        while self.waiting and free_slots and budget and len(segments) < self.chunk_sequences:
            live = self.requests[self.waiting[0]]
            sequence, _ = live.sequence()
            cached = self._cached_prefix(live, sequence)
            whole = pages_for(min(len(sequence) + tail, self.max_len), size) - len(cached)
            if reserved + whole > self.pages.free:
                self.pages.give_back(cached)
                break
            start = len(cached) * size
            take = min(len(sequence) - start, budget)
            taken = pages_for(wanted(sequence, start + take), size) - len(cached)
            reserved += whole - taken
            slot = free_slots.pop(0)
            request_id = self.waiting.popleft()
            self.owner[slot], live.slot = request_id, slot
            live.order, self._admitted = self._admitted, self._admitted + 1
            live.pages, live.computed = cached + self.pages.take(taken), start
            if not live.counted:
                live.counted, live.cached_tokens = True, start
                self.cached_tokens += start
            segments.append((live, take))
            budget -= take
        return segments

    def _cached_prefix(self, live: _Live, sequence: np.ndarray) -> list[int]:
        """The cached pages of the longest prefix of whole pages of `sequence` (held now), leaving at least its last
        token to compute (its logits, its drafter output)."""
        if not self.prefix_caching or (live.asks("prompt_logprobs") and not live.prefilled):
            return []  # a cached page holds no logits: a prompt whose logprobs are asked for is computed whole
        usable = (len(sequence) - 1) // self.pages.page_size
        return self.pages.lookup(self._keys(live, sequence, usable))

    def _keys(self, live: _Live, tokens: np.ndarray, pages: int) -> list[bytes]:
        """The first `pages` prefix-cache keys of a sequence whose tokens begin with `tokens` (those it has are
        kept)."""
        if len(live.keys) < pages:
            live.keys = chain_keys(tokens, self.pages.page_size, pages, self.with_next)
        return live.keys[:pages]

    def _keep(self, live: _Live, tokens: np.ndarray, committed: int) -> None:
        """Caches the full pages of `live` whose KV and drafter KV hold committed tokens below `committed`, keyed by
        `tokens` (its sequence, the token after each page included where the key needs it)."""
        if not self.prefix_caching:
            return
        full = min(committed, len(tokens) - 1 if self.with_next else len(tokens)) // self.pages.page_size
        full = min(full, len(live.pages))
        for page, key in zip(live.pages[:full], self._keys(live, tokens, full)):
            self.pages.keep(page, key)

    def _lay_out(self, plan: ChunkPlan, j: int, segments: list) -> list[_Live]:
        """Round j of the chunk plan for these (sequence, tokens taken) segments, each sequence's progress advanced;
        returns the sequences whose last chunk this is: they join the pool (their rows run from round j + 1)."""
        joined = []
        at = 0
        for p, (live, take) in enumerate(segments):
            sequence, resume = live.sequence()
            if not live.prefilled and live.asks("prompt_logprobs"):
                plan.prompt_segments.append((j, int(self.owner[live.slot]), at, live.computed, take))
            if live.row.penalties is not None:
                for field in ("frequency", "presence", "repetition", "bias_ids", "bias"):
                    getattr(plan.penalties, field)[j, p] = getattr(live.row.penalties, field)[0]
            plan.tokens[j, at : at + take] = sequence[live.computed : live.computed + take]
            plan.start[j, p], plan.slot[j, p] = live.computed, live.slot
            plan.table[j, p, : len(live.pages)] = live.pages
            live.computed += take
            self._keep(live, sequence, live.computed)
            at += take
            final = live.computed == len(sequence)
            plan.final[j, p] = final
            plan.next_token[j, p] = resume if final else sequence[live.computed]
            plan.generated[j, p], plan.max_new[j, p] = len(live.tokens), live.row.max_new[0]
            plan.stop_ids[j, p] = live.row.stop_ids[0]
            for field in ("temperature", "top_k", "top_p", "seed"):
                getattr(plan.sampling, field)[j, p] = getattr(live.row.sampling, field)[0]
            if final:
                live.joined = True
                plan.owners[j, p] = self.owner[live.slot]
                self._table_changed = True
                joined.append(live)
                if plan.history is not None:
                    plan.history[j, p, : len(sequence)] = sequence
                self._place(live, plan, j, p, resume)
            plan.cu[j, p + 1] = at
        plan.cu[j, len(segments) + 1 :] = at
        return joined

    def _place(self, live: _Live, plan: ChunkPlan, j: int, p: int, resume: int) -> None:
        """A joining constrained row's automaton laid out, and its state for round j's segment p: the initial one, or
        a recompute's after every token it emitted (its resume token the last)."""
        automaton = live.row.constraint(0)
        if automaton is None:
            return
        k, offset = self.grammar.place(automaton)
        live.placed = True
        local = automaton.initial if resume < 0 else automaton.walk(live.tokens)
        plan.grammar.table[j, p], plan.grammar.state[j, p] = k, offset + local if local >= 0 else grammar_lib.FREE

    def read(self, kind: str, gamma: int, owners: np.ndarray | None, outputs: np.ndarray,
             chunk_owners: np.ndarray | None = None, synced: bool = True, prompt_segments: tuple = ()) -> list[Event]:
        """The events of one operation's transfer: kind "rounds" ([R, rows + P, ...]: each round's rows, then its
        chunk's P segments when chunk_owners [R, P] is given; owners [R, rows]: the request id of each row in each
        round when it was dispatched, -1: none) or "chunk" (a call of its own: [P, ...], chunk_owners [P]);
        chunk_owners: each segment's request whose prompt it ended (-1: none); synced: whether the call left its
        rows' drafter KV up to date (it drafted, or brought held pairs in), so that their full committed pages may
        be cached. A round's rows are read before its chunk's first tokens, which come before the rounds their rows
        join. A recompute's chunk reports nothing. prompt_segments: the chunks' ChunkPlan.prompt_segments, whose
        prompt-logprob rows follow each chunk's P rows (spec_round._prompt_rows)."""
        if kind == "chunk":
            P = chunk_owners.shape[0]
            if prompt_segments:
                self._read_prompt_logprobs(prompt_segments,
                                           [RoundOutput.unpack(outputs[P:], gamma, self.tree_nodes).logprobs[:, 0]])
            return self._read_first_tokens(gamma, chunk_owners, outputs[:P])
        rows = owners.shape[1]
        if prompt_segments:
            P = chunk_owners.shape[1]
            self._read_prompt_logprobs(prompt_segments, [
                RoundOutput.unpack(outputs[j, rows + P:], gamma, self.tree_nodes).logprobs[:, 0]
                for j in range(outputs.shape[0])])
            outputs = outputs[:, : rows + P]
        for r in set(owners.ravel().tolist()):
            live = self.requests.get(r)
            if live is not None and live.slot >= 0 and self.owner[live.slot] == r and live.unread:
                live.unread.popleft()
        events = []
        for j in range(outputs.shape[0]):
            events += self._read_round(gamma, owners[j], outputs[j, :rows], synced)
            if chunk_owners is not None:
                events += self._read_first_tokens(gamma, chunk_owners[j], outputs[j, rows:])
        return events

    def _read_prompt_logprobs(self, segments: tuple, columns: list[np.ndarray]) -> None:
        """Each asking segment's prompt logprobs (round j's chunk position i: columns[j][i], the next token's), kept
        on its request by position until its first token's event carries them; the position after a prompt's last
        (its first token's) is the first token's own report."""
        for j, r, offset, start, take in segments:
            live = self.requests.get(r)
            if live is None or live.prefilled:
                continue
            prompt = int(live.row.lengths[0])
            if live.prompt_logprobs is None:
                live.prompt_logprobs = [None] * prompt
            k = int(live.row.prompt_logprobs[0])
            for t, entry in enumerate(logprobs_lib.unpack(columns[j][offset : offset + take], k)):
                if start + t + 1 < prompt:
                    live.prompt_logprobs[start + t + 1] = entry

    def _read_first_tokens(self, gamma: int, owners: np.ndarray, outputs: np.ndarray) -> list[Event]:
        events = []
        out = RoundOutput.unpack(outputs, gamma, self.tree_nodes)
        for p, r in enumerate(owners.tolist()):
            live = self.requests.get(r)
            if live is None or live.slot < 0 or self.owner[live.slot] != r or live.prefilled:
                continue  # gone, or a recompute (its first token was reported once)
            prompt = live.prompt_logprobs if live.asks("prompt_logprobs") else None
            events.append(self._emitted(live, r, out.tokens[p], bool(out.done[p]), 0, 0, None, None, True,
                                        live.cached_tokens, self._logprobs(live, out, p), prompt))
        return events

    @staticmethod
    def _logprobs(live: _Live, out: RoundOutput, row: int) -> list | None:
        """The logprobs of the tokens `out` emitted in `row`, when live's request asks for them."""
        if not live.asks("logprobs") or out.logprobs is None:
            return None
        return logprobs_lib.unpack(out.logprobs[row, : len(out.tokens[row])], int(live.row.logprobs[0]))

    def _read_round(self, gamma: int, owners: np.ndarray, packed: np.ndarray, synced: bool) -> list[Event]:
        events = []
        speculative = self.speculative
        out = RoundOutput.unpack(packed, gamma, self.tree_nodes)
        if speculative:
            self.policy.observe(gamma, out)
        accepted, done = out.accepted.tolist(), out.done.tolist()
        drafts, choices = (out.drafts.tolist(), out.choices.tolist()) if self.trace and speculative else ((), ())
        traces = list(zip(drafts, choices))
        if traces and out.tree is not None:  # a tree's nodes, choices, parents, path
            traces = list(zip(out.tree[0].tolist(), choices, out.tree[1].tolist(), out.tree[2].tolist()))
        for row, r in enumerate(owners.tolist()):
            live = self.requests.get(r)
            if live is None or live.slot < 0 or self.owner[live.slot] != r:
                continue
            new = out.tokens[row]
            events.append(self._emitted(live, r, new, done[row], accepted[row] if speculative else 0,
                                        (self.tree_nodes or gamma) if speculative and new else 0,
                                        gamma if speculative else None, traces[row] if traces else None, synced,
                                        logprobs=self._logprobs(live, out, row)))
        return events

    def _emitted(self, live: _Live, request_id: int, new: list[int], done: bool, accepted: int, drafted: int, gamma,
                 trace, synced: bool, cached: int = 0, logprobs: list | None = None,
                 prompt_logprobs: list | None = None) -> Event:
        """A read's tokens for `live`: its progress, its full committed pages into the cache (while its drafter is
        up to date: synced), and, when done, its slot and pages free."""
        live.left -= len(new)
        live.length += len(new)
        live.tokens += new
        live.prefilled = True
        if synced and new:
            self._keep(live, live.known(), live.length - 1)
        reason = None
        if done:
            reason = "stop" if new and live.row.is_stop(0, new[-1]) else "length"
            automaton = live.row.constraint(0)
            if automaton is not None and new and new[-1] in automaton.eos:
                new = new[:-1]  # a constrained row's end: its output is the constrained text alone
            self._free_slot(live)  # done on the device already: nothing to release
            del self.requests[request_id]
        return Event(request_id, new, accepted, drafted, done, reason, gamma, trace, cached, logprobs, prompt_logprobs)


def empty_chunk(tokens: int, sequences: int, width: int, stop_width: int, size: int, alone: bool,
                history: int = 0, rounds: int = 1, grammar: bool = False) -> ChunkPlan:
    """Chunks of no sequence (nothing is written, nothing joins) of these shapes, one per round of `rounds`: tokens
    [tokens], segments [sequences], page tables of `width`, stop ids of `stop_width`, slots of a pool of `size`
    (none), histories of `history` tokens (0: none), and the segments' automaton states when `grammar` (all free).
    """
    R, P = rounds, sequences
    settings = SamplingParams(np.zeros((R, P), np.float32), np.zeros((R, P), np.int32), np.ones((R, P), np.float32),
                              np.zeros((R, P, 2), np.uint32))
    return ChunkPlan(np.zeros((R, tokens), np.int32), np.zeros((R, P + 1), np.int32), np.zeros((R, P), np.int32),
                     np.full((R, P, width), -1, np.int32), np.zeros((R, P), bool), np.full((R, P), size, np.int32),
                     np.full((R, P), -1, np.int32), np.zeros((R, P), np.int32), np.ones((R, P), np.int32),
                     np.full((R, P, stop_width), -1, np.int32), settings, np.full((R, P), -1, np.int64), alone,
                     np.zeros((R, P, history), np.int32) if history else None,
                     grammar_lib.Rows(np.zeros((R, P), np.int32), np.full((R, P), grammar_lib.FREE, np.int32))
                     if grammar else None,
                     jax.tree.map(lambda x: np.tile(x, (R,) + (1,) * x.ndim), Penalties.neutral(P)), [])


def live_row(prompt, max_new_tokens, stop_token_ids=(), *, max_len: int, vocab_size: int, stop_width: int,
             constraint=None, **settings) -> Request:
    """One prompt checked as Engine.generate checks it (ValueError naming any bad value), as a one-row request
    whose stop ids are padded to the pool's `stop_width` (more are refused) and whose sampling settings are set
    even when greedy (temperature 0), so that every row of a live pool has the same fields. settings:
    Request.build's (sampling, penalties, logit_bias, logprobs)."""
    stops = list(stop_token_ids) if isinstance(stop_token_ids, (list, tuple)) else stop_token_ids
    if isinstance(stops, list) and len(stops) > stop_width:
        raise ValueError(f"at most {stop_width} stop token ids per request, got {len(stops)}")
    row = Request.build([prompt], max_new_tokens, stops, max_len=max_len, vocab_size=vocab_size,
                        constraints=[constraint], **settings)
    if row.stop_ids.shape[1] > stop_width and np.sum(row.stop_ids[0] >= 0) > stop_width:
        raise ValueError(f"at most {stop_width} stop token ids per request, the constraint's end ids included")
    stop_ids = np.full((1, stop_width), -1, np.int32)
    given = row.stop_ids[0][row.stop_ids[0] >= 0]
    stop_ids[0, : len(given)] = given
    return _with_settings(dataclasses.replace(row, stop_ids=stop_ids))


def request_rows(request: Request, max_len: int) -> list[Request]:
    """A checked request's rows (Engine.request) as the one-row requests a live pool takes, stop ids at the
    request's width, each prompt cut to its own bucket."""
    return [_with_settings(request.take([i], 1, max_len)) for i in range(request.num_rows)]


def _with_settings(row: Request) -> Request:
    """The row with its sampling settings set even when greedy (temperature 0), so that every row of a live pool
    has the same fields."""
    sampling = row.sampling or SamplingParams(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                                              np.zeros((1, 2), np.uint32))
    return dataclasses.replace(row, sampling=sampling)


def row_bucket(rows: int, capacity: int) -> int:
    """The rows a call of `rows` running rows computes: the power of two at or above (at least 1), at most the
    pool's capacity. Buckets at most 2x apart pad a call by less than its running rows, and keep the compiled calls
    to one per power of two up to the capacity (Engine.compile compiles them all)."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, capacity)


def row_buckets(capacity: int) -> list[int]:
    """Every bucket a pool of `capacity` slots can run (`row_bucket`'s values)."""
    return sorted({row_bucket(n, capacity) for n in range(capacity + 1)})


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
    penalties = None
    if any(r.penalties is not None for r in rows):
        penalties = Penalties(*(cat(lambda r, f=f: getattr(r.penalties or Penalties.neutral(1), f)) for f in
                                ("frequency", "presence", "repetition", "bias_ids", "bias")))

    def counts(field):
        none = np.full((1,), -1, np.int32)
        return None if all(getattr(r, field) is None for r in rows) else cat(lambda r: getattr(r, field) if
                                                                            getattr(r, field) is not None else none)

    together = Request(tokens, cat(lambda r: r.lengths), cat(lambda r: r.max_new), cat(lambda r: r.stop_ids),
                       sampling, penalties=penalties, logprobs=counts("logprobs"),
                       prompt_logprobs=counts("prompt_logprobs"))
    return together.take(list(range(len(rows))), num_rows, max_len)
