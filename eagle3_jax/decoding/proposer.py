"""The seam between the speculative round (spec_round.py) and what proposes its drafts. docs/proposers.md
explains the split; in short, a proposer owns its drafts and its own state, and the round owns everything
that makes the output lossless (verify, acceptance, the cache rewind) and everything the engine shares
between proposers (the pool, "auto" gamma's held pairs and round costs, the trace).

A proposer is a frozen, hashable object (it is part of `StepSpec`, a static argument of the jitted steps);
its weights, if any, travel beside the target's as the steps' `dparams`. The round calls, inside its jit:

  new_rows(batch, spec, dtype) -> {DecodeState field: value}
      its fields of `batch` free slots;
  admit(dparams, tparams, spec, state, chunk, successor, features, first, final) -> (state, {field: [P, ...]})
      its state for a prefill chunk (spec_round.Chunk; successor [C]: each chunk token's next token; features
      [C, F]: their captured target features, or None; first [P]: each segment's first token; final [P]: the
      segments that end their prompts): the pool's state with what it writes for the chunk, and the fields of the
      rows the final segments install;
  propose(dparams, tparams, state, keys, spec) -> (drafts [B, gamma], q or None, q_ids or None, carry)
      up to gamma drafts per row as target ids, NO_DRAFT (-1) past a row's proposal when `partial`; q the
      distribution sampled drafts were drawn from (None: one-hot at the draft) over the token ids q_ids
      (None: the whole vocabulary); carry, anything `update` needs from the proposal;
  update(dparams, tparams, old, new, carry, choices, accepted, features, spec) -> DecodeState
      told what the round accepted (choices [B, gamma + 1], accepted [B]; `new` holds the round's commit),
      it updates its own fields of `new` (`features`: the verified tokens' target features, or None);

and declares, as attributes: `capture_layers` (the target layers whose hidden states it reads; () for none),
`feature_width`, `partial` (it may propose fewer than gamma tokens), `samples_drafts` (proposal="sample" means
something to it), `keeps_history` (a chunk must bring each joining row's whole sequence: Chunk.history),
`token_elements()` (the KV elements one token takes in its page pool) and `new_pages(num_pages, page_size, dtype)`
(its page pool, addressed by the target's page tables; None for none). A proposer that reads features may also define
`catch_up(dparams, tparams, state, held, live, spec) -> (state, matched [B, H])`, the rebuild over the pairs "auto"'s
plain rounds held back, written for the rows `live` when the call began (its `update` is then skipped at gamma 0);
one that reads none has its `update` run every round and defines `shadow(old, choices, num_emit, spec) -> [B, 2]`,
a plain round's evidence for "auto" (round_output's shadow columns). One that drafts trees (EAGLE-3; draft_top_k > 1)
defines `propose_tree(dparams, tparams, state, spec) -> (decoding/tree.Tree, carry)`, spec.tree's shape; the tree
round then calls its `update` with the accepted path's choices and features.
"""

from __future__ import annotations

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.decoding.prompt_lookup import PromptLookup


def resolve(drafter) -> tuple:
    """What `Engine(target, drafter)` was given, as (the proposer, its weights): an EAGLE-3 `Drafter`, a
    `PromptLookup`, or None (spec off: (None, None)); anything else, a ValueError."""
    if drafter is None:
        return None, None
    if isinstance(drafter, Drafter):
        return Eagle3(drafter.config), drafter.params
    if isinstance(drafter, PromptLookup):
        return drafter, None
    raise ValueError(f"drafter must be an EAGLE-3 Drafter (load_drafter), a PromptLookup or None, got "
                     f"{type(drafter).__name__}")


def holds_pairs(proposer) -> bool:
    """Whether plain rounds hold their pairs back for it ("auto"): it reads the target's features."""
    return proposer is not None and bool(proposer.capture_layers)
