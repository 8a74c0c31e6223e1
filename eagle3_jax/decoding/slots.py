"""A pool of decoding slots on the device: its rows are allocated once, and prompts are prefilled into free
slots while the other slots keep their rows.

The pool is a `DecodeState` of N rows over the engine's page pools. A free slot is a row that is done
(frozen: rounds change nothing it owns and write nothing). Admitting M prompts prefills them as a batch of M
rows straight into their pages (spec_round.prefill) and scatters each row's fields into its slot (`insert`).
Rows padding M up to a bucket target slot N, out of range, so their scatter is dropped. Every operation here
reads and writes the rows' fields only (spec_round.split_pages): the page pools are not the slots'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import spec_round


def empty(tparams, dparams, pages, template: spec_round.Admission, *, spec: spec_round.StepSpec):
    """N free slots: the rows prefill builds for the N rows of `template` (an admission), zeroed and done, without
    their page pools (spec_round.split_pages). The template fixes the widths (stop ids, page table) and the build
    (sampling settings or none); its values are not kept."""
    shapes, _ = jax.eval_shape(functools.partial(spec_round.prefill, spec=spec), tparams, dparams, pages, template)
    rows, _ = spec_round.split_pages(shapes)
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rows)
    return dataclasses.replace(state, done=jnp.ones(state.done.shape, bool))


def insert(rows: spec_round.DecodeState, fresh: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """Writes row i of `fresh` (M rows, as prefill built them, without pools) into slot slots[i] of the pool's
    `rows`; a slot index >= N drops its row. Prefill is jitted apart, so its compilations serve every pool
    size."""
    return jax.tree.map(lambda pool, new: pool.at[slots].set(new, mode="drop"), rows, fresh)


def resize(rows: spec_round.DecodeState, index) -> spec_round.DecodeState:
    """A pool of len(index) slots whose slot i holds the row of slot index[i]; an index at or past the pool's
    size makes a free slot (a copy of some row, done). Growing or shrinking a live pool: the rows keep their
    pages and settings whatever slot they move to."""
    n = rows.done.shape[0]
    moved = jax.tree.map(lambda x: x[jnp.minimum(index, n - 1)], rows)
    return dataclasses.replace(moved, done=moved.done | (index >= n))


def release(rows: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """The rows of these slots stopped (done): an aborted or preempted request's row emits and writes nothing
    more. An index >= N is dropped."""
    return dataclasses.replace(rows, done=rows.done.at[slots].set(True, mode="drop"))
