"""The live pool: requests submitted while it runs join at the next admission and give their tokens alone
(greedy, float32; sampled with a seed), aborts free their slot, and rows of different settings share it."""

import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import eagle3_jax
from eagle3_jax.decoding import gamma_policy
from eagle3_jax.decoding.live import LivePool
from eagle3_jax.decoding.live_plan import LiveScheduler, live_row, row_bucket, row_buckets
from eagle3_jax.decoding.page_pool import PagePool

import spec_worlds as worlds

MAX_LEN = 64


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    _, target = worlds.save_target("random", root / "target", layers=4)
    _, _, drafter = worlds.save_drafter("random", root / "drafter", target)
    return target, drafter


class Collector:
    """A request's events, gathered on the pool's thread."""

    def __init__(self):
        self.events, self.done, self.first = [], threading.Event(), threading.Event()

    def __call__(self, event):
        self.events.append(event)
        self.first.set()
        if event.finished:
            self.done.set()

    @property
    def tokens(self):
        return sum((e.tokens for e in self.events), [])

    def wait(self):
        assert self.done.wait(120), "the request did not finish"
        return self.events[-1].finish_reason


PROMPTS = [[3, 17, 5], [40, 2, 9, 11, 30, 7], [1] * 20, [8, 8], [44, 12, 19, 27]]


def test_requests_submitted_while_it_runs_equal_their_outputs_alone(world):
    """Two requests, then three more once the pool runs: each equals its output alone. The pool, given no events
    list (as the server's), keeps none: a long-lived pool's list would grow with every call."""
    target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=MAX_LEN, max_batch=4)
    alone = eagle3_jax.Engine(target, max_len=MAX_LEN)
    expected = [alone.generate([p], 12 + 3 * i)[0].token_ids for i, p in enumerate(PROMPTS)]
    pool = LivePool(engine)
    try:
        first = [Collector() for _ in PROMPTS[:2]]
        for i, c in enumerate(first):
            pool.submit(pool.check(PROMPTS[i], 12 + 3 * i), c)
        assert first[0].first.wait(120)  # the pool runs: the rest join it
        later = [Collector() for _ in PROMPTS[2:]]
        for i, c in enumerate(later, start=2):
            pool.submit(pool.check(PROMPTS[i], 12 + 3 * i), c)
        for c, want in zip(first + later, expected):
            assert c.wait() == "length" and c.tokens == want
            assert sum(e.drafted for e in c.events) >= sum(e.accepted for e in c.events)
        assert pool.running == 0 and pool.waiting == 0
        assert pool.draft_tokens > 0 and pool.draft_tokens >= pool.accepted_tokens
        assert pool._events is None
    finally:
        pool.close()


def test_prompt_lookup_under_auto_gamma_through_the_live_pool(world):
    """The second proposer through the live pool, under "auto" (no held pairs): each request's tokens are its
    spec-off tokens alone, on prompts that repeat themselves (lookup proposes) and one that does not."""
    target, _ = world
    engine = eagle3_jax.Engine(target, eagle3_jax.PromptLookup(max_ngram=3), num_draft_tokens="auto",
                               max_draft_tokens=3, max_len=MAX_LEN, max_batch=4,
                               round_costs=lambda batch, length: [1.0, 1.1, 1.2, 1.3])
    assert not engine.holds_pairs
    alone = eagle3_jax.Engine(target, max_len=MAX_LEN)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 1, 9, 1, 9, 1, 9], PROMPTS[1]]
    expected = [alone.generate([p], 16)[0].token_ids for p in prompts]
    pool = LivePool(engine)
    try:
        collectors = [Collector() for _ in prompts]
        for p, c in zip(prompts, collectors):
            pool.submit(pool.check(p, 16), c)
        for c, want in zip(collectors, expected):
            assert c.wait() == "length" and c.tokens == want
        assert pool.draft_tokens > 0
    finally:
        pool.close()


