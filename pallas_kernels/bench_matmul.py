"""Benchmark of the skinny matmul kernel at Qwen3-8B's decode shapes (one device call).

  PYTHONPATH=. python3 pallas_kernels/bench_matmul.py

Every matmul of a batch-1 decode step reads a weight once; its floor is the
weight's bytes over the copy bandwidth (eagle3_jax.measure, measured in the
same run). For each shape and row count this times the Pallas kernel
(pallas_kernels/skinny_matmul.py) and what XLA runs for the same product
(eagle3_jax.layers with kernels="xla"), and prints a table.

- sweep: tunings at one row, on the o, gate/up and down shapes; the tuning with
  the least total kernel time is then used for the table.
- table: every shape at 1, 4 and 32 rows, Pallas and XLA.

Each timed jit holds `calls` products over distinct weights (more bytes than
the 50 MB L2 holds, so no call is served from the cache), each with its own x.
wall: the jit's median wall time (less an empty jit's dispatch) per call,
launch gaps included. kernel: GPU kernel time per call from a profiler trace.
err: max |out - f32 reference| / max |reference|. Rows go to
$OUT/bench_matmul.json. BENCH_DRY_RUN=1: tiny shapes in interpret mode (CPU).
"""

import dataclasses
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp

from eagle3_jax import measure
from eagle3_jax.layers import gated_mlp, linear, normed_linear
from pallas_kernels.bench_attention import dispatch_overhead, kernel_ns, median_wall
from pallas_kernels.skinny_matmul import SkinnyConfig, skinny_matmul

DRY = os.environ.get("BENCH_DRY_RUN") == "1"
DTYPE = jnp.float32 if DRY else jnp.bfloat16
D, I, V, VD = (64, 96, 160, 64) if DRY else (4096, 12288, 151936, 32000)
# name: (output features, input features, kind); kind "gated" is the fused gate/up weight [2 I, D] with
# the RMSNorm and silu(gate) * up in the kernel, "normed" the RMSNorm before the product (q/k/v).
SHAPES = {
    "qkv": (6 * D // 4, D, "normed"),
    "o": (D, D, "plain"),
    "gate_up": (I, D, "gated"),
    "down": (D, I, "plain"),
    "lm_head": (V, D, "logits"),
    "draft_fc": (D, 3 * D, "plain"),
    "draft_head": (VD, D, "logits"),
}
SWEEP_SHAPES = ("o", "gate_up", "down")
ROWS_MEASURED = (1, 2) if DRY else (1, 4, 32)
SWEEP = (
    [SkinnyConfig(16, 32, 4, 2), SkinnyConfig(4, 16, 4, 1, dot=False)]
    if DRY
    else [SkinnyConfig(64, 256, 4, 4), SkinnyConfig(32, 512, 4, 4), SkinnyConfig(32, 256, 4, 6), SkinnyConfig(64, 256, 4, 3),
          SkinnyConfig(64, 128, 4, 6)]
    + [SkinnyConfig(n, k, 4, s, dot=False) for n, k, s in itertools.product((4, 8, 16), (512, 1024), (1, 3))]
    + [SkinnyConfig(8, 512, 2, 3, dot=False), SkinnyConfig(8, 1024, 8, 3, dot=False), SkinnyConfig(2, 1024, 4, 3, dot=False)]
)
L2_BYTES = 50 << 20
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "400"))
T0 = time.perf_counter()
RESULTS = []


