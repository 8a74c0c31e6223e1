"""Prefill and the speculative round: pure functions over a `DecodeState`; the engine jits prefill and a
scan of rounds.

Invariants, per row b:
  * the target cache holds committed tokens x_0 .. x_{n-1} (n = lengths[b]); x_n, the newest token,
    is `last_token` and is not in any cache yet;
  * the drafter cache holds the pairs (g_t, x_{t+1}) for t < m, at positions t; `draft_hidden` is the
    drafter's pre-norm output at position m - 1, from which d_1 comes. m = n, except after gamma-0 calls that
    held their pairs back (`DecodeState.held` keeps the n - m pairs): a call that drafts starts at m = n;
  * a row that is done is frozen: nothing it owns changes any more, but for a flush's catch-up, which may
    bring the drafter cache of a row that finished while pairs were held up to date (it emits nothing).
A round with gamma = 0 is a plain decoding step (with a drafter, `spec_rounds` keeps the drafter's pairs).

Rows decode greedily unless the step is built for sampling (`StepSpec.sampling`): then each row's
settings travel in `DecodeState.sampling`, rows with temperature 0 still take the argmax path (the same
tokens as the greedy build), and the others sample losslessly (decoding/sampling.py).

Under tensor parallelism (`StepSpec.tp`) these functions run on each device inside a shard_map
(parallel/steps.py), `StepSpec.target` being the per-device config: the target's logits are the device's
slice of the vocabulary, and every choice over them (argmax, filters, draws) goes through `_vocab(spec)`,
which combines the slices; the drafter and everything else is replicated, computed alike on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import round_output
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding.request import Request
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.models.eagle3 import DrafterConfig
from eagle3_jax.models.kv_cache import KVCache
from eagle3_jax.parallel.collectives import Shards, Vocab


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeldPairs:
    """The pairs (g_t, x_{t+1}) committed by gamma-0 calls that did not bring the drafter up to date: row b
    holds target_cache.lengths - draft_cache.lengths of them, from position draft_cache.lengths on."""

    features: jax.Array  # [B, H, C] the target's features g_t
    tokens: jax.Array  # [B, H] int32 x_{t+1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    target_cache: KVCache
    draft_cache: KVCache | None
    last_token: jax.Array  # [B] int32, x_n
    draft_hidden: jax.Array | None  # [B, D] drafter output at position n - 1
    num_generated: jax.Array  # [B] int32, tokens emitted so far
    max_new: jax.Array  # [B] int32, the request's max_new_tokens
    stop_ids: jax.Array  # [B, P] int32 padded with -1
    done: jax.Array  # [B] bool
    sampling: sampling_lib.SamplingParams | None = None  # per-row settings; None in a greedy build
    held: HeldPairs | None = None  # pairs gamma-0 calls held back from the drafter; None unless StepSpec.held


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about the jitted steps (hashable, so it is a static argument)."""

    target: Qwen3Config
    drafter: DrafterConfig | None
    gamma: int
    max_len: int
    kernels: str  # see eagle3_jax/models/kernels.py
    sampling: bool = False  # rows may sample (DecodeState.sampling); False: every row is greedy
    proposal: str = "argmax"  # how sampled rows draft: "argmax" (q one-hot) or "sample" (x ~ q)
    # Which exact search finds a sampling build's top-k / top-p cuts (sampling.FILTERS): "candidates" only
    # when every sampled row's top_k is in [1, 64] (sampling.filter_for), "radix" for any settings.
    filter: str = "radix"
    # The target's decode and verify steps on the EXACT kernels: a token's logits are bit-identical
    # whether it is verified among gamma + 1 or decoded alone (eagle3_jax/models/kernels.py).
    exact: bool = False
    # The pairs gamma-0 calls may hold back from the drafter (DecodeState.held): 0, or at least a call's rounds.
    held: int = 0
    # Whether a gamma-0 call with a drafter brings it up to date at its end (else it holds the call's pairs;
    # the host flushes before the held pairs would overflow and before any call that drafts).
    flush: bool = True
    # Tensor parallel: the mesh axis the target is split over (target is then the per-device config).
    tp: Shards | None = None

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.drafter.capture_layers if self.drafter else ()

    @property
    def step_kernels(self) -> str:
        """The kernels of the target's decode/verify steps (prefill and the drafter run `kernels`)."""
        return kernels_lib.EXACT if self.exact else self.kernels


def _vocab(spec: StepSpec) -> Vocab:
    """Reductions over the target's logits: whole, or this device's slice of the vocabulary."""
    return Vocab(spec.tp)


