"""Continuous batching with mixed steps: many prompts through the engine's pool of slots, against the workload's
physical floor, the steady-state decode throughput of a full batch, and (optionally) fixed chunks of the same size
(each chunk one batch, the next waiting for its slowest row); a prefill_chunk sweep; and a shared-prefix workload
with prefix caching on and off.

    python -m eagle3_jax_bench.pool --out DIR [--model qwen3-8b | demo] [--prompts 512] [--pools 32 64]
        [--gammas 0 3 auto] [--lengths 128 2048] [--budgets 64 512] [--max-len N] [--kv-tokens N]
        [--prefill-chunk N] [--planted-tau 3] [--sweep 256 1024 4096 --sweep-prompts 128]
        [--shared-prefix 2000 --prefix-prompts 512 --prefix-lengths 64 512]

* model: a preset's shapes with random bf16 weights (a random drafter: tau about 1), or with --planted-tau the
  planted-acceptance world at those shapes (eagle3_jax_bench/planted_world.py: drafts accepted with the
  probability that gives tau at gamma 3, prompts walks along the target's cycle), or `demo`, the shipped demo
  pair in float32 with prompts cut from its held-out corpus files.
* workload: prompt lengths and max_new_tokens drawn uniformly from --lengths and --budgets (seed 0), no stop
  ids, so every run emits the same tokens.
* engine: --pools slots (max_batch), max_len (--max-len; default the longest prompt and budget and a round's
  drafts), the engine's default paged KV (or --kv-tokens) and page size, its prefill_chunk (or --prefill-chunk);
  gamma "auto" drafts up to 3. Engine.compile runs before the timed runs (its seconds and calls recorded).
* floor (preset models): the workload's FLOPs (every token through every matmul, the lm_head for generated tokens,
  causal attention) at the matmul rate measured in the same run, and its bytes (every weight once per decode
  step, at least max_new_tokens steps and the generated tokens over the pool; each generated token's context
  KV) at the measured copy rate; a pool's floor is the larger. Each pool row reports its wall time over it
  (x_floor) and over the compute floor alone (x_compute_floor): the workload's floor, the lowest any pool size
  can reach (a small pool's extra weight reads are its own cost, not the workload's).
* per run: tokens/s (generated tokens over the wall time, prefill included), time to first token p50/p99 (from
  the request's start), inter-token latency p50/p99 (the gaps between one prompt's chunks: a call's rounds
  arrive together), peak memory (the device's peak bytes in use where it reports them, else the process's peak
  RSS; both only grow), the most sequences running at once (between a prompt's first chunk and its last), the
  sequences the engine preempted (its KV full: recomputed later), compilations inside the run, and the prompt
  tokens served from the prefix cache.
* steady state: the engine's own call of rounds on a full batch of rows at the workload's mean KV length, on its
  own pages (Engine.time_call: no second KV beside the engine's), tokens/s = batch x tokens per round (tau, from
  the first pool's prompts) over its time per round: what a pool could reach if prefill and partly empty batches
  cost nothing; ITL p99 is compared with a call of it (a call's rounds arrive together). Also the same call with a
  chunk of prefill_chunk prompt tokens in every round (mixed_call_ms; its chunks hold no sequence, and the
  forward's width is the same whatever they hold).
* sweep: the first pool size and gamma at each --sweep prefill_chunk over the first --sweep-prompts prompts (and
  the engine's default over the same prompts, for the ratio).
* shared prefix: --prefix-prompts prompts, each the same --shared-prefix tokens and then its own 64-512 tokens,
  through the first pool size and gamma, with prefix caching on and off: hit rate (cached over prompt tokens) and
  TTFT.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import resource
import time
from pathlib import Path

import jax
import numpy as np

import eagle3_jax
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.models import kernels as kernels_lib

from . import dense, planted_world, presets
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


def planted_workload(world, count: int, lengths: tuple[int, int], budgets: tuple[int, int], vocab: int,
                     seed: int = 0):
    """random_workload's prompt lengths and budgets, each prompt a walk along the planted target's cycle from a
    random position: greedy decoding goes on along it, every draft accepted with the world's probability."""
    prompts, new = random_workload(count, lengths, budgets, vocab, seed)
    rng = np.random.default_rng(seed + 1)
    walk = world.universe[world.order]
    return [walk[(int(rng.integers(world.size)) + np.arange(len(p))) % world.size].tolist() for p in prompts], new


