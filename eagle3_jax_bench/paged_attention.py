"""`python -m eagle3_jax_bench.paged_attention --out DIR`: ragged paged attention on the GPU against the copy rate.

At Qwen3-8B heads (32 query, 8 KV, head_dim 128; --heads for others), bf16, random data, every sequence of a batch with
the same number of keys L (its new tokens included):
  decode   one query per sequence, batch x keys x page size (the plan's grid)
  verify   gamma + 1 = 4 queries per sequence, a smaller grid
  chunk    a prefill chunk of 512 queries after a prefix (batch 1): TFLOP/s
Each row times two ops on the same K/V:
  paged       pallas_kernels.ragged_paged_attention (Mosaic GPU) over pages of the row's size, the
              pages of each sequence in shuffled order over the pool
  xla         eagle3_jax.models.paged_attention.paged_attention_xla (the path for other GPUs), at the
              smallest page size only
Two times per op: wall (one jit of `calls` back-to-back calls, each on its own page tables so no call
is served from L2; median, less an empty jit's dispatch, over calls) and, with --kernel-times, dev
(the GPU kernel time per call from a profiler trace, merge included).
Bandwidth counts the K/V bytes a call must read, 2 * B * K * L * H * 2; of_copy divides it by the
copy rate measured in the same run (core.copy_bandwidth). err: each op's output against the dense
float32-accumulating reference (pallas_kernels.attention_reference over the same keys; max abs
difference over max abs value). The goal (issue 36): of_copy >= 0.85 from 8k keys.
--tunings adds rows for other RaggedPagedConfig fields (default TUNINGS) at the decode shapes of
--tuning-shapes ([batch, keys, page_size]).
--dry-run: tiny shapes on the CPU (the kernels in their interpreters, float32), the same code.
Rows go to DIR/bench_paged_attention.json after each measurement; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models.paged_attention import paged_attention_xla
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import attention_reference

from .core import Run, versions
from .profile import gpu_kernel_times

SECTIONS = ("decode", "verify", "chunk", "tuning")
TUNINGS = (  # against the defaults (block_kv 128, 2 stages, one CTA per SM)
    {"block_kv": 64, "num_stages": 4},  # the same ring in finer steps
    {"block_kv": 64, "num_stages": 2, "wave": 264},  # half the shared memory: two CTAs per SM, twice the splits
    {"num_splits": 1},  # no merge: what the split and its XLA merge cost or gain
)


@dataclasses.dataclass(frozen=True)
class Plan:
    heads: tuple[int, int, int]  # N, K, H
    dtype: str
    decode: tuple[tuple[int, int], ...]  # (batch, keys)
    decode_pages: tuple[int, ...]
    verify: tuple[tuple[int, int], ...]
    verify_pages: tuple[int, ...]
    verify_tokens: int
    chunk: tuple[tuple[int, int], ...]  # (keys, chunk tokens), batch 1
    chunk_pages: tuple[int, ...]
    copy_bytes: int
    pool_bytes: int  # K/V bytes of all calls of one timed jit, at most
    jit_seconds: float  # work aimed at per timed jit (sets the calls)


def qwen3_8b_plan() -> Plan:
    batches, keys = (1, 8, 32, 64), (1024, 8192, 32768)
    return Plan(
        heads=(32, 8, 128), dtype="bfloat16",
        decode=tuple((b, n) for n in keys for b in batches), decode_pages=(16, 64, 128),
        verify=tuple((b, n) for n in (1024, 32768) for b in (1, 8, 32)), verify_pages=(16, 64), verify_tokens=4,
        chunk=((4096, 512), (16384, 512)), chunk_pages=(64,),
        copy_bytes=4 << 30, pool_bytes=8 << 30, jit_seconds=2e-3,
    )


def tiny_plan() -> Plan:
    return Plan(heads=(8, 2, 64), dtype="float32", decode=((3, 40),), decode_pages=(8,),
                verify=((2, 40),), verify_pages=(16,), verify_tokens=4, chunk=((40, 24),), chunk_pages=(8,),
                copy_bytes=1 << 20, pool_bytes=1 << 20,
                jit_seconds=0.0)


def _dry() -> bool:
    return jax.default_backend() != "gpu"


@dataclasses.dataclass
class Shape:
    """One (batch, keys, tokens) with its K/V for `calls` calls: caches [calls][B, K, L, H] and,
    per page size, a pool [K, calls * B * L / page, page, H] with each call's shuffled page tables."""

    batch: int
    keys: int
    tokens: int
    calls: int
    qs: list
    caches: list  # [(k, v)] per call
    start: jax.Array  # [B] keys before the new tokens


