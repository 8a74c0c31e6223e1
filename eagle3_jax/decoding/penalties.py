"""Penalties and logit_bias on the target's logits, on the device: vLLM's presence, frequency and repetition
penalties and OpenAI's logit_bias, exact under speculation. Built only into a step that asks for them
(spec_round.StepSpec.penalties), which a call runs while one of its rows has any.

The order on a row's logits, at every position a round verifies and for a prompt's first token: the raw logits;
the repetition penalty over every token of the prompt or the output (a positive logit divided by it, any other
multiplied: vLLM's, as transformers' RepetitionPenaltyLogitsProcessor); the frequency penalty times each token's
count in the output, and the presence penalty where that count is above 0, subtracted (OpenAI's definition, as
vLLM applies them); logit_bias added; then the sampler's temperature, top-k and top-p (sampling.py), or the argmax
of a greedy row. Logprobs stay the raw logits' (logprobs.py). A row with no penalty and no bias gets its logits bit
for bit (x * 1 - 0 * count - 0 + 0).

Counts, exact under speculation. A row's sequence x_0 .. x_n (its prompt, then its output, x_n the newest token)
is `PenaltyState.sequence`, with its prompt's length; the output is positions prompt_length .. n. The verify
position after x_n, d_1 .. d_i chooses the token that would follow the drafts, so it sees the output's counts plus
d_1 .. d_i: what a plain decoding step there would see. Each round counts afresh from the sequence (a scatter of
[B, max_len] into [B, V]) instead of keeping [B, V] counts in every slot: 4 MB of sequence for 256 slots at
max_len 4096, where counts and a prompt mask at Qwen3's vocabulary would hold 194 MB.

The sequence is written only by steps built with penalties (a row's admission from its chunk's whole sequence,
`live_plan.ChunkPlan.history`, and each round's committed tokens): a row with penalties runs in no other step.
The settings are written at every admission, so that no row inherits its slot's last settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BIAS_WIDTH = 300  # logit_bias entries a row carries (OpenAI's API takes at most 300)
BIAS_LIMIT = 100.0  # a bias is in [-100, 100], as OpenAI's
PENALTY_LIMIT = 2.0  # presence and frequency penalties are in [-2, 2], as OpenAI's


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Each row's settings (host or device arrays of B rows)."""

    frequency: jax.Array  # [B] float32, 0: none
    presence: jax.Array  # [B] float32, 0: none
    repetition: jax.Array  # [B] float32, 1: none
    bias_ids: jax.Array  # [B, BIAS_WIDTH] int32: logit_bias's token ids, -1 past them
    bias: jax.Array  # [B, BIAS_WIDTH] float32: their biases

    @staticmethod
    def neutral(batch: int) -> Penalties:
        """B rows of no penalty and no bias, as host arrays."""
        return Penalties(np.zeros((batch,), np.float32), np.zeros((batch,), np.float32),
                         np.ones((batch,), np.float32), np.full((batch, BIAS_WIDTH), -1, np.int32),
                         np.zeros((batch, BIAS_WIDTH), np.float32))

    def active(self) -> np.ndarray:
        """[B] bool (host arrays): the rows with a penalty or a bias."""
        return ((np.asarray(self.frequency) != 0) | (np.asarray(self.presence) != 0)
                | (np.asarray(self.repetition) != 1) | np.any(np.asarray(self.bias_ids) >= 0, axis=-1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """A pool's rows' penalties (spec_round.DecodeState.penalty)."""

    settings: Penalties
    sequence: jax.Array  # [B, max_len] int32: x_0 .. x_n of a row with penalties (written by penalty steps only)
    prompt_lengths: jax.Array  # [B] int32


def new_rows(batch: int, max_len: int) -> PenaltyState:
    """`batch` free slots' fields."""
    settings = jax.tree.map(jnp.asarray, Penalties.neutral(batch))
    return PenaltyState(settings, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))


def _counts(sequence, first, last, vocab_size: int) -> jax.Array:
    """[B, V] int32: how often each token occurs at positions first .. last [B] (inclusive) of sequence [B, L]."""
    B, L = sequence.shape
    inside = (jnp.arange(L)[None, :] >= first[:, None]) & (jnp.arange(L)[None, :] <= last[:, None])
    ids = jnp.where(inside, sequence, vocab_size)  # outside: past the vocabulary, dropped
    return jnp.zeros((B, vocab_size), jnp.int32).at[jnp.arange(B)[:, None], ids].add(1, mode="drop")


def _apply(logits, s: Penalties, counts, in_prompt) -> jax.Array:
    """logits [B, T, V] with the module's order applied: counts [B, T, V] the output's at each position, in_prompt
    [B, 1, V] whether the prompt holds each token."""
    B, _, V = logits.shape
    seen = in_prompt | (counts > 0)
    rp = s.repetition[:, None, None]
    x = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    x = x - s.frequency[:, None, None] * counts.astype(jnp.float32)
    x = x - s.presence[:, None, None] * (counts > 0).astype(jnp.float32)
    ids = jnp.where(s.bias_ids >= 0, s.bias_ids, V)
    bias = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], ids].add(s.bias, mode="drop")
    return x + bias[:, None, :]


