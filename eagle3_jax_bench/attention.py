"""Benchmark of the Pallas attention kernels on one GPU (one device call).

  python -m eagle3_jax_bench.attention [sections...]

Sections (default all): sweep, mosaic_check, prefill, decode; the ceilings always run.
Prints a line per measurement and writes every row to
$OUT/bench_attention.json (OUT defaults to ./out). Qwen3-8B heads: 32 query,
8 KV, head_dim 128, bf16, random data; the cache holds exactly L keys.

Two times per op:
- wall: one jit holds `calls` back-to-back calls, each with its own q and its
  own K/V (so XLA can neither merge calls that share an operand nor serve
  them from L2); median wall time of that jit, less the measured
  dispatch-and-sync cost of an empty jit, over `calls`. Includes the gaps
  between kernel launches.
- dev: GPU kernel time per call, summed from a profiler trace of the same
  jit; the kernels' own efficiency.
Bandwidth counts the K/V bytes a call must read: 2 * B * K * L * H * 2;
"of copy" divides wall bandwidth by the wall copy rate and kernel bandwidth
by the copy kernel's rate (a jnp.copy of 4 GiB, bytes read + written).
DECODE_TUNING / PREFILL_TUNINGS / MOSAIC_TUNINGS (JSON) override the tunings; SWEEP_SHAPES / SWEEP_TUNINGS the sweep.
mosaic_check compares the Mosaic GPU prefill kernel with the f32 reference at edge shapes (GPU only).
"""

import json
import math
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax.models.attention import xla_attention
from pallas_kernels.attention import attention_reference, decode_attention, prefill_attention
from pallas_kernels.prefill_attention_mgpu import prefill_attention_mgpu

from .core import Budget, write_json
from .profile import gpu_kernel_times

# BENCH_DRY_RUN=1: tiny shapes in interpret mode, to check this script on a CPU.
DRY = os.environ.get("BENCH_DRY_RUN") == "1"
N, K, H = (8, 2, 64) if DRY else (32, 8, 128)  # Qwen3-8B heads; fewer on the CPU dry run
DTYPE = jnp.float32 if DRY else jnp.bfloat16  # the CPU lacks some bf16 dots
SCALE = H**-0.5
BATCHES = (2,) if DRY else (1, 8, 32)
LENGTHS = (200,) if DRY else (1024, 4096, 16384, 32768)
PREFILL_LENGTHS = (96,) if DRY else (2048, 8192)
COPY_ELEMENTS, MATMUL_N = (2**20, 256) if DRY else (2**30, 8192)
T0 = time.perf_counter()
BUDGET = Budget(float(os.environ.get("BENCH_BUDGET_S", "330")))
ROWS = []


def _save():
    write_json(Path(os.environ.get("OUT", "./out")), "bench_attention.json", ROWS)


def _over_budget():
    return not BUDGET.left()


def _short(e):
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text[:300] + (" ... " + text[-600:] if len(text) > 900 else "")


def median_wall(run, overhead, iters=None, min_s=0.25):
    times = []
    while len(times) < (iters or 5) or (not iters and sum(times) < min_s and len(times) < 50):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    return max(statistics.median(times) - overhead, 1e-9)


def dispatch_overhead():
    """Wall time of an (almost) empty jit, dispatch to block_until_ready."""
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones((8,), jnp.float32)
    f(x).block_until_ready()
    return median_wall(lambda: f(x), 0.0, iters=50)


def kernel_ns(run, reps=2):
    """{kernel name: GPU ns per run()} from a profiler trace ({} if none)."""
    if DRY:
        return {}
    return {name: us * 1e3 for name, (_, us) in gpu_kernel_times(run, reps).items()}


def _batched(op, qs, kv_sets, start):
    """A runner of len(qs) calls of op in one jit; also the first output."""

    @jax.jit
    def many(qs, kv_sets, start):
        return [op(q, *kv, start) for q, kv in zip(qs, kv_sets)]

    outs = many(qs, kv_sets, start)  # compile and warm up
    jax.block_until_ready(outs)
    return (lambda: many(qs, kv_sets, start)), outs[0]


def _rel_err(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))
    return float(err) if bool(jnp.isfinite(out).all()) else float("nan")


def _caches(key, B, S, n_sets):
    sets = []
    for i in range(n_sets):
        kk, kv = jax.random.split(jax.random.fold_in(key, i))
        sets.append((jax.random.normal(kk, (B, K, S, H), DTYPE), jax.random.normal(kv, (B, K, S, H), DTYPE)))
    return sets


def _queries(key, B, T, calls):
    return [jax.random.normal(jax.random.fold_in(key, 1000 + i), (B, T, N, H), DTYPE) for i in range(calls)]


