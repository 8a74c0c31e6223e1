"""Loading a Qwen3 or Qwen3-MoE target: a Hugging Face safetensors folder or our orbax conversion of one,
both laid out by the target's weight description (models/weights.py).

A Qwen3-MoE checkpoint stores its experts either per expert (the hub's layout,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, which transformers 5 still writes on save) or fused
(transformers 5's in-memory layout, `mlp.experts.gate_up_proj [E, 2I, D]` and `mlp.experts.down_proj
[E, D, I]`); both load, layer by layer, into the fused layout.

With a tensor-parallel mesh (`mesh=`, parallel/mesh.py) each device's shard is read straight from the files
(checkpoints/sharded.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from eagle3_jax.checkpoints import hf_layout, orbax_io, safetensors_io, sharded
from eagle3_jax.checkpoints.common import check_dtype, read_json, refuse_unused
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.parallel import layout as tp_layout
from eagle3_jax.parallel.mesh import mesh_size

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target: its config, its parameters on the device (or sharded over `mesh`, laid out by
    parallel/layout.py), and the folder it came from."""

    config: Qwen3Config
    params: dict
    folder: Path
    mesh: Mesh | None = None


def load_target(path: str | Path, dtype: str = "bfloat16", progress: bool = True, mesh: Mesh | None = None) -> Target:
    """Loads a Qwen3 target from a Hugging Face folder or an orbax folder written by `convert`; with a
    tensor-parallel `mesh`, from a Hugging Face folder straight to the shards (a tp that does not split the
    target is refused before anything is read)."""
    folder = Path(path)
    jdtype = check_dtype(dtype)
    cfg = Qwen3Config.from_dict(read_json(folder / "config.json"), where=str(folder / "config.json"))
    placements = None if mesh is None else tp_layout.target_placements(cfg, mesh_size(mesh))
    if (folder / orbax_io.ORBAX_MARKER).exists():
        if mesh is not None:
            raise CheckpointError(f"{folder}: an orbax conversion loads on one device; a mesh needs the Hugging "
                                  "Face folder")
        return Target(cfg, _load_orbax(folder, cfg, jdtype), folder)
    files = safetensors_io.weight_map(folder)
    layout = hf_layout.plan(weights_lib.target_weights(cfg), files)
    expected = hf_layout.expected_shapes(layout)
    safetensors_io.check_tensors(folder, files, expected)
    # A tied checkpoint may still hold the lm_head that transformers ties to the embedding and never reads.
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    refuse_unused(folder, files, {*expected, *tied})
    if mesh is not None:
        with sharded.from_files(files, layout) as blocks:
            return Target(cfg, sharded.place_tree(placements, mesh, blocks, jdtype), folder, mesh)
    loaded: dict[str, jax.Array] = {}

    def put(name: str, array: np.ndarray) -> None:
        # Cast on the host only when the file's dtype differs (bf16 stays bf16, no float32 detour).
        loaded[name] = jax.device_put(array if array.dtype == jdtype else array.astype(jdtype))

    experts = hf_layout.ExpertStacks(layout, jdtype, put)

    def take(name: str, array: np.ndarray) -> None:
        if not experts.take(name, array):
            put(name, array)

    safetensors_io.read_tensors(files, list(expected), take, progress)
    return Target(cfg, hf_layout.assemble(layout, loaded), folder)  # q/k/v and gate/up fused on the device


def _load_orbax(folder: Path, cfg: Qwen3Config, dtype) -> dict:
    marker = orbax_io.read_marker(folder, "target")
    stored = check_dtype(marker.str("dtype"))
    params = orbax_io.restore_params(folder, weights_lib.abstract_params(weights_lib.target_weights(cfg), stored))
    return params if stored == dtype else jax.tree.map(lambda x: x.astype(dtype), params)


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    """Hugging Face folder -> orbax folder (params, config.json, tokenizer files) that loads faster."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst}: destination already exists")
    tgt = load_target(src, dtype=dtype)
    dst.mkdir(parents=True)
    orbax_io.save_params(dst, tgt.params)
    shutil.copy(src / "config.json", dst / "config.json")
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    orbax_io.write_marker(dst, "target", dtype)
    return dst
