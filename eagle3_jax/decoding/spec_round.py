"""Prefill and the speculative round: pure functions over a `DecodeState`; the engine jits prefill and a
scan of rounds.

The round is the same for every proposer (decoding/proposer.py: EAGLE-3, eagle3_proposer.py; prompt lookup,
prompt_lookup.py), which proposes its drafts and keeps its own fields of the state; the round verifies,
accepts, commits and reports (docs/proposers.md).

The KV caches are page pools (models/kv_cache.py) shared by every row: `target_pages` and, with EAGLE-3,
`draft_pages`, both addressed through each row's `page_table` row (the same page ids in both pools), which the
host fills as the row grows (decoding/page_pool.py). Nothing but the pools is shared between rows.

Invariants, per row b:
  * the target's pages hold committed tokens x_0 .. x_{n-1} (n = lengths[b]); x_n, the newest token,
    is `last_token` and is not in any cache yet;
  * with EAGLE-3, the drafter's pages hold the pairs (g_t, x_{t+1}) for t < m (m = draft_lengths[b]), at
    positions t; `draft_hidden` is the drafter's pre-norm output at position m - 1, from which d_1 comes. m = n,
    except after gamma-0 calls that held their pairs back (`DecodeState.held` keeps the n - m pairs): a call that
    drafts starts at m = n;
  * with prompt lookup, `history` holds x_0 .. x_n at positions 0 .. n;
  * a row that is done is frozen: nothing it owns changes any more, and it writes nothing into the pools (its
    pages may already belong to another row once the host has read that it finished).
A round with gamma = 0 is a plain decoding step (with a proposer that reads features, `spec_rounds` keeps
its pairs; any other proposer is updated as in every round).

Rows decode greedily unless the step is built for sampling (`StepSpec.sampling`): then each row's
settings travel in `DecodeState.sampling`, rows with temperature 0 still take the argmax path (the same
tokens as the greedy build), and the others sample losslessly (decoding/sampling.py).

Under tensor parallelism (`StepSpec.tp`) these functions run on each device inside a shard_map
(decoding/parallel_steps.py), `StepSpec.target` being the per-device config: the target's logits are the device's
slice of the vocabulary, and every choice over them (argmax, filters, draws) goes through `_vocab(spec)`,
which combines the slices; the drafter and everything else is replicated, computed alike on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import grammar as grammar_lib
from eagle3_jax.decoding import logprobs as logprobs_lib
from eagle3_jax.decoding import penalties as penalties_lib
from eagle3_jax.decoding import proposer as proposer_lib
from eagle3_jax.decoding import round_output
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding import tree as tree_lib
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.decoding.prompt_lookup import NO_DRAFT, PromptLookup
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.collectives import Shards, Vocab
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.models.kv_cache import KVPages, Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeldPairs:
    """The pairs (g_t, x_{t+1}) committed by gamma-0 calls that did not bring the drafter up to date: row b
    holds lengths - draft_lengths of them, from position draft_lengths on."""

    features: jax.Array  # [B, H, C] the target's features g_t
    tokens: jax.Array  # [B, H] int32 x_{t+1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    target_pages: KVPages  # the target's page pool, shared by every row (no batch axis)
    draft_pages: KVPages | None  # EAGLE-3's, shared likewise
    page_table: jax.Array  # [B, W] int32: row b's pages in both pools, -1 past what it owns
    lengths: jax.Array  # [B] int32, n: the target's committed entries
    draft_lengths: jax.Array | None  # [B] int32, m: EAGLE-3's committed pairs
    last_token: jax.Array  # [B] int32, x_n
    draft_hidden: jax.Array | None  # [B, D] EAGLE-3's drafter output at position n - 1
    num_generated: jax.Array  # [B] int32, tokens emitted so far
    max_new: jax.Array  # [B] int32, the request's max_new_tokens
    stop_ids: jax.Array  # [B, P] int32 padded with -1
    done: jax.Array  # [B] bool
    # per-row settings (greedy rows at temperature 0, as the engine's pool sets them; a greedy build reads none of
    # them); None: a state built without any
    sampling: sampling_lib.SamplingParams | None = None
    held: HeldPairs | None = None  # pairs gamma-0 calls held back from the drafter; None unless StepSpec.held
    history: jax.Array | None = None  # [B, max_len] int32 prompt lookup's x_0 .. x_n
    # penalties and logit_bias (penalties.py): every row's settings, and a penalized row's sequence; None on a mesh
    penalty: penalties_lib.PenaltyState | None = None
    # Structured outputs (decoding/grammar.py): each row's automaton state (FREE: unconstrained), and the pool's
    # automata (no batch axis); both None while no row of the pool is constrained.
    grammar: grammar_lib.Rows | None = None
    grammar_tables: grammar_lib.Tables | None = None


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about the jitted steps (hashable, so it is a static argument)."""

    target: Qwen3Config
    proposer: Eagle3 | PromptLookup | None  # decoding/proposer.py; None: spec off
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
    # The rows' penalties and logit_bias applied to the target's logits (penalties.py); off, a step reads none.
    penalties: bool = False
    # Each emitted token's logprob and most likely alternatives packed into the output (logprobs.py, round_output).
    logprobs: bool = False
    # Each chunk (in a round's forward, or a call of its own) also reports every position's next-token logprobs
    # (`_prompt_rows`; with logprobs).
    prompt_logprobs: bool = False
    # Constrained rows' drafts follow their automata too (masked proposals); False drafts unconstrained (lossless
    # either way: the target's side is masked), for measuring what the masks gain.
    constrain_drafts: bool = True
    # A draft tree (decoding/tree.py; EAGLE-3 only) instead of a chain: each round drafts its nodes and accepts one
    # root path, gamma being its depth. None: the chain of gamma drafts.
    tree: tree_lib.TreeShape | None = None

    def __post_init__(self):
        if self.tree is not None and self.gamma != self.tree.depth:
            raise ValueError(f"a draft tree's rounds run gamma = its depth {self.tree.depth}, got gamma {self.gamma}")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.proposer.capture_layers if self.proposer else ()

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
    return _emitted(spec, state.done, state.stop_ids, state.max_new - state.num_generated, new_tokens, num_new,
                    new_length)


