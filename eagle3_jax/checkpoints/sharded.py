"""Parameters placed straight onto a tensor-parallel mesh (eagle3_jax/parallel/layout.py's placements).

Each device's shard is read on its own: from a safetensors folder, only the rows and columns it holds
(`safe_open(...).get_slice`), so no host ever holds the whole model, nor more than one shard of one
parameter at a time; `jax.make_array_from_callback` asks each process for its own devices' shards only,
so several hosts load a mesh over all their devices with the same call. A model already in memory (an
unsharded Target or Drafter) is placed the same way from a host copy of one parameter at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open

from eagle3_jax.checkpoints import hf_layout
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.layout import Placement
from eagle3_jax.parallel.mesh import mesh_size

# (dim, start, stop) -> the parameter's values with that dim cut to [start, stop); dim None: all of it.
Block = Callable[[int | None, int, int], np.ndarray]


def place(placement: Placement, mesh: Mesh, block: Block, dtype) -> jax.Array:
    """One parameter on the mesh: each device's shard, its blocks concatenated, cast on the host to `dtype`."""
    def shard(index) -> np.ndarray:
        if placement.dim is None:
            data = block(None, 0, 0)
        else:
            ranges = placement.ranges[placement.device_of(index)]
            data = np.concatenate([block(placement.dim, a, b) for a, b in ranges], axis=placement.dim)
        return data if data.dtype == dtype else data.astype(dtype)

    return jax.make_array_from_callback(placement.global_shape, NamedSharding(mesh, placement.spec), shard)


def place_tree(placements, mesh: Mesh, blocks: Callable[[Placement], Block], dtype) -> dict:
    """Every parameter placed, one after another; `blocks(placement)` reads that parameter's blocks."""
    def one(p: Placement) -> jax.Array:
        return place(p, mesh, blocks(p), jax.numpy.dtype(p.weight.dtype or dtype))

    return weights_lib.build_tree((p.weight.path, one(p)) for p in placements)


def in_memory(params: dict) -> Callable[[Placement], Block]:
    """Blocks of parameters already loaded: a host copy of one parameter at a time, cut per device."""
    def blocks(p: Placement) -> Block:
        host = np.asarray(jax.device_get(functools.reduce(lambda node, key: node[key], p.weight.path, params)))
        return lambda dim, a, b: host if dim is None else _cut(host, dim, a, b)

    return blocks


def _cut(x: np.ndarray, dim: int, a: int, b: int) -> np.ndarray:
    return x[(slice(None),) * dim + (slice(a, b),)]


@contextlib.contextmanager
def from_files(files: dict[str, Path], plan: hf_layout.Plan):
    """Blocks read from the safetensors files of a checked folder (`hf_layout.plan`'s sources): each block
    only the rows and columns it needs, through the files' slices, the files open while the context is."""
    sources = {w.path: s for w, s in plan}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(name: str, index: tuple[slice, ...]) -> np.ndarray:
            file = files[name]
            try:
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="numpy"))
                return handles[file].get_slice(name)[index]
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: failed reading tensor data of {name!r} ({e})") from None

        def blocks(p: Placement) -> Block:
            source = sources[p.weight.path]
            return lambda dim, a, b: _source_block(source, p.weight.shape, dim, a, b, read)

        yield blocks


def _source_block(s: weights_lib.HFSource, shape: tuple[int, ...], dim: int | None, a: int, b: int, read) -> np.ndarray:
    """The block [a, b) along `dim` of the parameter made of source `s`, read from its tensors: a block lies
    inside one of the concatenated parts (q, k or v; gate or up), so it is one slice of one tensor (per
    expert, stacked, for a per-expert source)."""
    if s.experts:
        return np.stack([_part_block(s, shape[1:], None if dim is None else dim - 1, a, b, read, e)
                         for e in range(s.experts)])
    return _part_block(s, shape, dim, a, b, read, None)


def _part_block(s, shape, dim, a, b, read, expert) -> np.ndarray:
    keys = [k if expert is None else k.format(e=expert) for k in s.keys]
    whole = (slice(None),) * len(shape)
    if dim is None:
        parts = [read(k, whole) for k in keys]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=s.axis)
    if len(keys) == 1:
        return read(keys[0], whole[:dim] + (slice(a, b),))
    starts = np.cumsum((0,) + s.sizes)
    part = int(np.searchsorted(starts, a, side="right")) - 1
    assert dim == s.axis and b <= starts[part + 1], (s.keys, dim, a, b)  # layout.py's blocks never straddle
    return read(keys[part], whole[:dim] + (slice(a - starts[part], b - starts[part]),))


def shard_target(target, mesh: Mesh):
    """An unsharded Target placed on a tp mesh (one parameter at a time through the host)."""
    placements = layout.target_placements(target.config, mesh_size(mesh))
    params = place_tree(placements, mesh, in_memory(target.params), target.params["embed"].dtype)
    return dataclasses.replace(target, params=params, mesh=mesh)


def shard_drafter(drafter, target_config, mesh: Mesh):
    """A Drafter placed for a target on a tp mesh: replicated, but for an embedding of its own, which is
    split over the vocabulary as the target's."""
    described = weights_lib.drafter_weights(drafter.config, with_embed="embed" in drafter.params)
    placements = layout.drafter_placements(described, target_config, mesh_size(mesh))
    params = place_tree(placements, mesh, in_memory(drafter.params), drafter.params["fc"].dtype)
    return dataclasses.replace(drafter, params=params)
