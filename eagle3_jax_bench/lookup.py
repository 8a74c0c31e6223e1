"""Prompt lookup (eagle3_jax.PromptLookup) at a preset's shapes: what its round costs against the spec-off step,
and tokens/s through `Engine.generate` on a copy task, against spec off.

    python -m eagle3_jax_bench.lookup --out results.json [--batches 1 8 32] [--gamma 3]     (Qwen3-8B shapes)
    python -m eagle3_jax_bench.lookup --out results.json --dry-run   (the tiny preset, on the CPU)

* the world: planted_world.py's target (random weights at the preset's shapes, bf16, whose greedy next token
  walks a cycle f through a universe of tokens); no drafter. The copy task: each row's prompt holds a stretch of
  Plan.stretch tokens of the cycle (1,024), then the stretch's first COPY_CUE tokens again, so the target's
  continuation retraces the stretch and the lookup's proposals are right until the output runs past it
  (Plan.new_tokens, 256, is at most stretch - COPY_CUE: never). Rows start at different places on the cycle.
* per batch, spec off and prompt lookup at --gamma (one Engine each, its pool the batch): an untimed generate of
  the same prompts (two tokens: it compiles the prefill and the call of rounds), then the timed generate:
  tokens/s, tau, and whether the tokens are the cycle's (the output is spec-off's). Then the round: the engine's
  jitted call of rounds (engine.jit_rounds with the engine's StepSpec, as generate calls it) timed on a random
  running state at the run's mean KV length (the history random tokens: the search's cost does not depend on
  what it finds), per round.
* per batch: round_vs_step, the lookup round's time over the spec-off step's (the issue's goal at gamma 3: at
  most 1.12), and speedup, the lookup's tokens/s over spec off's. Beside them the same round with the search
  taken out (`NoSearch`: it proposes gamma tokens read straight from the history), timed the same way: the
  verify of gamma + 1 tokens, the acceptance and the history's update, so that search_ms, the lookup round less
  it, is what the search costs and verify_vs_step what the round costs without it.
The table is printed and the rows written as JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax

from . import planted_world, presets
from .core import versions

COPY_CUE = 8  # the stretch's first tokens repeated at the prompt's end: at least PromptLookup's default max_ngram


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    batches: tuple[int, ...]
    gamma: int
    stretch: int  # cycle tokens a prompt holds before the cue
    new_tokens: int
    reps: int
    inner: int
    dtype: str = "bfloat16"

    @property
    def prompt_len(self) -> int:
        return self.stretch + COPY_CUE

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + self.gamma + 2


def h200_plan(batches=(1, 8, 32), gamma: int = 3) -> Plan:
    return Plan("qwen3-8b", tuple(batches), gamma, stretch=1024, new_tokens=256, reps=5, inner=5)


def dry_plan() -> Plan:
    return Plan("tiny", (2,), 3, stretch=32, new_tokens=16, reps=1, inner=1, dtype="float32")


@dataclasses.dataclass(frozen=True)
class NoSearch(eagle3_jax.PromptLookup):
    """Prompt lookup with its search taken out, for timing what the rest of its round costs: it proposes the
    history's tokens at positions 1 .. gamma (no match to find), and updates the history as PromptLookup does."""

    def propose(self, dparams, tparams, state, keys, spec):
        return state.history[:, 1:spec.gamma + 1], None, None, None


def copy_prompts(world: planted_world.World, batch: int, stretch: int) -> list[list[int]]:
    """Per row, a stretch of the cycle from its own start, then the stretch's first COPY_CUE tokens again."""
    rows = []
    for r in range(batch):
        start = (r * 997) % world.size
        cycle = world.universe[world.order[(start + np.arange(stretch)) % world.size]].tolist()
        rows.append(cycle + cycle[:COPY_CUE])
    return rows