def _emitted(spec: StepSpec, done, stop_ids, budget, new_tokens, num_new, new_length):
    """_emit over the fields it reads: done, stop_ids [B, P] and the tokens each row may still emit."""
    M = new_tokens.shape[1]
    idx = jnp.arange(M)[None, :]
    is_stop = jnp.any(new_tokens[:, :, None] == stop_ids[:, None, :], axis=-1) & (idx < num_new[:, None])
    until_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, num_new)
    num_emit = jnp.where(done, 0, jnp.minimum(until_stop, budget))
    hit_stop = jnp.any(is_stop & (idx < num_emit[:, None]), axis=1)
    # The sequence (prompt + output) is new_length + 1 long: the newest token is not in the cache.
    full = (num_emit >= budget) | (new_length + 1 >= spec.max_len)
    return num_emit, done | hit_stop | full


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunk:
    """Prompt tokens one target forward prefills, beside a round's rows (a mixed call: one chunk per round, every
    array with a leading rounds axis) or alone (`prefill`): up to C tokens of up to P sequences, packed. Segment p
    holds tokens cu[p] .. cu[p + 1] - 1, its sequence's positions start[p] onwards, written into the pages of
    table[p]. A sequence longer than a chunk goes on in the next one's, after what this one wrote. A final segment
    ends its sequence's prompt: its row (its settings below) joins the pool at slot[p] once the chunk has run,
    with its first token drawn from the segment's last position, or, for a sequence a preemption put back, its
    resume token (nothing drawn or emitted)."""

    tokens: jax.Array  # [C] int32
    cu: jax.Array  # [P + 1] int32: segment offsets in tokens (a segment of no sequence: empty)
    start: jax.Array  # [P] int32
    table: jax.Array  # [P, W] int32: -1 past each sequence's pages
    final: jax.Array  # [P] bool
    slot: jax.Array  # [P] int32: the slot a final segment's row takes (a position in the call's rows; B: none)
    # [P] int32: the token after the segment's last: the prompt's next (not final), the resume token x_n of a
    # recompute (final), or -1 (final: the first token is drawn)
    next_token: jax.Array
    generated: jax.Array  # [P] int32: tokens the sequence emitted before (a recompute's), else 0
    max_new: jax.Array  # [P] int32
    stop_ids: jax.Array  # [P, width] int32
    sampling: sampling_lib.SamplingParams  # [P] each sequence's settings (greedy: temperature 0)
    history: jax.Array | None = None  # [P, max_len] int32: a final segment's whole sequence, for a proposer's history
    # [P] each sequence's penalties and logit_bias (a penalized final segment's chunk carries its history too)
    penalties: penalties_lib.Penalties | None = None
    # [P] a final segment's automaton and state (grammar.Rows): its initial state, or a recompute's state after its
    # resume token; present whenever the pool's grammar is
    grammar: grammar_lib.Rows | None = None

    @property
    def layout(self) -> Layout:
        return Layout.ragged(self.table, self.start, self.cu, self.tokens.shape[0])

    @property
    def lengths(self) -> jax.Array:
        """[P] each segment's sequence length once it ran: a final segment's prompt length n."""
        return self.start + self.cu[1:] - self.cu[:-1]

    @property
    def last(self) -> jax.Array:
        """[P] each segment's last token in the chunk (an empty segment: a valid index, unused)."""
        return jnp.clip(self.cu[1:] - 1, 0, self.tokens.shape[0] - 1)


