"""A pool of decoding slots on the device: its rows (spec_round.new_rows) are allocated once; a prompt's last
chunk installs its row into a free slot (spec_round.admit) while the other slots keep theirs. A call of rounds
computes a bucket of the slots (live_plan.row_bucket): `take` gathers them into a state of their own, the call
runs on it, and `put` writes them back, so the call's compilation depends on the bucket, not on the pool's size.

The pool is a `DecodeState` of N rows over the engine's page pools. A free slot is a row that is done
(frozen: rounds change nothing it owns and write nothing). The operations here move and stop rows, and read and
write the rows' fields only (spec_round.split_pages): the page pools are not the slots'.
"""

from __future__ import annotations

import dataclasses

import jax

from eagle3_jax.decoding import spec_round


def release(rows: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """The rows of these slots stopped (done): an aborted or preempted request's row emits and writes nothing
    more. An index >= N is dropped."""
    return dataclasses.replace(rows, done=rows.done.at[slots].set(True, mode="drop"))


def take(rows: spec_round.DecodeState, index) -> spec_round.DecodeState:
    """The rows of the slots `index` [b] (distinct), as a state of b rows (with the pool's grammar tables, which are
    no row's)."""
    tables = rows.grammar_tables
    part = jax.tree.map(lambda x: x[index], dataclasses.replace(rows, grammar_tables=None))
    return dataclasses.replace(part, grammar_tables=tables)


def put(rows: spec_round.DecodeState, index, part: spec_round.DecodeState) -> spec_round.DecodeState:
    """`rows` with the slots `index` [b] (distinct) replaced by `part`'s b rows."""
    tables = rows.grammar_tables
    whole = jax.tree.map(lambda whole, new: whole.at[index].set(new), dataclasses.replace(rows, grammar_tables=None),
                         dataclasses.replace(part, grammar_tables=None))
    return dataclasses.replace(whole, grammar_tables=tables)
