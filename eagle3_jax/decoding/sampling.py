"""Sampling on the device: the filters (temperature, top-k, top-p), per-row random keys, and the
rejection sampler that keeps speculative decoding lossless when rows sample.

Filters follow transformers' `generate` order (`TemperatureLogitsWarper`, then `TopKLogitsWarper`, then
`TopPLogitsWarper` over the tempered, top-k-filtered logits, then a softmax). Every parameter is a device
array with one value per row, so a batch mixes settings and new values never recompile.

What is kept. After both filters a row keeps the tokens whose tempered logit is above a cut, and of the
tokens exactly at the cut those with the highest ids (`Filtered`: a cut and a tie id per row, from which a
probability is one logit read and a row's distribution one elementwise pass). Two exact searches find the
cuts, and which one a build runs is static (`FILTERS`, spec_round.StepSpec.filter): the engine picks it per
request on the host (`filter_for`), so neither program holds a device-side branch. When every sampled row's
top_k is in [1, 64], the cuts come from each row's 64 largest logits (candidate_filter.py: a few passes over
the row). Otherwise a radix search over the logits' bit patterns runs: a float32 maps to a uint32 key with
the same order, and the key is settled 4 bits at a time, from the top, by one pass over the row that weighs
16 candidate thresholds at once (top-k counts the tokens at or above each candidate, top-p sums their
probability). 8 passes fix a 32-bit key exactly: the threshold a sort would give, not an approximation. On
the H200 the radix search takes 0.31 ms over [4, 151936] rows and 1.06 ms over [32, 151936] (a sort per row:
0.36 and 1.23 ms), as XLA runs each pass as its own reduction; the candidate filter 0.23 and 0.43 ms.

Ties at the top-p boundary. transformers sorts the logits ascending and drops the tokens whose
cumulative probability is <= 1 - top_p, so among tokens of equal logit it keeps some and drops others by
their place in `torch.sort`'s output, which is not stable. Here the tied tokens are ordered by id, as a
stable sort would (higher ids last, so kept first). The kept probability mass is transformers' exactly;
which of the equal-logit tokens carry it is defined by their ids rather than by torch's sorting internals.

Tensor parallelism. Every reduction over the vocabulary goes through a `Vocab` (models/collectives.py):
the whole row on one device (`FULL`, plain jnp), or each device's slice of the vocabulary with the counts,
sums, maxima and argmaxima combined across devices. A sharded row is always filtered by the radix search
(the candidate filter's top-k is per device): its counts and sums are then over the whole vocabulary, so the
cuts are the unsharded ones, and a draw adds to each id the Gumbel noise it gets unsharded: the same token
for the same seed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding import candidate_filter
from eagle3_jax.models.collectives import FULL, Vocab

_DIGIT_BITS = 4  # bits of the threshold settled per radix pass: 16 candidates weighed in one pass
_ACCEPT, _FINAL, _DRAFT = 0, 1, 2  # what a row's round key is folded with for each of its draws
_NO_TIE = 2**31 - 1  # tie id of a row that keeps none of the tokens at its cut
FILTERS = ("radix", "candidates")  # the exact searches for the cuts (`filter_rows`), a static choice per build


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One row's sampling settings, as device arrays (B rows)."""

    temperature: jax.Array  # [B] float32; 0 = greedy (argmax, every other setting ignored)
    top_k: jax.Array  # [B] int32; 0 = no top-k filter
    top_p: jax.Array  # [B] float32 in (0, 1]; 1 = no top-p filter
    seed: jax.Array  # [B, 2] uint32: the row's threefry key data (a 64-bit seed, high word first)

    @property
    def greedy(self) -> jax.Array:
        return self.temperature <= 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Filtered:
    """Rows of tempered logits and what the filters keep: token i of row r is kept when
    logits[r, i] > cut[r], or logits[r, i] == cut[r] and i >= tie_id[r]. top is the row's largest logit
    and total the sum of exp(logit - top) over the kept tokens, so the filtered distribution needs one
    elementwise pass over the row (`probs`)."""

    logits: jax.Array  # [R, V] float32, tempered (this device's slice of the vocabulary under `vocab`)
    cut: jax.Array  # [R] float32
    tie_id: jax.Array  # [R] int32
    top: jax.Array  # [R] float32
    total: jax.Array  # [R] float32
    vocab: Vocab = dataclasses.field(default=FULL, metadata=dict(static=True))

    def keep(self) -> jax.Array:
        ids = self.vocab.ids(self.logits.shape[-1])
        at_cut = (self.logits == self.cut[:, None]) & (ids >= self.tie_id[:, None])
        return (self.logits > self.cut[:, None]) | at_cut

    def probs(self) -> jax.Array:
        weights = jnp.where(self.keep(), jnp.exp(self.logits - self.top[:, None]), 0.0)
        return weights / self.total[:, None]

    def prob(self, rows: jax.Array, ids: jax.Array) -> jax.Array:
        """The filtered probability of token ids[...] in row rows[...] (same shapes): one logit read each,
        on the device holding the id under a sharded vocabulary (0 from the others, summed)."""
        if self.vocab.shards is None:
            return self._prob(rows, ids, self.logits[rows, ids])
        local = self.vocab.local_index(ids, self.logits.shape[-1])
        mine = local < self.logits.shape[-1]
        p = self._prob(rows, ids, self.logits[rows, jnp.where(mine, local, 0)])
        return self.vocab.sum(jnp.where(mine, p, 0.0)[..., None])

    def _prob(self, rows, ids, x):
        cut = self.cut[rows]
        kept = (x > cut) | ((x == cut) & (ids >= self.tie_id[rows]))
        return jnp.where(kept, jnp.exp(x - self.top[rows]) / self.total[rows], 0.0)

    def rows(self, rows: jax.Array) -> Filtered:
        """The rows rows [B] of this filter, as their own `Filtered`."""
        return jax.tree.map(lambda a: a[rows], self)