def shared_prefix_workload(prefix: int, count: int, lengths: tuple[int, int], budgets: tuple[int, int], vocab: int,
                           seed: int = 1):
    """`count` prompts of the same `prefix` random tokens, each followed by its own random tokens."""
    head = np.random.default_rng(seed).integers(0, vocab, size=prefix).tolist()
    tails, new = random_workload(count, lengths, budgets, vocab, seed + 1)
    return [head + t for t in tails], new


def workload_floor(cfg, prompts, budgets, pool: int, itemsize: int, matmul_tflops: float, copy_tbps: float) -> dict:
    """The workload's FLOPs and bytes on a dense target and their seconds at the measured rates (module
    docstring); floor_s is the larger."""
    D, L, H, N, K, I = (cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                        cfg.intermediate_size)
    body = L * (D * (N + 2 * K) * H + N * H * D + 3 * D * I)  # a token's matmul weights below the lm_head
    head = cfg.vocab_size * D
    lengths, new = np.array([len(p) for p in prompts], np.float64), np.array(budgets, np.float64)
    prompt_keys = float(np.sum(lengths * (lengths + 1) / 2))  # keys each prompt token attends, summed
    output_keys = float(np.sum(new * lengths + new * (new + 1) / 2))
    flops = 2 * body * (lengths.sum() + new.sum()) + 2 * head * new.sum() + 4 * L * N * H * (prompt_keys + output_keys)
    steps = max(float(new.max()), float(np.ceil(new.sum() / pool)))
    nbytes = steps * (body + head) * itemsize + 2 * L * K * H * itemsize * output_keys
    compute_s, bytes_s = flops / (matmul_tflops * 1e12), nbytes / (copy_tbps * 1e12)
    floor_s = max(compute_s, bytes_s)
    return {"pool": pool, "prompt_tokens": int(lengths.sum()), "generated_tokens": int(new.sum()),
            "pflop": flops / 1e15, "terabytes": nbytes / 1e12, "compute_s": compute_s, "bytes_s": bytes_s,
            "floor_s": floor_s, "floor_tokens_per_s": new.sum() / floor_s}


def timed_streams(engine, groups) -> tuple[dict, list[list[int]]]:
    """Streams each (prompts, budgets) group in turn, timing every prompt's chunks from the first start; also
    returns each prompt's tokens."""
    start, first, last, gaps, tokens = time.perf_counter(), [], {}, [], 0
    offset, outputs = 0, [[] for group, _ in groups for _ in group]
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
            outputs[key] += new
        offset += len(prompts)
    wall = time.perf_counter() - start
    ms = 1e3
    spans = sorted([(t, 1) for t in first] + [(t, -1) for t in last.values()])  # a prompt runs from first to last
    running = max(np.cumsum([d for _, d in spans]), default=0)
    row = {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "max_running": int(running),
           "ttft_p50_ms": float(np.percentile(first, 50)) * ms, "ttft_p99_ms": float(np.percentile(first, 99)) * ms,
           "itl_p50_ms": float(np.percentile(gaps, 50)) * ms if gaps else None,
           "itl_p99_ms": float(np.percentile(gaps, 99)) * ms if gaps else None,
           "peak_gib": peak_bytes() / 2**30}
    return row, outputs


def tau_of(engine, prompts, budgets) -> float:
    results = engine.generate(prompts, budgets, progress=False)
    accepts = [a for r in results for a in r.accept_lengths]
    return float(np.mean(accepts) + 1) if accepts else 1.0


