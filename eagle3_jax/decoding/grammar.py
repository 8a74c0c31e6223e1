"""Constrained rows on the device: the pool's automata as two tables (`Tables`), each row's place in them (`Rows`),
and the pure functions the round applies (`allowed`, `mask`, `advance`, `along`); and the host's `Registry`, which
lays the automata of the pool's constrained rows out in those tables.

Tables. Every automaton (automaton.py) of a row in the pool has a row k of `classes` [K, V] (each token's class in
it) and a range of states in `next` [S, C] (the state after a token of each class, numbered globally; -1: not
allowed). A row's `state` is its automaton's state after its newest token, -1 for a free row. A gather of the row's
class map and one of its state's next-state row give a whole mask: [B, T, V] bool for T positions costs one read
of the row's class map (V int32) and a gather in a row of C values, never a [S, V] table. Sizes: K V + S C int32s,
with K, S and C rounded up to powers of two so that the calls' shapes change rarely (each shape compiles once):
Qwen3's vocabulary and one 5-field JSON schema take 0.6 MB (the class map) + 101 x 159 int32s.

Positions past a token the automaton does not allow get state -1 (all allowed): the round never uses their
outputs (a greedy row's choices there follow a rejected draft; a sampled row's draft had probability 0), and an
all-allowed row keeps every filter's arithmetic finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding.automaton import Automaton

FREE = -1  # a row's state when it is not constrained (and past a token its automaton does not allow)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tables:
    """The pool's automata (no batch axis)."""

    classes: jax.Array  # [K, V] int32: each automaton's class of each token
    next: jax.Array  # [S, C] int32: the next global state, -1 where a class is not allowed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Each row's automaton and state."""

    table: jax.Array  # [B] int32: its automaton's row of Tables.classes
    state: jax.Array  # [B] int32: its global state after its newest token, FREE when unconstrained


def allowed(tables: Tables, table, states) -> jax.Array:
    """[B, T, V] bool: the tokens allowed after states [B, T] of rows whose automata are `table` [B] (a FREE state:
    every token)."""
    classes = tables.classes[table]  # [B, V]
    rows = tables.next[jnp.maximum(states, 0)]  # [B, T, C]
    ok = jnp.take_along_axis(rows, jnp.broadcast_to(classes[:, None, :], states.shape + classes.shape[-1:]), axis=-1)
    return (ok >= 0) | (states < 0)[..., None]


def mask(tables: Tables, table, states, logits) -> jax.Array:
    """logits [B, T, V] with the tokens states [B, T] do not allow at -inf."""
    return jnp.where(allowed(tables, table, states), logits, -jnp.inf)


def advance(tables: Tables, table, state, tokens) -> jax.Array:
    """The states [B] after tokens [B] (FREE stays FREE; a token not allowed gives FREE)."""
    cls = tables.classes[table, jnp.maximum(tokens, 0)]
    nxt = tables.next[jnp.maximum(state, 0), cls]
    return jnp.where((state < 0) | (tokens < 0), FREE, nxt)


def along(tables: Tables, rows: Rows, drafts) -> jax.Array:
    """[B, G + 1] the states after the newest token and after each of drafts [B, G] (FREE from a draft the
    automaton does not allow on)."""
    states = [rows.state]
    for i in range(drafts.shape[1]):
        states.append(advance(tables, rows.table, states[-1], drafts[:, i]))
    return jnp.stack(states, axis=1)


def cut(rows: Rows, states, drafts, no_draft: int) -> jax.Array:
    """drafts [B, G] of constrained rows cut at the first one their automaton does not allow (no_draft past it)."""
    refused = (rows.state >= 0)[:, None] & (states[:, 1:] < 0)
    return jnp.where(jnp.cumsum(refused, axis=1) > 0, no_draft, drafts)


def committed(tables: Tables, rows: Rows, states, choices, accepted, live) -> Rows:
    """The rows after a round that accepted `accepted` [B] drafts and emitted choices[accepted] after them: the
    state after the accepted drafts, advanced by that token (rows not `live` unchanged)."""
    b = jnp.arange(states.shape[0])
    after = advance(tables, rows.table, states[b, accepted], choices[b, accepted])
    return dataclasses.replace(rows, state=jnp.where(live, after, rows.state))


