"""A fixed pool of decoding slots on the device: its state is allocated once, and prompts are prefilled into
free slots while the other slots keep their rows.

The pool is a `DecodeState` of N rows. A free slot is a row that is done (frozen: rounds change nothing it
owns). Admitting M prompts prefills them as a batch of M rows, exactly as a request of those prompts alone
would (spec_round.prefill), and scatters each row into its slot (`insert`); entries of a slot's caches past
its new length are stale and never read. Rows padding M up to a bucket target slot N, out of range, so
their scatter is dropped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.request import Request


def empty(tparams, dparams, template: Request, *, spec: spec_round.StepSpec) -> spec_round.DecodeState:
    """N free slots: the state prefill builds for the N rows of `template`, zeroed and done. The template
    fixes the widths (stop ids) and the build (sampling settings or none); its values are not kept."""
    shapes, _ = jax.eval_shape(functools.partial(spec_round.prefill, spec=spec), tparams, dparams, template)
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return dataclasses.replace(state, done=jnp.ones(state.done.shape, bool))


def insert(state: spec_round.DecodeState, fresh: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """Writes row i of `fresh` (M rows, as prefill built them) into slot slots[i] of the pool `state`; a
    slot index >= N drops its row. Prefill is jitted apart, so its compilations serve every pool size."""
    return jax.tree.map(lambda pool, new: pool.at[slots].set(new, mode="drop"), state, fresh)


def resize(state: spec_round.DecodeState, index) -> spec_round.DecodeState:
    """A pool of len(index) slots whose slot i holds the row of `state`'s slot index[i]; an index at or past
    `state`'s size makes a free slot (a copy of some row, done). Growing or shrinking a live pool: the rows
    keep their caches and settings whatever slot they move to."""
    n = state.done.shape[0]
    moved = jax.tree.map(lambda x: x[jnp.minimum(index, n - 1)], state)
    return dataclasses.replace(moved, done=moved.done | (index >= n))


def release(state: spec_round.DecodeState, slots) -> spec_round.DecodeState:
    """The rows of these slots stopped (done): an aborted request's row emits nothing more. An index >= N is
    dropped."""
    return dataclasses.replace(state, done=state.done.at[slots].set(True, mode="drop"))
