"""The EAGLE-3 drafter: one Llama-style (or Qwen3-style) layer over [embedding, hidden] inputs.

Parameters: a dict pytree described in models/weights.py (`drafter_weights`), weights [out, in] as
transformers stores them; d2t maps draft ids to target ids by offset; embed is optional (else the
target's is used). Under tensor parallelism (`tp`) the drafter is replicated but for its embedding,
which is split over the vocabulary as the target's is (its lookup summed across devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.models import collectives, weights
from eagle3_jax.models.collectives import Shards
from eagle3_jax.models.config import DrafterConfig
from eagle3_jax.models.kv_cache import KVPages, Layout, RowCache, mask_words
from eagle3_jax.models.layers import add_rms_norm, gated_mlp, linear, rms_norm, rope_tables
from eagle3_jax.models.paged_attention import attention_block


def abstract_params(cfg: DrafterConfig, dtype, with_embed: bool = False) -> dict:
    """Every parameter's shape and dtype (jax.ShapeDtypeStruct), in the pytree's structure."""
    return weights.abstract_params(weights.drafter_weights(cfg, with_embed=with_embed), dtype)


def new_pages(cfg: DrafterConfig, num_pages: int, page_size: int, dtype) -> KVPages:
    """A page pool for the drafter's one layer of KV (kv_cache.KVPages)."""
    return KVPages.create(1, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim, dtype)


def new_row_cache(cfg: DrafterConfig, batch: int, capacity: int, dtype) -> RowCache:
    """The drafter's KV for `batch` sequences of up to `capacity` pairs with no allocator (kv_cache.RowCache)."""
    return RowCache.create(1, batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)


def forward(params, cfg: DrafterConfig, embed, h, tokens, pages: KVPages, layout: Layout, kernels: str,
            tp: Shards | None = None):
    """One drafter pass over the layout's pairs (h_t, token_{t+1}), tokens [B, T] at the layout's positions.

    h [B, T, D] is either `project_features` of target features or the drafter's own carried hidden.
    Returns the pre-norm output hidden [B, T, D] and the pages with the new K/V written where the layout says
    (the caller commits by advancing lengths).
    """
    B, T = tokens.shape

    def paged_attention(qkv, cos, sin):
        out, k_pages, v_pages = attention_block(
            qkv, cos, sin, pages.k[0], pages.v[0], layout, num_heads=cfg.num_heads,
            q_norm=params["q_norm"] if cfg.qk_norm else None, k_norm=params["k_norm"] if cfg.qk_norm else None,
            eps=cfg.rms_norm_eps, kernels=kernels,
        )
        return out, KVPages((k_pages,), (v_pages,))

    return layer(params, cfg, embed, h, tokens, layout.positions.reshape(B, T), paged_attention, kernels, tp)


def forward_rows(params, cfg: DrafterConfig, embed, h, tokens, cache: RowCache, kernels: str):
    """`forward` of pairs after each row's in a row cache (no allocator): (hidden, the cache with their K/V
    written, lengths unchanged)."""
    out, pages = forward(params, cfg, embed, h, tokens, cache.pages, cache.layout(tokens.shape[1]), kernels)
    return out, cache.written(pages)


def layer(params, cfg: DrafterConfig, embed, h, tokens, positions, attention, kernels: str,
          tp: Shards | None = None):
    """The drafter's layer over T pairs (h_t, token_{t+1}) at `positions` [B, T], its attention an argument:
    attention(qkv [B, T, (N + 2K) H], cos, sin) -> (output [B, T, N, H], what it carries). Inference attends
    through the KV cache (`forward`); training-time test, through its own mask (training/ttt.py). Returns the
    pre-norm output hidden [B, T, D] and what the attention carries."""
    B, T = tokens.shape
    N, H, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    normed_h = rms_norm(h, params["hidden_norm"], eps)
    residual = normed_h if cfg.norm_before_residual else h
    # The embedding comes first in the concatenation, then the hidden state.
    embedded = collectives.embed(embed, tokens, tp).astype(h.dtype)
    x = jnp.concatenate([rms_norm(embedded, params["embed_norm"], eps), normed_h], axis=-1)
    cos, sin = rope_tables(positions, cfg.rope, h.dtype)
    attn, carried_by_attention = attention(linear(x, params["wqkv"]), cos, sin)
    attn = linear(attn.reshape(B, T, N * H), params["wo"])
    h, normed = add_rms_norm(residual, attn, params["mlp_norm"], eps, kernels)
    h = h + gated_mlp(normed, params["w_gate_up"], params["w_down"])
    return h, carried_by_attention