# ----------------------------------------------------------------------------- filters


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest). -0.0 becomes +0.0 first: they are equal logits."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_threshold(keys, weights, target, vocab: Vocab = FULL) -> jax.Array:
    """Per row, the largest uint32 T with sum(weights where keys >= T) >= target; 0 when no T
    qualifies. keys [R, V] uint32, weights [R, V] (nonnegative), target [R].

    The sum falls as T rises, so the qualifying T form a range from 0 up: each pass keeps the highest of 16
    candidates for the next 4 bits that still qualifies (a nonnegative float sum is monotone in its terms
    under one reduction order, so the 16 answers are monotone too)."""
    digits = jnp.arange(1 << _DIGIT_BITS, dtype=jnp.uint32)
    passes = 32 // _DIGIT_BITS

    def one_pass(i, prefix):
        shift = ((passes - 1 - i) * _DIGIT_BITS).astype(jnp.uint32)
        candidates = prefix[:, None] | (digits << shift)  # [R, 16]
        mass = vocab.sum(jnp.where(keys[:, None, :] >= candidates[:, :, None], weights[:, None, :], 0))
        qualifying = jnp.sum(mass >= target[:, None], axis=-1)  # the candidates that qualify: 0 .. n - 1
        return prefix | (jnp.maximum(qualifying - 1, 0).astype(jnp.uint32) << shift)

    # A loop of fixed trip count: one pass's code, compiled once (unrolled, it ran no faster on the H200).
    prefix = jax.lax.fori_loop(0, passes, one_pass, jnp.zeros(keys.shape[:-1], jnp.uint32))
    return prefix


def top_k_mask(logits: jax.Array, top_k: jax.Array, vocab: Vocab = FULL) -> jax.Array:
    """logits [R, V], top_k [R] -> bool [R, V]: the tokens at or above the k-th largest logit (all of a tie
    at the k-th value, as transformers keeps them); everything when top_k is 0 or >= V."""
    keys = _order_keys(logits)
    kth = _largest_threshold(keys, jnp.ones(keys.shape, jnp.int32), top_k, vocab)
    return (keys >= kth[:, None]) | (top_k[:, None] <= 0)


def top_p_mask(logits: jax.Array, probs: jax.Array, top_p: jax.Array, vocab: Vocab = FULL) -> jax.Array:
    """logits [R, V] (tempered, top-k filtered to -inf), their softmax probs, top_p [R] -> bool [R, V].

    In the order of a stable ascending sort of the logits, token i is kept when the probability after it
    is < top_p (transformers: dropped when the cumulative probability up to it is <= 1 - top_p); the most
    likely token is always kept. The cut's logit comes from the radix search: the largest logit whose
    tokens at or above it hold >= top_p. Tokens above it are kept, tokens below dropped, and of the tokens
    at it (equal logits, so equal probabilities) those with the highest ids are kept while the mass after
    them stays < top_p: a count of the tied tokens with a higher id, one cumulative sum over the row."""
    keys = _order_keys(logits)
    cut = _largest_threshold(keys, probs, top_p, vocab)
    above = keys > cut[:, None]
    tied = keys == cut[:, None]
    above_mass = vocab.sum(jnp.where(above, probs, 0), keepdims=True)
    tied_after = vocab.count_after(tied)  # tied tokens of higher id
    tied_p = vocab.max(jnp.where(tied, probs, 0), keepdims=True)
    keep = above | (tied & (above_mass + tied_after * tied_p < top_p[:, None]))
    return keep | (top_p[:, None] >= 1)