def new_pages(spec: StepSpec, num_pages: int, page_size: int, dtype) -> tuple[KVPages, KVPages | None]:
    """Zeroed page pools for a step of this spec: the target's and its proposer's (None without one of its own)."""
    target = target_lib.new_pages(spec.target, num_pages, page_size, dtype)
    return target, spec.proposer.new_pages(num_pages, page_size, dtype) if spec.proposer is not None else None


def new_rows(spec: StepSpec, batch: int, width: int, stop_width: int, dtype) -> DecodeState:
    """`batch` free slots (done, zeroed) without their page pools (split_pages): a pool's rows, page tables of
    `width` columns, stop ids of `stop_width`, sampling settings always set (greedy rows at temperature 0)."""
    zeros = jnp.zeros((batch,), jnp.int32)
    held = None
    if spec.held:
        held = HeldPairs(jnp.zeros((batch, spec.held, spec.proposer.feature_width), dtype),
                         jnp.zeros((batch, spec.held), jnp.int32))
    settings = sampling_lib.SamplingParams(jnp.zeros((batch,), jnp.float32), zeros, jnp.ones((batch,), jnp.float32),
                                           jnp.zeros((batch, 2), jnp.uint32))
    rows = DecodeState(target_pages=None, draft_pages=None, page_table=jnp.full((batch, width), -1, jnp.int32),
                       lengths=zeros, draft_lengths=None, last_token=zeros, draft_hidden=None, num_generated=zeros,
                       max_new=zeros, stop_ids=jnp.full((batch, stop_width), -1, jnp.int32),
                       done=jnp.ones((batch,), bool), sampling=settings, held=held,
                       penalty=penalties_lib.new_rows(batch, spec.max_len) if spec.tp is None else None)
    own = spec.proposer.new_rows(batch, spec, dtype) if spec.proposer is not None else {}
    return dataclasses.replace(rows, **own)


def split_pages(state: DecodeState) -> tuple[DecodeState, tuple[KVPages, KVPages | None]]:
    """(the state's per-row fields, its page pools): the slot operations (decoding/slots.py) touch rows only."""
    return dataclasses.replace(state, target_pages=None, draft_pages=None), (state.target_pages, state.draft_pages)


def with_pages(rows: DecodeState, pages: tuple[KVPages, KVPages | None]) -> DecodeState:
    return dataclasses.replace(rows, target_pages=pages[0], draft_pages=pages[1])


def prefill(tparams, dparams, state: DecodeState, chunk: Chunk, *, spec: StepSpec):
    """A call of the chunk alone, over every slot (an exact engine prefills so: its kernels' results must not
    depend on rows beside the chunk): its target forward, then `admit` -> (state, the chunk's output packed
    [P, width]; with `spec.prompt_logprobs`, then the chunk's `_prompt_rows` [C, width])."""
    hidden, target_pages, features = target_lib.forward(tparams, spec.target, chunk.tokens[None], state.target_pages,
                                                        chunk.layout, spec.capture_layers, spec.kernels, spec.tp)
    state = dataclasses.replace(state, target_pages=target_pages)
    logits = target_lib.logits(tparams, hidden[0, chunk.last])
    state, packed = admit(tparams, dparams, state, chunk, logits, None if features is None else features[0], spec)
    if not spec.prompt_logprobs:
        return state, packed
    return state, jnp.concatenate([packed, _prompt_rows(tparams, hidden[0], chunk, spec)])