RUNS = ("pool", "fixed_chunks", "steady")


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every measurement shares: the pair, the workload and the engine's settings."""

    target: object
    drafter: object
    prompts: list
    budgets: list
    max_len: int
    kv_tokens: int | None
    prefill_chunk: int
    floor: object  # pool -> workload_floor's dict (preset models), or None
    world: object = None  # the planted world the prompts walk (planted_world.World), or None


def make_engine(b: Bench, pool: int, gamma, prefill_chunk: int | None = None, prefix_caching: bool = True):
    """A fresh engine; the caller has dropped its last one first (an engine's KV is most of the device, so two
    cannot live at once)."""
    auto = gamma == "auto"
    return eagle3_jax.Engine(b.target, b.drafter if gamma else None, num_draft_tokens="auto" if auto else max(gamma, 1),
                             max_draft_tokens=3 if auto else None, max_len=b.max_len, max_batch=pool,
                             kv_tokens=b.kv_tokens, prefill_chunk=prefill_chunk or b.prefill_chunk,
                             prefix_caching=prefix_caching)


def warm_up(run: Run, engine, label: dict) -> None:
    start = time.perf_counter()
    calls = engine.compile()
    run.add("warm_up", {**label, "calls": calls, "seconds": time.perf_counter() - start})


def timed_run(run: Run, engine, name: str, groups, label: dict, floor: dict | None = None, world=None) -> dict:
    """One timed pass; on a planted world (`world`) every prompt's tokens are checked against the target's greedy
    continuation (planted_match: the share that equal it)."""
    preempted, cached = engine.preemptions, engine.cached_tokens
    with count_compilations() as compiles:
        row, outputs = timed_streams(engine, groups)
    prompts = [p for group, _ in groups for p in group]
    if world is not None:
        budgets = [n for _, group in groups for n in group]
        row["planted_match"] = float(np.mean([out == world.continuation(p, n)
                                              for p, n, out in zip(prompts, budgets, outputs)]))
    row.update(run=name, **label, prompts=len(prompts), compilations=compiles.count,
               preemptions=engine.preemptions - preempted, prefill_chunk=engine.prefill_chunk,
               cached_tokens=engine.cached_tokens - cached, prompt_tokens=sum(len(p) for p in prompts))
    if floor is not None:  # the pool's floor (max of compute and bytes at its size), and the workload's: compute
        row.update(floor_s=floor["floor_s"], x_floor=row["seconds"] / floor["floor_s"],
                   compute_floor_s=floor["compute_s"], x_compute_floor=row["seconds"] / floor["compute_s"])
    return run.add("pool", row)


def measure(run: Run, b: Bench, pool: int, gamma, runs=RUNS) -> None:
    engine = make_engine(b, pool, gamma)
    label = {"pool": pool, "gamma": gamma}
    run.add("engine", {**label, "max_len": b.max_len, "kv_tokens": engine.kv_tokens, "page_size": engine.page_size,
                       "prefill_chunk": engine.prefill_chunk, "prefill_sequences": engine.prefill_sequences,
                       "max_sequences_of_mean_length": engine.kv_tokens // int(
                           np.mean([len(p) for p in b.prompts]) + np.mean(b.budgets))})
    if {"pool", "fixed_chunks"} & set(runs):
        warm_up(run, engine, label)
    chunks = [(b.prompts[i : i + pool], b.budgets[i : i + pool]) for i in range(0, len(b.prompts), pool)]
    for name, groups in (("pool", [(b.prompts, b.budgets)]), ("fixed_chunks", chunks)):
        if name in runs and run.time_left(f"{name} pool={pool} gamma={gamma}"):
            timed_run(run, engine, name, groups, label, b.floor(pool) if b.floor else None, b.world)
    if "steady" not in runs or gamma == "auto" or not run.time_left(f"steady {label}"):
        return
    tau = tau_of(engine, b.prompts[:pool], b.budgets[:pool]) if gamma else 1.0
    length = int(np.mean([len(p) for p in b.prompts]) + np.mean(b.budgets) / 2)
    call_s = min(engine.time_call(pool, length, gamma) for _ in range(3))
    mixed_s = min(engine.time_call(pool, length, gamma, mixed=True) for _ in range(3))
    run.add("steady", {**label, "kv_len": length, "tau": tau, "call_ms": call_s * 1e3,
                       "round_ms": call_s / engine.rounds_per_call * 1e3,
                       "tokens_per_s": pool * tau * engine.rounds_per_call / call_s,
                       "mixed_call_ms": mixed_s * 1e3, "mixed_over_call": mixed_s / call_s})


