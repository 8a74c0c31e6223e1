"""Tensor parallelism on several GPUs: the engine's spec-off step (a call of rounds with no drafter) on a mesh of
--tp devices, against its floor. `python -m eagle3_jax_bench.tensor_parallel --tp N` runs it.

Weights are random, generated on the mesh shard by shard (no device ever holds a whole weight, so models larger
than one GPU run); the KV caches likewise, at --kv-len. The floor of a step is
    per-device bytes / copy rate  +  all-reduce bytes / all-reduce rate,
per-device bytes being the device's shards of every weight but the embedding (an MoE layer's experts counted
for the expected number of distinct experts its B tokens route to) and its KV heads' caches; all-reduce bytes
the step's 2 per layer plus the embedding's, [B, D] each. The copy rate is measured on one device; the
all-reduce rate by a psum of --allreduce-mb on the mesh. Also reported: the time of one [B, D] all-reduce
(latency, not bandwidth, is what small messages pay) and that floor with the all-reduces at that time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.decoding import parallel_steps, spec_round
from eagle3_jax.models import weights
from eagle3_jax.models.collectives import TP_AXIS
from eagle3_jax.parallel import layout

from .core import compile_timed, time_chain, time_pure
from .inputs import random_state


@functools.cache
def _generator(mesh, spec: P):
    def make(key, shape, dtype):
        if jnp.issubdtype(dtype, jnp.integer):
            return jnp.zeros(shape, dtype)
        x = jax.random.normal(key, shape, jnp.float32) * 0.02
        return (1 + x if len(shape) == 1 else x).astype(dtype)

    return jax.jit(make, static_argnums=(1, 2), out_shardings=NamedSharding(mesh, spec))


def random_on_mesh(placements, mesh, dtype, seed: int) -> dict:
    """Random parameters generated shard by shard on the mesh (inputs.random_tree's values' kind)."""
    def one(i, p):
        dt = jnp.dtype(p.weight.dtype or dtype)
        return _generator(mesh, p.spec)(jax.random.key(seed * 1000 + i), p.global_shape, dt)

    return weights.build_tree((p.weight.path, one(i, p)) for i, p in enumerate(placements))


def random_state_on_mesh(cfg, local_spec, mesh, batch: int, kv_len: int, capacity: int, dtype):
    """inputs.random_state for the target on the mesh (KV heads as the devices hold them), built sharded."""
    wide = dataclasses.replace(cfg, num_kv_heads=local_spec.target.num_kv_heads * mesh.devices.size)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), parallel_steps.state_specs(local_spec),
                             is_leaf=lambda x: isinstance(x, P))
    build = jax.jit(lambda: random_state((wide, None), batch, kv_len, capacity, dtype, False), out_shardings=shardings)
    return build()


def device_bytes(placements, cfg, tp: int, batch: int, kv_len: int, itemsize: int) -> int:
    """What one device reads in a spec-off step (see the module's docstring)."""
    experts = 1.0
    if cfg.moe is not None:  # expected distinct experts routed to by `batch` tokens, as a fraction of all
        m = cfg.moe
        experts = 1 - (1 - m.num_experts_per_tok / m.num_experts) ** batch
    total = 0.0
    for p in placements:
        if p.weight.path == ("embed",):
            continue
        n = int(np.prod(p.global_shape)) * itemsize / (tp if p.dim is not None else 1)
        total += n * (experts if p.weight.axes[0] == "experts" and p.weight.path[-1] != "router" else 1)
    local = layout.local_config(cfg, tp)
    return int(total) + cfg.num_layers * 2 * batch * kv_len * local.num_kv_heads * cfg.head_dim * itemsize


def allreduce_s(mesh, shape, dtype, repeats: int = 32) -> float:
    """Seconds per psum of a per-device array of `shape`, `repeats` of them chained in one call."""
    def chained(x):
        return jax.lax.fori_loop(0, repeats, lambda _, y: jax.lax.psum(y, TP_AXIS) * 0.5, x)

    run = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=P(TP_AXIS), out_specs=P(TP_AXIS), check_vma=False))
    x = jnp.ones((mesh.devices.size * shape[0],) + tuple(shape[1:]), dtype)
    x = jax.device_put(x, NamedSharding(mesh, P(TP_AXIS)))
    return time_pure(run, (x,), reps=5, inner=3) / repeats


def measure(run, cfg, mesh, batch: int, args) -> None:
    tp = mesh.devices.size
    dtype = jnp.dtype(args.dtype)
    capacity = args.kv_len + 1024
    spec = spec_round.StepSpec(target=cfg, proposer=None, gamma=0, max_len=capacity, kernels=args.kernels)
    local = parallel_steps.local_spec(spec, tp)
    placements = layout.target_placements(cfg, tp)
    params = random_on_mesh(placements, mesh, dtype, seed=1)
    state = random_state_on_mesh(cfg, local, mesh, batch, args.kv_len, capacity, dtype)
    compiled, compile_s = compile_timed(parallel_steps.jit_rounds, params, None, state, spec=local,
                                        num_rounds=args.rounds_per_call, mesh=mesh)
    seconds, _ = time_chain(lambda s: compiled(params, None, s), state, (), args.reps, args.inner)
    step_ms = seconds / args.rounds_per_call * 1e3
    read = device_bytes(placements, cfg, tp, batch, args.kv_len, dtype.itemsize)
    count, message = 1 + 2 * cfg.num_layers, batch * cfg.hidden_size * dtype.itemsize
    rate = args.allreduce_mb * 2**20 / allreduce_s(mesh, (args.allreduce_mb * 2**20 // dtype.itemsize,), dtype)
    one_ms = allreduce_s(mesh, (batch, cfg.hidden_size), dtype) * 1e3
    copy_ms = read / (run.bw * 1e12) * 1e3
    floor_ms = copy_ms + count * message / rate * 1e3
    run.add("tp_step", {"tp": tp, "batch": batch, "kv_len": args.kv_len, "step_ms": step_ms, "floor_ms": floor_ms,
                        "ratio": step_ms / floor_ms, "device_bytes": read, "allreduces": count,
                        "allreduce_gbps": rate / 1e9, "one_allreduce_ms": one_ms,
                        "floor_with_allreduce_latency_ms": copy_ms + count * one_ms, "compile_s": compile_s})
