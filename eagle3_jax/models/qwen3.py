"""The Qwen3 target (dense or Qwen3-MoE) as pure functions over a parameter pytree.

Parameters: a dict pytree described in models/weights.py (`target_weights`), weights in transformers'
[out, in] orientation, one array per layer (never a stacked array sliced per layer, which costs copies on
the GPU); a Qwen3-MoE target's sparse layers (cfg.is_sparse) hold a router and fused experts (models/moe.py).

Tensor parallel (`tp`, inside a shard_map: eagle3_jax/parallel/): the same code runs on each device with
its shard of the weights and the per-device config (parallel/layout.py: its heads, its part of the
intermediate, its slice of the vocabulary); the row-parallel outputs (o_proj, the MLP's down projection,
the experts) and the embedding lookup are summed across devices, so the residual stream is whole on each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from eagle3_jax.models import collectives, kv_cache, moe, weights
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models.collectives import Shards
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.models.kv_cache import KVPages, Layout
from eagle3_jax.models.layers import add_rms_norm, gated_mlp, linear, rope_tables
from eagle3_jax.models.paged_attention import attention_block

Params = dict


def abstract_params(cfg: Qwen3Config, dtype) -> dict:
    """Every parameter's shape and dtype (jax.ShapeDtypeStruct), in the pytree's structure."""
    return weights.abstract_params(weights.target_weights(cfg), dtype)


def new_pages(cfg: Qwen3Config, num_pages: int, page_size: int, dtype) -> KVPages:
    """A page pool for this target's KV (kv_cache.KVPages)."""
    return KVPages.create(cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim, dtype)


def new_row_cache(cfg: Qwen3Config, batch: int, capacity: int, dtype) -> kv_cache.RowCache:
    """KV for `batch` sequences of up to `capacity` tokens with no allocator (kv_cache.RowCache)."""
    return kv_cache.RowCache.create(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)


def attention_layer(layer, cfg: Qwen3Config, normed, cos, sin, k_pages, v_pages, layout: Layout, kernels, tp):
    """Self-attention of one layer over the normed residual stream [B, T, D]; returns its output projection
    (summed across a tensor-parallel mesh) and the layer's pages with the new tokens' K/V."""
    B, T, _ = normed.shape
    out, k_pages, v_pages = attention_block(
        linear(normed, layer["wqkv"], kernels), cos, sin, k_pages, v_pages, layout, num_heads=cfg.num_heads,
        q_norm=layer["q_norm"], k_norm=layer["k_norm"], eps=cfg.rms_norm_eps, kernels=kernels,
    )
    projected = linear(out.reshape(B, T, cfg.num_heads * cfg.head_dim), layer["wo"], kernels)
    return collectives.all_reduce(projected, tp), k_pages, v_pages


def forward(
    params: Params,
    cfg: Qwen3Config,
    tokens: jax.Array,
    pages: KVPages,
    layout: Layout,
    capture_layers: tuple[int, ...] = (),
    kernels: str = "xla",
    tp: Shards | None = None,
):
    """Runs tokens [B, T] (the layout's N = B T tokens, row-major) at the layout's positions, writing their K/V
    into the pages where the layout says.

    Returns (hidden [B, T, D] after the final norm, the pages with the new K/V, features
    [B, T, len(capture_layers) * D] or None). The features are the residual stream entering each capture layer,
    concatenated in order. The caller commits tokens by advancing its sequences' lengths.
    """
    hidden, pages, features, _ = _run(params, cfg, tokens, pages, layout, capture_layers, kernels, tp)
    return hidden, pages, features


def forward_rows(params: Params, cfg: Qwen3Config, tokens: jax.Array, cache: kv_cache.RowCache,
                 capture_layers: tuple[int, ...] = (), kernels: str = "xla", tp: Shards | None = None):
    """`forward` of tokens [B, T] after each row's keys in a row cache (no allocator): (hidden, the cache with
    their K/V written, lengths unchanged, features)."""
    hidden, pages, features = forward(params, cfg, tokens, cache.pages, cache.layout(tokens.shape[1]), capture_layers,
                                      kernels, tp)
    return hidden, cache.written(pages), features


def expert_ids(params: Params, cfg: Qwen3Config, tokens: jax.Array, pages: KVPages, layout: Layout,
               kernels: str = "xla") -> tuple[jax.Array, ...]:
    """The experts each token of tokens [B, T] is routed to, per sparse layer in order: [B T, k] int32
    each. What a step of these tokens reads, for the benchmark's floors."""
    return _run(params, cfg, tokens, pages, layout, (), kernels, None)[3]


def _run(params, cfg: Qwen3Config, tokens, pages: KVPages, layout: Layout, capture_layers, kernels, tp):
    """forward, plus the sparse layers' routing (XLA drops it where the caller does not use it)."""
    B, T = tokens.shape
    x = collectives.embed(params["embed"], tokens, tp)
    cos, sin = rope_tables(layout.positions.reshape(B, T), cfg.rope, x.dtype)
    eps = cfg.rms_norm_eps
    captured, new_k, new_v, routing = {}, [], [], []
    delta = None  # what the previous block adds to the residual stream x
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            # Each residual add is fused with the norm that reads its result.
            x, normed = add_rms_norm(x, delta, layer["attn_norm"], eps, kernels)
            if i in capture_layers:
                captured[i] = x
            attn, k_pages, v_pages = attention_layer(layer, cfg, normed, cos, sin, pages.k[i], pages.v[i], layout,
                                                     kernels, tp)
            x, normed = add_rms_norm(x, attn, layer["mlp_norm"], eps, kernels)
            if cfg.is_sparse(i):
                delta, ids = moe.moe_mlp(normed, layer, cfg.moe, kernels=kernels)
                routing.append(ids)
            else:
                delta = gated_mlp(normed, layer["w_gate_up"], layer["w_down"], kernels)
            delta = collectives.all_reduce(delta, tp)
        new_k.append(k_pages)
        new_v.append(v_pages)
    _, hidden = add_rms_norm(x, delta, params["final_norm"], eps, kernels)
    features = jnp.concatenate([captured[i] for i in capture_layers], axis=-1) if capture_layers else None
    return hidden, KVPages(tuple(new_k), tuple(new_v)), features, tuple(routing)


def logits(params: Params, hidden: jax.Array, kernels: str = "xla") -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (the lm_head, or the embedding when tied); with the EXACT
    kernels a row's logits do not depend on the number of rows either (eagle3_jax/models/kernels.py)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"]
    if kernels_lib.exact(kernels):
        return pallas_kernels.skinny_matmul(hidden, w, out_dtype=jnp.float32, interpret=kernels_lib.interpret())
    return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)
