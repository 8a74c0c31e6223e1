"""What every benchmark shares: a run's time budget and results (rows with their floor and ratio, written
as JSON after each measurement), the ceilings measured in the same run (copy bandwidth, bf16 matmul rate),
the timers, and the versions a result was measured with."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp


class Budget:
    """Seconds a run may start new measurements for (one that has started runs to its end)."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> bool:
        return time.perf_counter() < self.deadline


def write_json(folder: Path, filename: str, value) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / filename).write_text(json.dumps(value, indent=1, default=str))


class Run:
    """One run's results and its time budget: no new measurement starts once `budget_s` has passed (each
    is recorded under "skipped"), and the JSON file is rewritten after every row, so a run cut short still
    leaves its numbers. With out=None it writes nothing and prints nothing (a notebook's call)."""

    def __init__(self, budget_s: float, out: Path | None, filename: str):
        self.budget = Budget(budget_s)
        self.out, self.filename = out, filename
        self.results: dict = {"skipped": []}
        self.bw: float | None = None  # TB/s, once the ceilings are measured

    def log(self, line: str) -> None:
        if self.out is not None:
            print(line, flush=True)

    def time_left(self, label: str) -> bool:
        if self.budget.left():
            return True
        self.results["skipped"].append(label)
        self.log(f"skipped (time budget): {label}")
        return False

    def ceilings(self, copy_bytes: int, matmul_n: int | None) -> dict:
        """The copy rate every floor divides by, and the bf16 matmul rate (matmul_n None: not measured)."""
        self.results["ceilings"] = found = copy_bandwidth(copy_bytes)
        if matmul_n is not None:
            found["matmul_tflops"] = matmul_rate(matmul_n)
        self.bw = found["copy_tbps"]
        self.log(f"ceilings {json.dumps(found)}")
        return found

    def floor_s(self, nbytes_read: int) -> float:
        """Seconds to read nbytes at the measured copy rate (nan before the ceilings)."""
        return nbytes_read / (self.bw * 1e12) if self.bw else float("nan")

    def row(self, section: str, entry: dict, seconds: float, read: int, compile_s: float | None = None) -> dict:
        """A timed row against its floor: time_ms, floor_ms, ratio, bytes_read (and compile_s) added."""
        floor = self.floor_s(read)
        entry.update(time_ms=seconds * 1e3, floor_ms=floor * 1e3, ratio=seconds / floor, bytes_read=read)
        if compile_s is not None:
            entry["compile_s"] = compile_s
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}
        return self.add(section, entry, rounded)

    def add(self, section: str, entry: dict, shown: dict | None = None) -> dict:
        """An untimed row (or a timed one, from row) appended to its section, logged and saved."""
        self.results.setdefault(section, []).append(entry)
        self.log(f"{section:12s} {json.dumps(entry if shown is None else shown, default=str)}")
        self.save()
        return entry

    def record(self, section: str, value: Any) -> None:
        """A section that is one value (a dict), not a list of rows."""
        self.results[section] = value
        self.log(f"{section} {json.dumps(value, default=str)}")
        self.save()

    def save(self) -> None:
        if self.out is not None:
            write_json(self.out, self.filename, self.results)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A compiled function's time: seconds per call (per round for calls of several rounds), and the
    seconds its compile took."""

    seconds: float
    compile_s: float


def compile_timed(jitted, *args, **static):
    """(executable, compile seconds): compiled ahead of the timed region, so nothing recompiles inside it."""
    start = time.perf_counter()
    compiled = jitted.lower(*args, **static).compile()
    return compiled, time.perf_counter() - start


def time_chain(compiled, state, args, reps: int, inner: int, warmup: int = 3):
    """(median seconds per call, the state it leaves) of `state, out = compiled(*args, state)`, state
    donated and rebound: `warmup` calls, then `reps` samples of `inner` back-to-back calls."""
    for _ in range(warmup):
        state, _ = compiled(*args, state)
    jax.block_until_ready(state)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            state, _ = compiled(*args, state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples), state


def time_pure(compiled, args, reps: int, inner: int) -> float:
    """Median seconds per call of a stateless compiled function, `reps` samples of `inner` calls."""
    jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = compiled(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _median_call_s(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int) -> dict:
    """Device memory bandwidth in TB/s (bytes read + written): a jitted bf16 scale, and torch's copy kernel
    where torch has CUDA; copy_tbps is the faster."""
    x = (jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.float32) * 0.02).astype(jnp.bfloat16)
    out = {"jax_elementwise_tbps": 2 * nbytes / _median_call_s(jax.jit(lambda a: a * jnp.bfloat16(1.5)), x) / 1e12}
    del x
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
            b = torch.empty_like(a)
            b.copy_(a)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            times = []
            for _ in range(10):
                ev[0].record()
                b.copy_(a)
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]) / 1e3)
            out["torch_copy_tbps"] = 2 * nbytes / statistics.median(times) / 1e12
            del a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    out["copy_tbps"] = max(out.values())
    return out


def matmul_rate(n: int) -> float:
    """bf16 TFLOP/s of an n x n x n matmul with float32 accumulation."""
    a, b = ((jax.random.normal(jax.random.key(i), (n, n), jnp.float32) * 0.02).astype(jnp.bfloat16) for i in (1, 2))
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / _median_call_s(mm, a, b) / 1e12


def versions() -> dict:
    out = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind)}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def import_absl_library(name: str):
    """Imports a library that defines absl flags and, the first time one is read, parses sys.argv with them
    unless absl's flags are already parsed (tokamax does): the bench's own argv (--model ...) would then
    raise absl's UnrecognizedFlagError. absl's flags are parsed first from the program name alone, so the
    library's flags, defined after, keep their defaults whether it reads them on import or later.
    ImportError, with nothing parsed, when the library is not installed."""
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"No module named {name!r}")
    from absl import flags  # a library that reads absl flags depends on absl

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    return importlib.import_module(name)
