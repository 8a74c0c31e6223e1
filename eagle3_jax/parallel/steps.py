"""The engine's device operations under tensor parallelism: each jitted step is one shard_map over the
mesh, so a call of rounds stays one jitted call with its collectives inside, one transfer out, and the
decoding state donated.

Inside the map every device runs decoding/spec_round.py's functions unchanged with the per-device config
(`local_spec`): its shards of the target, its KV heads' caches ([B, K_l, S, H], split on the head axis),
the replicated drafter and everything else replicated. The choice of shard_map over GSPMD's automatic
partitioning: the fused q/k/v and gate/up rows need a per-device row order that no partitioning of the
fused axis gives (parallel/layout.py), the Pallas kernels are custom calls that the partitioner cannot split
but that run per device inside a map, and the collectives are then exactly the ones written here: one
all-reduce after each row-parallel matmul, one after the embedding lookup, and a few numbers per row for
each reduction over the vocabulary (parallel/collectives.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.checkpoints import sharded
from eagle3_jax.decoding import slots, spec_round
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.kv_cache import KVCache
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.collectives import TP_AXIS, Shards
from eagle3_jax.parallel.mesh import mesh_size


@dataclasses.dataclass(frozen=True)
class Steps:
    """An engine's jitted device operations (each with spec_round's / slots' signature) and its transfers."""

    empty: Callable
    prefill: Callable
    insert: Callable
    rounds: Callable
    put: Callable  # host pytree -> its arrays on the device(s)
    fetch: Callable  # a step's packed output -> one host array


def local_spec(spec: spec_round.StepSpec, tp: int) -> spec_round.StepSpec:
    """The spec each device's shard runs: the per-device target config, and the tp axis."""
    return dataclasses.replace(spec, target=layout.local_config(spec.target, tp), tp=Shards(tp))


def state_specs(spec: spec_round.StepSpec) -> spec_round.DecodeState:
    """Where a DecodeState's parts live: the target's KV caches split on the head axis, the rest replicated."""
    heads = tuple(P(None, TP_AXIS) for _ in range(spec.target.num_layers))
    drafted = P() if spec.proposer is not None and spec.proposer.capture_layers else None
    looked_up = P() if spec.proposer is not None and not spec.proposer.capture_layers else None
    return spec_round.DecodeState(
        target_cache=KVCache(heads, heads, P()), draft_cache=drafted, last_token=P(), draft_hidden=drafted,
        num_generated=P(), max_new=P(), stop_ids=P(), done=P(), sampling=P() if spec.sampling else None,
        history=looked_up)


def _param_specs(spec: spec_round.StepSpec, dparams) -> tuple:
    target = weights_lib.partition_specs(weights_lib.target_weights(spec.target), layout.TARGET_RULES)
    if dparams is None:
        return target, None
    described = weights_lib.drafter_weights(spec.proposer.config, with_embed="embed" in dparams)
    return target, weights_lib.partition_specs(described, layout.DRAFTER_RULES)


def _mapped(fn, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.partial(jax.jit, static_argnames=("spec", "mesh"))
def jit_empty(tparams, dparams, template, *, spec, mesh):
    fn = functools.partial(slots.empty, spec=spec)
    return _mapped(fn, mesh, (*_param_specs(spec, dparams), P()), state_specs(spec))(tparams, dparams, template)


@functools.partial(jax.jit, static_argnames=("spec", "mesh"))
def jit_prefill(tparams, dparams, request, *, spec, mesh):
    fn = functools.partial(spec_round.prefill, spec=spec)
    out = (state_specs(spec), P())
    return _mapped(fn, mesh, (*_param_specs(spec, dparams), P()), out)(tparams, dparams, request)


def _specs_like(state: spec_round.DecodeState) -> spec_round.DecodeState:
    """state_specs from a state's own structure."""
    heads = tuple(P(None, TP_AXIS) for _ in state.target_cache.k)
    return dataclasses.replace(jax.tree.map(lambda _: P(), state), target_cache=KVCache(heads, heads, P()))


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def jit_insert(state, fresh, slot_ids, *, mesh):
    states = _specs_like(state)
    return _mapped(slots.insert, mesh, (states, states, P()), states)(state, fresh, slot_ids)


@functools.partial(jax.jit, static_argnames=("spec", "num_rounds", "mesh"), donate_argnames=("state",))
def jit_rounds(tparams, dparams, state, *, spec, num_rounds, mesh):
    fn = functools.partial(spec_round.spec_rounds, spec=spec, num_rounds=num_rounds)
    states = state_specs(spec)
    return _mapped(fn, mesh, (*_param_specs(spec, dparams), states), (states, P()))(tparams, dparams, state)


def sharded_steps(mesh: Mesh) -> Steps:
    """The Steps of an engine on `mesh` (their specs are `local_spec`s)."""
    replicated = NamedSharding(mesh, P())

    def put(tree):
        return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), replicated, lambda i: x[i]), tree)

    return Steps(
        empty=functools.partial(jit_empty, mesh=mesh), prefill=functools.partial(jit_prefill, mesh=mesh),
        insert=functools.partial(jit_insert, mesh=mesh), rounds=functools.partial(jit_rounds, mesh=mesh), put=put,
        fetch=lambda packed: np.asarray(packed.addressable_shards[0].data))


def on_mesh(target, drafter, mesh: Mesh, exact: bool):
    """An engine's target and drafter on `mesh` (placed there when they are not yet: checkpoints/sharded.py),
    and its Steps; a tp that does not split the target, a target on another mesh, or exact=True, refused."""
    tp = mesh_size(mesh)
    layout.check(target.config, tp)
    if exact:
        raise ValueError("exact=True runs on one device: its kernels' row invariance is not checked across a mesh")
    if target.mesh is None:
        target = sharded.shard_target(target, mesh)
    elif target.mesh != mesh:
        raise ValueError(f"the target is loaded on another mesh ({target.mesh.devices.tolist()}) than the engine's "
                         f"({mesh.devices.tolist()})")
    placed = getattr(drafter.params["fc"], "sharding", None) if drafter is not None else None
    if drafter is not None and not (isinstance(placed, NamedSharding) and placed.mesh == mesh):
        drafter = sharded.shard_drafter(drafter, target.config, mesh)
    return target, drafter, sharded_steps(mesh)


def per_device_target(target):
    """The target as one device holds it (its per-device config), for sizing the pool of slots."""
    return dataclasses.replace(target, config=layout.local_config(target.config, mesh_size(target.mesh)))
