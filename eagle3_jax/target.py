"""The Qwen3 target as pure functions over a parameter pytree.

Parameters (weights in transformers' [out, in] orientation; one array per layer, never a stacked
array sliced per layer, which costs copies on the GPU):
    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied to embed),
    layers: tuple of {attn_norm [D], wqkv [(N + 2K) H, D], q_norm [H], k_norm [H], wo [D, N H],
                      mlp_norm [D], w_gate_up [2 I, D], w_down [D, I]}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax import kv_cache
from eagle3_jax.attention import attend
from eagle3_jax.config import Qwen3Config
from eagle3_jax.layers import apply_rope, gated_mlp, linear, normed_linear, rms_norm, rope_tables

Params = dict


def abstract_params(cfg: Qwen3Config, dtype) -> dict:
    """Every parameter's shape and dtype (jax.ShapeDtypeStruct), in the pytree's structure."""
    D, H, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    N, K = cfg.num_heads, cfg.num_kv_heads
    layer = {
        "attn_norm": (D,),
        "wqkv": ((N + 2 * K) * H, D),
        "q_norm": (H,),
        "k_norm": (H,),
        "wo": (D, N * H),
        "mlp_norm": (D,),
        "w_gate_up": (2 * I, D),
        "w_down": (D, I),
    }
    shapes = {
        "embed": (cfg.vocab_size, D),
        "final_norm": (D,),
        "layers": tuple(dict(layer) for _ in range(cfg.num_layers)),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, D)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=_is_shape)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def new_cache(cfg: Qwen3Config, batch: int, capacity: int, dtype) -> kv_cache.KVCache:
    return kv_cache.KVCache.create(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype)


def _attention_block(layer, cfg: Qwen3Config, x, cos, sin, k_buf, v_buf, start, positions, kernels):
    B, T, _ = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = normed_linear(x, layer["attn_norm"], cfg.rms_norm_eps, layer["wqkv"], kernels)
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
    # Qwen3 normalises q and k per head before RoPE.
    q = apply_rope(rms_norm(q.reshape(B, T, N, H), layer["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k.reshape(B, T, K, H), layer["k_norm"], cfg.rms_norm_eps), cos, sin)
    k_buf = kv_cache.write(k_buf, k, positions)
    v_buf = kv_cache.write(v_buf, v.reshape(B, T, K, H), positions)
    out = attend(q, k_buf, v_buf, start, kernels)
    return linear(out.reshape(B, T, N * H), layer["wo"], kernels), k_buf, v_buf


def forward(
    params: Params,
    cfg: Qwen3Config,
    tokens: jax.Array,
    cache: kv_cache.KVCache,
    capture_layers: tuple[int, ...] = (),
    kernels: str = "xla",
):
    """Runs tokens [B, T] at positions cache.lengths + t, writing their K/V into the cache.

    Returns (hidden [B, T, D] after the final norm, cache with the new K/V but the same lengths:
    the caller commits by setting lengths, features [B, T, len(capture_layers) * D] or None).
    The features are the residual stream entering each capture layer, concatenated in order.
    """
    T = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = params["embed"][tokens]
    cos, sin = rope_tables(positions, cfg.rope, x.dtype)
    captured, new_k, new_v = {}, [], []
    for i, layer in enumerate(params["layers"]):
        if i in capture_layers:
            captured[i] = x
        with jax.named_scope(f"layer_{i}"):
            attn, k_buf, v_buf = _attention_block(
                layer, cfg, x, cos, sin, cache.k[i], cache.v[i], cache.lengths, positions, kernels
            )
            x = x + attn
            x = x + gated_mlp(x, layer["mlp_norm"], cfg.rms_norm_eps, layer["w_gate_up"], layer["w_down"], kernels)
        new_k.append(k_buf)
        new_v.append(v_buf)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([captured[i] for i in capture_layers], axis=-1) if capture_layers else None
    return hidden, kv_cache.KVCache(tuple(new_k), tuple(new_v), cache.lengths), features


def logits(params: Params, hidden: jax.Array, kernels: str = "xla") -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (the lm_head, or the embedding when tied)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"]
    return linear(hidden, w, kernels, out_dtype=jnp.float32)