def _emit(spec: StepSpec, state: DecodeState, new_tokens, num_new, new_length):
    """How many of new_tokens [B, M] (the first num_new of them) each row emits, and who is done.

    Cuts at the first stop token (included), at max_new_tokens, and at max_len; frozen rows emit 0.
    """
    M = new_tokens.shape[1]
    idx = jnp.arange(M)[None, :]
    is_stop = jnp.any(new_tokens[:, :, None] == state.stop_ids[:, None, :], axis=-1) & (idx < num_new[:, None])
    until_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, num_new)
    budget = state.max_new - state.num_generated
    num_emit = jnp.where(state.done, 0, jnp.minimum(until_stop, budget))
    hit_stop = jnp.any(is_stop & (idx < num_emit[:, None]), axis=1)
    # The sequence (prompt + output) is new_length + 1 long: the newest token is not in the cache.
    full = (num_emit >= budget) | (new_length + 1 >= spec.max_len)
    done = state.done | hit_stop | full
    return num_emit, done


def prefill(tparams, dparams, request: Request, *, spec: StepSpec):
    """A request (its arrays on the device; `request.sampling` set when spec.sampling) -> (DecodeState, the
    first token packed as a round's output)."""
    tokens, prompt_lengths, sampling = request.tokens, request.lengths, request.sampling
    B, Tp = tokens.shape
    dtype = tparams["embed"].dtype
    cache = target_lib.new_cache(spec.target, B, spec.max_len, dtype)
    hidden, cache, features = target_lib.forward(tparams, spec.target, tokens, cache, spec.capture_layers, spec.kernels,
                                                 spec.tp)
    rows = jnp.arange(B)
    logits = target_lib.logits(tparams, hidden[rows, prompt_lengths - 1])
    vocab = _vocab(spec)
    first = vocab.argmax(logits)
    if spec.sampling:
        s = sampling
        probs = sampling_lib.filtered_probs(logits, s.temperature, s.top_k, s.top_p, vocab, filter=spec.filter)
        drawn = sampling_lib.first_token(sampling_lib.row_keys(s.seed, prompt_lengths), probs, vocab)
        first = jnp.where(s.greedy, first, drawn)
    draft_cache = draft_hidden = None
    if spec.drafter is not None:
        # Pairs (g_t, x_{t+1}) for t < prompt length: the prompt shifted left, then the first token.
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        nxt = jnp.where(jnp.arange(Tp)[None, :] == prompt_lengths[:, None] - 1, first[:, None], nxt)
        draft_cache = drafter_lib.new_cache(spec.drafter, B, spec.max_len, dtype)
        embed = dparams.get("embed", tparams["embed"])
        h = drafter_lib.project_features(dparams, spec.drafter, features)
        out, draft_cache = drafter_lib.forward(dparams, spec.drafter, embed, h, nxt, draft_cache, spec.kernels, spec.tp)
        draft_hidden = out[rows, prompt_lengths - 1]
        draft_cache = draft_cache.with_lengths(prompt_lengths)
    held = None
    if spec.held:
        held = HeldPairs(jnp.zeros((B, spec.held, spec.drafter.feature_width), dtype),
                         jnp.zeros((B, spec.held), jnp.int32))
    zeros = jnp.zeros((B,), jnp.int32)
    state = DecodeState(
        target_cache=cache.with_lengths(prompt_lengths),
        draft_cache=draft_cache,
        last_token=first,
        draft_hidden=draft_hidden,
        num_generated=zeros,
        max_new=request.max_new,
        stop_ids=request.stop_ids,
        done=prompt_lengths >= spec.max_len,  # no room for even one token
        sampling=sampling,
        held=held,
    )
    num_emit, done = _emit(spec, state, first[:, None], jnp.ones((B,), jnp.int32), prompt_lengths)
    state = dataclasses.replace(state, num_generated=num_emit, done=done)
    unused = jnp.zeros((B, spec.gamma), jnp.int32)  # same width as a round's output: one unpacking
    return state, round_output.pack(jnp.concatenate([first[:, None], unused], axis=1), unused, num_emit, zeros, done)


def _accept(drafts, choices, room):
    """Longest prefix of drafts [B, G] equal to the target's choices [B, G + 1], at most room."""
    matches = (drafts == choices[:, :-1]).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1)
    return jnp.clip(accepted, 0, jnp.maximum(room, 0))


