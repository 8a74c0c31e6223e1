"""A constraint's token-level automaton, compiled once on the host into two small integer tables that the device
reads (decoding/grammar.py): the next state of every (state, token class), -1 where the token is not allowed.

Compiling a regex for a vocabulary (`compile_regex`):
  * The byte DFA. outlines-core's `Index` of the regex over a vocabulary of the 256 single bytes is the regex's
    DFA over bytes (UTF-8 sequences included): a few milliseconds, where its index over a 151,936-token
    vocabulary took 0.43 s for a 5-field JSON schema and 6.6 s for `[a-z ]{1,400}` on this project's CPU.
  * Byte classes: bytes whose DFA columns are equal move every state alike (the regex's character sets split
    the bytes into a few dozen classes).
  * Token classes, first pass: a token is the string of its bytes' classes; tokens with the same string move
    every state alike, so each distinct string is walked once (a 64-bit hash of the class string, checked
    against its representative's string: no collision merges two strings).
  * The walk: every (state, class string) pair whose first byte the state allows is walked through the DFA a
    byte position at a time, vectorised over all live pairs (numpy); pairs die as their bytes leave the DFA.
  * Token classes, second pass: class strings with the same transitions in every state are merged (a hash of
    their (state, next state) pairs, checked the same way), so the table is [states, classes] with classes far
    fewer than the vocabulary (`[a-z ]{1,400}`: one class per token length, and the tokens never allowed).
The end of sequence: every end id is allowed in a final state, where it leaves the state as it is (the row stops
there: its end ids are stop ids); a state whose only allowed tokens are the end ids is `complete`.

Bounds (`Limits`): the byte DFA is built on a worker thread that is abandoned past `seconds`, the walk checks the
clock between byte positions and counts its live pairs, and the tables take at most `table_bytes`; past any of
them the constraint is refused (ValueError).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import re
import time

import numpy as np

# Two odd 64-bit multipliers (splitmix64's and murmur3's finaliser's): the fingerprints' independent halves.
_MULTIPLIERS = np.array([[0x9E3779B97F4A7C15], [0xFF51AFD7ED558CCD]], np.uint64)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a constraint's compile may cost before it is refused."""

    seconds: float = 10.0
    table_bytes: int = 64 * 2**20  # the state table and the class map together
    pairs: int = 50_000_000  # live (state, token class string) pairs of the walk at once


@dataclasses.dataclass(frozen=True, eq=False)
class Vocabulary:
    """A target's tokens as bytes (None or b"": a token no text maps to, as a special token), its end-of-sequence
    ids, and `size`, the target's vocabulary (the embedding's rows), at least the tokenizer's."""

    tokens: tuple
    eos: tuple[int, ...]
    size: int

    def __post_init__(self):
        if not self.eos:
            raise ValueError("structured outputs need an end-of-sequence id (generation_config.json's "
                             "eos_token_id or the tokenizer's eos_token)")
        if len(self.tokens) > self.size or any(not 0 <= e < self.size for e in self.eos):
            raise ValueError(f"the tokenizer's ids do not fit the target's vocabulary of {self.size}")

    @functools.cached_property
    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tokens with bytes, longest first, position-major (computed once per vocabulary): (their ids [N], their
        lengths [N], `flat` [total bytes] uint8, `starts` [L + 1]): flat[starts[j] : starts[j + 1]] is byte j of
        the tokens longer than j, which are the first starts[j + 1] - starts[j] of them."""
        ids = [i for i, t in enumerate(self.tokens) if t and i not in self.eos]
        lengths = np.array([len(self.tokens[i]) for i in ids], np.int64)
        order = np.argsort(-lengths, kind="stable")
        ids, lengths = np.array(ids, np.int64)[order], lengths[order]
        longest = int(lengths[0]) if len(ids) else 0
        live = np.searchsorted(-lengths, -np.arange(longest), side="left")  # tokens longer than j
        padded = b"".join(self.tokens[i].ljust(longest, b"\0") for i in ids.tolist())
        matrix = np.frombuffer(padded, np.uint8).reshape(len(ids), longest)
        flat = np.concatenate([matrix[:n, j] for j, n in enumerate(live.tolist())] + [np.zeros(0, np.uint8)])
        return ids, lengths, flat, np.concatenate([[0], np.cumsum(live)])


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
    """A compiled constraint: `classes` [V] int32 each token's class, `next` [S, C] int32 the state after a token of
    each class (-1: not allowed), `initial` the start state, `complete` [S] bool the states that allow only the
    end ids `eos`."""

    classes: np.ndarray
    next: np.ndarray
    initial: int
    complete: np.ndarray
    eos: tuple[int, ...]

    @property
    def num_states(self) -> int:
        return self.next.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next.shape[1]

    @property
    def nbytes(self) -> int:
        return self.classes.nbytes + self.next.nbytes

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens allowed in `state`."""
        return self.next[state][self.classes] >= 0

    def walk(self, tokens, state: int | None = None) -> int:
        """The state after `tokens` from `state` (None: the initial one); -1 once a token is not allowed."""
        state = self.initial if state is None else state
        for t in tokens:
            if state < 0:
                return -1
            state = int(self.next[state, self.classes[t]])
        return state


