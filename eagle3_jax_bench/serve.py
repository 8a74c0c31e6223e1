"""The OpenAI-compatible server (eagle3_jax/serving) under load, through HTTP, spec on ("auto") against spec off,
on a planted-acceptance world (planted_world.py) at a preset's shapes.

    python -m eagle3_jax_bench.serve --out DIR [--model qwen3-8b] [--users 1 4 16 64] [--requests 8 32 128 512]
        [--lengths 128 2048] [--budgets 64 512] [--tau 3] [--max-gamma 3] [--think-s 0.05] [--budget-s 1e9]
        [--logprobs K]
    python -m eagle3_jax_bench.serve --out DIR --dry-run     (the tiny preset on the CPU, a few requests)

The table's columns: output tokens/s, TTFT and inter-chunk latency p50/p99 (ms), the mean request's decode
tokens/s, and at 1 user that against Engine.generate's.

* world: the preset's shapes, random bf16 weights with a planted drafter whose drafts are accepted with the
  probability that gives tau (--tau) at the largest gamma; greedy decoding, so every output is known
  (`outputs_follow_f`). A word-level stand-in tokenizer (token i is the word "t<i>") detokenizes.
* server: the app of `eagle3-jax serve` with uvicorn on 127.0.0.1 in this process (its own thread, the live
  pool's scheduler on another); the load generator (load.py) runs in a process of its own.
* per mode (spec "auto" with max_draft_tokens --max-gamma; spec off) and per level of --users: that many closed-
  loop users with exponential think times (Poisson arrivals), --requests requests of the level, prompt lengths
  and max_tokens uniform in --lengths and --budgets as the pool bench draws them (seed 0). Each level first runs,
  untimed and with max_tokens cut to 4, WARM_UP_PER_USER x users requests of another seed (it compiles the
  level's pool sizes, their calls with and without a prompt chunk and a chunk's call of its own; the compilations
  left are counted; other prompts, so the timed pass finds none of them in the prefix cache), then all of them
  timed: output tokens/s (all completion tokens over the wall time), TTFT p50/p99,
  inter-chunk latency p50/p99 (a call of rounds arrives as one chunk), and each request's decode speed (its
  tokens over the time from its send to its last chunk).
* one_user_vs_generate: at 1 user, the mean over requests of that decode speed against `Engine.generate`'s
  batch-1 tokens/s on the same prompt and budget, on an engine of the same configuration in this process with KV
  for one sequence and no prefix cache (goal: >= 0.95, i.e. HTTP, JSON and detokenization cost under 5%).
* --logprobs K: every request asks for each token's logprob and its K most likely alternatives (the build with
  logprobs, and their JSON), and so does the Engine.generate it is compared with (goal: still >= 0.95).
512 requests at every level make a long run: at 1 user the workload's 147k output tokens take about
5 minutes at spec "auto"'s 477 tokens/s and 11 at spec off's 216, so the defaults scale the requests with the
users (--requests).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import socket
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax
from eagle3_jax.checkpoints.generation import GREEDY

from . import load, planted
from .core import Run, versions
from .profile import count_compilations

MODES = ("auto", "off")
WARM_UP_PER_USER = 2  # the untimed pass's requests per user
WARM_UP_SEED = 10**6  # the untimed pass's prompts: a seed no level's timed requests use


def stand_in_tokenizer(vocab_size: int):
    """A word-level tokenizer over the whole vocabulary: token i is the word "t<i>" (the planted world's weights
    come with no tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def workload(world, count: int, lengths, budgets, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt of universe tokens, max_tokens) pairs, lengths and budgets uniform in their ranges."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, count)
    news = rng.integers(budgets[0], budgets[1] + 1, count)
    return [(world.prompts(1, int(n), seed=seed * 100003 + i)[0], int(m)) for i, (n, m) in enumerate(zip(sizes, news))]


class Serving:
    """The server's app over a live pool of `engine`, on a free port of 127.0.0.1, in a thread of its own."""

    def __init__(self, engine, tokenizer):
        import uvicorn

        from eagle3_jax.decoding.live import LivePool
        from eagle3_jax.serving.app import ServerState, build_app

        self.pool = LivePool(engine)
        state = ServerState(self.pool, tokenizer, "bench", dict(GREEDY), ())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # log_config None: uvicorn's dictConfig would shut down the process's logging handlers (serving/server.py)
        self.server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                                    log_level="warning", log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.pool.close()


def summary(results: list[dict], requests, world) -> dict:
    """Throughput and latency of one timed level."""
    ms = 1e3
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    start, end = min(r["sent"] for r in results), max(r["chunks"][-1] for r in results)
    ttft = [r["chunks"][0] - r["sent"] for r in results]
    gaps = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    speeds = [r["usage"]["completion_tokens"] / (r["chunks"][-1] - r["sent"]) for r in results]
    follow = all(r["text"] == " ".join(f"t{t}" for t in world.continuation(p, m))
                 for r, (p, m) in zip(results, requests))
    accepted = sum(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for r in results)
    rejected = sum(r["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "seconds": end - start, "tokens_per_s": tokens / (end - start),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) * ms, "ttft_p99_ms": float(np.percentile(ttft, 99)) * ms,
            "itl_p50_ms": float(np.percentile(gaps, 50)) * ms if gaps else None,
            "itl_p99_ms": float(np.percentile(gaps, 99)) * ms if gaps else None,
            "request_tokens_per_s_mean": float(np.mean(speeds)), "request_speeds": speeds,
            "acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
            "outputs_follow_f": follow}


def generate_speeds(engine, requests, logprobs: int | None = None) -> list[float]:
    """Engine.generate's batch-1 tokens/s per request (compiled by a first call of each), on an engine of the
    served one's configuration with KV for one sequence of its own (the served engine's pages are the server's)
    and no prefix cache (the compiling call's prompt would serve the timed one); with `logprobs`, asking for them."""
    engine = eagle3_jax.Engine(engine.target, engine.drafter, num_draft_tokens="auto" if engine.auto else
                               engine.num_draft_tokens or 1, max_draft_tokens=engine.num_draft_tokens if engine.auto
                               else None, max_len=engine.max_len, max_batch=1, kv_tokens=engine.max_len,
                               page_size=engine.page_size, prefix_caching=False)
    speeds = []
    for prompt, max_tokens in requests:
        engine.generate([prompt], 2, progress=False, logprobs=logprobs)
        start = time.perf_counter()
        (result,) = engine.generate([prompt], max_tokens, progress=False, logprobs=logprobs)
        speeds.append(len(result.token_ids) / (time.perf_counter() - start))
    return speeds


def serving(w, mode: str, args) -> tuple:
    """(engine, Serving) of one mode: spec "auto" with the planted drafter, or the target alone."""
    drafter = w.drafters[args.tau][1] if mode == "auto" else None
    engine = eagle3_jax.Engine(w.target, drafter, num_draft_tokens="auto" if drafter else 1,
                               max_draft_tokens=args.max_gamma if drafter else None, max_len=args.max_len,
                               max_batch=max(args.users))
    return engine, Serving(engine, stand_in_tokenizer(w.target.config.vocab_size))


def measure(run: Run, w, mode: str, engine, server: Serving, users: int, count: int, args, client) -> None:
    """One level of one mode: an untimed pass with max_tokens cut to 4 (it compiles), then the timed one."""
    requests = workload(w.world, count, args.lengths, args.budgets, seed=users)
    start = time.perf_counter()
    warm = [(p, min(m, 4)) for p, m in workload(w.world, WARM_UP_PER_USER * users, args.lengths, args.budgets,
                                                 seed=users + WARM_UP_SEED)]
    client.submit(load.run_load, server.url, "bench", warm, users, 0.0, 0, args.logprobs).result()
    warm_s = time.perf_counter() - start
    with count_compilations() as compiles:  # a shape the warm-up pass did not meet compiles here
        results = client.submit(load.run_load, server.url, "bench", requests, users, args.think_s, 0,
                                args.logprobs).result()
    row = {"mode": mode, "users": users, "logprobs": args.logprobs, "warm_up_s": warm_s,
           "compilations": compiles.count, **summary(results, requests, w.world),
           "scored_tokens": sum(r["logprobs"] for r in results)}
    if users == 1:
        base = generate_speeds(engine, requests, args.logprobs)
        row["generate_tokens_per_s_mean"] = float(np.mean(base))
        row["one_user_vs_generate"] = float(np.mean(np.array(row["request_speeds"]) / np.array(base)))
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "request_speeds"}
    run.add("serve", row, shown)


def table(rows: list[dict]) -> str:
    head = f"{'mode':5s} {'users':>5s} {'tok/s':>9s} {'ttft p50':>9s} {'ttft p99':>9s} {'itl p50':>8s} " \
           f"{'itl p99':>8s} {'req tok/s':>9s} {'vs gen':>7s}"
    lines = [head]
    for r in rows:
        vs = r.get("one_user_vs_generate")
        lines.append(f"{r['mode']:5s} {r['users']:5d} {r['tokens_per_s']:9.1f} {r['ttft_p50_ms']:9.1f} "
                     f"{r['ttft_p99_ms']:9.1f} {r['itl_p50_ms'] or 0:8.2f} {r['itl_p99_ms'] or 0:8.2f} "
                     f"{r['request_tokens_per_s_mean']:9.1f} {'' if vs is None else f'{vs:7.3f}'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-8b", help="a preset's shapes (eagle3_jax_bench/presets.py)")
    parser.add_argument("--users", type=int, nargs="+", help="concurrent users per level (default: 1 4 16 64)")
    parser.add_argument("--requests", type=int, nargs="+", help="requests per level (default: 8 32 128 512)")
    parser.add_argument("--lengths", type=int, nargs=2, default=[128, 2048], help="prompt lengths (the pool bench's)")
    parser.add_argument("--budgets", type=int, nargs=2, default=[64, 512], help="max_tokens (the pool bench's)")
    parser.add_argument("--tau", type=float, default=3.0, help="planted tokens per round at the largest gamma")
    parser.add_argument("--max-gamma", type=int, default=3)
    parser.add_argument("--think-s", type=float, default=0.05, help="mean think time between a user's requests")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--budget-s", type=float, default=1e9, help="no new measurement starts after this many s")
    parser.add_argument("--logprobs", type=int, help="every request asks for logprobs with this many alternatives")
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset, two levels of a few requests")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.lengths, args.budgets = "tiny", [4, 20], [2, 8]
    args.users = args.users or ([1, 2] if args.dry_run else [1, 4, 16, 64])
    args.requests = args.requests or ([2, 3] if args.dry_run else [8, 32, 128, 512])
    if len(args.requests) != len(args.users) or min(args.users + args.requests) < 1:
        parser.error("--requests needs one positive count per level of --users")
    if min(args.lengths + args.budgets) < 1 or args.lengths[0] > args.lengths[1] or args.budgets[0] > args.budgets[1]:
        parser.error("--lengths and --budgets are positive ranges LOW HIGH")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        parser.error(f"--logprobs must be in [0, 20], got {args.logprobs}")
    run = Run(args.budget_s, args.out, "serve_bench.json")
    run.record("versions", versions())
    plan = planted.Plan(args.model, "independent", (), (args.tau,), (0, args.max_gamma), args.lengths[1],
                        args.budgets[1], reps=1, inner=1)
    args.max_len = plan.max_len
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    w = planted.build(run, plan, dtype)
    spawn = multiprocessing.get_context("spawn")
    servers = {mode: serving(w, mode, args) for mode in args.modes}  # both at once: levels in order, modes side by side
    try:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as client:
            for users, count in zip(args.users, args.requests):
                for mode, (engine, server) in servers.items():
                    if run.time_left(f"{mode} users={users}"):
                        measure(run, w, mode, engine, server, users, count, args, client)
    finally:
        for _, server in servers.values():
            server.close()
    print(table(run.results.get("serve", [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
