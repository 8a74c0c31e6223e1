"""What prefill and each speculative round report to the host, packed into one int32 array per round so
that a call needs a single device-to-host transfer. The layout lives here alone: `pack` writes it on the
device and `RoundOutput.unpack` reads it on the host.

Columns of a row, in order (gamma: the drafts per round):
  choices   gamma + 1  the target's choices after each of [x_n, d_1 .. d_gamma] (prefill: its token, then 0s)
  drafts    gamma      the drafter's proposals, as target ids
  emitted   1          how many of the choices the row emitted (cut by a stop token, max_new_tokens, max_len)
  accepted  1          how many drafts the row committed: the drafts among its emitted tokens
  done      1          whether the row has finished
  shadow    1          a gamma-0 round with a drafter: 1 when the drafter's first draft, which the round did not
                       propose, equals the token the row emitted, 0 when not; -1 where there is no such
                       observation (a round that drafted, prefill, no drafter, a row that emitted nothing).
                       It lets the gamma policy (gamma_policy.py) see the drafter improve while it is not used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_COLUMNS = ("choices", "drafts", "emitted", "accepted", "done", "shadow")


def _widths(gamma: int) -> dict[str, int]:
    return dict(zip(_COLUMNS, (gamma + 1, gamma, 1, 1, 1, 1)))


def width(gamma: int) -> int:
    """The packed row's width: 2 gamma + 5."""
    return sum(_widths(gamma).values())


def pack(choices, drafts, emitted, accepted, done, shadow=None) -> jax.Array:
    """The columns (choices [B, gamma + 1], drafts [B, gamma], the rest [B]; shadow None: -1, no observation)
    as one int32 array [B, width(gamma)]."""
    shadow = jnp.full(emitted.shape, -1, jnp.int32) if shadow is None else shadow
    columns = (choices, drafts, emitted, accepted, done, shadow)
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
    shadow: np.ndarray  # [B] 1 / 0: a gamma-0 round's unproposed first draft matched / did not; -1: none

    @classmethod
    def unpack(cls, packed: np.ndarray, gamma: int) -> RoundOutput:
        """packed [B, width(gamma)], as `pack` wrote it."""
        if packed.shape[-1] != width(gamma):
            raise ValueError(f"a round of gamma {gamma} packs {width(gamma)} columns, got {packed.shape[-1]}")
        at, columns = 0, {}
        for name, w in _widths(gamma).items():
            columns[name] = packed[:, at : at + w]
            at += w
        emitted, accepted, done, shadow = (columns[k][:, 0] for k in ("emitted", "accepted", "done", "shadow"))
        # Whole-array tolist, then list slices: per-row numpy work costs seconds at thousands of rows.
        tokens = [row[:n] for row, n in zip(columns["choices"].tolist(), emitted.tolist())]
        return cls(tokens, columns["choices"], columns["drafts"], accepted, done.astype(bool), emitted, shadow)
