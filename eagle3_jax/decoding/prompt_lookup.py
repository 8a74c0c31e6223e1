"""Prompt lookup (n-gram) drafting as a proposer (decoding/proposer.py): no weights, no features; its state is
each row's token history, prompt and output, a fixed-width device array (`DecodeState.history` [B, max_len],
x_0 .. x_n at positions 0 .. n, n = the row's committed length; later entries are stale), searched on the device
inside the round's jitted scan.

The rule, for a row whose newest token is x_n: for n-gram sizes k = max_ngram down to min_ngram, the first k
whose suffix x_{n-k+1} .. x_n occurs earlier wins, at its LATEST earlier occurrence x_{j-k+1} .. x_j (j < n; the
occurrence may overlap the suffix); the proposal is x_{j+1} .. x_{j+gamma}, cut at x_n (only known tokens are
proposed, so a match near the end proposes fewer than gamma). No match: no proposal. vLLM's `ngram` proposer
also takes the longest n-gram in [min, max] but its EARLIEST occurrence; transformers'
`prompt_lookup_num_tokens` tries sizes from its max down to 1 and also takes the earliest occurrence. Both cut
the proposal at the last known token, as here. The latest occurrence is taken because it continues the most
recent context: when the output retraces a file, an n-gram that repeats within the file is followed, at its
latest occurrence, by the text the output is copying now.

The proposal is a token, not a distribution: a sampled row's q is one-hot at it, accepted with probability
p(x) (lossless), so `proposal="sample"` changes nothing for it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from eagle3_jax.decoding.request import is_int

NO_DRAFT = -1  # a draft position the proposer left empty (RoundTrace.drafted shows it)


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup drafting: passed where a drafter goes, `Engine(target, PromptLookup(), ...)`.
    max_ngram, min_ngram: the n-gram sizes tried, largest first (1 <= min_ngram <= max_ngram)."""

    max_ngram: int = 4
    min_ngram: int = 1
    partial = True  # may propose fewer than gamma tokens (none, without a match)
    samples_drafts = False  # a token, never a distribution: proposal="sample" is proposal="argmax"
    capture_layers = ()  # reads no target features
    feature_width = 0

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"PromptLookup's {name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup's min_ngram ({self.min_ngram}) must be at most max_ngram "
                             f"({self.max_ngram})")
        object.__setattr__(self, "max_ngram", int(self.max_ngram))
        object.__setattr__(self, "min_ngram", int(self.min_ngram))

    def token_elements(self) -> int:
        """No KV: the history's int32s are small beside the target's KV (counted as 0 elements)."""
        return 0

    def new_pages(self, num_pages: int, page_size: int, dtype):
        """No page pool of its own."""
        return None

    def new_rows(self, batch: int, spec, dtype) -> dict:
        """Its field of `batch` free slots: an empty history."""
        return dict(history=jnp.zeros((batch, spec.max_len), jnp.int32))

    keeps_history = True  # a chunk brings each joining row's whole sequence (live_plan.ChunkPlan.history)

    def admit(self, dparams, tparams, spec, state, chunk, successor, features, first, final):
        """A final segment's row's history: its whole sequence (the chunk's, cached prefix included), then its first
        token -> (state, no row fields of its own)."""
        joined = jnp.where(final, chunk.slot, state.history.shape[0])  # a segment that does not end it: dropped
        history = state.history.at[joined].set(chunk.history, mode="drop")
        history = history.at[joined, chunk.lengths].set(first, mode="drop")
        return dataclasses.replace(state, history=history), {}

    def propose(self, dparams, tparams, state, keys, spec):
        """(drafts [B, gamma], NO_DRAFT past each row's proposal; no q; no q ids; nothing to carry)."""
        return lookup(state.history, state.lengths, spec.gamma, self.max_ngram, self.min_ngram), \
            None, None, None

    def update(self, dparams, tparams, old, new, carry, choices, accepted, features, spec):
        """The round's committed tokens x_{n+1} .. x_{n+accepted+1} (choices[:accepted + 1]) appended to the
        history of each live row; the choices past them land past the new length, stale."""
        n = old.lengths
        at = n[:, None] + 1 + jnp.arange(choices.shape[1])[None, :]
        at = jnp.where(old.done[:, None], spec.max_len, at)  # a frozen row writes nothing (dropped)
        rows = jnp.arange(n.shape[0])[:, None]
        return dataclasses.replace(new, history=old.history.at[rows, at].set(choices, mode="drop"))

    def shadow(self, old, choices, num_emit, spec):
        """A plain round's evidence for "auto" (round_output's shadow columns): per row that emitted, whether
        the would-be first draft (none without a match: a miss) equals the token the round emitted, and 1."""
        first = lookup(old.history, old.lengths, 1, self.max_ngram, self.min_ngram)[:, 0]
        emitted = num_emit > 0
        return jnp.stack([emitted & (first == choices[:, 0]), emitted], axis=1).astype(jnp.int32)


def lookup(history, n, gamma: int, max_ngram: int, min_ngram: int):
    """The proposals [B, gamma] of the module's rule for rows of `history` [B, L] whose newest token is at n [B]:
    the continuation's tokens, NO_DRAFT past its end (or everywhere, without a match)."""
    B, L = history.shape
    positions = jnp.arange(L)[None, :]
    rows = jnp.arange(B)
    match = positions < n[:, None]  # occurrences end before the newest token
    best = jnp.full((B,), -1, jnp.int32)  # the winning occurrence's last position j, -1: none yet
    for i in range(max_ngram):  # i: the offset from the end of the n-gram; k = i + 1 tokens compared so far
        shifted = jnp.pad(history, ((0, 0), (i, 0)), constant_values=-1)[:, :L]  # x_{j-i} at j (-1 before 0)
        suffix = history[rows, jnp.clip(n - i, 0, L - 1)]
        match = match & (shifted == suffix[:, None]) & (n >= i)[:, None]
        if i + 1 >= min_ngram:
            latest = jnp.max(jnp.where(match, positions, -1), axis=1).astype(jnp.int32)
            best = jnp.where(latest >= 0, latest, best)  # a longer k, tried later in this loop, overrides
    at = best[:, None] + 1 + jnp.arange(gamma)[None, :]
    found = (best >= 0)[:, None] & (at <= n[:, None])
    return jnp.where(found, history[rows[:, None], jnp.clip(at, 0, L - 1)], NO_DRAFT).astype(jnp.int32)