def ceilings(overhead):
    x = jax.random.normal(jax.random.key(0), (COPY_ELEMENTS,), jnp.float32)
    row = {"kind": "ceilings", "overhead_us": overhead * 1e6}
    copy = jax.jit(jnp.copy)
    copy(x).block_until_ready()
    row["copy_TBps"] = 2 * x.nbytes / median_wall(lambda: copy(x), overhead, iters=10) / 1e12
    try:
        kernels = kernel_ns(lambda: copy(x))
        if kernels:
            row["copy_dev_TBps"] = 2 * x.nbytes / sum(kernels.values()) / 1e3
        row["copy_kernels"] = kernels
    except Exception as e:  # a trace that fails only costs the dev columns
        row["profile_error"] = _short(e)
    x = None  # frees the copy buffer before the matmul ceiling
    a, b = (jax.random.normal(jax.random.key(i), (MATMUL_N, MATMUL_N), DTYPE) for i in (1, 2))
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    row["matmul_TFLOPs"] = 2 * MATMUL_N**3 / median_wall(lambda: mm(a, b), overhead, iters=10) / 1e12
    print(f"ceilings: {row}", flush=True)
    ROWS.append(row)
    return row


ORACLE = jax.jit(partial(attention_reference, scale=SCALE))


def _kv_sets(key, B, L):
    """Enough K/V sets for ~2 ms of calls at ~3 TB/s, one per call, <= 8 GB."""
    per_set = 2 * B * K * L * H * 2
    calls = int(2e-3 / (per_set / 3e12 + 5e-6))
    return _caches(key, B, L, max(1, min(16, calls, int(8e9 // per_set))))


def _time_pallas(row, run, calls, overhead):
    row["pallas_us"] = median_wall(run, overhead) / calls * 1e6
    try:
        kernels = kernel_ns(run)
    except Exception as e:
        row["profile_error"] = _short(e)
        return
    if kernels:
        row["pallas_dev_us"] = sum(kernels.values()) / calls / 1e3
        row["pallas_kernels_us"] = {k: v / calls / 1e3 for k, v in kernels.items()}


def decode_row(key, B, L, T, kv_sets, overhead, tuning, copy_bw, with_xla):
    """Times Pallas (and XLA) at one shape; err vs the f32 oracle."""
    start = jnp.full((B,), L - T, jnp.int32)
    qs = _queries(key, B, T, len(kv_sets))
    ref = ORACLE(qs[0], *kv_sets[0], start)
    row = {"kind": "decode", "B": B, "L": L, "T": T, "calls": len(qs), "tuning": tuning}
    ops = {"pallas": partial(decode_attention, scale=SCALE, interpret=DRY, **tuning)}
    if with_xla:
        ops["xla"] = partial(xla_attention, scale=SCALE)
    for name, op in ops.items():
        try:
            run, out = _batched(op, qs, kv_sets, start)
            row[f"{name}_err"] = _rel_err(out, ref)
            if name == "pallas":
                _time_pallas(row, run, len(qs), overhead)
            else:
                row[f"{name}_us"] = median_wall(run, overhead) / len(qs) * 1e6
        except Exception as e:  # report and carry on: one call must tell all
            row[f"{name}_error"] = _short(e)
    kv_bytes = 2 * B * K * L * H * 2
    for kind in ("", "dev_"):  # wall vs wall copy, kernel time vs copy kernel
        if f"pallas_{kind}us" in row and f"copy_{kind}TBps" in copy_bw:
            tbps = kv_bytes / row[f"pallas_{kind}us"] / 1e6
            row[f"{kind}TBps"] = tbps
            row[f"{kind}of_copy"] = tbps / copy_bw[f"copy_{kind}TBps"]
    ROWS.append(row)
    _save()  # a run cut off at its time limit still returns what it measured
    return row


def _fmt(row, name, spec):
    value = row.get(name)
    return format(value, spec) if isinstance(value, float) else "-"


def _print_decode(row):
    errors = {k: v for k, v in row.items() if k.endswith("_error")}
    print(
        f"{row['kind']:6} B={row['B']:<3d} L={row['L']:<6d} T={row['T']} "
        f"pallas {_fmt(row, 'pallas_us', '7.1f')} us "
        f"(dev {_fmt(row, 'pallas_dev_us', '7.1f')}) "
        f"{_fmt(row, 'TBps', '4.2f')} TB/s {_fmt(row, 'of_copy', '4.0%')} "
        f"(dev {_fmt(row, 'dev_TBps', '4.2f')} {_fmt(row, 'dev_of_copy', '4.0%')})"
        f" xla {_fmt(row, 'xla_us', '7.1f')} err {_fmt(row, 'pallas_err', '.1e')}"
        f" {row['tuning'] if row['kind'] == 'sweep' else ''}" + (f"\n  ERRORS {errors}" if errors else ""),
        flush=True,
    )


SWEEP_SHAPES = [(1, 200, 1)] if DRY else [(1, 16384, 1), (8, 16384, 8), (1, 32768, 8)]
SWEEP_TUNINGS = [
    dict(block_k=128, num_warps=4, num_stages=3, wave_slots=132),
    dict(block_k=128, num_warps=8, num_stages=3, wave_slots=132),
    dict(block_k=64, num_warps=4, num_stages=3, wave_slots=264),
    dict(block_k=128, num_warps=4, num_stages=3, wave_slots=264),
    dict(block_k=128, num_warps=4, num_stages=3, wave_slots=132),  # noise
]
# SWEEP_SHAPES / SWEEP_TUNINGS (JSON: [[B, L, T], ...] / [{...}, ...]) override the lists above.
SWEEP_SHAPES = [tuple(s) for s in json.loads(os.environ.get("SWEEP_SHAPES", "null")) or SWEEP_SHAPES]
SWEEP_TUNINGS = json.loads(os.environ.get("SWEEP_TUNINGS", "null")) or SWEEP_TUNINGS


def sweep(overhead, copy_bw):
    """Decode tunings on a few shapes; prints the fastest in kernel time."""
    key = jax.random.key(1)
    total = [0.0] * len(SWEEP_TUNINGS)
    for B, L, T in SWEEP_SHAPES:
        kv_sets = _kv_sets(key, B, L)
        for i, tuning in enumerate(SWEEP_TUNINGS):
            if _over_budget():
                return
            row = decode_row(key, B, L, T, kv_sets, overhead, tuning, copy_bw, with_xla=False)
            row["kind"] = "sweep"
            total[i] += row.get("pallas_dev_us", row.get("pallas_us", math.inf))
            _print_decode(row)
        del kv_sets
    best = min(range(len(total)), key=total.__getitem__)
    print(f"sweep totals (dev us) {[round(t, 1) for t in total]}; best {SWEEP_TUNINGS[best]}", flush=True)


def decode_table(overhead, copy_bw, tuning):
    key = jax.random.key(2)
    for B in BATCHES:
        for L in LENGTHS:
            kv_sets = _kv_sets(key, B, L)
            for T in (1, 4, 8):
                if _over_budget():
                    print("over budget: decode table cut short")
                    return
                _print_decode(decode_row(key, B, L, T, kv_sets, overhead, tuning, copy_bw, with_xla=True))
            del kv_sets


PREFILL_TUNINGS = [
    dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
]
MOSAIC_TUNINGS = [{}]  # MosaicPrefillConfig fields; {} = its defaults (MOSAIC_TUNINGS overrides, JSON)


def _prefill_ops(tunings, mosaic_tunings):
    ops = {f"pallas{i}": partial(prefill_attention, scale=SCALE, interpret=DRY, **t) for i, t in enumerate(tunings)}
    if not DRY:  # Mosaic GPU has no interpreter here: GPU only
        ops |= {f"mosaic{i}": partial(prefill_attention_mgpu, scale=SCALE, **t) for i, t in enumerate(mosaic_tunings)}
    ops["xla"] = partial(xla_attention, scale=SCALE)
    # cuDNN takes keys as [B, S, K, H]: the caller passes transposed caches.
    ops["cudnn"] = lambda q, k, v, s: jax.nn.dot_product_attention(
        q, k, v, scale=SCALE, is_causal=True, implementation="cudnn"
    )
    if not DRY:  # JAX's own Mosaic GPU flash attention ([B, S, K, H] like cuDNN; float16 only): the other lowering
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        ops["mosaic_jax"] = lambda q, k, v, s: attention_mgpu.attention(q, k, v, config=config)
    return ops


def prefill_row(T, overhead, matmul_tflops, tunings, mosaic_tunings):
    key = jax.random.key(3)
    k, v = _caches(key, 1, T, 1)[0]
    start = jnp.zeros((1,), jnp.int32)
    qs = _queries(key, 1, T, 4)
    ref = ORACLE(qs[0], k, v, start)
    flops = 4 * N * H * T * (T + 1) / 2  # causal: QK and PV over t + 1 keys
    row = {"kind": "prefill", "B": 1, "T": T, "tunings": tunings, "mosaic_tunings": mosaic_tunings}
    ops = _prefill_ops(tunings, mosaic_tunings)
    for name, op in ops.items():
        kv = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if name in ("cudnn", "mosaic_jax") else (k, v)
        queries = qs
        if name == "mosaic_jax":  # float16 has bfloat16's size and tensor-core rate; the kernel applies no scale
            queries, kv = [(q * SCALE).astype(jnp.float16) for q in qs], tuple(a.astype(jnp.float16) for a in kv)
        try:
            run, out = _batched(op, queries, [kv] * len(qs), start)
            row[f"{name}_TFLOPs"] = flops * len(qs) / median_wall(run, overhead) / 1e12
            row[f"{name}_of_matmul"] = row[f"{name}_TFLOPs"] / matmul_tflops
            row[f"{name}_err"] = _rel_err(out, ref)
            # Kernel time too: at 2k a call is ~0.2 ms and the wall time's spread is wide.
            if kernels := kernel_ns(run):
                row[f"{name}_dev_TFLOPs"] = flops * len(qs) / sum(kernels.values()) / 1e3
        except Exception as e:
            row[f"{name}_error"] = _short(e)
    ROWS.append(row)
    _save()
    print(
        f"prefill T={T}: "
        + ", ".join(
            f"{n} {_fmt(row, n + '_TFLOPs', '.0f')} TFLOP/s "
            f"({_fmt(row, n + '_of_matmul', '.0%')} of matmul; dev {_fmt(row, n + '_dev_TFLOPs', '.0f')}) "
            f"err {_fmt(row, n + '_err', '.1e')}"
            for n in ops
        )
    )
    for name in [n for n in row if n.endswith("_error")]:
        print(f"  {name}: {row[name]}")


# (B, T, S, N, K, H, starts): token tails, starts > 0 and differing, a cache just big enough, a row
# whose prompt overflows the cache (its rows past S are don't-care and not compared), GQA 1 to 8.
MOSAIC_CHECKS = [
    (1, 136, 264, 32, 8, 128, (0,)),
    (2, 520, 1024, 32, 8, 128, (0, 300)),
    (2, 256, 256, 16, 2, 128, (0, 100)),
    (1, 2048, 4096, 32, 8, 128, (1000,)),
    (3, 384, 512, 8, 8, 64, (0, 64, 128)),
    (1, 1024, 1024, 64, 8, 128, (0,)),
]


def mosaic_check(mosaic_tunings):
    """The Mosaic GPU prefill kernel against the f32 oracle at edge shapes (GPU only).

    Cache slots past start + T hold random finite values: the kernel's precondition.
    """
    for B, T, S, n_heads, kv_heads, head_dim, starts in MOSAIC_CHECKS:
        keys = jax.random.split(jax.random.key(T + S), 3)
        q = jax.random.normal(keys[0], (B, T, n_heads, head_dim), DTYPE)
        k, v = (jax.random.normal(x, (B, kv_heads, S, head_dim), DTYPE) for x in keys[1:])
        start = jnp.array(starts, jnp.int32)
        ref = attention_reference(q, k, v, start, scale=head_dim**-0.5)
        valid = (start[:, None] + jnp.arange(T)[None, :] < S)[:, :, None, None]  # rows past S: don't-care
        for i, tuning in enumerate(mosaic_tunings):
            row = {"kind": "mosaic_check", "shape": [B, T, S, n_heads, kv_heads, head_dim], "starts": starts,
                   "tuning": tuning}
            try:
                out = jax.block_until_ready(prefill_attention_mgpu(q, k, v, start, scale=head_dim**-0.5, **tuning))
                row["err"] = _rel_err(jnp.where(valid, out, 0), jnp.where(valid, ref, 0))
            except Exception as e:
                row["error"] = _short(e)
            ROWS.append(row)
            _save()
            verdict = "ok" if row.get("err", math.inf) <= 2e-2 else "FAIL"
            print(f"mosaic check {row['shape']} starts {starts} tuning {i}: err {_fmt(row, 'err', '.1e')} "
                  f"{verdict} {row.get('error', '')}", flush=True)


def main(sections):
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; sections {sections}", flush=True)
    overhead = dispatch_overhead()
    limits = ceilings(overhead)
    copy_bw = {k: v for k, v in limits.items() if k.startswith("copy_")}
    if "sweep" in sections:
        sweep(overhead, copy_bw)
    # The table measures what the model gets: DecodeConfig's defaults.
    tuning = json.loads(os.environ.get("DECODE_TUNING", "{}"))
    mosaic_tunings = json.loads(os.environ.get("MOSAIC_TUNINGS", "null")) or MOSAIC_TUNINGS
    if "mosaic_check" in sections and not DRY:
        mosaic_check(mosaic_tunings)
    if "prefill" in sections:
        tunings = json.loads(os.environ.get("PREFILL_TUNINGS", "null"))
        for T in PREFILL_LENGTHS:
            prefill_row(T, overhead, limits["matmul_TFLOPs"], tunings or PREFILL_TUNINGS, mosaic_tunings)
    if "decode" in sections:
        decode_table(overhead, copy_bw, tuning)
    _save()
    print(f"decode tuning {tuning}; {time.perf_counter() - T0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:] or ["sweep", "mosaic_check", "prefill", "decode"])