def test_abort_frees_the_slot_at_once_and_settings_share_the_pool(world):
    target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=MAX_LEN, max_batch=1)
    # The outputs alone first: a pool holds its engine's pages, so the engine runs nothing else meanwhile.
    (want,) = engine.generate([PROMPTS[1]], 10, temperature=0.9, top_p=0.8, seed=7)
    (plain,) = engine.generate([PROMPTS[3]], 10)
    pool = LivePool(engine)
    try:
        with pytest.raises(RuntimeError, match="the engine's KV pages are in use by another pool"):
            engine.generate([PROMPTS[3]], 10)
        long = Collector()
        long_id = pool.submit(pool.check(PROMPTS[0], 60), long)
        assert long.first.wait(120)
        seeded = Collector()  # waits for the one slot, which only the abort frees before 60 tokens
        pool.submit(pool.check(PROMPTS[1], 10, temperature=0.9, top_p=0.8, seed=7), seeded)
        pool.abort(long_id)
        assert long.wait() == "abort" and len(long.tokens) < 60
        seeded.wait()
        assert seeded.tokens == want.token_ids
        pool.abort(long_id)  # already gone: nothing happens
        stopped = Collector()  # a greedy row after a sampled one, with a stop id from its own output
        pool.submit(pool.check(PROMPTS[3], 10, [plain.token_ids[4]]), stopped)
        assert stopped.wait() == "stop" and stopped.tokens == plain.token_ids[: plain.token_ids.index(
            plain.token_ids[4]) + 1]
        assert pool.running == 0
    finally:
        pool.close()
    assert engine.page_pool.free == engine.page_pool.num_pages


def test_auto_gamma_runs_one_policy_over_the_pool(world):
    """num_draft_tokens="auto" (costs given): each call's gamma follows the pool's acceptance; outputs unchanged."""
    target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_len=MAX_LEN, max_batch=2,
                               round_costs=lambda batch, length: [1.0, 1.05, 1.1, 1.15])
    alone = eagle3_jax.Engine(target, max_len=MAX_LEN)
    pool = LivePool(engine)
    try:
        runs = [Collector() for _ in PROMPTS[:3]]
        for p, c in zip(PROMPTS, runs):
            pool.submit(pool.check(p, 20), c)
        for p, c in zip(PROMPTS, runs):
            c.wait()
            assert c.tokens == alone.generate([p], 20)[0].token_ids
        assert pool._scheduler.policy.rounds_seen > 0
    finally:
        pool.close()


def test_bad_requests_are_refused_before_they_queue(world):
    target, _ = world
    pool = LivePool(eagle3_jax.Engine(target, max_len=MAX_LEN, max_batch=2), stop_width=2)
    try:
        with pytest.raises(ValueError, match="at most 2 stop token ids per request, got 3"):
            pool.check([1, 2], 4, [1, 2, 3])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            pool.check([1, 999], 4)
        with pytest.raises(ValueError, match="must be shorter than max_len=64"):
            pool.check([1] * 64, 4)
        with pytest.raises(ValueError, match="stop_width must be a positive int"):
            LivePool(pool.engine, stop_width=0)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(pool.check([1], 1), queue.Queue().put)


def test_row_buckets_are_powers_of_two_up_to_the_capacity():
    assert [row_bucket(n, 20) for n in (0, 1, 2, 3, 4, 5, 9, 16, 17, 20)] == [1, 1, 2, 4, 4, 8, 16, 16, 20, 20]
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20] and row_buckets(1) == [1] and row_buckets(8) == [1, 2, 4, 8]


def packed(gamma, rows):
    """Round outputs as the device packs them (round_output.py): per row (tokens, accepted, done)."""
    out = np.zeros((len(rows), 2 * gamma + 6), np.int32)
    for i, (tokens, accepted, done) in enumerate(rows):
        out[i, : len(tokens)] = tokens
        out[i, 2 * gamma + 1 : 2 * gamma + 4] = len(tokens), accepted, done
    return out


def call_output(step, rounds, first=None, gamma=1):
    """A call's transfer as the device returns it ([R, rows + P, width]): `rounds` gives each round's rows (a list of
    (tokens, accepted, done) per row, or None: nothing emitted, free rows done), `first` each round's chunk rows
    (None: nothing)."""
    R, width = step.owners.shape
    P = step.chunk.owners.shape[1] if step.chunk is not None and not step.chunk.alone else 0
    out = []
    for j in range(R):
        rows = (rounds[j] if rounds and rounds[j] is not None else [([], 0, int(o < 0)) for o in step.owners[j]])
        chunk = (first[j] if first and first[j] is not None else [([], 0, 0)] * P)
        out.append(np.concatenate([packed(gamma, rows), packed(gamma, chunk)]) if P else packed(gamma, rows))
    return np.stack(out)