def draft_guide(tables: Tables, rows: Rows, draft_ids):
    """(the initial carry, mask, advance) that constrain a drafter's chain (models/eagle3.draft_chain's `guide`):
    masks over the draft vocabulary, whose target ids are draft_ids [Vd]; the carry is the rows' state."""
    classes = tables.classes[rows.table][:, draft_ids]  # [B, Vd]

    def mask_draft(state, logits):
        ok = (jnp.take_along_axis(tables.next[jnp.maximum(state, 0)], classes, axis=-1) >= 0) | (state < 0)[:, None]
        # A state that allows no draft token (its only tokens outside the draft vocabulary): an unmasked draft,
        # rejected by the target's mask, rather than a row of -inf.
        return jnp.where(ok | ~jnp.any(ok, axis=-1, keepdims=True), logits, -jnp.inf)

    return rows.state, mask_draft, lambda state, tokens: advance(tables, rows.table, state, tokens)


# ----------------------------------------------------------------------------- the host's layout


@dataclasses.dataclass
class _Entry:
    automaton: Automaton
    k: int  # its row of Tables.classes
    offset: int  # its first global state
    capacity: int  # the states its range holds (at least its automaton's)
    users: int = 0


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


class Registry:
    """The automata of a pool's constrained rows, laid out in one `Tables` (host arrays). An automaton is placed once
    however many rows use it (by identity: structured.Compiler returns one object per constraint text) and its range
    is kept while a row uses it; a range no row uses is reused by a later automaton that fits it, and the tables
    drop to None when no row is constrained. `version` counts the layouts, so that the runner loads new tables only
    when they changed."""

    def __init__(self):
        self._entries: list[_Entry] = []
        self._shape = (0, 0, 0)  # the tables' (K, S, C) so far
        self.version = 0

    @property
    def active(self) -> bool:
        return any(e.users for e in self._entries)

    def place(self, automaton: Automaton) -> tuple[int, int]:
        """(k, offset) of the automaton, placed if it is not: a row now uses it."""
        entry = next((e for e in self._entries if e.automaton is automaton), None)
        if entry is None:
            S = automaton.num_states
            entry = next((e for e in self._entries if e.users == 0 and e.capacity >= S), None)
            if entry is None:
                end = max((e.offset + e.capacity for e in self._entries), default=0)
                entry = _Entry(automaton, len(self._entries), end, S)
                self._entries.append(entry)
            else:
                entry.automaton = automaton
            self.version += 1
        entry.users += 1
        return entry.k, entry.offset

    def release(self, automaton: Automaton) -> None:
        """A row no longer uses the automaton; with no row constrained the layout is reset."""
        entry = next(e for e in self._entries if e.automaton is automaton and e.users > 0)
        entry.users -= 1
        if not self.active:
            self._entries, self._shape = [], (0, 0, 0)
            self.version += 1

    def tables(self) -> Tables | None:
        """The layout as host arrays (None: no row constrained), padded to powers of two."""
        if not self.active:
            return None
        # Capacities never shrink while a row is constrained (a new shape would compile the calls again).
        K, S, C = (max(a, b) for a, b in zip(self._shape, (
            _pow2(len(self._entries), 1), _pow2(max(e.offset + e.capacity for e in self._entries), 64),
            _pow2(max(e.automaton.num_classes for e in self._entries), 16))))
        self._shape = (K, S, C)
        classes = np.zeros((K, len(self._entries[0].automaton.classes)), np.int32)
        nxt = np.full((S, C), FREE, np.int32)
        for e in self._entries:
            a = e.automaton
            classes[e.k] = a.classes
            nxt[e.offset : e.offset + a.num_states, : a.num_classes] = np.where(a.next >= 0, a.next + e.offset, FREE)
        return Tables(classes, nxt)


def rows_for(batch: int) -> Rows:
    """`batch` free rows (host arrays)."""
    return Rows(np.zeros((batch,), np.int32), np.full((batch,), FREE, np.int32))


def installed(rows, registry: Registry, put):
    """The pool's rows (spec_round.DecodeState without pages) with the registry's tables, put on the device with
    `put`: free grammar rows added when the pool's first constrained row arrives, both dropped when none is left."""
    tables = registry.tables()
    if tables is None:
        return dataclasses.replace(rows, grammar=None, grammar_tables=None)
    grammar = rows.grammar if rows.grammar is not None else put(rows_for(rows.done.shape[0]))
    return dataclasses.replace(rows, grammar=grammar, grammar_tables=put(tables))