def _prompt_rows(tparams, hidden, chunk: Chunk, spec: StepSpec) -> jax.Array:
    """A chunk's prompt logprobs from its forward's final hidden states [C, D] (no second forward): [C, width] rows
    whose first logprobs columns hold chunk position j's next-token logprobs (logprobs.prompt_columns); the host
    keeps those of the segments that asked."""
    C = chunk.tokens.shape[0]
    columns = logprobs_lib.prompt_columns(tparams, hidden, _successors(chunk, chunk.next_token), spec.kernels)
    zeros = jnp.zeros((C,), jnp.int32)
    at_first = jnp.zeros((C, spec.gamma + 1, logprobs_lib.width()), jnp.int32).at[:, 0].set(columns)
    return round_output.pack(jnp.zeros((C, spec.gamma + 1), jnp.int32), jnp.zeros((C, spec.gamma), jnp.int32), zeros,
                             zeros, zeros, logprobs=at_first, tree=_no_tree(spec, C))


def _no_tree(spec: StepSpec, rows: int):
    """A tree round's columns (round_output) for `rows` rows that are no round's (a chunk's): zeros; None, a chain's."""
    if spec.tree is None:
        return None
    return (jnp.zeros((rows, spec.tree.nodes), jnp.int32),) * 2 + (jnp.zeros((rows, spec.gamma), jnp.int32),)


def _successors(chunk: Chunk, after) -> jax.Array:
    """[C] each chunk token's next token: the next of its segment, or after [P] at a segment's last token."""
    C, P = chunk.tokens.shape[0], chunk.start.shape[0]
    successor = jnp.concatenate([chunk.tokens[1:], chunk.tokens[:1]])
    seq = chunk.layout.seq
    is_last = jnp.arange(C) == chunk.last[jnp.minimum(seq, P - 1)]
    return jnp.where(is_last & (seq < P), after[jnp.minimum(seq, P - 1)], successor)


def admit(tparams, dparams, state: DecodeState, chunk: Chunk, logits, features, spec: StepSpec):
    """What a chunk's target forward leaves (the logits at each segment's last token [P, V], features [C, F] or
    None) turned into the proposer's KV for the chunk and, for each final segment, its first token and its row in
    its slot -> (state, the chunk's output packed [P, width]: a drawn first token emitted, a recompute's not)."""
    P = chunk.start.shape[0]
    seg_len = chunk.cu[1:] - chunk.cu[:-1]
    n = chunk.lengths
    vocab = _vocab(spec)
    # A penalized sequence's chunk carries its history (the whole sequence), from which its penalties count.
    penalized = spec.penalties and state.penalty is not None and chunk.history is not None
    prompt_lengths = penalties_lib.prompt_lengths_of(n, chunk.generated)
    scored = logits  # the logprobs below stay the raw logits'
    if penalized:
        scored = penalties_lib.first_logits(logits, chunk.penalties, chunk.history, n, prompt_lengths)
    if chunk.grammar is not None:  # a constrained row's first token follows its automaton
        scored = grammar_lib.mask(state.grammar_tables, chunk.grammar.table, chunk.grammar.state[:, None],
                                  scored[:, None])[:, 0]
    first = vocab.argmax(scored)
    if spec.sampling:
        s = chunk.sampling
        probs = sampling_lib.filtered_probs(scored, s.temperature, s.top_k, s.top_p, vocab, filter=spec.filter)
        drawn = sampling_lib.first_token(sampling_lib.row_keys(s.seed, n), probs, vocab)
        first = jnp.where(s.greedy, first, drawn)
    final = chunk.final & (seg_len > 0)
    resumed = final & (chunk.next_token >= 0)
    first = jnp.where(resumed, chunk.next_token, first)
    # Each token's successor, for the proposer's pairs: the next token of its segment, then the one after it.
    successor = _successors(chunk, jnp.where(final, first, chunk.next_token))
    own = {}
    if spec.proposer is not None:
        state, own = spec.proposer.admit(dparams, tparams, spec, state, chunk, successor, features, first, final)
    budget = chunk.max_new - chunk.generated
    num_emit, done = _emitted(spec, n >= spec.max_len, chunk.stop_ids, budget, first[:, None],
                              jnp.ones((P,), jnp.int32), n)
    num_emit, done = jnp.where(resumed, 0, num_emit), jnp.where(resumed, False, done)
    joined = {"page_table": chunk.table, "lengths": n, "last_token": first, "num_generated": chunk.generated + num_emit,
              "max_new": chunk.max_new, "stop_ids": chunk.stop_ids, "done": done, "sampling": chunk.sampling, **own}
    if chunk.grammar is not None:
        g = chunk.grammar
        joined["grammar"] = dataclasses.replace(g, state=jnp.where(
            resumed, g.state, grammar_lib.advance(state.grammar_tables, g.table, g.state, first)))
    slots = jnp.where(final, chunk.slot, state.done.shape[0])  # a segment that does not end its prompt: dropped
    state = dataclasses.replace(state, **{name: jax.tree.map(lambda pool, new: pool.at[slots].set(new, mode="drop"),
                                                             getattr(state, name), value)
                                          for name, value in joined.items()})
    if state.penalty is not None and chunk.penalties is not None:  # every joining row's settings: no stale ones
        state = dataclasses.replace(state, penalty=penalties_lib.admitted(
            state.penalty, slots, chunk.penalties, chunk.history, n, prompt_lengths, first, penalized))
    unused = jnp.zeros((P, spec.gamma), jnp.int32)  # a round's width (a tree's columns too): one unpacking
    zeros = jnp.zeros((P,), jnp.int32)
    logprobs = None
    if spec.logprobs:  # the first token's, from the raw logits, then a round's unused positions
        logprobs = jnp.zeros((P, spec.gamma + 1, logprobs_lib.width()), jnp.int32).at[:, 0].set(
            logprobs_lib.columns(logits, first))
    packed = round_output.pack(jnp.concatenate([first[:, None], unused], axis=1), unused,
                               jnp.where(final, num_emit, 0), zeros, final & done, logprobs=logprobs,
                               tree=_no_tree(spec, P))
    return state, packed


