"""The EAGLE-3 drafter: one Llama-style (or Qwen3-style) layer over [embedding, hidden] inputs.

Parameters: a dict pytree described in models/weights.py (`drafter_weights`), weights [out, in] as
transformers stores them; d2t maps draft ids to target ids by offset; embed is optional (else the
target's is used). Under tensor parallelism (`tp`) the drafter is replicated but for its embedding,
which is split over the vocabulary as the target's is (its lookup summed across devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.models import kv_cache, weights
from eagle3_jax.models.attention import attend, rotate_and_cache
from eagle3_jax.models.config import RopeConfig
from eagle3_jax.models.layers import add_rms_norm, gated_mlp, linear, rms_norm, rope_tables
from eagle3_jax.parallel import collectives
from eagle3_jax.parallel.collectives import Shards


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    capture_layers: tuple[int, ...]  # residual stream ENTERING these target layers, low to high
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h (speculators flag)
    qk_norm: bool = False  # Qwen3-style layer: RMSNorm on q and k per head before RoPE
    fc_norm: bool = False  # RMSNorm each captured feature chunk before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    norm_output: bool = False  # speculators: carry norm(h), not h, to the next draft step

    @property
    def feature_width(self) -> int:
        return len(self.capture_layers) * self.target_hidden_size


def abstract_params(cfg: DrafterConfig, dtype, with_embed: bool = False) -> dict:
    """Every parameter's shape and dtype (jax.ShapeDtypeStruct), in the pytree's structure."""
    return weights.abstract_params(weights.drafter_weights(cfg, with_embed=with_embed), dtype)


def new_cache(cfg: DrafterConfig, batch: int, capacity: int, dtype) -> kv_cache.KVCache:
    return kv_cache.KVCache.create(1, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype)


def forward(params, cfg: DrafterConfig, embed, h, tokens, cache: kv_cache.KVCache, kernels: str,
            tp: Shards | None = None):
    """One drafter pass over T pairs (h_t, token_{t+1}) at positions cache.lengths + t.

    h [B, T, D] is either `project_features` of target features or the drafter's own carried hidden.
    Returns the pre-norm output hidden [B, T, D] and the cache with the new K/V written (lengths
    unchanged: the caller commits).
    """
    T = tokens.shape[1]

    def cached_attention(qkv, cos, sin):
        q, k_buf, v_buf = rotate_and_cache(
            qkv, cos, sin, cache.k[0], cache.v[0], cache.lengths, num_heads=cfg.num_heads,
            q_norm=params["q_norm"] if cfg.qk_norm else None, k_norm=params["k_norm"] if cfg.qk_norm else None,
            eps=cfg.rms_norm_eps, kernels=kernels,
        )
        return attend(q, k_buf, v_buf, cache.lengths, kernels), kv_cache.KVCache((k_buf,), (v_buf,), cache.lengths)

    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return layer(params, cfg, embed, h, tokens, positions, cached_attention, kernels, tp)


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


def draft_chain(params, cfg: DrafterConfig, embed, hidden, cache: kv_cache.KVCache, gamma: int, kernels: str,
                propose=None, tp: Shards | None = None):
    """gamma drafts from hidden [B, D], the pre-norm output at the newest committed pair.

    d_1 comes straight from `hidden`; step k >= 2 feeds (carried hidden, d_{k-1}) at position
    lengths + k - 2. A lax.scan, so the choice never leaves the device. Drafts are greedy (argmax) unless
    `propose(logits [B, Vd] float32, step)` is given: it returns (draft ids [B], q [B, Vd]), the draft
    vocabulary ids it drew and the distribution it drew them from, which sampled speculation needs.
    Returns drafts [B, gamma] (target ids), with `propose` also q [B, gamma, Vd], and the cache holding
    the speculative entries (lengths unchanged: they are discarded by the rebuild after verify).
    """
    def choose(h, step):
        if propose is None:
            return draft_token(params, cfg, h), None
        draft_id, q = propose(draft_logits(params, cfg, h), step)
        return to_target_id(params, draft_id), q

    first, first_q = choose(hidden, 0)

    def step(carry, k):
        h, token, buf = carry
        out, buf = forward(params, cfg, embed, h[:, None], token[:, None], buf.with_lengths(cache.lengths + k), kernels,
                           tp)
        out = out[:, 0]
        nxt, q = choose(out, k + 1)
        return (carried(params, cfg, out), nxt, buf), (nxt, q)

    (_, _, cache_out), (rest, rest_q) = jax.lax.scan(step, (carried(params, cfg, hidden), first, cache),
                                                     jnp.arange(gamma - 1, dtype=jnp.int32))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    if propose is None:
        return drafts, cache_out.with_lengths(cache.lengths)
    q = jnp.concatenate([first_q[:, None], jnp.moveaxis(rest_q, 0, 1)], axis=1)
    return drafts, q, cache_out.with_lengths(cache.lengths)