def radix_filter(x, top_k, top_p, vocab: Vocab = FULL):
    """(cut, tie_id, top, total) of tempered logits x [R, V] by the radix searches: exact for any settings,
    and over a sharded vocabulary (x this device's slice) the whole rows' values."""
    keep_k = top_k_mask(x, top_k, vocab)
    x_k = jnp.where(keep_k, x, -jnp.inf)
    keep = keep_k & top_p_mask(x_k, vocab.softmax(x_k), top_p, vocab)
    # The kept set is every token above its lowest kept logit and the highest ids at it.
    cut = vocab.min(jnp.where(keep, x, jnp.inf))
    ids = vocab.ids(x.shape[-1])
    tie_id = vocab.min(jnp.where(keep & (x == cut[:, None]), ids, _NO_TIE))
    top = vocab.max(x)
    return cut, tie_id, top, vocab.sum(jnp.where(keep, jnp.exp(x - top[:, None]), 0.0))


def tempered(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """float32 logits [R, V] / temperature [R] (1 for a greedy row), as one buffer for every use: XLA may
    otherwise recompute the division in each fusion that reads it, and the CPU's vectorised division rounds
    differently from its scalar one, so a cut taken from one copy could miss its own token in another."""
    scale = jnp.where(temperature <= 0, 1.0, temperature)
    return jax.lax.optimization_barrier(logits.astype(jnp.float32) / scale[:, None])


def filter_for(settings: SamplingParams) -> str:
    """The filter a request's sampling build runs, from its settings as host arrays: "candidates" when every
    sampled row's top_k is in [1, K] (candidate_filter.py), else "radix" (exact for any settings). Greedy
    rows' settings do not count: their filtered distribution is never used."""
    sampled = np.asarray(settings.temperature) > 0
    top_k = np.asarray(settings.top_k)
    return "candidates" if np.all(~sampled | ((top_k >= 1) & (top_k <= candidate_filter.K))) else "radix"


def filter_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                vocab: Vocab = FULL, *, filter: str) -> Filtered:
    """float32 logits [R, V] and per-row settings [R] -> `Filtered`: temperature, then top-k, then top-p over
    the tempered distribution (transformers' order). filter (static, one of FILTERS): "candidates" takes the
    cuts from each row's K largest logits, exact for rows with top_k in [1, K] (candidate_filter.py);
    "radix" runs the radix search, exact for any settings. Each is one program without a branch. A greedy
    row (temperature 0) is filtered at temperature 1; its result is not used. Under a sharded `vocab` (logits
    this device's slice) only "radix" is taken, its counts and sums over the whole vocabulary: the candidate
    filter's top-k is per device."""
    if filter not in FILTERS:
        raise ValueError(f"filter must be one of {FILTERS}, got {filter!r}")
    if filter == "candidates" and vocab.shards is not None:
        raise ValueError("filter 'candidates' is per device: a vocabulary split over a mesh takes 'radix'")
    x = tempered(logits, temperature)
    if filter == "candidates":
        return Filtered(x, *candidate_filter.filter_rows(x, top_k, top_p))
    return Filtered(x, *radix_filter(x, top_k, top_p, vocab), vocab=vocab)


def filtered_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   vocab: Vocab = FULL, *, filter: str) -> jax.Array:
    """float32 logits [..., V] and per-row settings [...] -> the filtered, renormalised distribution [..., V]
    (`filter_rows`)."""
    shape = logits.shape
    t, k, p = (jnp.broadcast_to(x, shape[:-1]).reshape(-1) for x in (temperature, top_k, top_p))
    return filter_rows(logits.reshape(-1, shape[-1]), t, k, p, vocab, filter=filter).probs().reshape(shape)


def on_vocabulary(probs: jax.Array, ids: jax.Array, vocab_size: int, vocab: Vocab = FULL) -> jax.Array:
    """A distribution over a subset of the vocabulary, probs [..., Vd] over token ids [Vd] (distinct), as a
    distribution over the whole vocabulary [..., vocab_size] (this device's slice of it under `vocab`): the
    other tokens get probability 0."""
    if vocab.shards is None:
        return jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype).at[..., ids].set(probs)
    local = vocab.local_index(ids, vocab_size)
    return jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype).at[..., local].set(probs, mode="drop")


# ----------------------------------------------------------------------------- randomness


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """seed [B, 2] key data, position [B] -> one key per row. A step's key comes from its row's seed and the
    index of the first token it generates, so a row's draws depend on nothing else in the batch, and no
    two steps of a row share a key."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.wrap_key_data(s, impl="threefry2x32"), i))(
        seed, position)


def _fold(keys: jax.Array, data: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def categorical(keys: jax.Array, probs: jax.Array, vocab: Vocab = FULL) -> jax.Array:
    """One token per row from probs [B, V] (unnormalised weights are fine): Gumbel-max, on the device."""
    return jax.vmap(lambda k, p: vocab.categorical(k, jnp.log(p)))(keys, probs).astype(jnp.int32)


def uniforms(keys: jax.Array, count: int) -> jax.Array:
    """The round's acceptance uniforms, `count` a row [B, count] in [0, 1): the chain's one per draft, a draft
    tree's one per node (decoding/tree.py)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (count,)))(_fold(keys, _ACCEPT))