def _accept(drafts, choices, room):
    """Longest prefix of drafts [B, G] equal to the target's choices [B, G + 1], at most room."""
    matches = (drafts == choices[:, :-1]).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1)
    return jnp.clip(accepted, 0, jnp.maximum(room, 0))


def _verify(state: DecodeState, logits, drafts, draft_q, q_ids, keys, room, spec: StepSpec):
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
    # Argmax drafts: q is one-hot at the draft (None). Sampled drafts: q over the ids q_ids (the proposer's).
    drawn_accepted, drawn = sampling_lib.verify(keys, p, drafts, draft_q, room, q_ids)
    drawn = jnp.where(jnp.arange(spec.gamma + 1)[None, :] > drawn_accepted[:, None], choices, drawn)
    return (jnp.where(s.greedy[:, None], choices, drawn), jnp.where(s.greedy, accepted, drawn_accepted))


def _target_step(tparams, state: DecodeState, layout: Layout, tokens, chunk: Chunk | None, spec: StepSpec):
    """The round's target forward over the rows' tokens [B, T] at `layout`, a chunk's tokens riding in it: (logits
    [B, T, V], the target's pages, features [B, T, C] or None, the chunk's (logits at its segments' last tokens,
    features [C, F] or None, its `_prompt_rows` with spec.prompt_logprobs or None), or None without a chunk)."""
    B, T = tokens.shape
    flat = tokens
    if chunk is not None:  # one forward over the rows' tokens, then the chunk's: one read of the weights
        layout, flat = layout.then(chunk.layout), jnp.concatenate([tokens.reshape(-1), chunk.tokens])[None]
    hidden, target_pages, features = target_lib.forward(
        tparams, spec.target, flat, state.target_pages, layout, spec.capture_layers, spec.step_kernels, spec.tp
    )
    if chunk is None:
        return target_lib.logits(tparams, hidden, spec.step_kernels), target_pages, features, None
    # One lm_head matmul for the rows' tokens and the chunk's segments' last tokens: one weight read.
    last = hidden[0, B * T + chunk.last]
    both = target_lib.logits(tparams, jnp.concatenate([hidden[0, : B * T], last]), spec.step_kernels)
    chunk_out = (both[B * T:], None if features is None else features[0, B * T:],
                 _prompt_rows(tparams, hidden[0, B * T:], chunk, spec) if spec.prompt_logprobs else None)
    features = None if features is None else features[0, : B * T].reshape(B, T, -1)
    return both[: B * T].reshape(B, T, -1), target_pages, features, chunk_out


