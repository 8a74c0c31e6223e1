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
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program loaded from the persistent cache


class Compilations:
    """Counts the process's XLA compilations from now on, until `close`: JAX's backend-compile events, less its
    persistent cache's hits (a program loaded from the cache passes through the same step, and emits both)."""

    def __init__(self):
        self.requests = self.hits = 0
        jax.monitoring.register_event_duration_secs_listener(self._timed)
        jax.monitoring.register_event_listener(self._event)

    @property
    def count(self) -> int:
        return self.requests - self.hits

    def _timed(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.requests += 1

    def _event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            self.hits += 1

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._timed)
        jax.monitoring.unregister_event_listener(self._event)


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
    """The marker file of a configuration, or None where the persistent compilation cache is off or keeps only some
    programs (jax's default stores only those that took a second or more to compile; the CLI sets 0)."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or not jax.config.jax_enable_compilation_cache or \
            jax.config.jax_persistent_cache_min_compile_time_secs > 0:
        return None
    full = {**fields, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"), "sources": source_hash()}
    key = hashlib.sha256(json.dumps(full, sort_keys=True, default=repr).encode()).hexdigest()[:24]
    return Path(folder).expanduser().parent / "compiled" / f"{key}.json"


def is_warm(path: Path | None) -> bool:
    """Whether the marker is there and the cache folder beside it holds something (a cache deleted on its own
    leaves a marker that would otherwise claim programs that are gone)."""
    cache = Path(jax.config.jax_compilation_cache_dir or "").expanduser()
    return path is not None and path.exists() and cache.is_dir() and any(cache.iterdir())


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
