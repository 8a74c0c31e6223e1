"""The live pool's scheduler: host bookkeeping of requests that arrive and leave while the pool runs, and the
decision of each step as data (`Step`) for a runner to execute (live.py).

A request waits in arrival order until a slot and its pages are free. Its prompt is then prefilled in chunks
(`ChunkPlan`): each call of rounds carries up to `prefill_chunk` prompt tokens, of one or more prompts packed, in
its first round's target forward (a mixed step); a prompt longer than that goes on in the next call's chunk, and
when its last chunk has run, its first token is drawn and its row joins the pool for the next call's rounds. With
no running row, or for an exact engine, a chunk is a call of its own (`ChunkPlan.alone`). `plan` also frees the
slots of aborted requests, resizes the pool to the batch it needs, gives the running rows the pages the next
call may write into, and picks that call's gamma. The pool holds `size` slots, a power of four up to max_batch:
enough for the running and waiting requests, so that a lone request runs rounds of one row, not of max_batch. A
pool that does not `shrink` (Engine.generate's, whose requests all arrive at once) keeps its size to the end,
so its tail compiles no smaller pool.

Pages (page_pool.py): a sequence holds the pages of its prompt's KV as its chunks write it, then of its committed
KV and of every position its dispatched calls may write (a call of R rounds of gamma G writes at most R (G + 1)
positions past the committed ones; nothing past max_len). A prompt is admitted only while the running rows' next
call (at the largest gamma) and its whole prompt and first call fit in the free pages beside them. When the
running rows' next call does not fit, the youngest sequence (running or prefilling) is preempted: its pages are
freed and it waits again, ahead of the others, to be recomputed from its prompt and the tokens it already emitted
(a chunk's resume token: the recompute rebuilds the caches and draws nothing, so a sampled row goes on with its
own random stream). A preemption needs the host to know every token: it happens only when nothing is in flight;
until then the call waits.

Prefix caching (page_pool.py): a sequence admitted first takes the cached pages of its longest cached prefix of
whole pages (at least its last token is computed) and its chunks start after them; a sequence's full pages of
committed KV join the cache as its chunks write them, and as its rounds commit them once its drafter's KV is up to
date (every call that drafts, or that brings a held drafter up to date).

While some running row surely needs another call (more tokens left than the call in flight can emit), the
next call is planned before the one in flight is read, so the device does not idle on the host. While requests
wait for slots, only when every running row needs it: a slot freed by the call in flight is then refilled
before another call runs without it. `read` attributes one operation's transfer to the requests that held its
rows when it was dispatched (the owner snapshots travel with the operation), so a row that finished or was
aborted while the operation was in flight is ignored.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import numpy as np

from eagle3_jax.decoding.page_pool import PagePool, chain_keys, pages_for
from eagle3_jax.decoding.request import Request
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


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """A chunk's prompt tokens as the host lays them out (spec_round.Chunk's fields, numpy), and whose they are."""

    tokens: np.ndarray  # [C] int32
    cu: np.ndarray  # [P + 1] int32
    start: np.ndarray  # [P] int32
    table: np.ndarray  # [P, W] int32
    final: np.ndarray  # [P] bool
    slot: np.ndarray  # [P] int32
    next_token: np.ndarray  # [P] int32
    generated: np.ndarray  # [P] int32
    max_new: np.ndarray  # [P] int32
    stop_ids: np.ndarray  # [P, width] int32
    sampling: SamplingParams  # [P]
    owners: np.ndarray  # [P] int64: the request whose prompt each final segment ends (-1: none)
    alone: bool  # a call of its own (no running row, or an exact engine), not riding in a call of rounds
    history: np.ndarray | None = None  # [P, max_len] int32: a final segment's whole sequence (prompt lookup's)

    @property
    def samples(self) -> bool:
        """Whether some final segment draws its first token (a sampling build then)."""
        return bool(np.any(self.final & (self.next_token < 0) & (self.sampling.temperature > 0)))


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the live pool, in the order the runner executes it."""

    release: tuple[int, ...]  # slots (before the resize) whose aborted rows stop: marked done on the device
    # The pool's new layout: new slot i takes old slot resize[i]; an index >= the old size is a free slot.
    # None: the layout is unchanged. The first step of a pool (no state yet) allocates `size` free slots.
    resize: np.ndarray | None
    size: int  # the pool's slots after the resize
    preempt: tuple[int, ...]  # slots (after the resize) whose preempted rows stop
    rounds: object | None  # the call of rounds to dispatch (gamma_policy.Call), None: none this step
    chunk: ChunkPlan | None  # prompt tokens: in the call of rounds, or (chunk.alone) after it in a call of their own
    sampling: bool  # whether the call's rows (or its chunk's first tokens) include a sampled one: the sampling build
    page_table: np.ndarray | None  # [size, W] every slot's pages, to load before the call; None: unchanged
    owners: np.ndarray  # [size] int64: the request running in each slot (-1: none), the call of rounds' rows


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
    the gamma policy. pages: the engine's page pool (page_pool.PagePool), whose free pages this scheduler hands
    out; width: the page table's columns (kv_cache.table_width); prefill_chunk, prefill_sequences: a chunk's prompt
    tokens and the most prompts it holds; alone: whether every chunk runs in a call of its own (an exact engine's:
    its kernels' results must not depend on a chunk beside them); prefix_caching, with_next: whether sequences
    share cached prefixes, and whether a page's key holds the token after it (page_pool.chain_keys); history:
    whether a chunk carries each final segment's whole sequence (prompt lookup's history, which a cached prefix
    would leave without the tokens no chunk holds); tree_nodes: a draft tree's nodes (its rounds' outputs carry the
    tree: round_output), 0 for a chain; scratch: positions a call's last round writes past the R (G + 1) it may
    commit (a tree's nodes and beams past its depth: Engine.scratch), which its rows' pages must hold too."""

    def __init__(self, max_batch: int, max_len: int, prefill_chunk: int, prefill_sequences: int,
                 rounds_per_call: int, policy: Policy, speculative: bool, pages: PagePool, width: int,
                 max_gamma: int, stop_width: int, shrink: bool = True, trace: bool = False, alone: bool = False,
                 prefix_caching: bool = False, with_next: bool = False, history: bool = False, tree_nodes: int = 0,
                 scratch: int = 0):
        self.max_batch, self.max_len, self.prefill_chunk = max_batch, max_len, prefill_chunk
        self.rounds_per_call, self.policy, self.speculative = rounds_per_call, policy, speculative
        self.pages, self.width, self.max_gamma, self.stop_width = pages, width, max_gamma, stop_width
        self.shrink, self.trace, self.alone = shrink, trace, alone
        # with_next: the cache keys a page with the token after it (an EAGLE-3 drafter's last entry pairs with it)
        self.prefix_caching, self.with_next = prefix_caching, with_next
        self.history = history  # chunks carry a final segment's whole sequence (a proposer's token history)
        self.chunk_sequences = prefill_sequences
        self.tree_nodes, self.scratch = tree_nodes, scratch
        self.size = 0  # the pool's slots (0: no pool yet)
        self.owner = np.zeros((0,), np.int64)  # request id per slot, -1 free
        self.waiting: collections.deque[int] = collections.deque()
        self.requests: dict[int, _Live] = {}
        self.preemptions = 0  # sequences preempted so far
        self.cached_tokens = 0  # prompt tokens first admissions took from the prefix cache so far
        self._release: list[int] = []  # slots of aborted rows, for the next step's `release`
        self._admitted = 0  # admissions so far (_Live.order)
        self._table_changed = True

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
            rows += [self.requests[int(r)].row for r in chunk.owners if r >= 0]
        rows = rows or [next(iter(self.requests.values())).row]
        return stack(rows, len(rows), self.max_len)

    def plan(self, rounds_in_flight: int, idle: bool | None = None) -> Step:
        """The next step. rounds_in_flight: calls dispatched and not read yet (at most one more is planned then,
        and only when no running row can finish in the one in flight and nothing waits); idle: whether nothing at
        all is in flight (None: no call in flight), which a preemption needs."""
        idle = rounds_in_flight == 0 if idle is None else idle
        release, self._release = tuple(self._release), []
        resize, size = self._resize(rounds_in_flight)
        preempted: list[int] = []
        rounds = None
        busy = self._running()
        # Tokens each running row may still emit once what is in flight arrives (its first token).
        left = np.array([self.requests[r].left - (not self.requests[r].prefilled) for r in busy])
        if rounds_in_flight == 0 and np.any(left > 0):
            rounds = self._choose()
        elif rounds_in_flight == 1 and busy and self.policy.may_choose_ahead():
            ahead = self._choose()
            need = left > self.rounds_per_call * (ahead.gamma + 1)
            if need.all() if self.waiting else need.any():
                rounds = ahead
        # The call's pages; when the running rows' are not free, the call waits for what is in flight to be read, or
        # preempts when nothing is.
        if rounds is not None and not self._grow(self.rounds_per_call * (rounds.gamma + 1) + self.scratch, idle,
                                                 preempted):
            rounds = None
        busy = self._running()  # the call's rows: not the preempted ones, nor those this step's chunk joins
        # A chunk rides in the call of rounds; with no row running (or for an exact engine) it is a call of its own.
        chunk = self._chunk(alone=self.alone or rounds is None) if rounds is not None or not busy or self.alone \
            else None
        owners = np.full((self.size,), -1, np.int64)
        if rounds is not None:
            self.policy.dispatched(rounds)
            for r in busy:
                self.requests[r].unread.append(self.rounds_per_call * (rounds.gamma + 1))
                owners[self.requests[r].slot] = r
        table = None
        if rounds is not None and self._table_changed:
            table, self._table_changed = self.page_table(), False
        sampling = (rounds is not None and self.samples()) or (chunk is not None and chunk.samples)
        return Step(release, resize, size, tuple(preempted), rounds, chunk, sampling, table, owners)

    def page_table(self) -> np.ndarray:
        """[size, W] every running slot's pages (-1 past them, and for a slot with no running row)."""
        table = np.full((self.size, self.width), -1, np.int32)
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

    def _choose(self):
        return self.policy.choose(float(np.mean([self.requests[r].length for r in self._running()])))

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

    def _chunk(self, alone: bool) -> ChunkPlan | None:
        """The next chunk: up to prefill_chunk tokens of the prefilling sequences (oldest first), then of waiting
        ones admitted into free slots in line order. Pages: the running rows' next call (at the largest gamma) is
        kept free first; a prefilling sequence takes its segment's pages beside it; a waiting one is admitted only
        while its whole prompt and first call fit beside that and every prefilling sequence's rest, so a sequence
        admitted can always finish its prompt. None when no prompt token can go."""
        tail = self.rounds_per_call * (self.max_gamma + 1) + self.scratch
        size = self.pages.page_size
        reserved = sum(max(self._need(self.requests[r], tail), 0) for r in self._running())
        prefilling = sorted((self.requests[int(r)] for r in self.owner if r >= 0 and not self.requests[int(r)].joined),
                            key=lambda live: live.order)
        budget, segments = self.prefill_chunk, []
        for live in prefilling:
            if budget == 0 or len(segments) == self.chunk_sequences:
                break
            sequence, _ = live.sequence()
            take = min(len(sequence) - live.computed, budget)
            more = pages_for(live.computed + take, size) - len(live.pages)
            if reserved + more > self.pages.free:
                continue
            live.pages += self.pages.take(more)
            segments.append((live, take))
            budget -= take
        # What the prefilling sequences have yet to take, for their prompts and first calls.
        reserved += sum(max(pages_for(min(len(live.sequence()[0]) + tail, self.max_len), size) - len(live.pages), 0)
                        for live in prefilling)
        free_slots = list(np.flatnonzero(self.owner < 0))
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
            taken = pages_for(start + take, size) - len(cached)
            reserved += whole - taken
            slot = int(free_slots.pop(0))
            request_id = self.waiting.popleft()
            self.owner[slot], live.slot = request_id, slot
            live.order, self._admitted = self._admitted, self._admitted + 1
            live.pages, live.computed = cached + self.pages.take(taken), start
            if not live.counted:
                live.counted, live.cached_tokens = True, start
                self.cached_tokens += start
            segments.append((live, take))
            budget -= take
        if not segments:
            return None
        return self._lay_out(segments, alone)

    def _cached_prefix(self, live: _Live, sequence: np.ndarray) -> list[int]:
        """The cached pages of the longest prefix of whole pages of `sequence` (held now), leaving at least its last
        token to compute (its logits, its drafter output)."""
        if not self.prefix_caching:
            return []
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

    def _lay_out(self, segments: list, alone: bool) -> ChunkPlan:
        """The chunk's arrays for these (sequence, tokens taken) segments, each sequence's progress advanced; a
        sequence whose last chunk this is joins the pool (its row runs from the next call)."""
        plan = empty_chunk(self.prefill_chunk, self.chunk_sequences, self.width, self.stop_width, self.size, alone,
                           self.max_len if self.history else 0)
        tokens, cu, start, table, final, slot, next_token = (plan.tokens, plan.cu, plan.start, plan.table, plan.final,
                                                              plan.slot, plan.next_token)
        generated, max_new, stop_ids, owners = plan.generated, plan.max_new, plan.stop_ids, plan.owners
        settings = [getattr(plan.sampling, f) for f in ("temperature", "top_k", "top_p", "seed")]
        at = 0
        for p, (live, take) in enumerate(segments):
            sequence, resume = live.sequence()
            tokens[at : at + take] = sequence[live.computed : live.computed + take]
            start[p], slot[p] = live.computed, live.slot
            table[p, : len(live.pages)] = live.pages
            live.computed += take
            self._keep(live, sequence, live.computed)
            at += take
            final[p] = live.computed == len(sequence)
            next_token[p] = resume if final[p] else sequence[live.computed]
            generated[p], max_new[p] = len(live.tokens), live.row.max_new[0]
            stop_ids[p] = live.row.stop_ids[0]
            for field, values in zip(("temperature", "top_k", "top_p", "seed"), settings):
                values[p] = getattr(live.row.sampling, field)[0]
            if final[p]:
                live.joined = True
                owners[p] = self.owner[live.slot]
                self._table_changed = True
                if plan.history is not None:
                    plan.history[p, : len(sequence)] = sequence
            cu[p + 1] = at
        cu[len(segments) + 1 :] = at
        return plan

    def read(self, kind: str, gamma: int, owners: np.ndarray, outputs: np.ndarray,
             chunk_owners: np.ndarray | None = None, synced: bool = True) -> list[Event]:
        """The events of one operation's transfer: kind "rounds" ([R, size, ...], then a chunk's [P, ...] rows when
        chunk_owners is given) or "chunk" ([P, ...]); owners: the request id of each round row when it was
        dispatched (-1: none), chunk_owners: each chunk segment's whose prompt it ended (-1: none); synced: whether
        the call left its rows' drafter KV up to date (it drafted, or brought held pairs in), so that their full
        committed pages may be cached. A recompute's chunk reports nothing."""
        events = []
        if chunk_owners is not None:
            P = chunk_owners.shape[0]
            rounds, chunk = (outputs[:-P].reshape(-1, len(owners), outputs.shape[-1]), outputs[-P:]) \
                if kind == "rounds" else (None, outputs)
        else:
            rounds, chunk = outputs, None
        if rounds is not None:
            events += self._read_rounds(gamma, owners, rounds, synced)
        if chunk is not None:
            events += self._read_first_tokens(gamma, chunk_owners, chunk)
        return events

    def _read_first_tokens(self, gamma: int, owners: np.ndarray, outputs: np.ndarray) -> list[Event]:
        events = []
        out = RoundOutput.unpack(outputs, gamma, self.tree_nodes)
        for p, r in enumerate(owners.tolist()):
            live = self.requests.get(r)
            if live is None or live.slot < 0 or self.owner[live.slot] != r or live.prefilled:
                continue  # gone, or a recompute (its first token was reported once)
            events.append(self._emitted(live, r, out.tokens[p], bool(out.done[p]), 0, 0, None, None, True,
                                        live.cached_tokens))
        return events

    def _read_rounds(self, gamma: int, owners: np.ndarray, outputs: np.ndarray, synced: bool) -> list[Event]:
        events = []
        speculative = self.speculative
        for r in set(owners.tolist()):
            live = self.requests.get(r)
            if live is not None and live.slot >= 0 and self.owner[live.slot] == r and live.unread:
                live.unread.popleft()
        for packed in list(outputs):
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
                                            gamma if speculative else None,
                                            traces[row] if traces else None, synced))
        return events

    def _emitted(self, live: _Live, request_id: int, new: list[int], done: bool, accepted: int, drafted: int, gamma,
                 trace, synced: bool, cached: int = 0) -> Event:
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
            self._free_slot(live)  # done on the device already: nothing to release
            del self.requests[request_id]
        return Event(request_id, new, accepted, drafted, done, reason, gamma, trace, cached)


def empty_chunk(tokens: int, sequences: int, width: int, stop_width: int, size: int, alone: bool,
                history: int = 0) -> ChunkPlan:
    """A chunk of no sequence (nothing is written, nothing joins) of these shapes: tokens [tokens], segments
    [sequences], page tables of `width`, stop ids of `stop_width`, slots of a pool of `size` (none), and histories of
    `history` tokens (0: none)."""
    P = sequences
    settings = SamplingParams(np.zeros((P,), np.float32), np.zeros((P,), np.int32), np.ones((P,), np.float32),
                              np.zeros((P, 2), np.uint32))
    return ChunkPlan(np.zeros((tokens,), np.int32), np.zeros((P + 1,), np.int32), np.zeros((P,), np.int32),
                     np.full((P, width), -1, np.int32), np.zeros((P,), bool), np.full((P,), size, np.int32),
                     np.full((P,), -1, np.int32), np.zeros((P,), np.int32), np.ones((P,), np.int32),
                     np.full((P, stop_width), -1, np.int32), settings, np.full((P,), -1, np.int64), alone,
                     np.zeros((P, history), np.int32) if history else None)


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