def new_scheduler(capacity: int, pages: int = 64, chunk: int = 64, **options) -> LiveScheduler:
    """A scheduler of max_len 64, 2 rounds a call of gamma 1, chunks of `chunk` prompt tokens of up to 4 prompts,
    over `pages` pages of 8."""
    return LiveScheduler(capacity=capacity, max_len=64, prefill_chunk=chunk, prefill_sequences=min(4, capacity),
                         rounds_per_call=2, policy=gamma_policy.Fixed(1), speculative=True,
                         pages=PagePool(pages, 8, lambda: None), width=9, max_gamma=1, stop_width=4, **options)


def row(n, budget, stops=(9,)):
    return live_row(list(range(1, n + 1)), budget, list(stops), max_len=64, vocab_size=48, stop_width=4)


def segments(chunk, j=0) -> list[tuple]:
    """Round j's segments of a chunk plan: (tokens, start, slot, final, next token) each."""
    cu = chunk.cu[j]
    return [(chunk.tokens[j, cu[p]:cu[p + 1]].tolist(), int(chunk.start[j, p]), int(chunk.slot[j, p]),
             bool(chunk.final[j, p]), int(chunk.next_token[j, p])) for p in range(chunk.start.shape[1])
            if cu[p + 1] > cu[p]]


def test_each_step_is_decided_as_data():
    """The allocation, chunks, joins mid-call, release and the call of rounds over its row bucket, as the
    scheduler decides them, without a device."""
    scheduler = new_scheduler(4)
    for i in range(3):
        scheduler.add(i, row(3, 20))
    step = scheduler.plan(rounds_in_flight=0)
    assert step.allocate == 4 and step.release == () and not step.sampling  # the pool's 4 slots, allocated once
    # no row runs yet: a call whose first round carries the three prompts packed, each ending its prompt; their
    # rows join when that round ends and run the call's second round (a bucket of 4 rows: every slot)
    assert step.rounds == gamma_policy.Call(1) and not step.chunk.alone and step.rows is None
    assert segments(step.chunk) == [([1, 2, 3], 0, s, True, -1) for s in range(3)] and segments(step.chunk, 1) == []
    assert step.chunk.owners[0].tolist() == [0, 1, 2, -1] and step.chunk.prompt_tokens == 9
    assert step.owners.tolist() == [[-1] * 4, [0, 1, 2, -1]] and scheduler.running == 3
    # the next call goes ahead of reading this one: every row surely needs it (19 tokens left, a call emits <= 4)
    ahead = scheduler.plan(rounds_in_flight=1)
    assert ahead.allocate == 0 and ahead.rounds == gamma_policy.Call(1) and ahead.chunk is None
    assert ahead.owners.tolist() == [[0, 1, 2, -1]] * 2
    # the first call's first tokens (its chunk's rows in round 0) come before the rounds their rows then ran
    events = scheduler.read("rounds", 1, step.owners, call_output(
        step, [None, [([6, 7], 1, 0), ([6, 9], 1, 1), ([6], 0, 0), ([], 0, 1)]], [[([5], 0, 0)] * 3 + [([], 0, 0)],
                                                                                   None]), step.chunk.owners)
    assert [(e.request, e.tokens, e.accepted, e.gamma, e.finish_reason) for e in events] == [
        (0, [5], 0, None, None), (1, [5], 0, None, None), (2, [5], 0, None, None),
        (0, [6, 7], 1, 1, None), (1, [6, 9], 1, 1, "stop"), (2, [6], 0, 1, None)]
    assert scheduler.owner.tolist() == [0, -1, 2, -1] and scheduler.running == 2
    # an abort frees its slot at once; the next step stops its row, and a newcomer takes the first free slot: its
    # prompt rides in the call's first round and its row runs the second; the call computes the running row and
    # the newcomer's (a bucket of 2)
    assert scheduler.abort(0).finish_reason == "abort" and scheduler.abort(0) is None
    scheduler.add(3, row(20, 5))
    step = scheduler.plan(rounds_in_flight=1)
    assert step.release == (0,) and step.rounds == gamma_policy.Call(1) and not step.chunk.alone
    assert segments(step.chunk) == [(list(range(1, 21)), 0, 0, True, -1)]
    assert step.rows.tolist() == [2, 0] and step.owners.tolist() == [[2, -1], [2, 3]]
    # one request left, nothing in flight: a call of one row
    scheduler.abort(3)
    scheduler.requests[2].prefilled = True
    step = scheduler.plan(rounds_in_flight=0)
    assert step.release == (0,) and step.rows.tolist() == [2] and step.owners.tolist() == [[2], [2]]
    # a call ahead only when a running row surely needs it after the one in flight (2 rounds of up to 2 tokens)
    assert scheduler.plan(rounds_in_flight=1).rounds == gamma_policy.Call(1)  # 19 tokens left
    scheduler.requests[2].left = 4
    assert scheduler.plan(rounds_in_flight=1).rounds is None