def project_features(params, cfg: DrafterConfig, features) -> jax.Array:
    """Target features [..., C] -> the drafter's hidden width [..., D] through fc (and its norms)."""
    if cfg.norm_before_fc:
        features = rms_norm(features, params["feature_norm"], cfg.rms_norm_eps)
    if cfg.fc_norm:
        chunks = jnp.split(features, len(cfg.capture_layers), axis=-1)
        features = jnp.concatenate([rms_norm(c, w, cfg.rms_norm_eps) for c, w in zip(chunks, params["fc_norms"])], -1)
    return linear(features, params["fc"])


def carried(params, cfg: DrafterConfig, hidden) -> jax.Array:
    """What a draft step hands to the next one: the pre-norm output, or its norm under norm_output."""
    return rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps) if cfg.norm_output else hidden


def draft_logits(params, cfg: DrafterConfig, hidden) -> jax.Array:
    """Pre-norm hidden [..., D] -> float32 logits over the draft vocabulary [..., Vd]."""
    normed = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    return jnp.einsum("...d,vd->...v", normed, params["lm_head"], preferred_element_type=jnp.float32)


def draft_token(params, cfg: DrafterConfig, hidden) -> jax.Array:
    """Greedy draft: argmax over the draft vocabulary, then d2t maps it to a target id (no scatter)."""
    return to_target_id(params, jnp.argmax(draft_logits(params, cfg, hidden), axis=-1))


def to_target_id(params, draft_id) -> jax.Array:
    """Draft-vocabulary ids -> target ids through d2t's offsets."""
    return (draft_id + params["d2t"][draft_id]).astype(jnp.int32)


def draft_chain(params, cfg: DrafterConfig, embed, hidden, pages: KVPages, page_table, lengths, gamma: int,
                kernels: str, propose=None, write=None, tp: Shards | None = None, guide=None):
    """gamma drafts from hidden [B, D], the pre-norm output at the newest committed pair, for rows whose drafter
    has `lengths` [B] committed pairs in the pages of page_table [B, W].

    d_1 comes straight from `hidden`; step k >= 2 feeds (carried hidden, d_{k-1}) at position
    lengths + k - 2. A lax.scan, so the choice never leaves the device. Drafts are greedy (argmax) unless
    `propose(logits [B, Vd] float32, step)` is given: it returns (draft ids [B], q [B, Vd]), the draft
    vocabulary ids it drew and the distribution it drew them from, which sampled speculation needs.
    write [B] bool: the rows whose speculative entries are written (None: every row).
    guide: None, or (carry, mask, advance) constraining the chain: mask(carry, logits [B, Vd]) -> logits (the
    tokens not allowed at -inf) is applied before each choice, and advance(carry, target ids [B]) -> carry moves
    along the chain's drafts (structured outputs: the carry is each row's automaton state).
    Returns drafts [B, gamma] (target ids), with `propose` also q [B, gamma, Vd], and the pages holding the
    speculative entries past each row's committed pairs (stale: the rebuild after verify overwrites them).
    """
    def choose(h, step, g):
        if propose is None and guide is None:
            return draft_token(params, cfg, h), None, g
        logits = draft_logits(params, cfg, h)
        if guide is not None:
            logits = guide[1](g, logits)
        if propose is None:
            draft_id, q = jnp.argmax(logits, axis=-1), None
        else:
            draft_id, q = propose(logits, step)
        token = to_target_id(params, draft_id)
        return token, q, g if guide is None else guide[2](g, token)

    first, first_q, g = choose(hidden, 0, None if guide is None else guide[0])

    def step(carry, k):
        h, token, buf, g = carry
        layout = Layout.uniform(page_table, lengths + k, 1, write)
        out, buf = forward(params, cfg, embed, h[:, None], token[:, None], buf, layout, kernels, tp)
        out = out[:, 0]
        nxt, q, g = choose(out, k + 1, g)
        return (carried(params, cfg, out), nxt, buf, g), (nxt, q)

    (_, _, pages_out, _), (rest, rest_q) = jax.lax.scan(step, (carried(params, cfg, hidden), first, pages, g),
                                                        jnp.arange(gamma - 1, dtype=jnp.int32))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    if propose is None:
        return drafts, pages_out
    q = jnp.concatenate([first_q[:, None], jnp.moveaxis(rest_q, 0, 1)], axis=1)
    return drafts, q, pages_out


