"""The demo pair on the current device: end-to-end tokens/s of greedy decoding with speculation off and on,
its tau, and what that tau would buy at Qwen3-8B shapes.

    python -m eagle3_jax_bench.pair --out DIR [--pair eagle3_jax/demo/pair] [--tiny] [--lookup]

* end to end: Engine.generate on the pair's held-out demo prompts, the first lines of library modules (batch 1:
  each prompt alone; batch 8: eight together), spec off and at each gamma, after a warm-up request of the
  same shapes; tokens/s and tau. --auto adds num_draft_tokens="auto" (max_draft_tokens: the largest gamma) against
  the best fixed gamma in hindsight, with the gammas its rounds ran.
* proposers (--lookup): at batch 1 and gamma 3, prompt lookup (eagle3_jax.PromptLookup) against EAGLE-3 and spec
  off, tokens/s and tau on two tasks: the held-out demo prompts (free continuation of code), and "rewrite": each
  prompt holds the head of a held-out file (from this machine's standard library, else the demo prompt's text),
  then its first line again, so the target's continuation retraces the file.
* projection: at Qwen3-8B shapes (random bf16 weights, 1024 cached tokens, batch 1) the spec-off step and the
  gamma-3 round are timed as the engine runs them (eagle3_jax_bench/dense.py); the speedup this pair's tau would give
  there is tau x step / round. --tiny uses dense.py's tiny plan instead (a CPU dry run).
* draft trees (--trees, instead of the above): the first `--held-out` prompts of prompts.json that are not demo
  prompts, through Engine.generate with max_batch 8, the tokenizer's end-of-sequence ids as stops, greedy and sampled
  (--temperatures; 0.7 with seed i for prompt i): tau and tokens/s of chains (--gammas, 0: spec off) and draft trees
  (--tree-shapes N,D,K ...), each tree's tau over the chain of its depth when measured, and whether greedy output is
  the first configuration's. The GPU's side, the rounds' cost at Qwen3-8B shapes, is eagle3_jax_bench/trees.py.
The pair is tiny (11M parameters): its steps are launch-bound, not bandwidth-bound, so its own speedup says
little about a large target; the projection is the figure to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

import eagle3_jax
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
from eagle3_jax.demo import PAIR, corpus, timed_generate
from eagle3_jax.models import kernels as kernels_lib

from . import dense
from .core import Run, versions


def end_to_end(target, drafter, prompts, gammas, max_new, stops, batches=(1, 8), auto: bool = False) -> list[dict]:
    rows = []
    max_len = max(len(p) for p in prompts) + max_new + max(gammas) + 2
    for batch in batches:
        groups = [[p] for p in prompts[:4]] if batch == 1 else [prompts[:8]]
        for gamma in (0,) + tuple(gammas) + (("auto",) if auto else ()):
            engine = eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens=gamma or 3,
                                       max_len=max_len, **({"max_draft_tokens": max(gammas)} if auto and
                                                           gamma == "auto" else {}))
            tokens, seconds, accepts, used = 0, 0.0, [], []
            for group in groups:
                results, s = timed_generate(engine, group, max_new, stops)
                tokens += sum(len(r.token_ids) for r in results)
                seconds += s
                accepts += [a for r in results for a in r.accept_lengths]
                used += [g for r in results for g in r.gammas]
            row = {"batch": batch, "gamma": gamma, "tokens": tokens, "seconds": seconds,
                   "tokens_per_s": tokens / seconds, "tau": float(np.mean(accepts) + 1) if accepts else None}
            if gamma == "auto":
                row["rounds_by_gamma"] = {str(g): used.count(g) for g in range(max(gammas) + 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        same = [r for r in rows if r["batch"] == row["batch"]]
        row["speedup"] = row["tokens_per_s"] / next(r for r in same if r["gamma"] == 0)["tokens_per_s"]
        if row["gamma"] == "auto":
            best = max((r for r in same if r["gamma"] != "auto"), key=lambda r: r["tokens_per_s"])
            row.update(best_fixed_gamma=best["gamma"], vs_best_fixed=row["tokens_per_s"] / best["tokens_per_s"])
    return rows


DEFAULT_TREE_SHAPES = ((8, 4, 2), (16, 4, 4), (16, 5, 4), (24, 6, 4), (24, 7, 4), (32, 7, 6), (32, 7, 8))


def trees(target, drafter, prompts, max_new, stops, gammas, shapes, temperatures=(0.0, 0.7), max_batch=8) -> list[dict]:
    """Per temperature, each chain gamma (0: spec off) and tree shape (N, D, K) over every prompt at once: tau,
    tokens/s (timed after a first run of the same request), and for trees tau over the chain of their depth; greedy
    rows record whether their tokens are the first configuration's (spec off's when gamma 0 comes first: speculation
    is lossless, so they must be)."""
    rows = []
    max_len = max(len(p) for p in prompts) + max_new + 2
    configs = [dict(num_draft_tokens=g) for g in gammas] + [
        dict(num_draft_tokens=n, draft_depth=d, draft_top_k=k) for n, d, k in shapes]
    for temperature in temperatures:
        sampling = dict(temperature=temperature, seed=list(range(len(prompts)))) if temperature else {}
        first = None
        for config in configs:
            engine = eagle3_jax.Engine(target, drafter if config["num_draft_tokens"] else None, max_len=max_len,
                                       max_batch=max_batch, **(config if config["num_draft_tokens"] else {}))
            results, seconds = timed_generate(engine, prompts, max_new, stops, **sampling)
            tokens = [r.token_ids for r in results]
            first = first or tokens
            accepts = [a for r in results for a in r.accept_lengths]
            row = {"temperature": temperature, "num_draft_tokens": engine.num_draft_tokens,
                   "draft_depth": engine.draft_depth, "draft_top_k": config.get("draft_top_k", 1),
                   "tokens": sum(map(len, tokens)), "seconds": seconds,
                   "tokens_per_s": sum(map(len, tokens)) / seconds,
                   "tau": float(np.mean(accepts) + 1) if accepts else None}
            if not temperature:
                row["same_tokens_as_first"] = tokens == first
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine, results
            jax.clear_caches()  # each engine's programs keep memory mappings: a long sweep would run out of them
    for row in rows:
        chain = [r for r in rows if r["temperature"] == row["temperature"] and r["draft_top_k"] == 1
                 and r["draft_depth"] == row["draft_depth"] and r["tau"]]
        if row["draft_top_k"] > 1 and chain:
            row["tau_over_chain_of_its_depth"] = row["tau"] / chain[0]["tau"]
    return rows


def tree_shape(text: str) -> tuple[int, int, int]:
    """'N,D,K' -> (N, D, K)."""
    try:
        n, d, k = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree shape is N,D,K (three ints), got {text!r}") from None
    return n, d, k


REWRITE_CHARS = 700  # the head of a held-out file a rewrite prompt holds: a few hundred tokens, well inside max_len


def rewrite_text(entry: dict) -> str:
    """A "rewrite this file" prompt for a demo prompt's file: its head (whole lines, at most REWRITE_CHARS; the
    demo prompt's own text when this machine's standard library lacks the file), a blank line, then its first
    line again."""
    path = corpus.stdlib_root() / entry["file"]
    text = path.read_text(encoding="utf-8") if path.is_file() else entry["text"]
    head = text[:REWRITE_CHARS]
    head = head[: head.rfind("\n") + 1] or head
    return head + "\n" + head.split("\n", 1)[0] + "\n"


def proposers(target, drafter, tasks: dict, max_new: int, stops, gamma: int = 3, max_ngram: int = 4) -> list[dict]:
    """Per task (name -> prompts, each run alone at batch 1) and proposer (spec off, EAGLE-3, prompt lookup):
    tokens/s and tau at `gamma`, after a warm-up run of each prompt."""
    rows = []
    choices = {"off": None, "eagle3": drafter, "prompt_lookup": eagle3_jax.PromptLookup(max_ngram)}
    for task, prompts in tasks.items():
        max_len = max(len(p) for p in prompts) + max_new + gamma + 2
        for name, proposer in choices.items():
            engine = eagle3_jax.Engine(target, proposer, num_draft_tokens=gamma, max_len=max_len)
            tokens, seconds, accepts = 0, 0.0, []
            for prompt in prompts:
                results, s = timed_generate(engine, [prompt], max_new, stops)
                tokens += len(results[0].token_ids)
                seconds += s
                accepts += results[0].accept_lengths
            rows.append({"task": task, "proposer": name, "gamma": gamma if proposer is not None else 0,
                         "prompts": len(prompts), "tokens": tokens, "tokens_per_s": tokens / seconds,
                         "tau": float(np.mean(accepts) + 1) if accepts else None})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        off = next(r for r in rows if r["task"] == row["task"] and r["proposer"] == "off")
        row["speedup"] = row["tokens_per_s"] / off["tokens_per_s"]
    return rows


def projection(tau: float, tiny: bool, gamma: int = 3) -> dict:
    """tau x (spec-off step) / (round at gamma), both timed in this process at Qwen3-8B shapes."""
    plan = dense.tiny_plan() if tiny else dense.qwen3_8b_plan()
    length = plan.spec_kv_length
    kernels = kernels_lib.default()
    s = dense.setup(Run(budget_s=1e9, out=None, filename=""), plan, (kernels,), jax.numpy.bfloat16)
    step_s = dense.spec_off(s, 1, length, kernels).seconds
    round_s = dense.spec_rounds(s, 1, gamma, kernels, s.rounds_per_call).seconds
    out = {"shape": "tiny plan" if tiny else "Qwen3-8B", "kv_len": length, "gamma": gamma, "tau": tau,
           "step_ms": step_s * 1e3, "round_ms": round_s * 1e3, "projected_speedup": tau * step_s / round_s}
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=PAIR)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", choices=(1, 8), default=[1, 8])
    parser.add_argument("--tiny", action="store_true", help="the projection at dense.py's tiny plan (CPU dry run)")
    parser.add_argument("--auto", action="store_true", help='also num_draft_tokens="auto" against the best fixed gamma')
    parser.add_argument("--trees", action="store_true",
                        help="only the draft-tree section: chains (--gammas) against trees (--tree-shapes), greedy and "
                             "sampled, on the held-out prompts")
    parser.add_argument("--tree-shapes", type=tree_shape, nargs="+", default=list(DEFAULT_TREE_SHAPES),
                        metavar="N,D,K")
    parser.add_argument("--held-out", type=int, default=24, help="with --trees: the held-out prompts (default 24)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                        help="with --trees: 0 is greedy (default: 0 0.7)")
    parser.add_argument("--lookup", type=int, metavar="PROMPTS", default=0,
                        help="also prompt lookup against EAGLE-3 and spec off at gamma 3, batch 1, on this many "
                             "held-out prompts and as many rewrite prompts (0: not run)")
    args = parser.parse_args(argv)
    if 3 not in args.gammas and not args.trees:
        parser.error("--gammas must include 3: the projection is at gamma 3")
    target = eagle3_jax.load_target(args.pair / "target", dtype=args.dtype, progress=False)
    drafter = eagle3_jax.load_drafter(args.pair / "drafter", target, dtype=args.dtype)
    tokenizer = load_tokenizer(args.pair / "target")
    entries = json.loads((args.pair / "prompts.json").read_text())
    demo = [p for p in entries if p["demo"]]
    if args.trees:
        held_out = [tokenizer(p["text"].rstrip("\n"))["input_ids"] for p in entries if not p["demo"]][: args.held_out]
        results = {"device": jax.devices()[0].device_kind, "versions": versions(), "dtype": args.dtype,
                   "max_new_tokens": args.max_new_tokens, "prompts": len(held_out),
                   "trees": trees(target, drafter, held_out, args.max_new_tokens, eos_stop_ids(tokenizer),
                                  args.gammas, args.tree_shapes, tuple(args.temperatures))}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pair_trees.json").write_text(json.dumps(results, indent=1))
        return 0
    prompts = [tokenizer(p["text"].rstrip("\n"))["input_ids"] for p in demo[:8]]
    results = {"device": jax.devices()[0].device_kind, "versions": versions(), "dtype": args.dtype,
               "max_new_tokens": args.max_new_tokens}
    results["end_to_end"] = end_to_end(target, drafter, prompts, args.gammas, args.max_new_tokens,
                                       eos_stop_ids(tokenizer), tuple(args.batches), args.auto)
    if args.lookup:
        tasks = {"held-out code": prompts[: args.lookup],
                 "rewrite": [tokenizer(rewrite_text(p))["input_ids"] for p in demo[: args.lookup]]}
        results["proposers"] = proposers(target, drafter, tasks, args.max_new_tokens, eos_stop_ids(tokenizer))
    tau3 = next(r["tau"] for r in results["end_to_end"] if r["batch"] == args.batches[0] and r["gamma"] == 3)
    results["projection"] = projection(tau3, args.tiny)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pair_bench.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
