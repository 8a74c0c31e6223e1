"""The fused residual add + RMSNorm: the Mosaic GPU kernel against the Triton kernel and XLA's ops.

    python -m eagle3_jax_bench.norm --out DIR [--dry-run]

At hidden 4096 (Qwen3-8B), bf16, rows 1, 8, 32 and 128, each implementation (pallas_kernels.add_rms_norm_mgpu,
pallas_kernels.add_rms_norm, and eagle3_jax.models.layers.add_rms_norm with kernels="xla") is timed two ways:
* "call": one call in a jit, its GPU kernel time from a profiler trace (all its kernels; XLA runs several);
* "chain": 72 dependent calls in one jit (a Qwen3-8B step has two per layer, 36 layers; each call's delta is the
  previous call's norm), wall time per call over back-to-back executions. It carries what the kernel time does
  not: an XLA custom call's launch (Mosaic GPU) against a plain kernel (Triton) and XLA fusing across calls.
Both against the floor: the bytes a call moves (x, delta and weight read, the sum and the norm written) at the
copy rate measured in the same run. Every row also gives the largest differences from XLA's result.
About a minute on an H200. --dry-run: the same code on the CPU at tiny shapes, the kernels in their
interpreters, one row count, a chain of 2; prints the table and writes the JSON all the same.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from eagle3_jax.models import layers

from .core import Run, compile_timed, time_pure, versions
from .profile import gpu_kernel_times

EPS = 1e-6
IMPLS = ("mosaic_gpu", "triton", "xla")
STEP_CALLS = 72  # two norms per layer in Qwen3-8B's 36 layers


def norm_fn(impl: str, interpret: bool):
    """(x, delta, weight) -> (x + delta, rms_norm(x + delta) * weight) by one implementation."""
    if impl == "mosaic_gpu":
        return functools.partial(pallas_kernels.add_rms_norm_mgpu, eps=EPS, interpret=interpret)
    if impl == "triton":
        return functools.partial(pallas_kernels.add_rms_norm, eps=EPS, interpret=interpret)
    if impl == "xla":
        return lambda x, delta, weight: layers.add_rms_norm(x, delta, weight, EPS, "xla")
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def chain(norm, calls: int):
    """A jit of `calls` dependent norms: each call's delta is the previous call's norm. Returns the last pair."""

    def run(x, delta, weight):
        for _ in range(calls):
            x, delta = norm(x, delta, weight)
        return x, delta

    return jax.jit(run)


def call_bytes(rows: int, hidden: int, dtype) -> int:
    """Bytes one call moves: x, delta and the weight read, the sum and the norm written."""
    return (4 * rows * hidden + hidden) * jnp.dtype(dtype).itemsize


def inputs(rows: int, hidden: int, dtype):
    keys = jax.random.split(jax.random.key(rows), 3)
    x, delta = (jax.random.normal(k, (rows, hidden), jnp.float32).astype(dtype) for k in keys[:2])
    weight = (1 + 0.1 * jax.random.normal(keys[2], (hidden,), jnp.float32)).astype(dtype)
    return x, delta, weight


def differences(got, want) -> dict:
    """Largest absolute differences of the sum and of the norm, relative to the norm's largest value for it."""
    (s, n), (s_ref, n_ref) = ([np.asarray(a, np.float32) for a in pair] for pair in (got, want))
    return {"sum_max_abs_diff": float(np.abs(s - s_ref).max()),
            "norm_rel_diff": float(np.abs(n - n_ref).max() / np.abs(n_ref).max())}


def measure(run: Run, impl: str, rows: int, hidden: int, dtype, calls: int, interpret: bool, reps: int) -> None:
    label = f"{impl} rows={rows}"
    if not run.time_left(label):
        return
    args = inputs(rows, hidden, dtype)
    norm = norm_fn(impl, interpret)
    entry = {"impl": impl, "rows": rows, "hidden": hidden, "dtype": jnp.dtype(dtype).name}
    one, _ = compile_timed(jax.jit(norm), *args)
    entry.update(differences(one(*args), jax.jit(norm_fn("xla", False))(*args)))
    kernels = gpu_kernel_times(lambda: one(*args))
    run.add("call", {**entry, "kernel_us": sum(us for _, us in kernels.values()) if kernels else None,
                     "launches": sum(count for count, _ in kernels.values()) if kernels else None,
                     "floor_us": run.floor_s(call_bytes(rows, hidden, dtype)) * 1e6})
    many, compile_s = compile_timed(chain(norm, calls), *args)
    seconds = time_pure(many, args, reps=reps, inner=10) / calls
    run.row("chain", {**entry, "calls": calls}, seconds, call_bytes(rows, hidden, dtype), compile_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.norm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, the kernels interpreted")
    parser.add_argument("--budget-s", type=float, default=60.0, help="no measurement starts after this")
    args = parser.parse_args(argv)
    hidden, row_counts, calls, reps = (256, (3,), 2, 2) if args.dry_run else (4096, (1, 8, 32, 128), STEP_CALLS, 7)
    run = Run(args.budget_s, args.out, "norm.json")
    run.record("versions", versions())
    run.ceilings(copy_bytes=1 << 20 if args.dry_run else 1 << 30, matmul_n=None)
    for rows in row_counts:
        for impl in IMPLS:
            measure(run, impl, rows, hidden, jnp.bfloat16, calls, args.dry_run, reps)
    print(f"\n{'rows':>5s} {'impl':>11s} {'kernel us':>10s} {'launches':>8s} {'chain us/call':>14s} "
          f"{'floor us':>9s} {'x floor':>8s} {'norm diff':>10s}")
    for c, r in zip(run.results.get("call", []), run.results.get("chain", [])):
        kernel = "-" if c["kernel_us"] is None else f"{c['kernel_us']:.2f}"
        launches = "-" if c["launches"] is None else f"{c['launches']:.0f}"
        print(f"{c['rows']:5d} {c['impl']:>11s} {kernel:>10s} {launches:>8s} "
              f"{r['time_ms'] * 1e3:14.2f} {r['floor_ms'] * 1e3:9.3f} {r['ratio']:8.1f} {c['norm_rel_diff']:10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
