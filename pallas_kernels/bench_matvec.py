"""Benchmark of the one-row matvec kernel at Qwen3-8B's decode shapes (one device call).

  PYTHONPATH=. python3 pallas_kernels/bench_matvec.py

A batch-1 step reads each weight once: a product's floor is the weight's bytes over the copy
bandwidth (eagle3_jax.measure, measured in the same run). For the o, q/k/v and down projections
(down with silu(gate) * up formed from the gate/up output) this times a sweep of MatvecConfigs and
what XLA runs for the same product in the model (kernels="xla": the GEMM, its split-K reduce, and
for down the activation), and prints a table.

Each timed jit holds `calls` products over distinct weights (more bytes than the 50 MB L2 holds, so
no call is served from the cache), each with its own x. wall: the jit's median wall time (less an
empty jit's dispatch) per call, launch gaps included. kernel: GPU kernel time per call from a
profiler trace. err: max |out - f32 reference| / max |reference|. Rows go to
$OUT/bench_matvec.json. BENCH_DRY_RUN=1: tiny shapes in interpret mode (CPU).
"""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp

from eagle3_jax import measure
from eagle3_jax.layers import gated_mlp, linear
from pallas_kernels.bench_attention import dispatch_overhead, kernel_ns, median_wall
from pallas_kernels.matvec import MatvecConfig, matvec

DRY = os.environ.get("BENCH_DRY_RUN") == "1"
DTYPE = jnp.float32 if DRY else jnp.bfloat16
D, I = (64, 96) if DRY else (4096, 12288)
SHAPES = {"qkv": (3 * D // 2, D, False), "o": (D, D, False), "down": (D, I, True)}  # N, K, gated input
SWEEP = (
    [MatvecConfig(4, 32), MatvecConfig(8, 16, 2, 1)]
    if DRY
    else [MatvecConfig(n, k) for n, k in ((2, 1024), (4, 512), (4, 1024), (4, 2048), (8, 512), (8, 1024), (16, 512))]
    + [MatvecConfig(4, 1024, 8, 3), MatvecConfig(4, 1024, 2, 3), MatvecConfig(4, 1024, 4, 1), MatvecConfig(8, 1024, 8, 3)]
)
L2_BYTES = 50 << 20
RESULTS = []


def _save():
    path = os.environ.get("OUT", "./out")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "bench_matvec.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def _inputs(name):
    """Distinct weights (together several times the L2) with an input row each, and one weight's bytes."""
    N, K, gated = SHAPES[name]
    one = N * K * jnp.dtype(DTYPE).itemsize
    calls = 2 if DRY else max(2, min(16, -(-4 * L2_BYTES // one)))
    key = jax.random.key(N + K)
    ws = [measure.normal(jax.random.fold_in(key, i), (N, K), DTYPE) for i in range(calls)]
    width = 2 * K if gated else K
    xs = [measure.normal(jax.random.fold_in(key, 100 + i), (1, 1, width), DTYPE) * 50 for i in range(calls)]
    return xs, ws, one


def _op(name, tuning):
    gated = SHAPES[name][2]
    if tuning is None:  # what the model runs with kernels="xla"
        if gated:
            return lambda x, w: linear(jax.nn.silu(x[..., : w.shape[1]]) * x[..., w.shape[1] :], w)
        return lambda x, w: linear(x, w)
    return lambda x, w: matvec(x, w, gated_input=gated, interpret=DRY, **dataclasses.asdict(tuning))


def measure_one(name, tuning, xs, ws, nbytes, overhead, copy_tbps):
    op = _op(name, tuning)
    many = jax.jit(lambda xs, ws: [op(x, w) for x, w in zip(xs, ws)])
    row = {"shape": name, "impl": "xla" if tuning is None else "pallas",
           "tuning": dataclasses.asdict(tuning) if tuning else None, "calls": len(ws), "weight_bytes": nbytes}
    try:
        out = jax.block_until_ready(many(xs, ws))[0].astype(jnp.float32)
        with jax.default_matmul_precision("highest"):
            ref = _op(name, None)(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32))
        finite = bool(jnp.isfinite(out).all())
        row["err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) if finite else float("nan")
        row["wall_us"] = median_wall(lambda: many(xs, ws), overhead) / len(ws) * 1e6
        kernels = kernel_ns(lambda: many(xs, ws))
        if kernels:
            row["kernel_us"] = sum(kernels.values()) / len(ws) / 1e3
            row["kernels"] = {k: v / len(ws) / 1e3 for k, v in kernels.items()}
        for col in ("wall", "kernel"):
            if f"{col}_us" in row:
                row[f"{col}_x_floor"] = row[f"{col}_us"] * 1e-6 * copy_tbps * 1e12 / nbytes
    except Exception as e:  # a tuning that fails to compile costs its row only
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    RESULTS.append(row)
    _save()
    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    return row


def main():
    overhead = dispatch_overhead()
    ceilings = {"kind": "ceilings", **measure.measure_copy_bandwidth(64 << 20 if DRY else 4 << 30),
                "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    RESULTS.append(ceilings)
    copy_tbps = ceilings["copy_tbps"]
    table = []
    for name in SHAPES:
        inputs = _inputs(name)
        for tuning in [None, *SWEEP]:
            table.append(measure_one(name, tuning, *inputs, overhead, copy_tbps))
    time_of = lambda r: r.get("kernel_us", r.get("wall_us", float("inf")))  # noqa: E731
    totals = {t: sum(time_of(r) for r in table if r["tuning"] == dataclasses.asdict(t)) for t in SWEEP}
    print(f"\ncopy {copy_tbps:.2f} TB/s; best tuning over the three shapes: {min(totals, key=totals.get)}")
    print("| shape | MB | impl | tuning (block_n, block_k, warps, stages) | wall us | kernel us | x floor (wall / kernel) | err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        t = r["tuning"]
        tuning = "" if t is None else f"{t['block_n']}, {t['block_k']}, {t['num_warps']}, {t['num_stages']}"
        print(f"| {r['shape']} | {r['weight_bytes'] / 1e6:.0f} | {r['impl']} | {tuning} | {r.get('wall_us', float('nan')):.1f} | "
              f"{r.get('kernel_us', float('nan')):.1f} | {r.get('wall_x_floor', float('nan')):.2f} / "
              f"{r.get('kernel_x_floor', float('nan')):.2f} | {r.get('err', float('nan')):.1e} |")


if __name__ == "__main__":
    main()
