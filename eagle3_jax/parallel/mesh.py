"""The tensor-parallel mesh: a jax.sharding.Mesh of tp devices along one axis, "tp".

On several hosts (jax.distributed.initialize first, one process per host) jax.devices() lists every
host's devices, so the same call builds the mesh over all of them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from eagle3_jax.models.collectives import TP_AXIS


def tp_mesh(tp: int, devices=None) -> Mesh:
    """A mesh of the first tp devices (of `devices`, default jax.devices()); refused when fewer are present."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if tp > len(devices):
        kinds = sorted({d.platform for d in devices})
        raise ValueError(f"tp={tp} needs {tp} devices, and {len(devices)} are present ({', '.join(kinds)})")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def mesh_size(mesh: Mesh) -> int:
    """The tp of a mesh, which must have the one axis "tp" (tp_mesh's)."""
    if not isinstance(mesh, Mesh) or mesh.axis_names != (TP_AXIS,):
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with the one axis {TP_AXIS!r} (tp_mesh), got axes {names}")
    return int(mesh.devices.size)
