"""Our orbax folders (written by `convert`): the parameter pytree under `params/` and a marker file saying
what the folder holds. The structure restored is the model's description (models/weights.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from eagle3_jax.checkpoints.common import DTYPES, read_json, refuse_unused
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models.config_fields import Fields

ORBAX_MARKER = "eagle3_jax.json"  # present in folders written by `convert`
FORMAT_VERSION = 1


def write_marker(folder: Path, kind: str, dtype: str, **extra) -> None:
    (folder / ORBAX_MARKER).write_text(json.dumps({"format_version": FORMAT_VERSION, "kind": kind, "dtype": dtype,
                                                   **extra}))


def read_marker(folder: Path, kind: str) -> Fields:
    """The marker of a folder converted for `kind` ("target" or "drafter") by this version, as Fields."""
    path = folder / ORBAX_MARKER
    fields = Fields.of(read_json(path), path)
    version = fields.int("format_version", None)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown format_version {version!r}")
    if fields.str("kind", kind) != kind:
        raise CheckpointError(f"{path}: not a {kind} converted by this version")
    if fields.str("dtype") not in DTYPES:
        raise CheckpointError(f"{path}: dtype {fields.str('dtype')!r} is not one of {DTYPES}")
    return fields


def save_params(folder: Path, params) -> None:
    """Writes a parameter pytree to folder/params with orbax."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((folder / "params").absolute(), params)


def restore_params(folder: Path, abstract):
    """Reads folder/params into the structure, shapes and dtypes of `abstract` (ShapeDtypeStructs); a stored
    tensor that `abstract` has no place for, or one it lacks, is refused naming it."""
    import orbax.checkpoint as ocp

    where = folder / "params"
    try:
        with ocp.StandardCheckpointer() as ckpt:
            metadata = ckpt.metadata(where.absolute()).item_metadata
            if metadata is None:
                raise ValueError("its metadata is unreadable")
            stored, wanted = leaf_names(metadata), leaf_names(abstract)
            missing = sorted(set(wanted) - set(stored))
            if missing:
                raise CheckpointError(f"{where}: missing tensor {missing[0]!r}")
            refuse_unused(where, stored, set(wanted))
            return ckpt.restore(where.absolute(), abstract)
    except CheckpointError:
        raise
    except Exception as e:  # orbax raises many types; all mean the same thing to the user
        raise CheckpointError(f"{where}: cannot restore the orbax checkpoint ({e})") from None


def leaf_names(tree) -> list[str]:
    """A pytree's leaves as dotted names: {"layers": ({"wo": x},)} -> ["layers.0.wo"]."""
    def name(path) -> str:
        return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    return [name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