def round_seconds(eng: eagle3_jax.Engine, plan: Plan, batch: int, dtype) -> float:
    """Seconds per round of the engine's call of rounds as generate calls it (Engine.time_call: its executable, on
    its pages) at the run's mean KV length; the fastest of plan.reps."""
    return min(eng.time_call(batch, plan.prompt_len + plan.new_tokens // 2, eng.num_draft_tokens)
               for _ in range(plan.reps)) / eng.rounds_per_call


def measure(target, world, plan: Plan, batch: int, proposer, dtype) -> dict:
    prompts = copy_prompts(world, batch, plan.stretch)
    eng = eagle3_jax.Engine(target, proposer, num_draft_tokens=plan.gamma, max_len=plan.max_len, max_batch=batch,
                            kv_tokens=batch * plan.max_len)
    start = time.perf_counter()
    eng.generate(prompts, 2, progress=False)  # compiles this batch's prefill and call of rounds
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    results = eng.generate(prompts, plan.new_tokens, progress=False)
    seconds = time.perf_counter() - start
    accepts = [a for r in results for a in r.accept_lengths]
    tokens = sum(len(r.token_ids) for r in results)
    return {"batch": batch, "proposer": "prompt_lookup" if proposer is not None else "off",
            "gamma": plan.gamma if proposer is not None else 0, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "tau": float(np.mean(accepts) + 1) if accepts else 1.0,
            "tokens_follow_f": all(r.token_ids == world.continuation(p, plan.new_tokens)
                                   for r, p in zip(results, prompts)),
            "round_ms": round_seconds(eng, plan, batch, dtype) * 1e3, "compile_s": compile_s}


def run(plan: Plan) -> dict:
    dtype = jnp.dtype(plan.dtype)
    cfg, dcfg = presets.pair(plan.model)
    world = planted_world.make_world(cfg, dcfg)
    if plan.stretch + COPY_CUE > world.size or plan.new_tokens > plan.stretch - COPY_CUE:
        raise ValueError(f"the plan's stretch must be at most {world.size - COPY_CUE} (the cycle) and its new_tokens "
                         f"at most stretch - {COPY_CUE}, got {plan.stretch} and {plan.new_tokens}")
    start = time.perf_counter()
    target = planted_world.planted_target(cfg, world, dtype)
    jax.block_until_ready(target.params)
    out = {"device": jax.devices()[0].device_kind, "versions": versions(), "plan": dataclasses.asdict(plan),
           "init_s": time.perf_counter() - start, "rows": []}
    for batch in plan.batches:
        off = measure(target, world, plan, batch, None, dtype)
        lookup = measure(target, world, plan, batch, eagle3_jax.PromptLookup(), dtype)
        no_search = eagle3_jax.Engine(target, NoSearch(), num_draft_tokens=plan.gamma, max_len=plan.max_len,
                                      max_batch=batch, kv_tokens=batch * plan.max_len)
        verify_ms = round_seconds(no_search, plan, batch, dtype) * 1e3
        lookup.update(round_vs_step=lookup["round_ms"] / off["round_ms"],
                      speedup=lookup["tokens_per_s"] / off["tokens_per_s"], verify_ms=verify_ms,
                      verify_vs_step=verify_ms / off["round_ms"], search_ms=lookup["round_ms"] - verify_ms)
        out["rows"] += [off, lookup]
    return out


def table(out: dict) -> str:
    lines = [f"{'batch':>5} {'proposer':>13} {'gamma':>5} {'round ms':>9} {'vs step':>8} {'tau':>6} "
             f"{'tokens/s':>10} {'speedup':>8} {'follows f':>9} {'no-search ms':>12} {'search ms':>9}"]
    for r in out["rows"]:
        lines.append(f"{r['batch']:>5} {r['proposer']:>13} {r['gamma']:>5} {r['round_ms']:>9.3f} "
                     f"{r.get('round_vs_step', 1.0):>8.3f} {r['tau']:>6.2f} {r['tokens_per_s']:>10.1f} "
                     f"{r.get('speedup', 1.0):>8.3f} {str(r['tokens_follow_f']):>9} {r.get('verify_ms', 0.0):>12.3f} "
                     f"{r.get('search_ms', 0.0):>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.lookup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset in float32: a CPU check of the code")
    args = parser.parse_args(argv)
    plan = dry_plan() if args.dry_run else h200_plan(args.batches, args.gamma)
    out = run(plan)
    print(table(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
