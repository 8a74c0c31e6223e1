"""What prefill and each speculative round report to the host, packed into one int32 array per round so
that a call needs a single device-to-host transfer. The layout lives here alone: `pack` writes it on the
device and `RoundOutput.unpack` reads it on the host.

Columns of a row, in order (gamma: the drafts per round):
  choices   gamma + 1  the target's choices after each of [x_n, d_1 .. d_gamma] (prefill: its token, then 0s)
  drafts    gamma      the drafter's proposals, as target ids
  emitted   1          how many of the choices the row emitted (cut by a stop token, max_new_tokens, max_len)
  accepted  1          how many drafts the row committed: the drafts among its emitted tokens
  done      1          whether the row has finished
  logprobs  (gamma + 1) x logprobs.width(), only from a step built with logprobs (StepSpec.logprobs): each
                       choice's logprob and the most likely tokens at its position (logprobs.py; prefill: its
                       token's, then 0s)
  shadow    2          gamma-0 rounds' evidence for the gamma policy (gamma_policy.py), so it sees a proposer
                       improve while it is not used: how many committed tokens equalled the proposer's would-be
                       first draft, and over how many. EAGLE-3 gives it in the last round of a call that brought
                       the drafter up to date (spec_round._catch_up, over the pairs it caught up on), prompt
                       lookup in every gamma-0 round; 0, 0 otherwise. Last, where _catch_up writes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding import logprobs as logprobs_lib

_COLUMNS = ("choices", "drafts", "emitted", "accepted", "done", "logprobs", "shadow")


def _widths(gamma: int, logprobs: bool) -> dict[str, int]:
    return dict(zip(_COLUMNS, (gamma + 1, gamma, 1, 1, 1, (gamma + 1) * logprobs_lib.width() if logprobs else 0,
                               2)))


def width(gamma: int, logprobs: bool = False) -> int:
    """The packed row's width: 2 gamma + 6, and (gamma + 1) logprobs.width() more with logprobs."""
    return sum(_widths(gamma, logprobs).values())


def pack(choices, drafts, emitted, accepted, done, shadow=None, logprobs=None) -> jax.Array:
    """The columns (choices [B, gamma + 1], drafts [B, gamma], shadow [B, 2] (None: zeros), logprobs [B, gamma + 1,
    logprobs.width()] int32 (None: none), the rest [B]) as one int32 array [B, width(gamma, logprobs given)]."""
    shadow = jnp.zeros(emitted.shape + (2,), jnp.int32) if shadow is None else shadow
    columns = (choices, drafts, emitted, accepted, done) + (() if logprobs is None else (logprobs,)) + (shadow,)
    return jnp.concatenate([c.reshape(c.shape[0], -1).astype(jnp.int32) for c in columns], axis=1)


@dataclasses.dataclass(frozen=True)
class RoundOutput:
    """The host's view of one round (or of prefill) of B rows."""

    tokens: list[list[int]]  # the tokens each row emitted
    choices: np.ndarray  # [B, gamma + 1] the target's choices (RoundTrace.target)
    drafts: np.ndarray  # [B, gamma]
    accepted: np.ndarray  # [B] drafts committed
    done: np.ndarray  # [B] bool
    emitted: np.ndarray  # [B] tokens emitted
    shadow: np.ndarray  # [B, 2] (pairs whose would-be first draft matched, pairs) a catch-up reported
    logprobs: np.ndarray | None = None  # [B, gamma + 1, logprobs.width()] int32, from a step built with logprobs

    @classmethod
    def unpack(cls, packed: np.ndarray, gamma: int) -> RoundOutput:
        """packed [B, width(gamma)] or [B, width(gamma, logprobs=True)], as `pack` wrote it."""
        if packed.shape[-1] not in (width(gamma), width(gamma, True)):
            raise ValueError(f"a round of gamma {gamma} packs {width(gamma)} columns ({width(gamma, True)} with "
                             f"logprobs), got {packed.shape[-1]}")
        at, columns, has_logprobs = 0, {}, packed.shape[-1] == width(gamma, True)
        for name, w in _widths(gamma, has_logprobs).items():
            columns[name] = packed[:, at : at + w]
            at += w
        emitted, accepted, done = (columns[k][:, 0] for k in ("emitted", "accepted", "done"))
        # Whole-array tolist, then list slices: per-row numpy work costs seconds at thousands of rows.
        tokens = [row[:n] for row, n in zip(columns["choices"].tolist(), emitted.tolist())]
        logprobs = columns["logprobs"].reshape(len(tokens), gamma + 1, logprobs_lib.width()) if has_logprobs else None
        return cls(tokens, columns["choices"], columns["drafts"], accepted, done.astype(bool), emitted,
                   columns["shadow"], logprobs)
