"""Random inputs on the device at a preset's shapes: weights, KV pages and the decode state the engine's
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
from eagle3_jax.models.kv_cache import KVPages, RowCache

PAGE_SIZE = 64  # the benches' pages (the engine's default, page_pool.DEFAULT_PAGE_SIZE)


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


def random_cache(num_layers, batch, kv_heads, capacity, head_dim, length, dtype, seed) -> RowCache:
    """Random pages for `batch` rows of `capacity` positions each (rows own consecutive pages), `length` in use."""
    width = -(-capacity // PAGE_SIZE)
    shape = (kv_heads, batch * width, PAGE_SIZE, head_dim)
    pages = KVPages(k=tuple(normal(jax.random.key(seed + 2 * i), shape, dtype) for i in range(num_layers)),
                    v=tuple(normal(jax.random.key(seed + 2 * i + 1), shape, dtype) for i in range(num_layers)))
    return RowCache.over(pages, batch, jnp.full((batch,), length, jnp.int32))


def running_state(target: RowCache, last_token, draft: RowCache | None = None, draft_hidden=None) -> DecodeState:
    """The state the engine's rounds run from after a prefill: rows mid-generation with no stop id, no
    token limit and none done, greedy, with their sampling settings set (temperature 0) as the engine's pool
    lays its rows out (decoding/live_plan.py), so that a timed call runs the executable the engine runs. The
    drafter's pages (when given) use the target's page table, as the engine's do."""
    batch = last_token.shape[0]
    greedy = SamplingParams(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                            top_p=jnp.ones((batch,), jnp.float32), seed=jnp.zeros((batch, 2), jnp.uint32))
    return DecodeState(target_pages=target.pages, draft_pages=None if draft is None else draft.pages,
                       page_table=target.table, lengths=target.lengths,
                       draft_lengths=None if draft is None else draft.lengths, last_token=last_token,
                       draft_hidden=draft_hidden, num_generated=jnp.zeros((batch,), jnp.int32),
                       max_new=jnp.full((batch,), 1 << 30, jnp.int32), stop_ids=jnp.full((batch, 8), -1, jnp.int32),
                       done=jnp.zeros((batch,), bool), sampling=greedy)


def random_state(models: tuple, batch: int, length: int, capacity: int, dtype, with_drafter: bool) -> DecodeState:
    """A random running state at KV length `length` of `capacity` for a preset's (target, drafter) configs; the
    page table has room for a round's drafts past capacity (kv_cache.table_width), as the engine's."""
    t, d = models
    key = jax.random.key(batch * 7 + length)
    target = random_cache(t.num_layers, batch, t.num_kv_heads, capacity + 64, t.head_dim, length, dtype, 11)
    last_token = jax.random.randint(key, (batch,), 0, t.vocab_size, jnp.int32)
    if not with_drafter:
        return running_state(target, last_token)
    return running_state(target, last_token,
                         random_cache(1, batch, d.num_kv_heads, capacity + 64, d.head_dim, length, dtype, 99),
                         normal(key, (batch, d.hidden_size), dtype))
