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
  a draft tree's round only (decoding/tree.py; gamma is then the tree's depth, and choices, drafts and accepted are
  those of its accepted path; prefill's rows carry these columns too, zeros):
  tree_tokens   N      the tree's nodes 1 .. N, as target ids (node 0, the root, is the newest token x_n)
  tree_parents  N      each node's parent node (0: the root)
  path          gamma  the accepted path's nodes at depths 1 .. gamma (valid up to accepted; 0 past it)
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

_COLUMNS = ("choices", "drafts", "emitted", "accepted", "done", "logprobs", "tree_tokens", "tree_parents", "path",
            "shadow")


def _widths(gamma: int, logprobs: bool, tree_nodes: int = 0) -> dict[str, int]:
    logprob_columns = (gamma + 1) * logprobs_lib.width() if logprobs else 0
    tree = (tree_nodes, tree_nodes, gamma) if tree_nodes else (0, 0, 0)
    return dict(zip(_COLUMNS, (gamma + 1, gamma, 1, 1, 1, logprob_columns, *tree, 2)))


def width(gamma: int, logprobs: bool = False, tree_nodes: int = 0) -> int:
    """The packed row's width: 2 gamma + 6, (gamma + 1) logprobs.width() more with logprobs, and a tree of N nodes'
    2 N + gamma more."""
    return sum(_widths(gamma, logprobs, tree_nodes).values())


def pack(choices, drafts, emitted, accepted, done, shadow=None, logprobs=None, tree=None) -> jax.Array:
    """The columns (choices [B, gamma + 1], drafts [B, gamma], shadow [B, 2] (None: zeros), logprobs [B, gamma + 1,
    logprobs.width()] int32 (None: none), tree (None, or a tree round's (tree_tokens [B, N], tree_parents [B, N],
    path [B, gamma])), the rest [B]) as one int32 array [B, width(gamma, logprobs given, N)]."""
    shadow = jnp.zeros(emitted.shape + (2,), jnp.int32) if shadow is None else shadow
    columns = ((choices, drafts, emitted, accepted, done) + (() if logprobs is None else (logprobs,))
               + tuple(tree or ()) + (shadow,))
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
    tree: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # a tree round's (tree_tokens, tree_parents, path)

    @classmethod
    def unpack(cls, packed: np.ndarray, gamma: int, tree_nodes: int = 0) -> RoundOutput:
        """packed [B, width(gamma, logprobs, tree_nodes)], with or without logprobs, as `pack` wrote it (tree_nodes: a
        tree round's N, else 0)."""
        plain, with_logprobs = width(gamma, False, tree_nodes), width(gamma, True, tree_nodes)
        if packed.shape[-1] not in (plain, with_logprobs):
            tree = f" and a tree of {tree_nodes} nodes" if tree_nodes else ""
            raise ValueError(f"a round of gamma {gamma}{tree} packs {plain} columns ({with_logprobs} with logprobs), "
                             f"got {packed.shape[-1]}")
        at, columns, has_logprobs = 0, {}, packed.shape[-1] == with_logprobs
        for name, w in _widths(gamma, has_logprobs, tree_nodes).items():
            columns[name] = packed[:, at : at + w]
            at += w
        emitted, accepted, done = (columns[k][:, 0] for k in ("emitted", "accepted", "done"))
        # Whole-array tolist, then list slices: per-row numpy work costs seconds at thousands of rows.
        tokens = [row[:n] for row, n in zip(columns["choices"].tolist(), emitted.tolist())]
        logprobs = columns["logprobs"].reshape(len(tokens), gamma + 1, logprobs_lib.width()) if has_logprobs else None
        tree = tuple(columns[name] for name in ("tree_tokens", "tree_parents", "path")) if tree_nodes else None
        return cls(tokens, columns["choices"], columns["drafts"], accepted, done.astype(bool), emitted,
                   columns["shadow"], logprobs, tree)