def verify_logits(logits, pen: PenaltyState, lengths, drafts) -> jax.Array:
    """A round's logits [B, G + 1, V] (after x_n, d_1 .. d_G; x_n at position `lengths` [B] of the sequence) with
    each row's penalties: position i counts the output and d_1 .. d_i (drafts [B, G]; -1, an empty proposal,
    counts nothing)."""
    B, T, V = logits.shape
    output = _counts(pen.sequence, pen.prompt_lengths, lengths, V)
    in_prompt = _counts(pen.sequence, jnp.zeros_like(lengths), pen.prompt_lengths - 1, V) > 0
    ids = jnp.arange(V)
    counts = jnp.broadcast_to(output[:, None, :], (B, T, V))
    for g in range(drafts.shape[1]):  # d_{g+1} counts at positions g + 1 .. G: a few elementwise terms
        after = (jnp.arange(T) > g)[None, :, None]
        counts = counts + (after & (drafts[:, g, None, None] == ids)).astype(jnp.int32)
    return _apply(logits, pen.settings, counts, in_prompt[:, None, :])


def tree_logits(logits, pen: PenaltyState, lengths, tokens, ancestors) -> jax.Array:
    """A draft tree's verify logits [B, N + 1, V] (after its root x_n, at position `lengths` [B], and its nodes 1 .. N;
    decoding/tree.py) with each row's penalties: node j counts the output and its path's tokens (tokens [B, N] of
    nodes 1 .. N; ancestors [B, N + 1, N + 1], each node's ancestors and itself): what a plain decoding step after
    that path would see, `verify_logits` down every branch."""
    B, T, V = logits.shape
    output = _counts(pen.sequence, pen.prompt_lengths, lengths, V)
    in_prompt = _counts(pen.sequence, jnp.zeros_like(lengths), pen.prompt_lengths - 1, V) > 0
    shape = (B, T, tokens.shape[1])
    counts = jnp.broadcast_to(output[:, None, :], (B, T, V)).at[
        jnp.broadcast_to(jnp.arange(B)[:, None, None], shape), jnp.broadcast_to(jnp.arange(T)[None, :, None], shape),
        jnp.broadcast_to(tokens[:, None, :], shape)].add(ancestors[:, :, 1:].astype(jnp.int32))
    return _apply(logits, pen.settings, counts, in_prompt[:, None, :])


def first_logits(logits, settings: Penalties, history, lengths, prompt_lengths) -> jax.Array:
    """A prompt's first-token logits [P, V] with its penalties: history [P, L] holds the sequence x_0 .. x_{n-1}
    (n = lengths [P]); the output so far is positions prompt_lengths .. n - 1 (none for a new prompt)."""
    V = logits.shape[-1]
    output = _counts(history, prompt_lengths, lengths - 1, V)
    in_prompt = _counts(history, jnp.zeros_like(lengths), prompt_lengths - 1, V) > 0
    return _apply(logits[:, None, :], settings, output[:, None, :], in_prompt[:, None, :])[:, 0]


def admitted(pen: PenaltyState, slots, settings: Penalties, history, lengths, prompt_lengths, first,
             write_sequence: bool) -> PenaltyState:
    """The pool's penalty fields with the rows a chunk's final segments install at `slots` [P] (the pool's size: a
    segment that installs none, dropped): their settings, and with `write_sequence` (a penalty step whose chunk
    carries history [P, L]) their sequences x_0 .. x_{n-1}, then the first token x_n."""
    def put(pool, new):
        return pool.at[slots].set(new, mode="drop")

    pen = dataclasses.replace(pen, settings=jax.tree.map(put, pen.settings, settings),
                              prompt_lengths=put(pen.prompt_lengths, prompt_lengths))
    if not write_sequence:
        return pen
    L = pen.sequence.shape[1]
    sequence = put(pen.sequence, history[:, :L])
    return dataclasses.replace(pen, sequence=sequence.at[slots, lengths].set(first, mode="drop"))


def committed(pen: PenaltyState, lengths, choices, done) -> PenaltyState:
    """A round's committed tokens x_{n+1} .. x_{n+accepted+1} (choices [B, G + 1]) written after each live row's x_n
    (lengths [B] before the round); the choices past them land past the new length, stale; a row done before the
    round writes nothing."""
    L = pen.sequence.shape[1]
    at = lengths[:, None] + 1 + jnp.arange(choices.shape[1])[None, :]
    at = jnp.where(done[:, None], L, at)
    rows = jnp.arange(lengths.shape[0])[:, None]
    return dataclasses.replace(pen, sequence=pen.sequence.at[rows, at].set(choices, mode="drop"))


def prompt_lengths_of(lengths, generated):
    """[P] a chunk's final segments' prompt lengths: a recompute's sequence holds its prompt and all but the newest
    of the `generated` tokens it emitted (its resume token is x_n); a new prompt's is all prompt."""
    return lengths - jnp.maximum(generated - 1, 0)