def _save():
    path = os.environ.get("OUT", "./out")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "bench_matmul.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def _weights(name, key):
    """Distinct weights of one shape, together several times the L2, and the bytes each one is."""
    N, Din, kind = SHAPES[name]
    rows = 2 * N if kind == "gated" else N
    one = rows * Din * jnp.dtype(DTYPE).itemsize
    calls = 2 if DRY else max(2, min(16, -(-4 * L2_BYTES // one)))
    ws = [measure.normal(jax.random.fold_in(key, i), (rows, Din), DTYPE) for i in range(calls)]
    return ws, one


def _op(name, impl, tuning):
    """(x, w, norm) -> the product as the model computes it, with impl's kernels."""
    kind = SHAPES[name][2]
    if impl == "xla":
        return {
            "plain": lambda x, w, n: linear(x, w, "xla"),
            "normed": lambda x, w, n: normed_linear(x, n, 1e-6, w, "xla"),
            "logits": lambda x, w, n: linear(x, w, "xla", out_dtype=jnp.float32),
            "gated": _xla_gated,
        }[kind]
    options = dict(interpret=DRY, **dataclasses.asdict(tuning))
    return {
        "plain": lambda x, w, n: skinny_matmul(x, w, **options),
        "normed": lambda x, w, n: skinny_matmul(x, w, norm_weight=n, **options),
        "logits": lambda x, w, n: skinny_matmul(x, w, out_dtype=jnp.float32, **options),
        "gated": lambda x, w, n: skinny_matmul(x, w, norm_weight=n, gated=True, **options),
    }[kind]


def _xla_gated(x, w, n):
    """gated_mlp's first half on XLA: what the gated kernel replaces."""
    gate, up = jnp.split(normed_linear(x, n, 1e-6, w, "xla"), 2, axis=-1)
    return jax.nn.silu(gate) * up


def _reference(name, x, w, n):
    f32 = [a.astype(jnp.float32) for a in (x, w, n)]
    with jax.default_matmul_precision("highest"):
        return _op(name, "xla", None)(*f32)


def measure_one(name, rows, impl, tuning, ws, nbytes, overhead, copy_tbps):
    key = jax.random.key(rows)
    Din = SHAPES[name][1]
    xs = [measure.normal(jax.random.fold_in(key, i), (rows, Din), DTYPE) for i in range(len(ws))]
    norm = 1 + measure.normal(jax.random.fold_in(key, 99), (Din,), DTYPE)
    op = _op(name, impl, tuning)
    many = jax.jit(lambda xs, ws, n: [op(x, w, n) for x, w in zip(xs, ws)])
    row = {"shape": name, "rows": rows, "impl": impl, "tuning": dataclasses.asdict(tuning) if tuning else None,
           "calls": len(ws), "weight_bytes": nbytes}
    try:
        outs = jax.block_until_ready(many(xs, ws, norm))
        ref = _reference(name, xs[0], ws[0], norm)
        out = outs[0].astype(jnp.float32)
        row["err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) if bool(jnp.isfinite(out).all()) else float("nan")
        row["wall_us"] = median_wall(lambda: many(xs, ws, norm), overhead) / len(ws) * 1e6
        kernels = kernel_ns(lambda: many(xs, ws, norm))
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


def _over_budget():
    return time.perf_counter() - T0 > BUDGET_S


def main():
    overhead = dispatch_overhead()
    ceilings = {"kind": "ceilings", **measure.measure_copy_bandwidth(64 << 20 if DRY else 4 << 30),
                "overhead_us": overhead * 1e6, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    RESULTS.append(ceilings)
    copy_tbps = ceilings["copy_tbps"]
    print(json.dumps(ceilings), flush=True)
    weights = {name: _weights(name, jax.random.key(i)) for i, name in enumerate(SHAPES)}
    totals = {}
    for tuning in SWEEP:
        if _over_budget():
            break
        rows = [measure_one(n, 1, "pallas", tuning, *weights[n], overhead, copy_tbps) for n in SWEEP_SHAPES]
        if all("kernel_us" in r or (DRY and "wall_us" in r) for r in rows):
            totals[tuning] = sum(r.get("kernel_us", r.get("wall_us")) for r in rows)
    best = {dot: min((t for t in totals if t.dot == dot), key=totals.get, default=SkinnyConfig(dot=dot)) for dot in (True, False)}
    print(f"best tunings by total kernel time at one row: {best}", flush=True)
    table = []
    for name, rows in itertools.product(SHAPES, ROWS_MEASURED):
        impls = {"pallas": best[True], "xla": None} | ({"pallas_one_row": best[False]} if rows == 1 else {})
        if _over_budget():
            break
        pair = {impl: measure_one(name, rows, impl, tuning, *weights[name], overhead, copy_tbps) for impl, tuning in impls.items()}
        table.append((name, rows, pair))
        if rows == 1:  # the one-row kernel's line, under the same columns
            table.append((name, "1 (cuda cores)", {"pallas": pair["pallas_one_row"], "xla": pair["xla"]}))
    print(f"\ncopy {copy_tbps:.2f} TB/s; tunings {best}")
    print("| shape | rows | MB | pallas wall us | kernel us | x floor (wall / kernel) | xla wall us | kernel us | x floor (wall / kernel) | err pallas |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, pair in table:
        p, x = pair["pallas"], pair["xla"]
        cells = []
        for r in (p, x):
            cells += [f"{r.get('wall_us', float('nan')):.1f}", f"{r.get('kernel_us', float('nan')):.1f}",
                      f"{r.get('wall_x_floor', float('nan')):.2f} / {r.get('kernel_x_floor', float('nan')):.2f}"]
        print(f"| {name} | {rows} | {p['weight_bytes'] / 1e6:.0f} | " + " | ".join(cells) + f" | {p.get('err', float('nan')):.1e} |")


if __name__ == "__main__":
    main()