def test_a_prompt_longer_than_a_chunk_goes_on_in_the_next_rounds_and_calls_and_chunks_pack_prompts():
    """Chunks of 8 tokens: a 20-token prompt takes three, each after the one before (the next prompt token is each
    non-final segment's successor), two in one call's rounds and the third in the next call's; a 3-token prompt
    packs into that third chunk beside the last 4; rows join only after their last chunk, then run the call's
    rounds after it."""
    scheduler = new_scheduler(4, chunk=8)
    scheduler.add(0, row(20, 10))
    first = scheduler.plan(rounds_in_flight=0)
    assert segments(first.chunk) == [(list(range(1, 9)), 0, 0, False, 9)]
    assert segments(first.chunk, 1) == [(list(range(9, 17)), 8, 0, False, 17)]
    assert first.rows.tolist() == [0] and first.owners.tolist() == [[-1], [-1]]  # no row runs: a slot not running
    scheduler.add(1, row(3, 10))
    second = scheduler.plan(rounds_in_flight=0)
    assert segments(second.chunk) == [([17, 18, 19, 20], 16, 0, True, -1), ([1, 2, 3], 0, 1, True, -1)]
    assert second.chunk.owners[0, :2].tolist() == [0, 1] and segments(second.chunk, 1) == []
    assert second.rows.tolist() == [0, 1] and second.owners.tolist() == [[-1, -1], [0, 1]]
    # the joiners hold their prompt's pages and those of the one round they run in this call (2 positions)
    assert scheduler.requests[0].pages == [0, 1, 2] and scheduler.requests[1].pages == [3]


def test_rows_follow_the_running_rows_not_the_waiting_ones():
    """Eight slots and twelve prompts of 10 tokens whose KV (with a call's 4 positions) fits two at a time (4 pages
    of 8): each call computes a bucket of 2 rows, not 8, while ten prompts wait."""
    scheduler = new_scheduler(8, pages=4)
    for i in range(12):
        scheduler.add(i, row(10, 30, ()))
    step = scheduler.plan(rounds_in_flight=0)
    assert segments(step.chunk) == [(list(range(1, 11)), 0, s, True, -1) for s in (0, 1)]
    assert step.rows.tolist() == [0, 1] and len(scheduler.waiting) == 10
    scheduler.read("rounds", 1, step.owners, call_output(step, None, [[([5], 0, 0)] * 2 + [([], 0, 0)] * 2, None]),
                   step.chunk.owners)
    step = scheduler.plan(rounds_in_flight=0)
    assert step.chunk is None and step.rows.tolist() == [0, 1] and step.owners.tolist() == [[0, 1]] * 2


def test_while_requests_wait_for_a_slot_a_call_goes_ahead_only_when_every_running_row_needs_it():
    """A pool of 2 slots, full, with a third request waiting and a call in flight: no call ahead while a row
    could finish in that call (its slot would sit idle through one more call), one when neither can."""
    scheduler = new_scheduler(2)
    for i in range(3):
        scheduler.add(i, row(3, 20, ()))
    step = scheduler.plan(rounds_in_flight=0)
    assert step.owners.shape == (2, 2) and list(scheduler.waiting) == [2]
    for r in (0, 1):
        scheduler.requests[r].prefilled = True
    scheduler.requests[0].left = 3  # may finish in the call in flight (2 rounds of up to 2 tokens)
    assert scheduler.plan(rounds_in_flight=1).rounds is None
    scheduler.requests[0].left = 5
    assert scheduler.plan(rounds_in_flight=1).rounds == gamma_policy.Call(1)