def _tree_round(tparams, dparams, state: DecodeState, spec: StepSpec, chunk: Chunk | None = None):
    """`_round` with a draft tree (spec.tree, decoding/tree.py): the drafter's tree, its root and nodes verified in
    one target forward under the tree's mask, one root path accepted (greedily, or by the multi-draft rule for
    sampled rows), its target KV copied into position order and the drafter rebuilt along it. Penalties count each
    node's ancestors, a constrained row's masks follow its automaton down each branch, and logprobs are the path's.
    The features it returns are the path's [B, depth + 1, C]. A constrained row's tree is drafted unconstrained
    (lossless all the same: the target's side is masked)."""
    n, shape, vocab = state.lengths, spec.tree, _vocab(spec)
    B, D = n.shape[0], shape.depth
    room = spec.max_len - n - 2  # as a chain's: the committed sequence may reach max_len
    live = ~state.done
    with jax.named_scope("draft"):
        tree, carry = spec.proposer.propose_tree(dparams, tparams, state, spec)
    with jax.named_scope("verify"):
        tokens = jnp.concatenate([state.last_token[:, None], tree.tokens], axis=1)
        logits, target_pages, features, chunk_out = _target_step(tparams, state, tree.layout(state.page_table, n, live),
                                                                 tokens, chunk, spec)
        # As a chain's: penalties and logit_bias (each node counting its path's tokens), then the constrained rows'
        # masks (each node at its automaton state down its branch); the logprobs below stay the raw logits'.
        scored = logits
        if spec.penalties:
            scored = penalties_lib.tree_logits(logits, state.penalty, n, tree.tokens, tree.ancestors)
        if state.grammar is not None:
            states = tree_lib.automaton_states(state.grammar_tables, state.grammar, tree, D)
            scored = grammar_lib.mask(state.grammar_tables, state.grammar.table, states, scored)
        ok = tree_lib.usable(tree, room, spec.max_len - n)
        path, accepted, choices = tree_lib.greedy_path(tree, vocab.argmax(scored), ok, D)
        if spec.sampling:
            s = state.sampling
            keys = sampling_lib.row_keys(s.seed, n + 1)  # as a chain round's: the first token it emits
            drawn = tree_lib.sampled_path(tree, scored, s, keys, ok, D, vocab, filter=spec.filter)
            path, accepted, choices = (jnp.where(s.greedy.reshape((B,) + (1,) * (x.ndim - 1)), x, y)
                                       for x, y in zip((path, accepted, choices), drawn))
    new_length = jnp.where(live, n + accepted + 1, n)
    num_emit, done = _emit(spec, state, choices, accepted + 1, new_length)
    new_state = dataclasses.replace(
        state,
        target_pages=tree_lib.commit(target_pages, state.page_table, n, path, accepted, live),
        lengths=new_length,
        last_token=jnp.where(live, choices[jnp.arange(B), accepted], state.last_token),
        num_generated=state.num_generated + num_emit,
        done=done,
    )
    if spec.penalties:
        new_state = dataclasses.replace(new_state, penalty=penalties_lib.committed(state.penalty, n, choices,
                                                                                   state.done))
    if state.grammar is not None:
        new_state = dataclasses.replace(new_state, grammar=grammar_lib.committed(
            state.grammar_tables, state.grammar, jnp.take_along_axis(states, path, axis=1), choices, accepted, live))
    features = None if features is None else jnp.take_along_axis(features, path[:, :, None], axis=1)
    with jax.named_scope("rebuild"):
        new_state = spec.proposer.update(dparams, tparams, state, new_state, carry, choices, accepted, features, spec)
    depth = jnp.arange(1, D + 1)[None, :]
    drafts = jnp.where(depth <= accepted[:, None], jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:] - 1, 0), 1),
                       -1)
    logprobs = None
    if spec.logprobs:  # each choice's, from the raw logits of the path's node that chose it
        along = jnp.take_along_axis(logits, path[:, :, None], axis=1)
        logprobs = logprobs_lib.columns(along.reshape(B * (D + 1), -1), choices.reshape(-1)).reshape(B, D + 1, -1)
    packed = round_output.pack(choices, drafts, num_emit, jnp.minimum(accepted, num_emit), done, logprobs=logprobs,
                               tree=(tree.tokens, tree.parents[:, 1:], path[:, 1:]))
    return new_state, packed, features, chunk_out


def spec_round(tparams, dparams, state: DecodeState, *, spec: StepSpec):
    """Propose up to gamma tokens, verify them in one target step, accept (greedily, or by speculative sampling
    for sampled rows), commit by index, tell the proposer. With gamma 0 and a proposer that reads features, the
    proposer is left as it was: `spec_rounds` holds the round's pair for it and a flushing call brings it up to
    date."""
    new_state, packed, _, _ = _round(tparams, dparams, state, spec)
    return new_state, packed