def _draft(tparams, dparams, state: DecodeState, keys, spec: StepSpec):
    """The drafter's chain: (drafts [B, G] target ids, q [B, G, Vd] or None, the drafter cache). Greedy
    unless the build samples with proposal "sample": then sampled rows draw each draft from the drafter's
    filtered distribution q (the same filters as the target's), and greedy rows still take the argmax."""
    embed = dparams.get("embed", tparams["embed"])
    args = (dparams, spec.drafter, embed, state.draft_hidden, state.draft_cache, spec.gamma, spec.kernels)
    if not (spec.sampling and spec.proposal == "sample"):
        drafts, cache = drafter_lib.draft_chain(*args, tp=spec.tp)
        return drafts, None, cache
    s = state.sampling

    def propose(logits, step):
        q = sampling_lib.filtered_probs(logits, s.temperature, s.top_k, s.top_p, filter=spec.filter)
        drawn = sampling_lib.categorical(sampling_lib.draft_key(keys, step), q)
        return jnp.where(s.greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn), q

    return drafter_lib.draft_chain(*args, propose=propose, tp=spec.tp)


def _verify(state: DecodeState, logits, drafts, draft_q, keys, room, dparams, spec: StepSpec):
    """The target's side of a round: (choices [B, G + 1], accepted [B]). Greedy rows: choices are the
    argmax after each of [x_n, d_1 .. d_G] and the drafts are accepted while they match. Sampled rows
    (a sampling build): the accepted drafts, then the token sampled after them, then the argmax."""
    vocab = _vocab(spec)
    choices = vocab.argmax(logits)
    accepted = _accept(drafts, choices, room)
    if not spec.sampling:
        return choices, accepted
    s = state.sampling
    B, rows, V = logits.shape
    p = sampling_lib.filter_rows(logits.reshape(B * rows, V),
                                 *(jnp.repeat(x, rows) for x in (s.temperature, s.top_k, s.top_p)), vocab,
                                 filter=spec.filter)
    # Argmax drafts: q is one-hot at the draft (None). Sampled drafts: q lives on the draft vocabulary,
    # 0 for every other target token.
    draft_ids = (None if draft_q is None
                 else drafter_lib.to_target_id(dparams, jnp.arange(spec.drafter.draft_vocab_size)))
    drawn_accepted, drawn = sampling_lib.verify(keys, p, drafts, draft_q, room, draft_ids)
    drawn = jnp.where(jnp.arange(spec.gamma + 1)[None, :] > drawn_accepted[:, None], choices, drawn)
    return (jnp.where(s.greedy[:, None], choices, drawn), jnp.where(s.greedy, accepted, drawn_accepted))


def spec_round(tparams, dparams, state: DecodeState, *, spec: StepSpec):
    """Draft gamma tokens, verify them in one target step, accept (greedily, or by speculative sampling
    for sampled rows), commit by index, rebuild. With gamma 0 and a drafter, the drafter is left as it was:
    `spec_rounds` holds the round's pair for it and a flushing call brings it up to date."""
    new_state, packed, _ = _round(tparams, dparams, state, spec)
    return new_state, packed


def _round(tparams, dparams, state: DecodeState, spec: StepSpec):
    """`spec_round`, also returning the target's features of the verified tokens [B, gamma + 1, C] (or None)."""
    n = state.target_cache.lengths
    B, G = n.shape[0], spec.gamma
    embed = draft_q = None
    # A sampled row's draws in this round come from its seed and the index of the first token it emits.
    keys = sampling_lib.row_keys(state.sampling.seed, n + 1) if spec.sampling else None
    if G > 0:
        embed = dparams.get("embed", tparams["embed"])
        with jax.named_scope("draft"):
            drafts, draft_q, draft_cache = _draft(tparams, dparams, state, keys, spec)
        verify_tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    else:
        drafts = jnp.zeros((B, 0), jnp.int32)
        verify_tokens = state.last_token[:, None]
    with jax.named_scope("verify"):
        hidden, tcache, features = target_lib.forward(
            tparams, spec.target, verify_tokens, state.target_cache, spec.capture_layers, spec.step_kernels, spec.tp
        )
        # The committed sequence may reach max_len: (n + accepted + 1) + 1 <= max_len.
        logits = target_lib.logits(tparams, hidden, spec.step_kernels)
        choices, accepted = _verify(state, logits, drafts, draft_q, keys,
                                    spec.max_len - n - 2, dparams, spec)
    live = ~state.done
    new_length = jnp.where(live, n + accepted + 1, n)
    num_emit, done = _emit(spec, state, choices, accepted + 1, new_length)
    rows = jnp.arange(B)
    new_state = dataclasses.replace(
        state,
        target_cache=tcache.with_lengths(new_length),
        last_token=jnp.where(live, choices[rows, accepted], state.last_token),
        num_generated=state.num_generated + num_emit,
        done=done,
    )
    if G > 0:
        with jax.named_scope("rebuild"):
            # The target's choices are the true next tokens: (g_{n+i}, choices_i) for i <= accepted
            # are the newly committed pairs; the drafter's own speculative entries are overwritten.
            h = drafter_lib.project_features(dparams, spec.drafter, features)
            out, draft_cache = drafter_lib.forward(dparams, spec.drafter, embed, h, choices, draft_cache, spec.kernels,
                                                   spec.tp)
        new_state = dataclasses.replace(
            new_state,
            draft_cache=draft_cache.with_lengths(new_length),
            draft_hidden=jnp.where(live[:, None], out[rows, accepted], state.draft_hidden),
        )
    # A round cut short (a stop token inside the accepted span, max_new_tokens) commits only the drafts it
    # emits; a frozen row emits none.
    return new_state, round_output.pack(choices, drafts, num_emit, jnp.minimum(accepted, num_emit), done), features


