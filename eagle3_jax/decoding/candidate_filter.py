"""The top-k / top-p filter from each row's K largest logits: exact for rows whose top_k is in [1, K], in a
handful of passes over the row instead of the radix search's sixteen (sampling.py).

The candidates. A row's logits are cut into blocks (BLOCKS: 64 tokens, one level); the K blocks of largest maximum (of
equal maxima, the higher block) hold the row's K largest logits (of equal logits, the higher ids): each of
those K tokens lies in a block whose maximum is at least it, and were its block not chosen, the K chosen
blocks' maxima would all come before it. `lax.top_k` over the K gathered blocks, laid out in descending id
order (top_k puts the lower index first among equal values), then gives the K largest logits in the order
of a stable descending sort with higher ids first among equal logits: the order the filters keep tokens in.
With more levels the same holds of blocks of blocks: the K largest blocks lie in the K largest superblocks.

The filters. With top_k = k <= K the top-k cut is the k-th candidate; every token above it is a candidate,
but the tokens equal to it may run past the K candidates. One more pass counts them per block, so the
top-k mass is exact, and top-p's decision for tied token number t (by descending id) is the radix path's:
kept while the mass above the cut plus t times the tied token's probability is < top_p. When top-p keeps
tied tokens beyond the candidates, the per-block counts locate the id of the last kept one.

Fewer finite logits than top_k (a k-th logit of -inf). Exact without another search: the cut is -inf, and
as the candidates are the K largest logits and fewer than k <= K are finite, every finite token is a
candidate. The mass, and each finite token's `above` (the mass of higher logits) and `ahead` (equal logits
of higher id), are then sums over exactly the tokens transformers weighs, so each finite token is kept or
dropped as there. A token of logit -inf has weight exp(-inf - top) = 0, so the distribution (Filtered's
probs, prob and total) is the same whichever of them the cut and tie id mark as kept: zero-probability
tokens never change it. The same holds for tied tokens whose weight underflows to 0 at a finite cut.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

K = 64  # candidates per row: rows with top_k in [1, K] are filtered from them
# Block sizes, finest first: Qwen3's 151,936 logits are 2,374 blocks of 64, the 64 chosen 4,096 tokens (two
# top-k searches, over 2,374 and 4,096 entries). (16, 16) would search 594 superblocks, then 1,024 blocks, then
# 1,024 tokens: smaller sorts, one more level (the bench times both).
BLOCKS = (64,)


def padded(x: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
    """[R, V] -> [R, N], padded with -inf to a multiple of every level's blocks; -0.0 as +0.0 (equal
    logits, one order)."""
    size = math.prod(blocks)
    x = jnp.where(x == 0, 0.0, x)
    return jnp.pad(x, ((0, 0), (0, -x.shape[-1] % size)), constant_values=-jnp.inf)


def candidates(x: jax.Array, k: int, blocks: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """x [R, N] (N a multiple of prod(blocks)), k <= N -> (values [R, k], ids [R, k]): each row's k largest
    entries, descending, higher ids first among equal values. blocks: the block sizes, finest first; each
    level's k largest blocks (their maxima, by this function one level up) hold the level's k largest
    entries, so only k blocks are searched at each level."""
    R, N = x.shape
    if blocks:
        b = blocks[0]
        _, chosen = candidates(jnp.max(x.reshape(R, N // b, b), axis=-1), min(k, N // b), blocks[1:])
        chosen = -jnp.sort(-chosen, axis=-1)  # block numbers, highest first
        ids = (chosen[:, :, None] * b + jnp.arange(b - 1, -1, -1, dtype=jnp.int32)).reshape(R, -1)
    else:
        ids = jnp.broadcast_to(jnp.arange(N - 1, -1, -1, dtype=jnp.int32), (R, N))
    values, at = jax.lax.top_k(jnp.take_along_axis(x, ids, axis=-1), k)
    return values, jnp.take_along_axis(ids, at, axis=-1)


def _tied_id(blocks, cut, per_block, r) -> jax.Array:
    """The id of the r-th highest-id token equal to cut [R] in each row (1 <= r <= their count), from the
    row's blocks [R, NB, B], the per-block counts [R, NB] of those tokens and one gathered block."""
    rows, block = jnp.arange(blocks.shape[0]), blocks.shape[-1]
    from_block = jnp.cumsum(per_block[:, ::-1], axis=-1)[:, ::-1]  # tied tokens in block b and above
    b = jnp.clip(jnp.sum(from_block >= r[:, None], axis=-1) - 1, 0, blocks.shape[1] - 1)
    need = r - (from_block[rows, b] - per_block[rows, b])  # how many of block b's tied tokens, from the top
    from_pos = jnp.cumsum((blocks[rows, b] == cut[:, None])[:, ::-1], axis=-1)[:, ::-1]
    s = jnp.clip(jnp.sum(from_pos >= need[:, None], axis=-1) - 1, 0, block - 1)
    return (b * block + s).astype(jnp.int32)


