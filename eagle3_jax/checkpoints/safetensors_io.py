"""Reading Hugging Face safetensors folders: one file or shards with an index, one shard at a time.

Every header is checked (keys present, shapes, dtypes) before any tensor data is read, so a bad
folder is refused before any device work. Peak host memory is about one tensor: `safe_open` maps the
file and each tensor goes to the device as soon as it is read.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from safetensors import SafetensorError, safe_open

from eagle3_jax.checkpoints.common import read_json
from eagle3_jax.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def weight_map(folder: Path) -> dict[str, Path]:
    """tensor name -> the file that holds it, from the index or the single file's header."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    index = folder / INDEX_FILE
    if index.exists():
        raw = read_json(index).get("weight_map")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        bad = next((name for name, file in raw.items() if not isinstance(file, str)), None)
        if bad is not None:
            raise CheckpointError(f"{index}: weight_map.{bad} must be a file name, got {raw[bad]!r}")
        return {name: folder / file for name, file in raw.items()}
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    return {name: single for name in _header(single)}


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape), read from the header only."""
    if not file.is_file():
        raise CheckpointError(f"{file}: shard file not found")
    try:
        with safe_open(str(file), framework="numpy") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def check_tensors(folder: Path, files: dict[str, Path], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuses a missing tensor, a wrong shape or a non-float dtype, naming the file and key."""
    headers = {file: _header(file) for file in sorted(set(files[n] for n in expected if n in files))}
    for name, shape in expected.items():
        if name not in files:
            raise CheckpointError(f"{folder}: missing tensor {name!r}")
        file = files[name]
        if name not in headers[file]:
            raise CheckpointError(f"{file}: missing tensor {name!r} (listed in the index)")
        dtype, got = headers[file][name]
        if got != tuple(shape):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {got}, expected {tuple(shape)}")
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}, expected a float type")


def read_tensors(
    files: dict[str, Path], names: list[str], put: Callable[[str, np.ndarray], None], progress: bool
) -> None:
    """Reads the named tensors shard by shard and hands each to `put` (which moves it to the device)."""
    by_file: dict[Path, list[str]] = collections.defaultdict(list)
    for name in names:
        by_file[files[name]].append(name)
    for file, file_names in _progress(sorted(by_file.items()), progress):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in file_names:
                    put(name, f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: failed reading tensor data ({e})") from None


def _progress(items: list, enabled: bool) -> Iterator:
    if enabled and len(items) > 1:
        from tqdm.auto import tqdm

        return iter(tqdm(items, desc="loading shards", unit="shard"))
    return iter(items)
