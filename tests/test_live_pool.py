"""The live pool: requests submitted while it runs join at the next admission and give their tokens alone
(greedy, float32; sampled with a seed), aborts free their slot, and rows of different settings share it."""

import queue
import threading

import pytest

import eagle3_jax
from eagle3_jax.decoding.live import LivePool
from eagle3_jax.decoding.live_plan import pool_size

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
    finally:
        pool.close()


def test_abort_frees_the_slot_at_once_and_settings_share_the_pool(world):
    target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=MAX_LEN, max_batch=1)
    pool = LivePool(engine)
    try:
        long = Collector()
        long_id = pool.submit(pool.check(PROMPTS[0], 60), long)
        assert long.first.wait(120)
        seeded = Collector()  # waits for the one slot, which only the abort frees before 60 tokens
        pool.submit(pool.check(PROMPTS[1], 10, temperature=0.9, top_p=0.8, seed=7), seeded)
        pool.abort(long_id)
        assert long.wait() == "abort" and len(long.tokens) < 60
        seeded.wait()
        (want,) = engine.generate([PROMPTS[1]], 10, temperature=0.9, top_p=0.8, seed=7)
        assert seeded.tokens == want.token_ids
        pool.abort(long_id)  # already gone: nothing happens
        stopped = Collector()  # a greedy row after a sampled one, with a stop id from its own output
        (plain,) = engine.generate([PROMPTS[3]], 10)
        pool.submit(pool.check(PROMPTS[3], 10, [plain.token_ids[4]]), stopped)
        assert stopped.wait() == "stop" and stopped.tokens == plain.token_ids[: plain.token_ids.index(
            plain.token_ids[4]) + 1]
        assert pool.running == 0
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


def test_pool_size_is_a_power_of_two_up_to_max_batch():
    assert [pool_size(n, 6) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
