"""The host loop over a pool of slots: prompts are admitted into free slots in input order, calls of rounds
run over the whole pool, and each device operation's one transfer is read in the order it was dispatched.

Device operations are dispatched ahead of the host (JAX returns before the device finishes) and queued;
the host reads their outputs first in, first out, so a slot's tokens are always attributed to the prompt
that held it when the operation was dispatched. A slot freed by the host is refilled by an admission
dispatched after every operation already queued: the rounds in flight see the finished row frozen.

While some row surely needs another call (more tokens left than a call can emit), the next call is
dispatched before the current one's transfer is waited on, so the device does not idle on the host. When
prompts are waiting for slots, it is dispatched early only if no row can run out of budget in the current
call, so that a slot is not left idle for a whole extra call before its refill.

Each call's gamma (draft tokens per round) is the policy's (gamma_policy.py), chosen on the host before
the call is dispatched from the outputs already read (one call may be in flight, unread); each queued
call carries its gamma, which is how its output is unpacked.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from eagle3_jax.decoding.request import Request, bucket_length
from eagle3_jax.decoding.round_output import RoundOutput


@dataclasses.dataclass(frozen=True)
class Event:
    """What one device operation reported for one prompt."""

    prompt: int  # the prompt's index in the request
    tokens: list[int]  # the tokens it emitted
    accepted: int | None  # the drafts a speculative round committed; None for prefill and spec-off rounds
    gamma: int | None  # the drafts per round of a speculative round (0 included); None where accepted is
    trace: tuple[list[int], list[int]] | None  # with trace: a speculative round's (drafts, target choices)
    finished: bool


@dataclasses.dataclass(frozen=True)
class Ops:
    """The engine's device operations, each dispatched asynchronously but `fetch`."""

    empty: Callable  # (rows, request) -> state of `rows` free slots built for the request's widths
    # (state, request, slots) -> (state, packed first tokens); state None: the request fills the pool in slot order,
    # and its prefill's state is the pool's
    admit: Callable
    rounds: Callable  # (state, gamma, flush) -> (state, packed rounds [R, N, ...]) (gamma_policy.Call)
    fetch: Callable  # (packed) -> np.ndarray, the one transfer of an operation


def admission_rows(count: int, pool: int) -> int:
    """The rows a prefill of `count` prompts runs: a power of four, at most the pool, so that few shapes
    compile (a prefill compiles per rows x prompt bucket) while padding stays under 3/4 of a prefill."""
    rows = 1
    while rows < count:
        rows *= 4
    return min(rows, pool)


def admission_shapes(pool: int, bucket: int, prefill_tokens: int) -> list[int]:
    """The row counts admissions of prompts of one bucket can run (`_admission`'s rule): every
    admission_rows(n) that one prefill of prefill_tokens holds, and 1 always."""
    return sorted({admission_rows(n, pool) for n in range(1, pool + 1)
                   if n == 1 or admission_rows(n, pool) * bucket <= prefill_tokens})


class Policy(Protocol):
    """Which gamma each call of rounds runs (gamma_policy.py)."""

    # The next call (gamma_policy.Call) at this mean KV length of the busy slots; nothing changes until
    # `dispatched` says it ran.
    def choose(self, length: float): ...

    def dispatched(self, call) -> None: ...

    def observe(self, gamma: int, out: RoundOutput) -> None: ...  # one round's output, read

    # Whether a call may be chosen before the one in flight is read: a policy with no evidence yet would
    # choose the second call from its prior too.
    def may_choose_ahead(self) -> bool: ...


