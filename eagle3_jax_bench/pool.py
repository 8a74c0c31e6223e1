"""Continuous batching: many prompts through the engine's pool of slots, against fixed chunks of the same
size (each chunk one batch, the next chunk waiting for its slowest row), and against the steady-state decode
throughput of a full batch.

    python -m eagle3_jax_bench.pool --out DIR [--model qwen3-8b | demo] [--prompts 512] [--pools 32 64]
        [--gammas 0 3] [--lengths 128 2048] [--budgets 64 512] [--max-len N] [--kv-tokens N]

* model: a preset's shapes with random bf16 weights (a random drafter: tau about 1), or `demo`, the shipped
  demo pair in float32 with prompts cut from its held-out corpus files (the standard library's sources).
* workload: prompt lengths and max_new_tokens drawn uniformly from --lengths and --budgets (seed 0), no stop
  ids, so every run emits the same tokens.
* engine: --pools slots (max_batch), max_len (--max-len; default the longest prompt and budget and a round's
  drafts) and the engine's default paged KV (or --kv-tokens), in its default page size.
* per run: tokens/s (generated tokens over the wall time, prefill and compilation included after one
  warm-up pass of the same workload), time to first token p50/p99 (from the request's start), inter-token
  latency p50/p99 (the gaps between one prompt's chunks: a call's rounds arrive together), peak memory
  (the device's peak bytes in use where it reports them, else the process's peak RSS; both only grow), the
  most sequences running at once (between a prompt's first chunk and its last) and the sequences the engine
  preempted (its KV full: recomputed later).
* steady state: the engine's call of rounds on a full batch from a random state at the workload's mean
  KV length (eagle3_jax_bench/dense.py), tokens/s = batch x tokens per round (tau, from the pool run) over
  its time per round: what a pool could reach if admissions and partly empty batches cost nothing.
Chunked prefill is not implemented: an admission prefills its prompts whole (up to Engine.prefill_tokens
padded tokens at once), so a long prompt's admission stalls the running rows for its prefill.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import jax
import numpy as np

import eagle3_jax
from eagle3_jax.models import kernels as kernels_lib

from . import dense, presets
from .core import Run, versions
from .profile import count_compilations


def random_workload(count: int, lengths: tuple[int, int], budgets: tuple[int, int], vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(lengths[0], lengths[1] + 1, count)]
    return prompts, rng.integers(budgets[0], budgets[1] + 1, count).tolist()


def demo_workload(count: int, lengths: tuple[int, int], budgets: tuple[int, int], tokenizer, seed: int = 0):
    """Windows of the demo corpus' held-out files at random offsets and lengths."""
    from eagle3_jax.demo import corpus

    rng = np.random.default_rng(seed)
    streams = [tokenizer(f.text)["input_ids"] for f in corpus.read_sources() if f.held_out]
    streams = [s for s in streams if len(s) > lengths[1]]
    prompts = []
    for n in rng.integers(lengths[0], lengths[1] + 1, count):
        s = streams[rng.integers(len(streams))]
        start = int(rng.integers(0, len(s) - n + 1))
        prompts.append(s[start : start + int(n)])
    return prompts, rng.integers(budgets[0], budgets[1] + 1, count).tolist()


def peak_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_streams(engine, groups) -> dict:
    """Streams each (prompts, budgets) group in turn, timing every prompt's chunks from the first start."""
    start, first, last, gaps, tokens = time.perf_counter(), [], {}, [], 0
    offset = 0
    for prompts, budgets in groups:
        for i, new in engine.stream(prompts, budgets):
            now = time.perf_counter() - start
            key = offset + i
            if key in last:
                gaps.append(now - last[key])
            else:
                first.append(now)
            last[key] = now
            tokens += len(new)
        offset += len(prompts)
    wall = time.perf_counter() - start
    ms = 1e3
    spans = sorted([(t, 1) for t in first] + [(t, -1) for t in last.values()])  # a prompt runs from first to last
    running = max(np.cumsum([d for _, d in spans]), default=0)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "max_running": int(running),
            "ttft_p50_ms": float(np.percentile(first, 50)) * ms, "ttft_p99_ms": float(np.percentile(first, 99)) * ms,
            "itl_p50_ms": float(np.percentile(gaps, 50)) * ms if gaps else None,
            "itl_p99_ms": float(np.percentile(gaps, 99)) * ms if gaps else None,
            "peak_gib": peak_bytes() / 2**30}


def tau_of(engine, prompts, budgets) -> float:
    results = engine.generate(prompts, budgets, progress=False)
    accepts = [a for r in results for a in r.accept_lengths]
    return float(np.mean(accepts) + 1) if accepts else 1.0


