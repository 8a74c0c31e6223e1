"""A pool of decoding slots on the device: its rows (spec_round.new_rows) are allocated once; a prompt's last
chunk installs its row into a free slot (spec_round.admit) while the other slots keep theirs.

The pool is a `DecodeState` of N rows over the engine's page pools. A free slot is a row that is done
(frozen: rounds change nothing it owns and write nothing). The operations here move and stop rows, and read and
write the rows' fields only (spec_round.split_pages): the page pools are not the slots'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import spec_round


def resize(rows: spec_round.DecodeState, index) -> spec_round.DecodeState:
    """A pool of len(index) slots whose slot i holds the row of slot index[i]; an index at or past the pool's
    size makes a free slot (a copy of some row, done). Growing or shrinking a live pool: the rows keep their
    pages and settings whatever slot they move to."""
    n = rows.done.shape[0]
    tables, rows = rows.grammar_tables, dataclasses.replace(rows, grammar_tables=None)  # the pool's, not a row's
    moved = jax.tree.map(lambda x: x[jnp.minimum(index, n - 1)], rows)
    return dataclasses.replace(moved, done=moved.done | (index >= n), grammar_tables=tables)


def release(rows: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """The rows of these slots stopped (done): an aborted or preempted request's row emits and writes nothing
    more. An index >= N is dropped."""
    return dataclasses.replace(rows, done=rows.done.at[slots].set(True, mode="drop"))
