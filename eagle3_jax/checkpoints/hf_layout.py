"""Hugging Face tensors <-> parameter pytrees, driven by a model's weight description (models/weights.py):
which tensors a file must hold and their shapes, how they fuse into parameters, and how parameters split
back into tensors for export."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models.weights import HFSource, Weight, build_tree

Plan = tuple[tuple[Weight, HFSource], ...]  # each parameter with the source the file uses for it


def plan(weights: Iterable[Weight], present: Collection[str]) -> Plan:
    """Each weight with the first of its sources whose `present_if` tensor the file holds (or has none)."""
    return tuple((w, next((s for s in w.sources if s.present_if is None or s.present_if in present), w.sources[-1]))
                 for w in weights)


def expected_shapes(layout: Plan) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the file must hold, with its shape, in the description's order."""
    out = {}
    for w, s in layout:
        names = iter(s.names())
        for _ in range(max(s.experts, 1)):
            for part in range(len(s.keys)):
                out[next(names)] = w.hf_shape(s, part)
    return out


class ExpertStacks:
    """Per-expert tensors written into one host stack per parameter, each handed to `put` as soon as it is
    full: host memory holds the stacks being filled, never a second copy of the model."""

    def __init__(self, layout: Plan, dtype, put: Callable[[str, np.ndarray], None]):
        self.dtype, self.put = dtype, put
        self.slots = {}  # HF name -> (weight, source, expert, part)
        for w, s in layout:
            if s.experts:
                for e in range(s.experts):
                    for part, key in enumerate(s.keys):
                        self.slots[key.format(e=e)] = (w, s, e, part)
        self.stacks: dict[str, list] = {}  # source's first key -> [host array, tensors still missing]

    def take(self, name: str, array: np.ndarray) -> bool:
        """Stacks `array` when it is a per-expert tensor (True), else leaves it to the caller (False)."""
        if name not in self.slots:
            return False
        w, s, e, part = self.slots[name]
        entry = self.stacks.setdefault(s.keys[0], [np.empty(w.shape, self.dtype), s.experts * len(s.keys)])
        start = sum(s.sizes[:part])
        entry[0][(e,) + (slice(None),) * s.axis + (slice(start, start + s.sizes[part]),)] = array
        entry[1] -= 1
        if entry[1] == 0:
            self.put(s.keys[0], self.stacks.pop(s.keys[0])[0])
        return True


def assemble(layout: Plan, loaded: dict, concatenate=jnp.concatenate) -> dict:
    """The parameter pytree from the loaded tensors (popped from `loaded`): each parameter's parts
    concatenated, a per-expert parameter taken whole from its stack (named by its source's first key)."""
    def param(w: Weight, s: HFSource):
        if s.experts:
            return loaded.pop(s.keys[0])
        parts = [loaded.pop(k) for k in s.keys]
        return parts[0] if len(parts) == 1 else concatenate(parts, axis=s.axis)

    return build_tree((w.path, param(w, s)) for w, s in layout)


def to_hf(weights: Iterable[Weight], params: dict, dtype: str) -> dict[str, np.ndarray]:
    """Parameters -> HF tensors on the host in `dtype`, each split back into its first source's tensors
    (a single-tensor or concatenated source: what every export writes)."""
    out = {}
    for w in weights:
        s = w.sources[0]
        array = functools.reduce(lambda node, key: node[key], w.path, params)
        host = np.asarray(jax.device_get(jnp.asarray(array).astype(jnp.dtype(dtype))))
        parts = np.split(host, np.cumsum(s.sizes)[:-1], axis=s.axis) if len(s.keys) > 1 else [host]
        out.update((k, np.ascontiguousarray(p)) for k, p in zip(s.keys, parts))
    return out