def test_pages_as_data_allocation_preemption_and_recompute():
    """Pages, as the scheduler hands them out: a chunk takes its segments' pages (and a joiner those of the rounds
    it runs in the call); before a call every running row gets what the call may write (2 rounds of gamma 1: 4
    positions); when they are not free the call waits for what is in flight, then the youngest row is preempted,
    waits first in line and comes back as a recompute of its tokens but the newest (which is its resume token:
    nothing drawn); a finished row's pages are back at once."""
    scheduler = new_scheduler(2, pages=4)  # 32 tokens of KV
    for i, n in enumerate((10, 4)):
        scheduler.add(i, row(n, 40, ()))
    step = scheduler.plan(rounds_in_flight=0)
    # prompts of 10 and 4 tokens and the 2 positions of the round each runs after joining: 2 pages and 1
    assert [live.pages for live in scheduler.requests.values()] == [[0, 1], [2]]
    assert step.chunk.table[0, :2, :2].tolist() == [[0, 1], [2, -1]] and step.chunk.next_token[0, :2].tolist() == [
        -1, -1]
    scheduler.read("rounds", 1, step.owners, call_output(step, [None, [([6, 7], 1, 0), ([6, 7], 1, 0)]],
                                                         [[([5], 0, 0), ([5], 0, 0)], None]), step.chunk.owners)
    # 13 and 7 tokens (12 and 6 committed): the next call's 4 positions need row 1's second page
    step = scheduler.plan(rounds_in_flight=0)
    assert step.page_table[:, :2].tolist() == [[0, 1], [2, 3]] and scheduler.pages.free == 0
    scheduler.read("rounds", 1, step.owners, call_output(step, [[([6, 7], 1, 0)] * 2] * 2))
    # 17 and 11 tokens (16 and 10 committed): the next call needs a third page for row 0, none is free: with a
    # call in flight it waits; with nothing in flight row 1, the younger, is preempted
    assert scheduler.plan(rounds_in_flight=1, idle=False).rounds is None and scheduler.preemptions == 0
    step = scheduler.plan(rounds_in_flight=0)
    assert step.preempt == (1,) and step.rounds == gamma_policy.Call(1) and scheduler.preemptions == 1
    assert step.chunk is None  # the preempted prompt waits: its pages and row 0's next call do not fit beside it
    assert list(scheduler.waiting) == [1] and len(scheduler.requests[0].pages) == 3
    # row 0 finishes: its pages are back, and row 1 is recomputed: its prompt and tokens but the newest
    scheduler.read("rounds", 1, step.owners, call_output(step, [[([8], 0, 1)], [([], 0, 1)]]))
    assert scheduler.pages.free == 4
    step = scheduler.plan(rounds_in_flight=0)
    assert segments(step.chunk) == [([1, 2, 3, 4, 5, 6, 7, 6, 7, 6], 0, 0, True, 7)]
    assert step.chunk.generated[0, 0] == 7 and step.chunk.owners[0, 0] == 1
    # a recompute's chunk reports nothing (its tokens were reported once); its row's round after it does
    events = scheduler.read("rounds", 1, step.owners, call_output(step, [None, [([9], 0, 0)]],
                                                                  [[([], 0, 0)] * 2, None]), step.chunk.owners)
    assert [(e.request, e.tokens, e.gamma) for e in events] == [(1, [9], 1)]


