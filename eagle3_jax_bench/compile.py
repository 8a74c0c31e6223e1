"""What a cold start compiles: `Engine.compile()`'s programs and seconds at a preset's shapes (random weights), per
gamma setting and per number of compiler threads.

    python -m eagle3_jax_bench.compile --out DIR [--model qwen3-8b] [--max-batch 256] [--gammas 0 auto]
        [--threads 1 16] [--max-len 4096]

* per (gamma, threads): a fresh Engine (its own max_len, one position more than the run before it, so that no
  program is in jit's cache yet and the persistent compilation cache is off: every program compiles), then
  Engine.compile(threads=...): the programs (the calls of rounds of every row bucket, with and without prompt
  tokens, every gamma "auto" may choose; the buckets' gathers and scatters), the seconds, and the seconds a
  program. Under "auto", compile's round-cost measurement is left out (the costs are injected): this bench counts
  compilation alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

import eagle3_jax
from eagle3_jax.decoding import live_plan
from eagle3_jax.models import kernels as kernels_lib

from . import dense, presets
from .core import Run, versions
from .pool import gamma_arg


def measure(run: Run, target, drafter, max_batch: int, max_len: int, gamma, threads: int) -> dict:
    auto = gamma == "auto"
    engine = eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens="auto" if auto else max(gamma, 1),
                               max_len=max_len, max_batch=max_batch, kv_tokens=max_batch * 16 + max_len,
                               round_costs=(lambda batch, length: [1.0, 1.1, 1.2, 1.3]) if auto else None)
    start = time.perf_counter()
    programs = engine.compile(threads=threads)
    seconds = time.perf_counter() - start
    row = {"gamma": gamma, "threads": threads, "max_batch": max_batch, "buckets": live_plan.row_buckets(max_batch),
           "programs": programs, "seconds": seconds, "seconds_per_program": seconds / programs}
    return run.add("compile", row, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(presets.PRESETS))
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--gammas", type=gamma_arg, nargs="+", default=[0, "auto"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-len", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.max_batch < 1 or min(args.threads) < 1:
        parser.error("--max-batch and --threads must be positive")
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiles
    run = Run(1e9, args.out, "compile_bench.json")
    run.record("versions", versions())
    cfg, dcfg = presets.pair(args.model)
    plan = dense.Plan(cfg, dcfg, batches=(), kv_lengths=(), spec_batches=(), spec_kv_length=0, gammas=(), reps=1,
                      inner=1, copy_bytes=0, matmul_n=0)
    setup = dense.setup(run, plan, (kernels_lib.default(),), jax.numpy.bfloat16)
    max_len = args.max_len
    for gamma in args.gammas:
        for threads in args.threads:
            measure(run, setup.target, setup.drafter, args.max_batch, max_len, gamma, threads)
            max_len += 1
    print(json.dumps(run.results.get("compile", []), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
