"""Whether an engine configuration's programs are already in JAX's persistent compilation cache, so that a second
start (a server's, a CLI run's) compiles and lowers nothing ahead: `Engine.compile` leaves a marker file once it has
compiled every program with the cache on, and skips its work when the marker is there. The programs are then
loaded from the cache when first used (traced, not compiled).

The marker's key covers what the cache's own keys cover and a marker could otherwise get wrong: the configuration
(`fields`: the build, the pool's and chunks' sizes, the page pools' shapes, the stop ids' width), the device kind,
the jax and jaxlib versions, and a hash of this package's and its kernels' sources (a change to any module could
change a program, whose cache key, a hash of its HLO, then misses: the marker must miss too). Where it lives:
`compiled/` beside the compilation cache folder (its parent), so deleting one's folder tree deletes the other."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path

import jax

PACKAGES = ("eagle3_jax", "pallas_kernels")  # the sources a program is built from
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


class Compilations:
    """Counts the process's XLA backend compilations from now on (JAX's monitoring event: a program loaded from
    the persistent cache is not one), until `close`."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


@functools.cache
def source_hash() -> str:
    """A sha256 of every Python source of PACKAGES (their files under the package folders, in path order)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]  # the folder holding the packages
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def marker(fields: dict) -> Path | None:
    """The marker file of a configuration, or None where the persistent compilation cache is off."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or not jax.config.jax_enable_compilation_cache:
        return None
    full = {**fields, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"), "sources": source_hash()}
    key = hashlib.sha256(json.dumps(full, sort_keys=True, default=repr).encode()).hexdigest()[:24]
    return Path(folder).expanduser().parent / "compiled" / f"{key}.json"


def is_warm(path: Path | None) -> bool:
    return path is not None and path.exists()


def mark(path: Path | None, programs: int) -> None:
    """Records that every program of the marker's configuration is in the cache; a folder that cannot be written
    records nothing (the next start compiles ahead again)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"programs": programs}))
    except OSError:
        return