def _tied_kept(above, p_tied, top_p, count) -> jax.Array:
    """How many tokens t = 0, 1, .. count - 1 satisfy above + t * p_tied < top_p (a prefix: the sum rises
    with t), all of them when top_p >= 1; the same float expression as the per-token test. With p_tied 0
    (a cut at -inf, or a weight that underflows) the test is the same for every t: all of them or none."""
    def fits(t):
        return above + t.astype(jnp.float32) * p_tied < top_p

    guess = jnp.ceil((top_p - above) / jnp.where(p_tied > 0, p_tied, 1.0))
    guess = jnp.clip(guess, 0, count).astype(jnp.int32)  # off by at most one from rounding
    guess = jnp.where(fits(guess) & (guess < count), guess + 1, guess)
    guess = jnp.where((guess > 0) & ~fits(guess - 1), guess - 1, guess)
    guess = jnp.where(p_tied > 0, guess, jnp.where(fits(jnp.zeros_like(count)), count, 0))
    return jnp.where(top_p >= 1, count, guess)


def filter_rows(x: jax.Array, top_k: jax.Array, top_p: jax.Array, blocks: tuple[int, ...] = BLOCKS,
                count: int = K):
    """Tempered logits x [R, V], top_k and top_p [R] -> (cut, tie_id, top, total) as sampling.Filtered holds
    them: exact for rows with 1 <= top_k <= count, the candidates per row (top_k > V keeps the whole row, as
    transformers does); other rows' values are not the filter's. blocks: `candidates`' block sizes (any give
    the same result)."""
    padded_x = padded(x, blocks)
    values, ids = candidates(padded_x, min(count, x.shape[-1]), blocks)
    by_block = padded_x.reshape(x.shape[0], -1, blocks[0])  # the finest level's blocks
    rows, n = jnp.arange(x.shape[0]), values.shape[-1]
    k = jnp.clip(top_k, 1, n)
    thr, top = values[rows, k - 1], values[:, 0]
    in_k = values >= thr[:, None]
    per_block = jnp.sum(by_block == thr[:, None, None], axis=-1)  # the pass over the row for the tied tokens
    n_tied = jnp.sum(values == thr[:, None], axis=-1)  # tied candidates
    tail = jnp.sum(per_block, axis=-1) - n_tied  # tied tokens past the candidates
    w = jnp.where(in_k, jnp.exp(values - top[:, None]), 0.0)
    w_thr = jnp.exp(thr - top)
    mass = jnp.sum(w, axis=-1) + tail * w_thr
    p = w / mass[:, None]
    # Top-p in the stable order: the mass of higher logits, plus the tied tokens of higher id.
    above = jnp.sum(jnp.where(values[:, None, :] > values[:, :, None], p[:, None, :], 0.0), axis=-1)
    j = jnp.arange(n)
    ahead = jnp.sum((values[:, None, :] == values[:, :, None]) & (j[None, :] < j[:, None]), axis=-1)
    keep = in_k & ((above + ahead * p < top_p[:, None]) | (top_p[:, None] >= 1))
    tail_kept = jnp.clip(_tied_kept(above[rows, k - 1], w_thr / mass, top_p, n_tied + tail) - n_tied, 0, tail)
    last = jnp.sum(keep, axis=-1) - 1  # the most likely token is always kept
    past = tail_kept > 0
    cut = jnp.where(past, thr, values[rows, last])
    tie_id = jnp.where(past, _tied_id(by_block, thr, per_block, n_tied + tail_kept), ids[rows, last])
    total = jnp.sum(jnp.where(keep, w, 0.0), axis=-1) + tail_kept * w_thr
    return cut, tie_id, top, total