def _round(tparams, dparams, state: DecodeState, spec: StepSpec, chunk: Chunk | None = None):
    """`spec_round`, also returning the target's features of the verified tokens [B, gamma + 1, C] (or None) and,
    with a chunk riding in its target forward, the chunk's (logits at its segments' last tokens [P, V], features
    [C, F] or None, its `_prompt_rows` [C, width] with spec.prompt_logprobs or None) (else None)."""
    if spec.tree is not None:
        return _tree_round(tparams, dparams, state, spec, chunk)
    n = state.lengths
    B, G, proposer = n.shape[0], spec.gamma, spec.proposer
    draft_q = q_ids = carry = None
    # The committed sequence may reach max_len: (n + accepted + 1) + 1 <= max_len.
    room = spec.max_len - n - 2
    # A sampled row's draws in this round come from its seed and the index of the first token it emits.
    keys = sampling_lib.row_keys(state.sampling.seed, n + 1) if spec.sampling else None
    if G > 0:
        with jax.named_scope("draft"):
            drafts, draft_q, q_ids, carry = proposer.propose(dparams, tparams, state, keys, spec)
        if state.grammar is not None and proposer.partial and spec.constrain_drafts:
            drafts = grammar_lib.cut(state.grammar, grammar_lib.along(state.grammar_tables, state.grammar, drafts),
                                     drafts, NO_DRAFT)
        verified = drafts
        # Drafts past a row's proposal are never judged; they go through verify as token 0 (static shapes), and
        # their entries lie past the committed length, stale.
        if proposer.partial:
            room = jnp.minimum(room, jnp.sum(jnp.cumprod(drafts >= 0, axis=1), axis=1))
            verified = jnp.maximum(drafts, 0)
        verify_tokens = jnp.concatenate([state.last_token[:, None], verified], axis=1)
    else:
        drafts = jnp.zeros((B, 0), jnp.int32)
        verify_tokens = state.last_token[:, None]
    with jax.named_scope("verify"):
        T = verify_tokens.shape[1]
        layout = Layout.uniform(state.page_table, n, T, ~state.done)
        logits, target_pages, features, chunk_out = _target_step(tparams, state, layout, verify_tokens, chunk, spec)
        # The rows' penalties and logit_bias, each position counting the drafts before it (penalties.py), then the
        # constrained rows' masks; the logprobs below stay the raw logits'.
        scored = penalties_lib.verify_logits(logits, state.penalty, n, drafts) if spec.penalties else logits
        if state.grammar is not None:  # the target's choices follow each row's automaton along the drafts
            states = grammar_lib.along(state.grammar_tables, state.grammar, drafts)
            scored = grammar_lib.mask(state.grammar_tables, state.grammar.table, states, scored)
        choices, accepted = _verify(state, scored, drafts, draft_q, q_ids, keys, room, spec)
    live = ~state.done
    new_length = jnp.where(live, n + accepted + 1, n)
    num_emit, done = _emit(spec, state, choices, accepted + 1, new_length)
    rows = jnp.arange(B)
    new_state = dataclasses.replace(
        state,
        target_pages=target_pages,
        lengths=new_length,
        last_token=jnp.where(live, choices[rows, accepted], state.last_token),
        num_generated=state.num_generated + num_emit,
        done=done,
    )
    if spec.penalties:
        new_state = dataclasses.replace(new_state, penalty=penalties_lib.committed(state.penalty, n, choices,
                                                                                   state.done))
    if state.grammar is not None:
        new_state = dataclasses.replace(new_state, grammar=grammar_lib.committed(
            state.grammar_tables, state.grammar, states, choices, accepted, live))
    shadow = None
    if proposer is not None and (G > 0 or not proposer_lib.holds_pairs(proposer)):
        with jax.named_scope("rebuild"):
            new_state = proposer.update(dparams, tparams, state, new_state, carry, choices, accepted, features, spec)
        if G == 0:
            shadow = proposer.shadow(state, choices, num_emit, spec)
    # A round cut short (a stop token inside the accepted span, max_new_tokens) commits only the drafts it
    # emits; a frozen row emits none.
    logprobs = None
    if spec.logprobs:  # each choice's, from the logits of the position that chose it
        logprobs = logprobs_lib.columns(logits.reshape(B * T, -1), choices.reshape(-1)).reshape(B, T, -1)
    packed = round_output.pack(choices, drafts, num_emit, jnp.minimum(accepted, num_emit), done, shadow, logprobs)
    return new_state, packed, features, chunk_out