def run(ops: Ops, request: Request, pool: int, *, policy: Policy, prefill_gamma: int, rounds_per_call: int,
        max_len: int, speculative: bool, prefill_tokens: int, trace: bool = False) -> Iterator[Event]:
    """Decodes every prompt of `request` through `pool` slots; yields events in the order operations ran.
    prefill_gamma: the width prefill packs its output in (round_output.py).
    prefill_tokens: the most prompt tokens (rows x padded length) one admission prefills at once."""
    P = request.num_rows
    owner = np.full((pool,), -1)  # the prompt each slot holds (host view), -1 when free
    finished = np.zeros((P,), bool)
    left = request.budget(max_len).astype(np.int64)  # tokens each prompt may still emit
    kv = np.zeros((pool,), np.int64)  # each slot's sequence length (host view)
    # (kind, packed, its gamma, (the prompt of each output row at dispatch, its slot))
    queue: collections.deque = collections.deque()
    state = None  # the pool's state: the first admission's, when it fills every slot, else allocated free
    next_prompt = 0

    def admit():
        nonlocal state, next_prompt
        free = np.flatnonzero(owner < 0)
        while len(free) and next_prompt < P:
            take = _admission(request, next_prompt, len(free), pool, max_len, prefill_tokens)
            rows = admission_rows(len(take), pool)
            slots = np.full((rows,), pool, np.int32)  # padding rows go to slot `pool`: dropped
            slots[: len(take)] = free[: len(take)]
            if state is None and len(take) < pool:
                state = ops.empty(pool, request)
            state, packed = ops.admit(state, request.take(take, rows, max_len), slots)
            owner[free[: len(take)]] = take
            kv[free[: len(take)]] = request.lengths[take]
            queue.append(("admit", packed, prefill_gamma, (np.array(take), free[: len(take)])))
            free, next_prompt = free[len(take):], next_prompt + len(take)

    def choose():
        busy = owner >= 0
        return policy.choose(float(kv[busy].mean()) if busy.any() else 0.0)

    def dispatch_rounds(call):
        nonlocal state
        state, packed = ops.rounds(state, call.gamma, call.flush)
        policy.dispatched(call)
        queue.append(("rounds", packed, call.gamma, (owner.copy(), np.arange(pool))))

    def rounds_queued() -> bool:
        return any(entry[0] == "rounds" for entry in queue)

    admit()
    if np.any(left[:next_prompt] > 1):  # some row surely needs a round after its prefill token
        dispatch_rounds(choose())
    while queue and ((owner >= 0).any() or next_prompt < P):
        kind, packed, gamma, (owners, slot_of_row) = queue.popleft()
        busy = owner >= 0
        if kind == "rounds" and not rounds_queued() and busy.any() and policy.may_choose_ahead():
            ahead = choose()
            need = left[owner[busy]] > rounds_per_call * (ahead.gamma + 1)
            if need.all() if next_prompt < P else need.any():
                dispatch_rounds(ahead)
        outputs = ops.fetch(packed)
        rows = [outputs] if kind == "admit" else list(outputs)
        for packed_round in rows:
            out = RoundOutput.unpack(packed_round, gamma)
            speculative_round = kind == "rounds" and speculative
            if speculative_round:
                policy.observe(gamma, out)
            accepted, done = out.accepted.tolist(), out.done.tolist()
            drafts, choices = (out.drafts.tolist(), out.choices.tolist()) if trace and speculative_round else ((), ())
            for row, (prompt, slot) in enumerate(zip(owners.tolist(), slot_of_row.tolist())):
                if prompt < 0 or finished[prompt]:
                    continue
                new = out.tokens[row]
                left[prompt] -= len(new)
                kv[slot] += len(new)
                if done[row]:
                    finished[prompt] = True
                    owner[slot] = -1
                yield Event(prompt, new, accepted[row] if speculative_round else None,
                            gamma if speculative_round else None, (drafts[row], choices[row]) if drafts else None,
                            done[row])
        if next_prompt < P and (owner < 0).any():
            admit()
        if (owner >= 0).any() and not rounds_queued():
            dispatch_rounds(choose())


def _admission(request: Request, start: int, free: int, pool: int, max_len: int, prefill_tokens: int) -> list[int]:
    """The prompts of the next admission: from `start` in input order, at most `free`, and as many as one
    prefill of at most prefill_tokens padded tokens holds (always at least one)."""
    lengths = request.lengths
    end, longest = start + 1, int(lengths[start])
    while end - start < free and end < request.num_rows:
        longer = max(longest, int(lengths[end]))
        if admission_rows(end + 1 - start, pool) * bucket_length(longer, max_len) > prefill_tokens:
            break
        end, longest = end + 1, longer
    return list(range(start, end))