RUNS = ("pool", "fixed_chunks", "steady")


def measure(run: Run, target, drafter, prompts, budgets, pool: int, gamma: int, max_len: int, setup,
            runs=RUNS, kv_tokens: int | None = None) -> None:
    engine = eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens=max(gamma, 1), max_len=max_len,
                               max_batch=pool, kv_tokens=kv_tokens)
    run.add("engine", {"pool": pool, "gamma": gamma, "max_len": max_len, "kv_tokens": engine.kv_tokens,
                       "page_size": engine.page_size})
    chunks = [(prompts[i : i + pool], budgets[i : i + pool]) for i in range(0, len(prompts), pool)]
    if {"pool", "fixed_chunks"} & set(runs):
        start = time.perf_counter()
        shapes = engine.compile(max(len(p) for p in prompts), shortest_prompt=min(len(p) for p in prompts))
        run.add("warm_up", {"pool": pool, "gamma": gamma, "admission_shapes": shapes,
                            "seconds": time.perf_counter() - start})
    for name, groups in (("pool", [(prompts, budgets)]), ("fixed_chunks", chunks)):
        if name not in runs or not run.time_left(f"{name} pool={pool} gamma={gamma}"):
            continue
        preempted = engine.preemptions
        with count_compilations() as compiles:
            row = timed_streams(engine, groups)
        run.add("pool", {"run": name, "pool": pool, "gamma": gamma, "prompts": len(prompts), **row,
                         "compilations": compiles.count, "preemptions": engine.preemptions - preempted})
    if setup is None or "steady" not in runs or not run.time_left(f"steady pool={pool} gamma={gamma}"):
        return
    tau = tau_of(engine, prompts[:pool], budgets[:pool]) if gamma else 1.0
    length = int(np.mean([len(p) for p in prompts]) + np.mean(budgets) / 2)
    kernels = kernels_lib.default()
    timed = dense.engine_call(setup, pool, length, max_len, kernels, engine.rounds_per_call, gamma)
    run.add("steady", {"pool": pool, "gamma": gamma, "kv_len": length, "tau": tau,
                       "round_ms": timed.seconds * 1e3, "tokens_per_s": pool * tau / timed.seconds})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-8b", help="a preset (random weights) or 'demo' (the demo pair)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--pools", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--gammas", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--lengths", type=int, nargs=2, default=[128, 2048])
    parser.add_argument("--budgets", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--max-len", type=int, help="the engine's max_len (default: the workload's longest sequence)")
    parser.add_argument("--kv-tokens", type=int, help="the engine's KV in tokens (default: the engine's default)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="no new measurement starts after this")
    args = parser.parse_args(argv)
    if args.prompts < 1 or min(args.pools) < 1 or min(args.gammas) < 0 or min(args.lengths + args.budgets) < 1:
        parser.error("--prompts, --pools, --lengths and --budgets must be positive and --gammas >= 0")
    run = Run(args.budget_s, args.out, "pool_bench.json")
    run.record("versions", versions())
    if args.model == "demo":
        from eagle3_jax.checkpoints.tokenizer import load_tokenizer
        from eagle3_jax.demo import PAIR

        jax.config.update("jax_default_matmul_precision", "highest")
        target = eagle3_jax.load_target(PAIR / "target", dtype="float32", progress=False)
        drafter = eagle3_jax.load_drafter(PAIR / "drafter", target, dtype="float32")
        prompts, budgets = demo_workload(args.prompts, tuple(args.lengths), tuple(args.budgets),
                                         load_tokenizer(PAIR / "target"))
        setup = None
    else:
        plan = dense.Plan(*presets.pair(args.model), batches=(), kv_lengths=(), spec_batches=(), spec_kv_length=0,
                          gammas=(), reps=5, inner=5, copy_bytes=0, matmul_n=0)
        setup = dense.setup(run, plan, (kernels_lib.default(),), jax.numpy.bfloat16)
        target, drafter = setup.target, setup.drafter
        prompts, budgets = random_workload(args.prompts, tuple(args.lengths), tuple(args.budgets),
                                           target.config.vocab_size)
    max_len = args.max_len or args.lengths[1] + args.budgets[1] + max(args.gammas) + 2
    run.record("workload", {"model": args.model, "prompts": len(prompts), "lengths": args.lengths,
                            "budgets": args.budgets, "max_len": max_len, "tokens_to_generate": int(sum(budgets))})
    for gamma in args.gammas:
        for pool in args.pools:
            measure(run, target, drafter, prompts, budgets, pool, gamma, max_len, setup, args.runs, args.kv_tokens)
    print(json.dumps(run.results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