def draw(keys: jax.Array, probs: jax.Array, vocab: Vocab = FULL) -> jax.Array:
    """The round's final token of each row from probs [B, V] (unnormalised weights are fine), or prefill's
    first token: the round key's one categorical draw."""
    return categorical(_fold(keys, _FINAL), probs, vocab)


def draft_key(keys: jax.Array, step: int | jax.Array) -> jax.Array:
    """The key a row samples its draft number `step` (0-based) with, from the round's keys."""
    return jax.vmap(lambda k: jax.random.fold_in(k, _DRAFT + step))(keys)


# ----------------------------------------------------------------------------- rejection sampling


def accept(u: jax.Array, p_x: jax.Array, q_x: jax.Array) -> jax.Array:
    """Accept a draft x ~ q with probability min(1, p(x) / q(x)): u ~ U[0, 1), and q(x) > 0 for a drawn x."""
    return u * q_x < p_x


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """Where to sample after a rejection: max(p - q, 0) (unnormalised). With q one-hot at x (argmax drafts)
    this is p with x removed."""
    return jnp.maximum(p - q, 0.0)


def verify(keys, p: Filtered, drafts: jax.Array, q: jax.Array | None, room: jax.Array,
           q_ids: jax.Array | None = None):
    """Speculative sampling for one round of B rows (Leviathan et al., Chen et al.).

    p: the target's filter over B (G + 1) rows, row b (G + 1) + i after token i of [x_n, d_1 .. d_G] of
    batch row b; it is read only at the drafts and over the one row the round's last token is drawn from.
    drafts [B, G] (target ids) drawn from q; room [B]: the most drafts the cache can take. q is None for
    argmax drafts (q one-hot at the draft: nothing is built for it), else [B, G, Vq] over the token ids
    q_ids [Vq] (distinct; None: the whole vocabulary), so a drafter's q on its draft vocabulary is never
    spread over the target's. Draft i is accepted with probability min(1, p_i / q_i) until the first
    rejection, which samples from normalise(max(p - q, 0)) there; when every considered draft is accepted
    (all G, or the room's worth) the next token comes from p. Lossless for any q: each emitted token is
    distributed as p. Returns (accepted [B], tokens [B, G + 1]: the accepted drafts, then the sampled
    token, then padding). Under a sharded `p.vocab`, p's rows (and q when q_ids is None) hold this device's
    slice of the vocabulary.
    """
    vocab = p.vocab
    B, G = drafts.shape
    V = p.logits.shape[-1]
    rows = jnp.arange(B)
    u = uniforms(keys, G)
    p_x = p.prob(rows[:, None] * (G + 1) + jnp.arange(G)[None, :], drafts)
    if q is None:
        q_x = jnp.ones_like(p_x)
    elif q_ids is None:
        q_x = vocab.take(q, drafts)
    else:
        q_x = jnp.sum(jnp.where(q_ids == drafts[:, :, None], q, 0.0), axis=-1)
    leading = jnp.sum(jnp.cumprod(accept(u, p_x, q_x).astype(jnp.int32), axis=1), axis=1)
    considered = jnp.clip(room, 0, G)  # drafts beyond the room are never judged: a stop there draws from p
    accepted = jnp.minimum(leading, considered)
    rejected = leading < considered
    p_a = p.rows(rows * (G + 1) + accepted).probs()
    judged = jnp.minimum(accepted, G - 1)  # q is read only where a draft was rejected
    if G == 0:
        q_a = jnp.zeros_like(p_a)
    elif q is None:
        q_a = jax.nn.one_hot(vocab.local_index(drafts[rows, judged], V), V, dtype=p_a.dtype)
    elif q_ids is None:
        q_a = q[rows, judged]
    else:
        q_a = on_vocabulary(q[rows, judged], q_ids, V, vocab)
    left = residual(p_a, q_a)
    # p == q up to rounding makes a rejection (nearly) impossible and the residual empty: sample p then.
    left = jnp.where(vocab.sum(left, keepdims=True) > 0, left, p_a)
    final = draw(keys, jnp.where(rejected[:, None], left, p_a), vocab)
    idx = jnp.arange(G + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(idx < accepted[:, None], padded, jnp.where(idx == accepted[:, None], final[:, None], 0))
    return accepted, tokens


def first_token(keys, probs: jax.Array, vocab: Vocab = FULL) -> jax.Array:
    """Prefill's token: a plain draw from the filtered distribution probs [B, V]."""
    return draw(keys, probs, vocab)