def draft_tree(params, cfg: DrafterConfig, embed, hidden, pages: KVPages, page_table, lengths, depth: int,
               top_k: int, kernels: str, write=None, tp: Shards | None = None):
    """The candidates of a draft tree, SGLang's EAGLE expansion: `depth` levels of `top_k` beams from hidden [B, D],
    the pre-norm output at the newest committed pair, for rows whose drafter has `lengths` [B] committed pairs in
    the pages of page_table [B, W].

    Level 1 is the top_k tokens of the drafter's distribution at `hidden`; they are the first beams. Each of the
    depth - 1 steps feeds the K beams (as the chain feeds one draft: carried hidden, token) in one forward of K
    tokens a row, all at RoPE position lengths + step, scores each beam's top_k children by the path's summed
    log-probability, and keeps the best K of those K x K as the next beams; every scored child is a candidate.
    Beam b of step f writes its drafter KV at slot lengths + f K + b, past the committed pairs (a tree region of
    (depth - 1) K slots a row, so that no beam overwrites another's) and attends the committed pairs and its own
    ancestors' slots (a tree mask: kv_cache.Layout.tree). A lax.scan over the steps, so nothing leaves the device.
    write [B] bool: the rows whose entries are written (None: every row).

    Returns (scores [B, C] float32, tokens [B, C] target ids, parents [B, C] int32: each candidate's parent
    candidate, -1 for level 1's, the pages holding the beams' entries), C = K + (depth - 1) K^2 candidates in
    level order (a parent's index is below its children's); the entries are stale once the round's rebuild
    writes the accepted pairs over them.
    """
    B, K = hidden.shape[0], top_k
    region = max((depth - 1) * K, 1)

    def top(h):  # [..., D] -> (log-probabilities [..., K], draft vocabulary ids [..., K])
        logits = draft_logits(params, cfg, h)
        best, ids = jax.lax.top_k(logits, K)  # the log-softmax's top K, without a pass writing all of it
        return best - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids

    score, ids = top(hidden)
    first = (score, to_target_id(params, ids), jnp.repeat(carried(params, cfg, hidden)[:, None], K, axis=1),
             jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)), jnp.zeros((B, K, region), bool), pages)

    def step(carry, f):
        score, token, h, candidate, mask, buf = carry
        mask = mask | jax.nn.one_hot(f * K + jnp.arange(K), region, dtype=bool)[None]
        positions = jnp.broadcast_to((lengths + f)[:, None], (B, K))
        layout = Layout.tree(page_table, lengths, lengths + f * K, positions, mask_words(mask), write)
        out, buf = forward(params, cfg, embed, h, token, buf, layout, kernels, tp)  # [B, K, D]
        child_score, child_ids = top(out)  # [B, K, K]
        scores = (score[:, :, None] + child_score).reshape(B, K * K)
        tokens = to_target_id(params, child_ids).reshape(B, K * K)
        parents = jnp.repeat(candidate, K, axis=1)
        best, pick = jax.lax.top_k(scores, K)  # the next beams
        beam = pick // K

        def of_beam(x):
            return jnp.take_along_axis(x, beam.reshape(B, K, *([1] * (x.ndim - 2))), axis=1)

        carry = (best, jnp.take_along_axis(tokens, pick, axis=1), of_beam(carried(params, cfg, out)),
                 (K + f * K * K + pick).astype(jnp.int32), of_beam(mask), buf)
        return carry, (scores, tokens, parents)

    carry, (scores, tokens, parents) = jax.lax.scan(step, first, jnp.arange(depth - 1, dtype=jnp.int32))

    def levels(level1, later):  # level 1 [B, K], then each step's [depth - 1, B, K^2] -> [B, C]
        return jnp.concatenate([level1, jnp.moveaxis(later, 0, 1).reshape(B, -1)], axis=1)

    return (levels(first[0], scores), levels(first[1], tokens),
            levels(jnp.full((B, K), -1, jnp.int32), parents), carry[-1])
