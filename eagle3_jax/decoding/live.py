"""A live pool: an Engine's slots serving requests that arrive while it runs.

`LivePool.submit` checks a prompt and its settings (ValueError before any device work) and queues it; a
thread of the pool's own runs the scheduler (live_plan.py), executes each step it decides (allocate the pool's
rows, stop aborted and preempted rows, load the page table, dispatch a call of rounds over its row bucket with the
prompt tokens its rounds carry, or, for an exact engine, a chunk in a call of its own) and reads the operations'
transfers in the order they were dispatched, handing each request's tokens to its callback as its rounds complete.
`abort` frees a request's slot and pages at the next step. Callers never wait on the scheduler: submit and abort
only queue, under a lock the scheduler holds for no device work. The pool holds its engine's KV pages
(page_pool.py) from construction to `close`: one pool runs on an engine at a time.

Requests of different settings share the pool: every row carries its own sampling settings (greedy rows with
temperature 0) and stop ids padded to one width (`stop_width`; a request with more is refused). A call of
rounds runs the engine's greedy build when every row it runs is greedy, else the sampling build of those rows'
settings (sampling.filter_for); the two read the same state. On a tensor-parallel mesh every call runs
the sampling build (the radix filter there), whose sharded steps carry the rows' settings. A call with rows that have
penalties or ask for logprobs runs that build's variant with them (Step.penalties, Step.logprobs). Under
num_draft_tokens="auto" one gamma policy follows the pool's acceptance, with each call's round costs at its row
bucket, with or without prompt tokens.

`Engine.generate`, `stream` and `as_completed` run on a pool of their own (`Engine._events`): every prompt of the
request submitted at once (`submit_all`), the engine's max_batch slots, the request's stop width, and the rounds'
traces when asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable

import jax
import numpy as np

from eagle3_jax.decoding import gamma_policy, grammar, slots, spec_round
from eagle3_jax.decoding.live_plan import Event, LiveScheduler, Step, live_row
from eagle3_jax.decoding.request import Request

STOP_WIDTH = 8  # stop ids a live request may have: the pool's rows all carry this many (padded with -1)
THREAD_STACK_BYTES = 256 * 2**20  # the pool thread's stack (reserved address space, committed only as used)

jit_release = jax.jit(slots.release, donate_argnames=("rows",))
jit_take = jax.jit(slots.take)
jit_put = jax.jit(slots.put, donate_argnames=("rows",))


class LivePool:
    """An engine's pool serving requests submitted at any time from any thread (see the module docstring).
    max_batch: the pool's slots (None: the engine's); trace: whether events carry each speculative round's drafts
    and target choices; events: a list the pool appends its device operations to (Engine.device_events' kinds),
    or None to record nothing (a long-lived pool, the server's, would otherwise grow with every call)."""

    def __init__(self, engine, stop_width: int = STOP_WIDTH, *, max_batch: int | None = None, trace: bool = False,
                 events: list | None = None):
        if not isinstance(stop_width, int) or stop_width < 1:
            raise ValueError(f"stop_width must be a positive int, got {stop_width!r}")
        self.engine, self.stop_width = engine, stop_width
        self._events = events
        # On a mesh the steps' shard_maps fix which state fields exist per build, and only the sampling build's
        # carry every row's settings: its calls run every row there, greedy rows on its argmax path.
        self._always_sampling = engine.spec.tp is not None
        if engine.auto:
            # The policy lives in this pool's scheduler: it reaches the pool weakly, so a closed pool (and the engine
            # it holds, with its pages) is freed when dropped, not when the garbage collector next runs.
            me = weakref.ref(self)
            policy = gamma_policy.Auto(engine.num_draft_tokens, lambda length, rows, mixed: engine.round_costs(
                rows, length, me()._cost_template(), mixed), holds=engine.holds_pairs)
        else:
            policy = gamma_policy.Fixed(engine.draft_depth)
        self._pages = engine.page_pool
        self._pages.acquire()
        self._scheduler = LiveScheduler(max_batch or engine.max_batch, engine.max_len, engine.prefill_chunk,
                                        engine.prefill_sequences, engine.rounds_per_call, policy,
                                        engine.drafter is not None, self._pages,
                                        engine.table_width, engine.draft_depth, stop_width, trace,
                                        alone=engine.spec.exact, prefix_caching=engine.prefix_caching,
                                        with_next=engine.holds_pairs, history=engine.keeps_history,
                                        tree_nodes=engine.tree.nodes if engine.tree else 0, scratch=engine.scratch)
        self._rows = None  # the slots' rows on the device (spec_round.split_pages), None before the first step
        self._grammar_version = 0  # the layout of the constrained rows' automata the rows hold (grammar.Registry)
        # (kind, packed, gamma, owners, chunk owners or None, whether its rows' drafters are up to date after it,
        # the chunk's prompt segments) dispatched, unread
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", id, row, callback) or ("abort", id), in call order
        self._callbacks: dict[int, Callable[[Event], None]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self.draft_tokens = self.accepted_tokens = 0
        # XLA compiles the steps on this thread, and its compiler may recurse deeply: a large stack
        old = threading.stack_size(THREAD_STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, name="eagle3-jax-live-pool", daemon=True)
            self._thread.start()
        except BaseException:
            self._pages.release()
            raise
        finally:
            threading.stack_size(old)

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self._scheduler.running

    @property
    def waiting(self) -> int:
        """Requests queued for a slot (submitted ones the scheduler has not taken yet included)."""
        return len(self._scheduler.waiting) + sum(1 for item in list(self._inbox) if item[0] == "add")

    def check(self, prompt, max_new_tokens, stop_token_ids=(), *, structured=None, **settings) -> Request:
        """The one-row request `submit` queues for these arguments (live_plan.live_row; settings: Engine.generate's
        sampling, penalties, logit_bias and logprobs keywords), refused (ValueError) where the engine cannot honour
        it (Engine.check_outputs); structured: an eagle3_jax.Structured, compiled here (Engine.constraint: cached by
        its text)."""
        constraint = None if structured is None else self.engine.constraint(structured)
        row = live_row(prompt, max_new_tokens, stop_token_ids, max_len=self.engine.max_len,
                       vocab_size=self.engine.target.config.vocab_size, stop_width=self.stop_width,
                       constraint=constraint, **settings)
        self.engine.check_outputs(row)
        return row

    def submit(self, row: Request, on_event: Callable[[Event], None]) -> int:
        """Queues a request `check` built; returns its id. on_event(live_plan.Event) is called on the pool's
        thread for each chunk of tokens, the last with finished=True (finish_reason "stop", "length", "abort",
        or "error" when the pool failed)."""
        return self.submit_all([row], on_event)[0]

    def submit_all(self, rows: list[Request], on_event: Callable[[Event], None]) -> list[int]:
        """Queues one-row requests together (the scheduler takes them in one step, in order); their ids."""
        with self._lock:
            if self._stopping or self.error is not None:
                raise RuntimeError("the live pool is closed")
            ids = [next(self._ids) for _ in rows]
            self._inbox += [("add", request_id, row, on_event) for request_id, row in zip(ids, rows)]
            self._lock.notify()
        return ids

    def abort(self, request_id: int) -> None:
        """Stops a request (waiting or running) at the next step; its callback gets finish_reason "abort".
        Nothing happens for a request that already finished."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    def close(self) -> None:
        """Aborts every request left and stops the pool's thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join()

    def _cost_template(self) -> Request:
        """The round costs' build: the sampling one of the running rows' settings when one samples, else greedy."""
        if self._scheduler.samples():
            return self._scheduler.busy_settings()
        return self.engine.greedy_template()

    def _take_inbox(self) -> list[Event]:
        events = []
        for item in self._inbox:
            if item[0] == "add":
                _, request_id, row, callback = item
                self._callbacks[request_id] = callback
                self._scheduler.add(request_id, row)
            else:
                event = self._scheduler.abort(item[1])
                if event is not None:
                    events.append(event)
        self._inbox.clear()
        return events

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._scheduler.close()  # every page back to the engine, whatever ended the pool
            if self.error is not None:
                self._pages.forget()  # the failed operation may have planned pages it never wrote
            self._pages.release()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    events = self._take_inbox()
                    while not (self._stopping or self._queue or self._scheduler.requests or events):
                        self._lock.wait()
                        events = self._take_inbox()
                    stopping = self._stopping
                if stopping:
                    events += [e for r in list(self._scheduler.requests) if (e := self._scheduler.abort(r))]
                self._deliver(events)
                if stopping:
                    return
                if not self._scheduler.requests:  # calls dispatched ahead for rows that have all finished
                    self._queue.clear()
                    continue
                in_flight = self._rounds_in_flight()
                self._execute(self._scheduler.plan(in_flight, idle=not self._queue))
                if self._rounds_in_flight() == 0 and self._queue:
                    # a chunk's call of its own: the rows it joins need not wait for its read to run their rounds
                    self._execute(self._scheduler.plan(0, idle=False))
                if in_flight == 0 and self._rounds_in_flight() == 1:
                    # the call just dispatched is all in flight: the next may go ahead of reading it (the device
                    # then does not idle on the host), as the scheduler decides
                    self._execute(self._scheduler.plan(1, idle=False))
                if not self._queue:  # running requests, and nothing planned for them: they would never finish
                    raise RuntimeError("the live pool's scheduler planned nothing for its running requests")
                kind, packed, gamma, owners, chunk_owners, synced, prompt_segments = self._queue.popleft()
                self._record("transfer", tuple(packed.shape))
                self._deliver(self._scheduler.read(kind, gamma, owners, self.engine.steps.fetch(packed),
                                                   chunk_owners, synced, prompt_segments))
        except BaseException as e:  # a device or compiler failure: every request ends, the pool refuses more
            with self._lock:
                self.error = e
                self._take_inbox()
            self._deliver([Event(r, [], 0, 0, True, "error") for r in list(self._callbacks)])

    def _record(self, kind: str, shape: tuple[int, ...]) -> None:
        if self._events is not None:
            self._events.append((kind, shape))

    def _rounds_in_flight(self) -> int:
        return sum(entry[0] == "rounds" for entry in self._queue)

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            self.draft_tokens += event.drafted
            self.accepted_tokens += event.accepted
            callback = self._callbacks.get(event.request)
            if event.finished:
                self._callbacks.pop(event.request, None)
            if callback is not None:
                callback(event)

    @property
    def preemptions(self) -> int:
        """Sequences this pool preempted (their pages freed, recomputed later)."""
        return self._scheduler.preemptions

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens this pool's admissions served from the prefix cache."""
        return self._scheduler.cached_tokens

    def _execute(self, step: Step) -> None:
        engine, scheduler, steps, pages = self.engine, self._scheduler, self.engine.steps, self._pages
        params = (engine.target.params, engine.draft_params)
        if step.allocate:
            self._record("allocate", (step.allocate,))
            self._rows = steps.empty(engine.spec, step.allocate, engine.table_width, self.stop_width,
                                     engine.target.params["embed"].dtype)
        stopped = step.release + step.preempt
        if stopped:  # padded to the pool's slots (past them: dropped), so that one compilation serves every count
            index = np.full((scheduler.capacity,), scheduler.capacity, np.int32)
            index[: len(stopped)] = stopped
            self._rows = jit_release(self._rows, steps.put(index))
        if step.page_table is not None:
            self._rows = dataclasses.replace(self._rows, page_table=steps.put(step.page_table))
        if scheduler.grammar.version != self._grammar_version:  # the constrained rows' automata changed
            self._rows = grammar.installed(self._rows, scheduler.grammar, steps.put)
            self._grammar_version = scheduler.grammar.version
        chunk = step.chunk
        sampled = step.sampling or self._always_sampling
        build = engine.build_for(scheduler.busy_settings(chunk)) if sampled else engine.spec
        build = dataclasses.replace(build, penalties=step.penalties, logprobs=step.logprobs)
        if step.rounds is not None:
            mixed = chunk is not None and not chunk.alone
            spec = dataclasses.replace(build, gamma=step.rounds.gamma, flush=step.rounds.flush,
                                       prompt_logprobs=mixed and bool(chunk.prompt_segments))
            width = step.owners.shape[1]
            self._record("call", (engine.rounds_per_call, width, chunk.prompt_tokens if mixed else 0))
            index = None if step.rows is None else steps.put(step.rows)
            on_device = steps.put(device_chunks(chunk, step.rows, scheduler.capacity)) if mixed else None
            rows = self._rows if index is None else jit_take(self._rows, index)
            state, packed = steps.rounds(*params, spec_round.with_pages(rows, pages.arrays), on_device, spec=spec,
                                         num_rounds=engine.rounds_per_call)
            rows, pages.arrays = spec_round.split_pages(state)
            self._rows = rows if index is None else jit_put(self._rows, index, rows)
            synced = step.rounds.gamma > 0 or step.rounds.flush or not engine.holds_pairs
            self._queue.append(("rounds", packed, step.rounds.gamma, step.owners, chunk.owners if mixed else None,
                                synced, chunk.prompt_segments if mixed else ()))
        if chunk is not None and chunk.alone:
            self._record("prefill", (chunk.prompt_tokens,))
            state = spec_round.with_pages(self._rows, pages.arrays)
            on_device = steps.put(jax.tree.map(lambda x: x[0], device_chunks(chunk)))
            spec = engine.prefill_build(build, prompt_logprobs=bool(chunk.prompt_segments))
            state, packed = steps.prefill(*params, state, on_device, spec=spec)
            self._rows, pages.arrays = spec_round.split_pages(state)
            self._queue.append(("chunk", packed, engine.draft_depth, None, chunk.owners[0], True,
                                chunk.prompt_segments))


def device_chunks(chunk, rows: np.ndarray | None = None, capacity: int = 0) -> spec_round.Chunk:
    """A chunk plan's arrays as spec_round.Chunk takes them (host arrays, for the steps' put), its slots turned into
    positions in the call's `rows` (None: every slot, in order; a slot of none, the pool's capacity, past them)."""
    slot = chunk.slot
    if rows is not None:
        position = np.full((capacity + 1,), len(rows), np.int32)
        position[rows] = np.arange(len(rows), dtype=np.int32)
        slot = position[np.minimum(slot, capacity)]
    return spec_round.Chunk(chunk.tokens, chunk.cu, chunk.start, chunk.table, chunk.final, slot, chunk.next_token,
                            chunk.generated, chunk.max_new, chunk.stop_ids, chunk.sampling, chunk.history,
                            chunk.penalties, chunk.grammar)