def compile_regex(pattern: str, vocabulary: Vocabulary, limits: Limits = Limits()) -> Automaton:
    """The automaton of `pattern` (matched against the whole output) over the vocabulary; ValueError for a regex
    that does not compile, or one past the limits."""
    deadline = time.perf_counter() + limits.seconds
    dfa, initial, final = byte_dfa(pattern, limits.seconds)
    byte_columns, byte_class = np.unique(dfa, axis=1, return_inverse=True)  # [S, K], [256]
    ids, columns, string_of = _class_strings(vocabulary, byte_class.reshape(-1).astype(np.uint8))
    state, string, nxt = _walk(byte_columns, columns, limits, deadline)
    S = dfa.shape[0]
    table, string_class = _merge(state, string, nxt, S, len(columns[0]))
    # The end ids' column: a final state allows them and stays.
    table = np.concatenate([table, np.where(final, np.arange(S), -1).astype(np.int32)[:, None]], axis=1)
    classes = np.full((vocabulary.size,), table.shape[1], np.int32)  # past the table: never allowed (below)
    classes[ids] = string_class[string_of]
    classes[list(vocabulary.eos)] = table.shape[1] - 1
    # Tokens without bytes (and ids past the tokenizer) take an all -1 column of their own.
    table = np.concatenate([table, np.full((S, 1), -1, np.int32)], axis=1)
    complete = final & (np.sum(table >= 0, axis=1) == 1)
    automaton = Automaton(classes, table, initial, complete, tuple(vocabulary.eos))
    if automaton.nbytes > limits.table_bytes:
        raise ValueError(f"the constraint's tables take {automaton.nbytes} bytes ({S} states x "
                         f"{automaton.num_classes} token classes): past the {limits.table_bytes} allowed, refused")
    return automaton


def byte_dfa(pattern: str, seconds: float) -> tuple[np.ndarray, int, np.ndarray]:
    """(the regex's DFA over bytes [S, 256] int32, -1: no move; its initial state; final [S] bool), states numbered
    from 0, from outlines-core's index over the 256 single bytes, built on a worker thread abandoned past
    `seconds`."""
    try:
        import outlines_core
    except ImportError:
        raise ImportError("structured outputs need outlines-core: pip install 'eagle3-jax[structured]'") from None
    try:
        re.compile(pattern)
    except re.error as e:  # a clearer message than outlines-core's for what Python's parser rejects too
        raise ValueError(f"invalid regex {pattern!r}: {e}") from None
    except (OverflowError, RecursionError):
        raise ValueError(f"invalid regex {pattern!r}: too large") from None

    def build():
        vocab = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
        index = outlines_core.Index(pattern, vocab)
        return index.get_transitions(), index.get_initial_state(), index.get_final_states()

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        transitions, initial, finals = pool.submit(build).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise ValueError(f"the constraint took more than {seconds:g} s to compile: refused") from None
    except ValueError as e:
        raise ValueError(f"the regex {pattern[:200]!r} does not compile to an automaton: {e}") from None
    finally:
        pool.shutdown(wait=False)
    states = sorted(set(transitions) | set(finals) | {initial} |
                    {t for moves in transitions.values() for t in moves.values()})
    number = {s: i for i, s in enumerate(states)}
    dfa = np.full((len(states), 256), -1, np.int32)
    for s, moves in transitions.items():
        for b, t in moves.items():
            if b < 256:  # outlines-core's own end id is 256
                dfa[number[s], b] = number[t]
    return dfa, number[initial], np.array([s in finals for s in states])


