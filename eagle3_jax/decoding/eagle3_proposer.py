"""The EAGLE-3 drafter as a proposer (decoding/proposer.py): its state is the drafter's KV of the pairs
(g_t, x_{t+1}) in its own page pool (`DecodeState.draft_pages`, through the rows' page tables, `draft_lengths`
pairs a row) and its pre-norm output at the newest committed position (`draft_hidden`); it reads the target's
captured features, drafts a greedy (or, for sampled rows with proposal "sample", drawn) chain of gamma tokens,
and rebuilds its KV from the verified tokens' features."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from eagle3_jax.decoding import grammar as grammar_lib
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding import tree as tree_lib
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models.config import DrafterConfig
from eagle3_jax.models.kv_cache import Layout


def _embed(dparams, tparams):
    return dparams.get("embed", tparams["embed"])


@dataclasses.dataclass(frozen=True)
class Eagle3:
    """Static: the drafter's config (its weights travel as the steps' `dparams`)."""

    config: DrafterConfig
    partial = False  # always proposes gamma tokens
    samples_drafts = True  # proposal="sample" draws from its q
    keeps_history = False  # its state is KV in pages, no token history

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def feature_width(self) -> int:
        return self.config.feature_width

    def token_elements(self) -> int:
        """KV elements one token takes in its page pool (one layer, k and v)."""
        return 2 * self.config.num_kv_heads * self.config.head_dim

    def new_pages(self, num_pages: int, page_size: int, dtype):
        """Its page pool: as many pages as the target's, addressed by the same page tables."""
        return drafter_lib.new_pages(self.config, num_pages, page_size, dtype)

    def new_rows(self, batch: int, spec, dtype) -> dict:
        """Its fields of `batch` free slots."""
        return dict(draft_lengths=jnp.zeros((batch,), jnp.int32),
                    draft_hidden=jnp.zeros((batch, self.config.hidden_size), dtype))

    def admit(self, dparams, tparams, spec, state, chunk, successor, features, first, final):
        """The drafter's pages over a prefill chunk's pairs (g_t, x_{t+1}) (successor [C]: each token's x_{t+1};
        features [C, F]), written through the segments' page tables -> (state with its pages, the rows of the final
        segments: their pairs and the drafter's output at their last position)."""
        h = drafter_lib.project_features(dparams, self.config, features)
        out, pages = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h[None], successor[None],
                                         state.draft_pages, chunk.layout, spec.kernels, spec.tp)
        return dataclasses.replace(state, draft_pages=pages), dict(draft_lengths=chunk.lengths,
                                                                   draft_hidden=out[0, chunk.last])

    def propose(self, dparams, tparams, state, keys, spec):
        """The drafter's chain: (drafts [B, G] target ids, q [B, G, Vd] or None, q's target ids or None, the
        drafter's pages holding the chain's speculative entries). Greedy unless the build samples with proposal
        "sample": then sampled rows draw each draft from the drafter's filtered distribution q (the same
        filters as the target's), and greedy rows still take the argmax."""
        args = (dparams, self.config, _embed(dparams, tparams), state.draft_hidden, state.draft_pages, state.page_table,
                state.draft_lengths, spec.gamma, spec.kernels)
        write = ~state.done
        guide = None
        if state.grammar is not None and spec.constrain_drafts:  # the chain follows each row's automaton
            draft_ids = drafter_lib.to_target_id(dparams, jnp.arange(self.config.draft_vocab_size))
            guide = grammar_lib.draft_guide(state.grammar_tables, state.grammar, draft_ids)
        if not (spec.sampling and spec.proposal == "sample"):
            drafts, pages = drafter_lib.draft_chain(*args, write=write, tp=spec.tp, guide=guide)
            return drafts, None, None, pages
        s = state.sampling

        def propose(logits, step):
            q = sampling_lib.filtered_probs(logits, s.temperature, s.top_k, s.top_p, filter=spec.filter)
            drawn = sampling_lib.categorical(sampling_lib.draft_key(keys, step), q)
            return jnp.where(s.greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn), q

        drafts, q, pages = drafter_lib.draft_chain(*args, propose=propose, write=write, tp=spec.tp, guide=guide)
        # q lives on the draft vocabulary, 0 for every other target token.
        return drafts, q, drafter_lib.to_target_id(dparams, jnp.arange(self.config.draft_vocab_size)), pages

    def propose_tree(self, dparams, tparams, state, spec):
        """The drafter's tree of spec.tree's shape (decoding/tree.py) -> (tree_lib.Tree, the drafter's pages
        holding the beams' speculative entries). The same tree for greedy and sampled rows: its drafts are the
        drafter's top_k, deterministic."""
        shape = spec.tree
        scores, tokens, parents, pages = drafter_lib.draft_tree(
            dparams, self.config, _embed(dparams, tparams), state.draft_hidden, state.draft_pages, state.page_table,
            state.draft_lengths, shape.depth, shape.top_k, spec.kernels, write=~state.done, tp=spec.tp)
        return tree_lib.build(scores, tokens, parents, shape.nodes, shape.depth), pages

    def update(self, dparams, tparams, old, new, carry, choices, accepted, features, spec):
        """The target's choices are the true next tokens: (g_{n+i}, choices_i) for i <= accepted are the newly
        committed pairs; the drafter's own speculative entries (in `carry`, its pages) are overwritten."""
        live = ~old.done
        h = drafter_lib.project_features(dparams, self.config, features)
        layout = Layout.uniform(old.page_table, old.draft_lengths, choices.shape[1], live)
        out, pages = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h, choices, carry, layout,
                                         spec.kernels, spec.tp)
        return dataclasses.replace(
            new,
            draft_pages=pages,
            draft_lengths=new.lengths,
            draft_hidden=jnp.where(live[:, None], out[jnp.arange(choices.shape[0]), accepted], old.draft_hidden),
        )

    def catch_up(self, dparams, tparams, state, held, live, spec):
        """The rebuild over every held pair (held.features [B, H, C], held.tokens [B, H]) in one pass, and each
        held pair's would-be first draft d_1 matched against its token [B, H] (for the lm_head's price). Entries
        past a row's count land past its committed pairs, stale. Rows `live` [B] when the call began write
        theirs, those that finished inside the call included (their pages stay theirs until the host reads
        the call, and the prefix cache keeps them); a row done before it writes nothing (its pages may be
        another row's by now)."""
        count = state.lengths - state.draft_lengths
        h = drafter_lib.project_features(dparams, self.config, held.features)
        layout = Layout.uniform(state.page_table, state.draft_lengths, held.tokens.shape[1], live)
        out, pages = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h, held.tokens,
                                         state.draft_pages, layout, spec.kernels)
        before = jnp.concatenate([state.draft_hidden[:, None], out[:, :-1]], axis=1)  # where each pair's d_1 is from
        matched = drafter_lib.draft_token(dparams, self.config, before) == held.tokens
        rows = jnp.arange(count.shape[0])
        caught_up = dataclasses.replace(
            state,
            draft_pages=pages,
            draft_lengths=state.lengths,
            draft_hidden=jnp.where((count > 0)[:, None], out[rows, jnp.maximum(count - 1, 0)], state.draft_hidden),
        )
        return caught_up, matched
