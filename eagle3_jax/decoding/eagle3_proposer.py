"""The EAGLE-3 drafter as a proposer (decoding/proposer.py): its state is the drafter's KV cache of the pairs
(g_t, x_{t+1}) and its pre-norm output at the newest committed position (`DecodeState.draft_cache`,
`draft_hidden`); it reads the target's captured features, drafts a greedy (or, for sampled rows with proposal
"sample", drawn) chain of gamma tokens, and rebuilds its cache from the verified tokens' features."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models.eagle3 import DrafterConfig


def _embed(dparams, tparams):
    return dparams.get("embed", tparams["embed"])


@dataclasses.dataclass(frozen=True)
class Eagle3:
    """Static: the drafter's config (its weights travel as the steps' `dparams`)."""

    config: DrafterConfig
    partial = False  # always proposes gamma tokens
    samples_drafts = True  # proposal="sample" draws from its q

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def feature_width(self) -> int:
        return self.config.feature_width

    @property
    def head_dims(self) -> tuple[int, ...]:
        return (self.config.head_dim,)

    def row_bytes(self, max_len: int) -> int:
        """KV elements one row of its cache holds at max_len (one layer, k and v)."""
        return 2 * self.config.num_kv_heads * max_len * self.config.head_dim

    def prefill(self, dparams, tparams, spec, tokens, prompt_lengths, first, features) -> dict:
        """The drafter cache over the prompt's pairs (g_t, x_{t+1}), t < prompt length: the prompt shifted left,
        then the first token."""
        B, Tp = tokens.shape
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        nxt = jnp.where(jnp.arange(Tp)[None, :] == prompt_lengths[:, None] - 1, first[:, None], nxt)
        cache = drafter_lib.new_cache(self.config, B, spec.max_len, tparams["embed"].dtype)
        h = drafter_lib.project_features(dparams, self.config, features)
        out, cache = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h, nxt, cache, spec.kernels,
                                         spec.tp)
        return dict(draft_cache=cache.with_lengths(prompt_lengths), draft_hidden=out[jnp.arange(B), prompt_lengths - 1])

    def propose(self, dparams, tparams, state, keys, spec):
        """The drafter's chain: (drafts [B, G] target ids, q [B, G, Vd] or None, q's target ids or None, the
        drafter cache holding the chain's speculative entries). Greedy unless the build samples with proposal
        "sample": then sampled rows draw each draft from the drafter's filtered distribution q (the same
        filters as the target's), and greedy rows still take the argmax."""
        args = (dparams, self.config, _embed(dparams, tparams), state.draft_hidden, state.draft_cache, spec.gamma,
                spec.kernels)
        if not (spec.sampling and spec.proposal == "sample"):
            drafts, cache = drafter_lib.draft_chain(*args, tp=spec.tp)
            return drafts, None, None, cache
        s = state.sampling

        def propose(logits, step):
            q = sampling_lib.filtered_probs(logits, s.temperature, s.top_k, s.top_p, filter=spec.filter)
            drawn = sampling_lib.categorical(sampling_lib.draft_key(keys, step), q)
            return jnp.where(s.greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn), q

        drafts, q, cache = drafter_lib.draft_chain(*args, propose=propose, tp=spec.tp)
        # q lives on the draft vocabulary, 0 for every other target token.
        return drafts, q, drafter_lib.to_target_id(dparams, jnp.arange(self.config.draft_vocab_size)), cache

    def update(self, dparams, tparams, old, new, carry, choices, accepted, features, spec):
        """The target's choices are the true next tokens: (g_{n+i}, choices_i) for i <= accepted are the newly
        committed pairs; the drafter's own speculative entries (in `carry`, its cache) are overwritten."""
        live = ~old.done
        h = drafter_lib.project_features(dparams, self.config, features)
        out, cache = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h, choices, carry,
                                         spec.kernels, spec.tp)
        return dataclasses.replace(
            new,
            draft_cache=cache.with_lengths(new.target_cache.lengths),
            draft_hidden=jnp.where(live[:, None], out[jnp.arange(choices.shape[0]), accepted], old.draft_hidden),
        )

    def catch_up(self, dparams, tparams, state, held, spec):
        """The rebuild over every held pair (held.features [B, H, C], held.tokens [B, H]) in one pass, and each
        held pair's would-be first draft d_1 matched against its token [B, H] (for the lm_head's price). Entries
        past a row's count are stale and ignored (`with_lengths`)."""
        count = state.target_cache.lengths - state.draft_cache.lengths
        h = drafter_lib.project_features(dparams, self.config, held.features)
        out, cache = drafter_lib.forward(dparams, self.config, _embed(dparams, tparams), h, held.tokens,
                                         state.draft_cache, spec.kernels)
        before = jnp.concatenate([state.draft_hidden[:, None], out[:, :-1]], axis=1)  # where each pair's d_1 is from
        matched = drafter_lib.draft_token(dparams, self.config, before) == held.tokens
        rows = jnp.arange(count.shape[0])
        caught_up = dataclasses.replace(
            state,
            draft_cache=cache.with_lengths(state.target_cache.lengths),
            draft_hidden=jnp.where((count > 0)[:, None], out[rows, jnp.maximum(count - 1, 0)], state.draft_hidden),
        )
        return caught_up, matched