def sweep(run: Run, b: Bench, pool: int, gamma, chunks: list[int], count: int) -> None:
    """The pool over the first `count` prompts at each prefill_chunk (the default's run first, for the ratio)."""
    groups = [(b.prompts[:count], b.budgets[:count])]
    for chunk in [b.prefill_chunk] + [c for c in chunks if c != b.prefill_chunk]:
        label = {"pool": pool, "gamma": gamma, "sweep": chunk}
        if not run.time_left(f"sweep {label}"):
            return
        engine = make_engine(b, pool, gamma, prefill_chunk=chunk)
        warm_up(run, engine, label)
        timed_run(run, engine, "sweep", groups, label)
        del engine


def shared_prefix(run: Run, b: Bench, pool: int, gamma, prompts, budgets) -> None:
    """The shared-prefix workload with prefix caching on, then off (the same compiled calls)."""
    for caching in (True, False):
        label = {"pool": pool, "gamma": gamma, "prefix_caching": caching}
        if not run.time_left(f"shared prefix {label}"):
            return
        engine = make_engine(b, pool, gamma, prefix_caching=caching)
        warm_up(run, engine, label)
        row = timed_run(run, engine, "shared_prefix", [(prompts, budgets)], label)
        del engine
        run.add("shared_prefix", {**label, "prompt_tokens": row["prompt_tokens"], "cached_tokens": row["cached_tokens"],
                                  "hit_rate": row["cached_tokens"] / row["prompt_tokens"],
                                  "ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"],
                                  "tokens_per_s": row["tokens_per_s"]})