def make_shape(plan: Plan, batch: int, keys: int, tokens: int, seed: int) -> Shape:
    N, K, H = plan.heads
    dtype = jnp.dtype(plan.dtype)
    per_call = 2 * batch * K * keys * H * dtype.itemsize
    est = per_call / 3e12 + 5e-6
    calls = max(1, min(16, int(plan.jit_seconds / est) if plan.jit_seconds else 1, plan.pool_bytes // per_call))
    key = jax.random.key(seed)
    caches = []
    for c in range(calls):
        kk, kv = jax.random.split(jax.random.fold_in(key, c))
        caches.append(tuple(jax.random.normal(x, (batch, K, keys, H), jnp.float32).astype(dtype) for x in (kk, kv)))
    qs = [jax.random.normal(jax.random.fold_in(key, 1000 + c), (batch, tokens, N, H), jnp.float32).astype(dtype)
          for c in range(calls)]
    return Shape(batch, keys, tokens, calls, qs, caches, jnp.full((batch,), keys - tokens, jnp.int32))


def page_pool(shape: Shape, page_size: int, seed: int):
    """(k_pages, v_pages [K, P, page, H], tables [calls][B, ceil(L / page)]): the caches' keys cut into pages
    placed in shuffled order over one pool, so consecutive keys sit in scattered pages."""
    pages_per_seq = -(-shape.keys // page_size)
    count = shape.calls * shape.batch * pages_per_seq
    order = np.random.default_rng(seed).permutation(count).astype(np.int32)
    tables = order.reshape(shape.calls, shape.batch, pages_per_seq)
    inverse = np.argsort(order)  # pool page -> (call, row, page) in order
    pools = []
    for which in (0, 1):
        stacked = jnp.stack([c[which] for c in shape.caches])  # [calls, B, K, L, H]
        calls, B, K, L, H = stacked.shape
        stacked = jnp.pad(stacked, ((0, 0),) * 3 + ((0, pages_per_seq * page_size - L), (0, 0)))  # a last page's tail
        paged = stacked.reshape(calls, B, K, pages_per_seq, page_size, H).transpose(2, 0, 1, 3, 4, 5)
        pools.append(paged.reshape(K, count, page_size, H)[:, jnp.asarray(inverse)])
    return pools[0], pools[1], [jnp.asarray(t) for t in tables]


def _overhead() -> float:
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones((8,), jnp.float32)
    return _median_s(lambda: f(x), 50)


def _median_s(run, reps) -> float:
    jax.block_until_ready(run())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _timed(op, operands, calls: int, overhead: float, reps: int, kernel_times: bool) -> dict:
    """us per call, wall and (kernel_times, on a GPU) kernel time, of one jit of `calls` calls of op;
    and the first call's output."""
    many = jax.jit(lambda operands: [op(*x) for x in operands])
    start = time.perf_counter()
    outs = jax.block_until_ready(many(operands))
    timing = {"compile_s": time.perf_counter() - start}
    timing["us"] = max(_median_s(lambda: many(operands), reps) - overhead, 1e-9) / calls * 1e6
    kernels = gpu_kernel_times(lambda: many(operands)) if kernel_times else {}
    if kernels:
        timing["dev_us"] = sum(us for _, us in kernels.values()) / calls
        timing["kernels"] = sorted(kernels)
    return {"timing": timing, "out": outs[0]}


def _rel_err(out, ref) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    if not bool(jnp.isfinite(out).all()):
        return float("nan")
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def measure_shape(run: Run, plan: Plan, section: str, shape: Shape, pages, tuning: dict, *, overhead: float,
                  reps: int, kernel_times: bool) -> None:
    """The rows of one (batch, keys, tokens): paged (and xla) per page size, against the dense reference."""
    N, K, H = plan.heads
    B, L, T = shape.batch, shape.keys, shape.tokens
    scale = H**-0.5
    kv_bytes = 2 * B * K * L * H * jnp.dtype(plan.dtype).itemsize
    flops = 4 * N * H * B * sum(L - T + t + 1 for t in range(T))  # QK and PV over each query's visible keys
    reference = jax.jit(partial(attention_reference, scale=scale))(shape.qs[0], *shape.caches[0], shape.start)
    kv_lens = jnp.full((B,), L, jnp.int32)
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    flat_qs = [q.reshape(B * T, N, H) for q in shape.qs]
    for i, page_size in enumerate(pages):
        label = f"{section} B={B} L={L} T={T} page={page_size} {tuning or ''}"
        if not run.time_left(label):
            return
        k_pages, v_pages, tables = page_pool(shape, page_size, seed=page_size)
        row = {"batch": B, "keys": L, "tokens": T, "page_size": page_size, "calls": shape.calls, "tuning": tuning}
        ops = {"paged": partial(ragged_paged_attention, scale=scale, max_q_len=T, interpret=_dry(), **tuning)}
        if i == 0 and not tuning:
            ops["xla"] = partial(paged_attention_xla, scale=scale, max_q_len=T)
        for name, op in ops.items():
            try:
                operands = [(q, k_pages, v_pages, table, kv_lens, cu) for q, table in zip(flat_qs, tables)]
                found = _timed(op, operands, shape.calls, overhead, reps, kernel_times)
            except Exception as e:  # a refused tuning or a failed lowering is a row, not the end of the run
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            row[name] = found["timing"]
            row[f"{name}_err"] = _rel_err(found["out"].reshape(B, T, N, H), reference)
        del k_pages, v_pages, tables, operands
        for name in ("paged", "xla"):
            for kind in ("us", "dev_us"):
                if kind in row.get(name, {}):
                    row[name][kind.replace("us", "of_copy")] = kv_bytes / (row[name][kind] * 1e-6) / 1e12 / run.bw
                    row[name][kind.replace("us", "tflops")] = flops / (row[name][kind] * 1e-6) / 1e12
        run.add(section, row)


def table(results: dict) -> str:
    """One line per row: wall us (and kernel us) per op, the paged kernel's share of the copy rate
    (TFLOP/s for chunk rows), and the paged kernel's error."""
    lines = [f"{'section':7} {'B':>3} {'L':>6} {'T':>3} {'page':>4} | {'paged us':>9} {'dev':>7} {'rate':>7} "
             f"| {'xla us':>9} | {'err':>7} | tuning   (rate: of the copy rate; TFLOP/s for chunk rows)"]

    def f(d, k, spec):
        return format(d[k], spec) if k in d else "-"

    for section in SECTIONS:
        rate = ("tflops", "7.0f") if section == "chunk" else ("of_copy", "7.0%")
        for r in results.get(section, []):
            p, x = r.get("paged", {}), r.get("xla", {})
            lines.append(
                f"{section:7} {r['batch']:3d} {r['keys']:6d} {r['tokens']:3d} {r['page_size']:4d} | "
                f"{f(p, 'us', '9.1f')} {f(p, 'dev_us', '7.1f')} {f(p, *rate)} | "
                f"{f(x, 'us', '9.1f')} | {f(r, 'paged_err', '7.1e')} | "
                f"{r['tuning'] or ''}" + "".join(f"\n    {k}: {v}" for k, v in r.items() if k.endswith("_error")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.paged_attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (default off the GPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--tunings", type=json.loads, default=list(TUNINGS),
                        help="JSON list of RaggedPagedConfig fields for the tuning rows")
    parser.add_argument("--tuning-shapes", type=json.loads, default=None,
                        help="JSON list of [batch, keys, page_size] for the tuning rows (default: the plan's)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also GPU kernel time per call from a profiler trace (about 1 s more per op)")
    parser.add_argument("--heads", type=int, nargs=3, metavar=("N", "K", "H"), default=None,
                        help="query heads, KV heads, head_dim (default: Qwen3-8B's; 32 4 128 is Qwen3-30B-A3B's)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="no new row starts after this")
    args = parser.parse_args(argv)
    dry = args.dry_run or _dry()
    plan = tiny_plan() if dry else qwen3_8b_plan()
    if args.heads:
        plan = dataclasses.replace(plan, heads=tuple(args.heads))
    tuning_shapes = args.tuning_shapes or ([[1, 40, 8]] if dry else [[1, 1024, 16], [1, 8192, 16], [8, 32768, 16],
                                                                      [64, 8192, 64]])
    run = Run(args.budget_s, args.out, "bench_paged_attention.json")
    run.results.update(versions=versions(), plan=dataclasses.asdict(plan))
    run.ceilings(plan.copy_bytes, matmul_n=None)
    overhead = _overhead()
    timing = dict(overhead=overhead, reps=1 if dry else 10, kernel_times=args.kernel_times)
    run.results["overhead_us"] = overhead * 1e6
    if "decode" in args.sections:
        for B, L in plan.decode:
            if run.time_left(f"decode B={B} L={L}"):
                measure_shape(run, plan, "decode", make_shape(plan, B, L, 1, seed=B * L), plan.decode_pages, {},
                              **timing)
    if "verify" in args.sections:
        for B, L in plan.verify:
            if run.time_left(f"verify B={B} L={L}"):
                measure_shape(run, plan, "verify", make_shape(plan, B, L, plan.verify_tokens, seed=B * L + 1),
                              plan.verify_pages, {}, **timing)
    if "chunk" in args.sections:
        for L, C in plan.chunk:
            if run.time_left(f"chunk L={L} C={C}"):
                measure_shape(run, plan, "chunk", make_shape(plan, 1, L, C, seed=L + C), plan.chunk_pages, {}, **timing)
    if "tuning" in args.sections:
        for B, L, page_size in tuning_shapes:
            for tuning in args.tunings:
                if run.time_left(f"tuning B={B} L={L} {tuning}"):
                    measure_shape(run, plan, "tuning", make_shape(plan, B, L, 1, seed=B * L), (page_size,), tuning,
                                  **timing)
    print(table(run.results))
    run.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
