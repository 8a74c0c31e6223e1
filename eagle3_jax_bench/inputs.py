"""Random inputs on the device at a preset's shapes: weights, KV caches and the decode state the engine's
rounds run from (random data, never zeros, so no step can skip work)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding.sampling import SamplingParams
from eagle3_jax.decoding.spec_round import DecodeState
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.kv_cache import KVCache


@functools.partial(jax.jit, static_argnums=(1, 2))
def normal(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def random_tree(abstract, seed: int):
    """Random device arrays for a tree of ShapeDtypeStructs: matrices normal * 0.02, vectors (the norm
    weights) 1 + normal * 0.02 so logits are not flat, integers (d2t) zero: draft ids are target ids."""
    leaves, treedef = jax.tree.flatten(abstract)
    out = []
    for i, leaf in enumerate(leaves):
        key = jax.random.key(seed * 1000 + i)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        elif len(leaf.shape) == 1:
            out.append((1 + normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype))
        else:
            out.append(normal(key, leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def random_models(models: tuple, dtype, seed: int = 1) -> tuple[Target, Drafter]:
    """A target and a drafter with random weights (random_tree) for a preset's (Qwen3Config, DrafterConfig)."""
    cfg, dcfg = models
    target = Target(cfg, random_tree(target_lib.abstract_params(cfg, dtype), seed=seed), None)
    drafter = Drafter(dcfg, random_tree(drafter_lib.abstract_params(dcfg, dtype), seed=seed + 1), None)
    return target, drafter


def random_cache(num_layers, batch, kv_heads, capacity, head_dim, length, dtype, seed) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return KVCache(
        k=tuple(normal(jax.random.key(seed + 2 * i), shape, dtype) for i in range(num_layers)),
        v=tuple(normal(jax.random.key(seed + 2 * i + 1), shape, dtype) for i in range(num_layers)),
        lengths=jnp.full((batch,), length, jnp.int32),
    )


def running_state(target_cache: KVCache, last_token, draft_cache: KVCache | None = None,
                  draft_hidden=None) -> DecodeState:
    """The state the engine's rounds run from after a prefill: rows mid-generation with no stop id, no
    token limit and none done, greedy, with their sampling settings set (temperature 0) as the engine's pool
    lays its rows out (decoding/live_plan.py), so that a timed call runs the executable the engine runs.
    (Should become library API beside DecodeState: the engine builds the same after its prefill.)"""
    batch = last_token.shape[0]
    greedy = SamplingParams(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                            top_p=jnp.ones((batch,), jnp.float32), seed=jnp.zeros((batch, 2), jnp.uint32))
    return DecodeState(target_cache=target_cache, draft_cache=draft_cache, last_token=last_token,
                       draft_hidden=draft_hidden, num_generated=jnp.zeros((batch,), jnp.int32),
                       max_new=jnp.full((batch,), 1 << 30, jnp.int32), stop_ids=jnp.full((batch, 8), -1, jnp.int32),
                       done=jnp.zeros((batch,), bool), sampling=greedy)


def random_state(models: tuple, batch: int, length: int, capacity: int, dtype, with_drafter: bool) -> DecodeState:
    """A random running state at KV length `length` of `capacity` for a preset's (target, drafter) configs."""
    t, d = models
    key = jax.random.key(batch * 7 + length)
    target_cache = random_cache(t.num_layers, batch, t.num_kv_heads, capacity, t.head_dim, length, dtype, 11)
    last_token = jax.random.randint(key, (batch,), 0, t.vocab_size, jnp.int32)
    if not with_drafter:
        return running_state(target_cache, last_token)
    return running_state(target_cache, last_token,
                         random_cache(1, batch, d.num_kv_heads, capacity, d.head_dim, length, dtype, 99),
                         normal(key, (batch, d.hidden_size), dtype))
