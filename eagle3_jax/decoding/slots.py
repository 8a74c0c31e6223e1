"""A pool of decoding slots on the device: its rows (spec_round.new_rows) are allocated once; a prompt's last
chunk installs its row into a free slot (spec_round.admit) while the other slots keep theirs, and each call of
rounds gathers the slots it computes and writes them back (spec_round.spec_rounds).

The pool is a `DecodeState` of N rows over the engine's page pools. A free slot is a row that is done
(frozen: rounds change nothing it owns and write nothing). The operations here move and stop rows, and read and
write the rows' fields only (spec_round.split_pages): the page pools are not the slots'.
"""

from __future__ import annotations

import dataclasses

from eagle3_jax.decoding import spec_round


def release(rows: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """The rows of these slots stopped (done): an aborted or preempted request's row emits and writes nothing
    more. An index >= N is dropped."""
    return dataclasses.replace(rows, done=rows.done.at[slots].set(True, mode="drop"))