def spec_rounds(tparams, dparams, state: DecodeState, chunks: Chunk | None = None, *, spec: StepSpec,
                num_rounds: int):
    """num_rounds rounds in one call, as a lax.scan -> (state, packed outputs [num_rounds, B + P, 2 gamma + 6]
    (round_output.py): each round's B rows, then its chunk's P segments). The state's rows are the call's row bucket
    (the running rows, the rows its chunks join, and free slots to fill the bucket: slots.take gathers them from the
    pool's slots, so one compilation serves every pool of the bucket's size or more).
    A call costs 0.2-0.3 ms beyond its kernels on the H200 (the graph launch, PJRT's bookkeeping), paid
    once per call; XLA runs the scan's rounds back to back on the device (BENCHMARKS.md, design decisions).
    Rounds after a row is done leave it unchanged, as a single round does.
    With gamma 0 and a proposer that reads features the rounds are plain steps: each round's pair joins the held
    ones, and a flushing call (`StepSpec.flush`) then brings the proposer up to date over all of them
    (`_catch_up`).
    chunks (a mixed call): a Chunk whose every array has a leading axis of num_rounds; round r's prompt tokens ride
    in round r's target forward (one read of the weights for both), and its final segments' rows join their slots
    (rows of the state) when round r ends (`admit`): a prompt whose last chunk runs in round r runs rounds r + 1
    onwards of the same call. With spec.prompt_logprobs each round's chunk rows are followed by its C prompt-logprob
    rows (`_prompt_rows`)."""
    held = spec.gamma == 0 and proposer_lib.holds_pairs(spec.proposer)
    if held and spec.held < num_rounds:
        raise ValueError(f"a gamma-0 call with a drafter holds its {num_rounds} rounds' pairs: StepSpec.held "
                         f"must be at least that, got {spec.held}")
    return _rounds(tparams, dparams, state, chunks, spec, num_rounds, held)


def _rounds(tparams, dparams, state: DecodeState, chunks, spec: StepSpec, rounds: int, held: bool):
    """spec_rounds' rounds: each round (and its chunk, if any), scanned; a holding call's
    pairs written into `held` as they commit, and brought into the proposer at the end of a flushing one."""
    B = state.done.shape[0]

    def one(carry, chunk):
        s, touched = carry
        new, packed, features, chunk_out = _round(tparams, dparams, s, spec, chunk)
        if held:
            new = _hold(s, new, features)
        if chunk is not None:
            new, chunk_packed = admit(tparams, dparams, new, chunk, *chunk_out[:2], spec)
            # with prompt logprobs, the chunk's rows of them last (_prompt_rows)
            packed = jnp.concatenate([packed, chunk_packed] + ([chunk_out[2]] if spec.prompt_logprobs else []))
        return (new, touched | ~new.done), packed

    (end, touched), packed = jax.lax.scan(one, (state, ~state.done), chunks, length=rounds)
    if held and spec.flush:
        return _catch_up(tparams, dparams, end, packed, touched, B, spec)
    return end, packed


def _hold(old: DecodeState, new: DecodeState, features) -> DecodeState:
    """A plain round's pair (g_n, x_{n+1}) (features [B, 1, C] of x_n, the new last token) held at index
    lengths - draft_lengths of each row (its held count before the round). A frozen row's write lands past its
    count (it committed nothing), where nothing reads it."""
    at = old.lengths - old.draft_lengths
    rows = jnp.arange(at.shape[0])
    return dataclasses.replace(new, held=HeldPairs(new.held.features.at[rows, at].set(features[:, 0], mode="drop"),
                                                   new.held.tokens.at[rows, at].set(new.last_token, mode="drop")))


def _catch_up(tparams, dparams, state: DecodeState, packed, live, rows: int, spec: StepSpec):
    """The proposer's rebuild over every held pair, in one pass (for EAGLE-3, its weights are read once per flush
    instead of once per round), for the rows `live` [B] at some point of the call (their pages are theirs until the
    host reads it). The same pass gives each held round's would-be first draft d_1; the last round's shadow columns
    (of its `rows` rows in packed [R, rows + P, width]) count, per row, the held pairs whose token equals it (a
    sampled row's token equals an argmax draft d with probability p(d), the chance the round would have accepted
    it) and the held pairs."""
    count = state.lengths - state.draft_lengths  # [B] held pairs
    caught_up, matched = spec.proposer.catch_up(dparams, tparams, state, state.held, live, spec)
    valid = jnp.arange(spec.held)[None, :] < count[:, None]
    shadow = jnp.stack([jnp.sum(matched & valid, axis=1), count], axis=1).astype(jnp.int32)
    return caught_up, packed.at[-1, :rows, -2:].set(shadow)