def gamma_arg(value: str):
    if value == "auto":
        return value
    gamma = int(value)
    if gamma < 0:
        raise argparse.ArgumentTypeError(f"a gamma is 'auto' or an int >= 0, got {value!r}")
    return gamma


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-8b", help="a preset (random weights) or 'demo' (the demo pair)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--pools", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--gammas", type=gamma_arg, nargs="+", default=[0, 3])
    parser.add_argument("--lengths", type=int, nargs=2, default=[128, 2048])
    parser.add_argument("--budgets", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["pool", "steady"])
    parser.add_argument("--max-len", type=int, help="the engine's max_len (default: the workload's longest sequence)")
    parser.add_argument("--kv-tokens", type=int, help="the engine's KV in tokens (default: the engine's default)")
    parser.add_argument("--prefill-chunk", type=int, default=engine_lib.PREFILL_CHUNK)
    parser.add_argument("--planted-tau", type=float, help="the planted-acceptance world at this tau (gamma 3)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[], help="prefill_chunk values to sweep")
    parser.add_argument("--sweep-prompts", type=int, default=128)
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of the shared-prefix workload's prefix")
    parser.add_argument("--prefix-prompts", type=int, default=512)
    parser.add_argument("--prefix-lengths", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--budget-s", type=float, default=1e9, help="no new measurement starts after this")
    args = parser.parse_args(argv)
    if args.prompts < 1 or min(args.pools) < 1 or min(args.lengths + args.budgets) < 1 or args.prefill_chunk < 1:
        parser.error("--prompts, --pools, --lengths, --budgets and --prefill-chunk must be positive")
    if args.planted_tau is not None and args.model == "demo":
        parser.error("--planted-tau builds a world at a preset's shapes, not the demo pair")
    run = Run(args.budget_s, args.out, "pool_bench.json")
    run.record("versions", versions())
    numeric = [g for g in args.gammas if g != "auto"] or [0]
    max_len = args.max_len or args.lengths[1] + args.budgets[1] + max(numeric + [3]) + 2
    if args.shared_prefix:
        max_len = max(max_len, args.shared_prefix + args.prefix_lengths[1] + args.budgets[1] + 5)
    floor = None
    if args.model == "demo":
        from eagle3_jax.checkpoints.tokenizer import load_tokenizer
        from eagle3_jax.demo import PAIR

        jax.config.update("jax_default_matmul_precision", "highest")
        target = eagle3_jax.load_target(PAIR / "target", dtype="float32", progress=False)
        drafter = eagle3_jax.load_drafter(PAIR / "drafter", target, dtype="float32")
        prompts, budgets = demo_workload(args.prompts, tuple(args.lengths), tuple(args.budgets),
                                         load_tokenizer(PAIR / "target"))
    else:
        cfg, dcfg = presets.pair(args.model)
        dtype = jax.numpy.bfloat16
        ceilings = run.ceilings(4 << 30 if jax.default_backend() == "gpu" else 1 << 20,
                                8192 if jax.default_backend() == "gpu" else 128)
        if args.planted_tau is not None:
            world = planted_world.make_world(cfg, dcfg)
            a = planted_world.solve_acceptance(args.planted_tau, 3)
            target = planted_world.planted_target(cfg, world, dtype)
            drafter = planted_world.planted_drafter(dcfg, world, a, dtype)
            run.record("world", {"universe": world.size, "acceptance": a, "tau_at_gamma_3": args.planted_tau})
            prompts, budgets = planted_workload(world, args.prompts, tuple(args.lengths), tuple(args.budgets),
                                                cfg.vocab_size)
        else:
            target = drafter = None
        plan = dense.Plan(cfg, dcfg, batches=(), kv_lengths=(), spec_batches=(), spec_kv_length=0, gammas=(), reps=5,
                          inner=5, copy_bytes=0, matmul_n=0)
        setup = dense.setup(run, plan, (kernels_lib.default(),), dtype, target=target, drafter=drafter)  # on device
        target, drafter = setup.target, setup.drafter
        if args.planted_tau is None:
            prompts, budgets = random_workload(args.prompts, tuple(args.lengths), tuple(args.budgets),
                                               cfg.vocab_size)
        itemsize = jax.numpy.dtype(dtype).itemsize
        floor = functools.partial(workload_floor, cfg, prompts, budgets, itemsize=itemsize,
                                  matmul_tflops=ceilings["matmul_tflops"], copy_tbps=ceilings["copy_tbps"])
        for pool in args.pools:
            run.add("floor", floor(pool))
    bench = Bench(target, drafter, prompts, budgets, max_len, args.kv_tokens, args.prefill_chunk, floor,
                  world if args.planted_tau is not None else None)
    run.record("workload", {"model": args.model, "prompts": len(prompts), "lengths": args.lengths,
                            "budgets": args.budgets, "max_len": max_len, "tokens_to_generate": int(sum(budgets))})
    for gamma in args.gammas:
        for pool in args.pools:
            measure(run, bench, pool, gamma, args.runs)
    if args.sweep:
        sweep(run, bench, args.pools[0], args.gammas[0], args.sweep, args.sweep_prompts)
    if args.shared_prefix:
        vocab = target.config.vocab_size
        prompts, budgets = shared_prefix_workload(args.shared_prefix, args.prefix_prompts, tuple(args.prefix_lengths),
                                                  tuple(args.budgets), vocab)
        shared_prefix(run, bench, args.pools[0], args.gammas[0], prompts, budgets)
    print(json.dumps(run.results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
