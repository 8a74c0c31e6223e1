"""The engine's device operations under tensor parallelism: each jitted step is one shard_map over the
mesh, so a call of rounds stays one jitted call with its collectives inside, one transfer out, and the
decoding state donated.

Inside the map every device runs decoding/spec_round.py's functions unchanged with the per-device config
(`local_spec`): its shards of the target, its KV heads' pages ([K_l, P, page_size, H], the target's page pool
split on the head axis; every device holds the same page ids), the replicated drafter and its pages, and
everything else replicated. The choice of shard_map over GSPMD's automatic
partitioning: the fused q/k/v and gate/up rows need a per-device row order that no partitioning of the
fused axis gives (parallel/layout.py), the Pallas kernels are custom calls that the partitioner cannot split
but that run per device inside a map, and the collectives are then exactly the ones written here: one
all-reduce after each row-parallel matmul, one after the embedding lookup, and a few numbers per row for
each reduction over the vocabulary (models/collectives.py).
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
from eagle3_jax.decoding import spec_round
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.collectives import TP_AXIS, Shards
from eagle3_jax.models.kv_cache import KVPages
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.mesh import mesh_size


@dataclasses.dataclass(frozen=True)
class Steps:
    """An engine's jitted device operations (each with spec_round's / slots' signature) and its transfers."""

    empty: Callable
    prefill: Callable
    rounds: Callable
    put: Callable  # host pytree -> its arrays on the device(s)
    fetch: Callable  # a step's packed output -> one host array
    new_pages: Callable  # spec_round.new_pages's signature: the zeroed pools on the device(s)


def compile_ahead(step: Callable, *args, **kwargs):
    """Compiles a step (a jitted function, or a partial of one: a mesh's) for these arguments without running it:
    jit's own cache then holds the executable, so a later call of the same signature compiles nothing."""
    if isinstance(step, functools.partial):
        args, kwargs, step = step.args + args, {**step.keywords, **kwargs}, step.func
    return step.lower(*args, **kwargs).compile()


def local_spec(spec: spec_round.StepSpec, tp: int) -> spec_round.StepSpec:
    """The spec each device's shard runs: the per-device target config, and the tp axis."""
    return dataclasses.replace(spec, target=layout.local_config(spec.target, tp), tp=Shards(tp))


def page_specs(spec: spec_round.StepSpec) -> tuple:
    """Where the page pools live: the target's split on the KV-head axis, the drafter's (if any) replicated."""
    heads = tuple(P(TP_AXIS) for _ in range(spec.target.num_layers))
    drafted = spec.proposer is not None and bool(spec.proposer.capture_layers)
    return KVPages(heads, heads), (KVPages((P(),), (P(),)) if drafted else None)


def state_specs(spec: spec_round.StepSpec, pages: bool = True) -> spec_round.DecodeState:
    """Where a DecodeState's parts live: the page pools as `page_specs` (None without `pages`: the rows alone), the
    rest replicated."""
    drafted = P() if spec.proposer is not None and spec.proposer.capture_layers else None
    looked_up = P() if spec.proposer is not None and not spec.proposer.capture_layers else None
    target_pages, draft_pages = page_specs(spec) if pages else (None, None)
    return spec_round.DecodeState(
        target_pages=target_pages, draft_pages=draft_pages, page_table=P(), lengths=P(), draft_lengths=drafted,
        last_token=P(), draft_hidden=drafted, num_generated=P(), max_new=P(), stop_ids=P(), done=P(),
        sampling=P(), history=looked_up)  # a pool's rows always carry their settings (greedy: temperature 0)


def _param_specs(spec: spec_round.StepSpec, dparams) -> tuple:
    target = weights_lib.partition_specs(weights_lib.target_weights(spec.target), layout.TARGET_RULES)
    if dparams is None:
        return target, None
    described = weights_lib.drafter_weights(spec.proposer.config, with_embed="embed" in dparams)
    return target, weights_lib.partition_specs(described, layout.DRAFTER_RULES)


def _mapped(fn, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames=("mesh",))
def jit_empty(spec, batch, width, stop_width, dtype, *, mesh):
    fn = functools.partial(spec_round.new_rows, spec, batch, width, stop_width, dtype)
    return _mapped(fn, mesh, (), state_specs(spec, pages=False))()


def _chunk_specs(chunk):
    return None if chunk is None else jax.tree.map(lambda _: P(), chunk)  # chunks are replicated


@functools.partial(jax.jit, static_argnames=("spec", "mesh"), donate_argnames=("state",))
def jit_prefill(tparams, dparams, state, chunk, *, spec, mesh):
    fn = functools.partial(spec_round.prefill, spec=spec)
    states = state_specs(spec)
    return _mapped(fn, mesh, (*_param_specs(spec, dparams), states, _chunk_specs(chunk)), (states, P()))(
        tparams, dparams, state, chunk)


@functools.partial(jax.jit, static_argnames=("spec", "num_rounds", "mesh"), donate_argnames=("state",))
def jit_rounds(tparams, dparams, state, chunks=None, *, spec, num_rounds, mesh):
    fn = functools.partial(spec_round.spec_rounds, spec=spec, num_rounds=num_rounds)
    states = state_specs(spec)
    return _mapped(fn, mesh, (*_param_specs(spec, dparams), states, _chunk_specs(chunks)), (states, P()))(
        tparams, dparams, state, chunks)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("mesh",))
def _new_pages(spec, num_pages, page_size, dtype, *, mesh):
    """spec_round.new_pages on each device (its KV heads), laid out over the mesh by page_specs."""
    fn = functools.partial(spec_round.new_pages, spec, num_pages, page_size, dtype)
    return _mapped(fn, mesh, (), page_specs(spec))()


def sharded_steps(mesh: Mesh) -> Steps:
    """The Steps of an engine on `mesh` (their specs are `local_spec`s)."""
    replicated = NamedSharding(mesh, P())

    def put(tree):
        return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), replicated, lambda i: x[i]), tree)

    return Steps(
        empty=functools.partial(jit_empty, mesh=mesh), prefill=functools.partial(jit_prefill, mesh=mesh),
        rounds=functools.partial(jit_rounds, mesh=mesh), put=put,
        fetch=lambda packed: np.asarray(packed.addressable_shards[0].data),
        new_pages=functools.partial(_new_pages, mesh=mesh))


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