def _class_strings(vocabulary: Vocabulary, byte_class: np.ndarray):
    """(the token ids with bytes [N], the distinct byte-class strings, longest first, position-major: a list of
    columns, column j [U_j] byte j's class of the strings longer than j; each token's string [N])."""
    ids, lengths, flat, starts = vocabulary.layout
    mapped = byte_class[flat].astype(np.uint64) + np.uint64(1)
    h = np.zeros((2, len(ids)), np.uint64)  # two independent 64-bit fingerprints: a 128-bit one
    for j in range(len(starts) - 1):
        n = starts[j + 1] - starts[j]
        h[:, :n] = (h[:, :n] ^ mapped[None, starts[j] : starts[j + 1]]) * _MULTIPLIERS
    h ^= lengths.astype(np.uint64) << np.uint64(48)
    first, string_of = _groups(h)
    # Strings ordered by their first token: longest first, as the tokens are.
    order = np.argsort(first)
    first, string_of = first[order], np.argsort(order)[string_of]
    columns = []
    for j in range(len(starts) - 1):
        column = mapped[starts[j] : starts[j + 1]]
        columns.append((column[first[: int(np.searchsorted(first, len(column)))]] - np.uint64(1)).astype(np.int64))
    return ids, columns, string_of


def _walk(dfa: np.ndarray, columns: list, limits: Limits, deadline: float):
    """(state, string, next state) of every class string a state allows whole: each (state, string) pair whose
    first class the state allows, walked a byte position at a time (pairs ordered by string, longest first, so
    the pairs still walking at position j are a prefix)."""
    U = len(columns[0])
    allows = dfa >= 0  # [S, K]
    states_of = [np.flatnonzero(allows[:, k]) for k in range(dfa.shape[1])]
    count = allows.sum(axis=0)[columns[0]]  # [U] states allowing each string's first class
    total = int(count.sum())
    if total > limits.pairs:
        raise ValueError(f"the constraint's automaton needs {total} (state, token) pairs: past the "
                         f"{limits.pairs} allowed, refused")
    string = np.repeat(np.arange(U), count)
    flat_states = np.concatenate(states_of + [np.zeros(0, np.int64)])
    class_start = np.concatenate([[0], np.cumsum([len(x) for x in states_of])])
    offset = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    state = flat_states[class_start[columns[0][string]] + offset]
    dead = np.concatenate([dfa, np.full((1, dfa.shape[1]), -1, dfa.dtype)])  # row -1: a dead pair stays dead
    cur = dead[state, columns[0][string]]
    for column in columns[1:]:
        n = int(np.searchsorted(string, len(column)))  # pairs of strings longer than this position
        cur[:n] = dead[cur[:n], column[string[:n]]]
        if np.count_nonzero(cur[:n] < 0) * 2 > n:  # most walking pairs died: drop the dead ones (order kept)
            keep = cur >= 0
            state, string, cur = state[keep], string[keep], cur[keep]
        if time.perf_counter() > deadline:
            raise ValueError(f"the constraint took more than {limits.seconds:g} s to compile: refused")
    alive = cur >= 0
    return state[alive], string[alive], cur[alive].astype(np.int32)


def _merge(state, string, nxt, S: int, U: int) -> tuple[np.ndarray, np.ndarray]:
    """(the table [S, C] of the distinct columns, each string's class [U]) from the walk's triples: strings whose
    (state, next state) pairs are equal share a class."""
    mix = (state.astype(np.uint64) * np.uint64(S + 1) + nxt.astype(np.uint64) + np.uint64(1))[None] * _MULTIPLIERS
    mix ^= mix >> np.uint64(29)
    mix *= _MULTIPLIERS[::-1]
    h = np.zeros((2, U), np.uint64)  # a string's 128-bit fingerprint: the sum over its pairs (they are grouped)
    if len(string):
        starts = np.flatnonzero(np.concatenate([[True], string[1:] != string[:-1]]))
        h[:, string[starts]] = np.add.reduceat(mix, starts, axis=1)
    first, string_class = _groups(h)
    string_class = string_class.astype(np.int32)
    table = np.full((S, len(first)), -1, np.int32)
    table[state, string_class[string]] = nxt
    return table, string_class


def _groups(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each group's first member, each member's group) of fingerprints h [2, N] grouped by their first half; the
    second half must agree within a group (else two different things share 64 bits, refused as an error)."""
    _, first, group = np.unique(h[0], return_index=True, return_inverse=True)
    group = group.reshape(-1)
    if not np.array_equal(h[1], h[1, first[group]]):
        raise RuntimeError("a 64-bit fingerprint collision while compiling a constraint")
    return first, group