def test_a_preempted_prompt_counts_its_cache_hit_once():
    """A prompt that takes two cached pages and is preempted while it prefills comes back as a recompute: its
    count stays its first admission's (16), and the scheduler's total counts it once."""
    scheduler = new_scheduler(2, pages=8, chunk=2, prefix_caching=True)

    def run(step):  # every row emits up to 2 tokens a round, done at its budget; every final segment its first
        left = {int(r): scheduler.requests[int(r)].left for r in np.unique(step.owners) if r >= 0}
        rounds = []
        for j in range(step.owners.shape[0]):
            rows = []
            for r in step.owners[j].tolist():
                n = min(left.get(r, 0), 2)
                left[r] = left.get(r, 0) - n
                rows.append(([5, 6][:n], 1, int(r < 0 or left[r] == 0)))
            rounds.append(rows)
        first = None
        if step.chunk is not None:
            first = [[([7], 0, int(scheduler.requests[int(o)].left == 1) if o >= 0 else 0) for o in owners]
                     for owners in step.chunk.owners]
        scheduler.read("rounds", 1, step.owners, call_output(step, rounds, first),
                       None if step.chunk is None else step.chunk.owners)

    scheduler.add(0, row(17, 1))  # computes tokens 1-16: two full pages, cached when it finishes
    while 0 in scheduler.requests:
        run(scheduler.plan(0))
    assert scheduler.pages.cached == 2
    scheduler.add(1, row(3, 60))  # a row that grows until the pages run out
    run(scheduler.plan(0))
    scheduler.add(2, row(40, 5))  # shares tokens 1-16
    counts = set()
    for _ in range(60):
        run(scheduler.plan(0))
        if scheduler.requests[2].slot >= 0:
            counts.add(scheduler.requests[2].cached_tokens)
        if scheduler.requests[2].prefilled:
            break
    assert scheduler.preemptions >= 1 and scheduler.requests[2].prefilled
    assert counts == {16} and scheduler.cached_tokens == 16


MESH_SCRIPT = """
import threading
import eagle3_jax
from eagle3_jax.decoding.live import LivePool
from eagle3_jax.parallel.mesh import tp_mesh
import spec_worlds as worlds

_, target = worlds.save_target("random", "{root}/target", layers=4)
worlds.save_drafter("random", "{root}/drafter", target)
mesh = tp_mesh(2)
sharded = eagle3_jax.load_target("{root}/target", dtype="float32", mesh=mesh)
drafter = eagle3_jax.load_drafter("{root}/drafter", sharded, dtype="float32")
pool = LivePool(eagle3_jax.Engine(sharded, drafter, num_draft_tokens=2, max_len=64, max_batch=4, mesh=mesh))
alone = eagle3_jax.Engine(target, max_len=64)
prompts = [[3, 17, 5], [9, 30], [1, 2, 3, 4, 5, 6]]
tokens, done = [[] for _ in prompts], [threading.Event() for _ in prompts]
for i, p in enumerate(prompts):
    def on_event(e, i=i):
        tokens[i].extend(e.tokens)
        e.finished and done[i].set()
    pool.submit(pool.check(p, 20 + i), on_event)
assert all(d.wait(300) for d in done)
pool.close()
assert tokens == [alone.generate([p], 20 + i)[0].token_ids for i, p in enumerate(prompts)], tokens
assert pool.engine.time_call(4, 16, 2) > 0  # the sharded steps' call, timed on the engine's own sharded pages
print("mesh ok")
"""


def test_a_pool_on_a_two_device_mesh_gives_each_prompt_its_output_alone(tmp_path):
    """Tensor parallel over 2 CPU devices (a child process: the device count is fixed at JAX's start)."""
    tests = Path(__file__).parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(MESH_SCRIPT.format(root=tmp_path))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "mesh ok" in done.stdout, done.stderr[-3000:]


def test_a_prompt_ending_in_a_calls_last_round_reserves_only_the_calls_it_runs_in():
    """A 16-token prompt in chunks of 8 ends in the second (last) round of the first call, so it runs none of that
    call's rounds: after the next call is read, the positions its row can have written are its committed ones (no
    stale reservation left behind, which would make every later page estimate one call's reach too high)."""
    scheduler = new_scheduler(4, chunk=8)
    scheduler.add(0, row(16, 40, ()))
    step = scheduler.plan(rounds_in_flight=0)
    assert [s[3] for s in segments(step.chunk, 0)] == [False] and [s[3] for s in segments(step.chunk, 1)] == [True]
    live = scheduler.requests[0]
    scheduler.read("rounds", 1, step.owners, call_output(step, None, [None, [([5], 0, 0)] + [([], 0, 0)] * 3]),
                   step.chunk.owners)
    assert live.horizon == live.committed == 16
    step = scheduler.plan(rounds_in_flight=0)
    assert live.horizon == 16 + 2 * 2  # this call's 2 rounds of gamma 1
    scheduler.read("rounds", 1, step.owners, call_output(step, [[([6, 7], 1, 0)], [([8, 9], 1, 0)]]))
    assert live.horizon == live.committed == 20