def spec_rounds(tparams, dparams, state: DecodeState, *, spec: StepSpec, num_rounds: int):
    """num_rounds rounds in one call, as a lax.scan: (state, packed outputs [num_rounds, B, 2 gamma + 6]
    (round_output.py)).
    A call costs 0.2-0.3 ms beyond its kernels on the H200 (the graph launch, PJRT's bookkeeping), paid
    once per call; XLA runs the scan's rounds back to back on the device (BENCHMARKS.md, design decisions).
    Rounds after a row is done leave it unchanged, as a single round does.
    With gamma 0 and a drafter the rounds are plain steps: their pairs join the held ones, and a flushing
    call (`StepSpec.flush`) then brings the drafter up to date over all of them (`_catch_up`)."""
    if spec.gamma > 0 or spec.drafter is None:
        return jax.lax.scan(lambda s, _: spec_round(tparams, dparams, s, spec=spec), state, None, length=num_rounds)
    if spec.held < num_rounds:
        raise ValueError(f"a gamma-0 call with a drafter holds its {num_rounds} rounds' pairs: StepSpec.held "
                         f"must be at least that, got {spec.held}")

    def plain(s, _):
        new, packed, features = _round(tparams, dparams, s, spec)
        return new, (packed, features[:, 0], new.last_token)

    end, (packed, features, tokens) = jax.lax.scan(plain, state, None, length=num_rounds)
    behind = state.target_cache.lengths - state.draft_cache.lengths  # [B] pairs held before this call
    rows = jnp.arange(behind.shape[0])[:, None]
    at = behind[:, None] + jnp.arange(num_rounds)[None, :]  # a frozen row's extra pairs land past its count
    held = HeldPairs(state.held.features.at[rows, at].set(jnp.swapaxes(features, 0, 1), mode="drop"),
                     state.held.tokens.at[rows, at].set(tokens.T, mode="drop"))
    end = dataclasses.replace(end, held=held)
    return _catch_up(tparams, dparams, end, packed, spec) if spec.flush else (end, packed)


def _catch_up(tparams, dparams, state: DecodeState, packed, spec: StepSpec):
    """The drafter's rebuild over every held pair, in one pass: it reads its weights once per flush instead of
    once per round. The same pass gives each held round's would-be first draft d_1 for the price of its
    lm_head; the last round's shadow columns count, per row, the held pairs whose token equals it (a sampled
    row's token equals an argmax draft d with probability p(d), the chance the round would have accepted it)
    and the held pairs. Entries past a row's count are stale and ignored (`with_lengths`)."""
    embed = dparams.get("embed", tparams["embed"])
    start = state.draft_cache.lengths
    count = state.target_cache.lengths - start  # [B] held pairs
    h = drafter_lib.project_features(dparams, spec.drafter, state.held.features)
    out, draft_cache = drafter_lib.forward(dparams, spec.drafter, embed, h, state.held.tokens, state.draft_cache,
                                           spec.kernels)
    rows = jnp.arange(count.shape[0])
    before = jnp.concatenate([state.draft_hidden[:, None], out[:, :-1]], axis=1)  # where each pair's d_1 is from
    matched = drafter_lib.draft_token(dparams, spec.drafter, before) == state.held.tokens
    valid = jnp.arange(spec.held)[None, :] < count[:, None]
    caught_up = dataclasses.replace(
        state,
        draft_cache=draft_cache.with_lengths(state.target_cache.lengths),
        draft_hidden=jnp.where((count > 0)[:, None], out[rows, jnp.maximum(count - 1, 0)], state.draft_hidden),
    )
    shadow = jnp.stack([jnp.sum(matched & valid, axis=1), count], axis=1).astype(jnp.int32)
    return caught_up, packed.at[-1, :, -2:].set(shadow)
