"""End-to-end tokens/s through `Engine.generate` on a planted-acceptance world (planted_world.py) at a preset's
shapes, against the projection batch x tau / round time, the round timed in the same process.

    python -m eagle3_jax_bench.planted --out DIR [--model qwen3-8b | qwen3-30b-a3b | tiny | tiny-moe]
        [--batches 1 8 32] [--taus 1.5 2.5 3.5] [--gammas 0 1 2 3 4] [--prompt-len 128] [--new-tokens 256]
    eagle3-jax bench --planted [--model qwen3-30b-a3b]   (the defaults above)

* worlds: one target; per tau target one drafter whose acceptance a solves expected_tau(a, G) = tau at the
  largest gamma G of --gammas, so the same world is decoded at every gamma (tau at gamma < G is lower).
  --rows lockstep (the default): every row of a batch meets the same agreements (the pattern repeats every
  LOCKSTEP_PERIOD positions along f's cycle and every prompt ends at a multiple of it), so no row finishes
  rounds before another and the projection's full batch is what runs; --rows independent: each row its own
  (a fixed batch then waits on its slowest row: 5-15% of the rounds at batch 8 and 32 in simulation).
* per (batch, gamma): one Engine per world, max_batch = batch, every world's engine sharing one compilation,
  made by an untimed generate of the same prompts and tokens (exactly the calls the timed run makes: greedy
  decoding schedules them alike; Engine.compile would compile every row bucket's). Then, timed: the prefill (the
  median of three one-token generates: the prompts' call, their rows done when they join) and, per world, the
  whole generate of batch prompts of --prompt-len universe tokens, --new-tokens each, no stop ids.
* projection: the engine's own call of rounds (the executable the generate ran) timed on a random state at
  the run's mean KV length, per round: projected tokens/s = batch x tau / round time, tau measured.
* per row: tokens/s (the whole generate) and decode tokens/s (prefill's time and token taken out), each over
  the projection (ratio, ratio_decode); tau measured, expected (the formula) and simulated (the accept
  lengths planted_world.simulate replays for these prompts); accepts_match_simulation (the engine's accept
  lengths are those) and tokens_follow_f (its tokens are the target's f-chain): the world holds, in bf16 too;
  the calls of rounds the generate ran (device_rounds = calls x rounds per call) against the rounds a row needed
  (mean and max over rows): what is lost to the slowest row and to rounds run after every row is done, the
  rest of the gap being the host's; compilations inside the timed generate (0).
* best: the fastest fixed gamma per (batch, tau), measured and projected (gamma 0, spec-off, is in every tau's
  set).
* --auto: per (batch, tau), also Engine(num_draft_tokens="auto", max_draft_tokens=G) after the fixed gammas:
  tokens/s against the best fixed gamma, the gammas its rounds ran, its accept lengths against the simulation
  along those gammas.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import spec_round

from . import planted_world, presets
from .core import Run, versions
from .profile import count_compilations

BATCHES = {"qwen3-8b": (1, 8, 32), "qwen3-30b-a3b": (1, 8), "tiny": (1, 2), "tiny-moe": (1, 2)}
# Rows in lockstep: the agreement pattern repeats every this many positions along the cycle (at most half the
# universe), so 4,096 tokens hold 32 distinct rows and 2,048 hold 16.
LOCKSTEP_PERIOD = 128
ROWS = ("lockstep", "independent")


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    rows: str  # ROWS
    batches: tuple[int, ...]
    taus: tuple[float, ...]
    gammas: tuple[int, ...]  # ascending; 0 is spec-off
    prompt_len: int
    new_tokens: int
    reps: int  # round timing: samples of `inner` calls
    inner: int
    rounds_per_call: int = engine_lib.ROUNDS_PER_CALL
    auto: bool = False  # also num_draft_tokens="auto" (max_draft_tokens = the largest gamma) per batch

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + max(self.gammas) + 2


@dataclasses.dataclass(frozen=True)
class Worlds:
    """The target and, per tau target, the acceptance a and its drafter."""

    world: planted_world.World
    target: Target
    drafters: dict[float, tuple[float, Any]]
    dtype: Any


def build(run: Run, plan: Plan, dtype) -> Worlds:
    """The worlds on the device: a from each tau at the largest gamma."""
    start = time.perf_counter()
    cfg, dcfg = presets.pair(plan.model)
    size = planted_world.universe_size(cfg, dcfg)
    period = min(LOCKSTEP_PERIOD, size // 2) if plan.rows == "lockstep" else None
    world = planted_world.make_world(cfg, dcfg, size, period=period)
    target = planted_world.planted_target(cfg, world, dtype)
    drafters = {}
    for tau in plan.taus:
        a = planted_world.solve_acceptance(tau, max(plan.gammas))
        drafters[tau] = (a, planted_world.planted_drafter(dcfg, world, a, dtype))
    jax.block_until_ready((target.params, [d.params for _, d in drafters.values()]))
    run.record("world", {"model": plan.model, "universe": world.size, "rows": plan.rows, "period": world.period,
                         "epsilon": planted_world.EPSILON,
                         "acceptance": {str(tau): a for tau, (a, _) in drafters.items()},
                         "init_s": time.perf_counter() - start, "max_len": plan.max_len})
    return Worlds(world, target, drafters, dtype)


def engine(w: Worlds, plan: Plan, batch: int, gamma: int, tau: float) -> eagle3_jax.Engine:
    """A fixed-gamma engine on the world of `tau` (gamma 0: the target alone), its pool `batch` slots."""
    drafter = w.drafters[tau][1] if gamma else None
    return eagle3_jax.Engine(w.target, drafter, num_draft_tokens=max(gamma, 1), max_len=plan.max_len,
                             max_batch=batch, rounds_per_call=plan.rounds_per_call, kv_tokens=batch * plan.max_len)


def timed_generate(eng: eagle3_jax.Engine, prompts, new_tokens: int):
    """(results, wall seconds, compilations inside, calls of rounds) of one greedy generate."""
    with count_compilations() as compiles:
        start = time.perf_counter()
        results = eng.generate(prompts, new_tokens, progress=False)
        seconds = time.perf_counter() - start
    calls = sum(kind == "call" for kind, _ in eng.device_events)
    return results, seconds, compiles.count, calls


def round_seconds(eng: eagle3_jax.Engine, plan: Plan, batch: int) -> tuple[float, int]:
    """(seconds per round, executables) of the engine's call of rounds as generate calls it (Engine.time_call:
    its executable, on its pages) at the run's mean KV length; the fastest of plan.reps. Executables: those the
    call of rounds compiled meanwhile, on one device (0: the one generate ran; the timing's own small helpers aside)."""
    with count_compilations(spec_round.spec_rounds.__name__) as rounds_compiled:
        seconds = min(eng.time_call(batch, plan.prompt_len + plan.new_tokens // 2, eng.num_draft_tokens)
                      for _ in range(plan.reps))
    return seconds / eng.rounds_per_call, rounds_compiled.count


def measure(run: Run, w: Worlds, plan: Plan, batch: int, gamma: int) -> None:
    """Every world's row at (batch, gamma); gamma 0 (spec-off) is one row for all of them."""
    prompts = w.world.prompts(batch, plan.prompt_len, seed=batch)
    taus = plan.taus if gamma else (plan.taus[0],)
    first = engine(w, plan, batch, gamma, taus[0])
    start = time.perf_counter()
    first.generate(prompts, plan.new_tokens, progress=False)  # compiles every call the timed run makes
    compile_s = time.perf_counter() - start
    prefill_s = float(np.median([timed_generate(first, prompts, 1)[1] for _ in range(3)]))
    round_s, round_compiles = round_seconds(first, plan, batch)
    spec_off = {r["batch"]: r for r in run.results.get("planted", []) if r["gamma"] == 0}.get(batch)
    for tau in taus:
        a = w.drafters[tau][0] if gamma else 0.0
        results, seconds, compiles, calls = timed_generate(engine(w, plan, batch, gamma, tau), prompts,
                                                           plan.new_tokens)
        entry = {"batch": batch, "gamma": gamma, "tau_target": tau if gamma else None, "a": a,
                 **acceptance(w.world, plan, prompts, a, gamma, results), "seconds": seconds, "prefill_s": prefill_s,
                 "round_ms": round_s * 1e3, "calls": calls, "device_rounds": calls * first.rounds_per_call,
                 "compilations": compiles, "round_compilations": round_compiles, "compile_s": compile_s}
        entry.update(speeds(entry))
        if spec_off is not None:
            entry["speedup"] = entry["tokens_per_s"] / spec_off["tokens_per_s"]
            entry["speedup_projected"] = entry["tau"] * spec_off["round_ms"] / entry["round_ms"]
        run.add("planted", entry, {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})


def acceptance(world: planted_world.World, plan: Plan, prompts, a: float, gamma: int, results,
               auto: bool = False) -> dict:
    """A generate's tokens and tau against the world's: measured, expected (at fixed gamma), simulated (under
    "auto", along the gammas each row's rounds ran); the rounds per row."""
    accepts = [r.accept_lengths for r in results]
    schedules = [r.gammas for r in results] if auto else None
    simulated = planted_world.simulate(world, a, prompts, plan.new_tokens, gamma, schedules)
    rounds = [len(x) for x in accepts] if gamma else [plan.new_tokens - 1] * len(prompts)
    expected = {} if auto else {"tau_expected": planted_world.expected_tau(a, gamma)}
    return {"tau": float(np.mean([x + 1 for row in accepts for x in row])) if gamma else 1.0, **expected,
            "tau_simulated": float(np.mean([x + 1 for row in simulated for x in row])) if gamma else 1.0,
            "accepts_match_simulation": accepts == simulated,
            "tokens_follow_f": all(r.token_ids == world.continuation(p, plan.new_tokens)
                                   for r, p in zip(results, prompts)),
            "tokens": sum(len(r.token_ids) for r in results),
            "rounds_per_row_mean": float(np.mean(rounds)), "rounds_per_row_max": max(rounds)}


def speeds(e: dict) -> dict:
    """Tokens/s whole and without prefill (its time and first tokens), each over the projection batch x tau /
    round time; the rounds an average row needed over those the device ran (the slowest row's and the last
    call's dead rounds), and the device's rounds' share of decode's wall time (the rest is the host's).
    The decode figures are the difference of two timings: where the prefill alone timed longer than the whole
    generate (noise on a busy host at tiny shapes), they are None rather than negative."""
    decode_s, round_s = e["seconds"] - e["prefill_s"], e["round_ms"] / 1e3
    out = {"tokens_per_s": e["tokens"] / e["seconds"], "projected_tokens_per_s": e["batch"] * e["tau"] / round_s}
    decode = ({"decode_tokens_per_s": (e["tokens"] - e["batch"]) / decode_s} if decode_s > 0
              else {"decode_tokens_per_s": None})
    return dict(out, **decode, ratio=out["tokens_per_s"] / out["projected_tokens_per_s"],
                ratio_decode=(decode["decode_tokens_per_s"] / out["projected_tokens_per_s"] if decode_s > 0
                              else None),
                rounds_needed_over_run=e["rounds_per_row_mean"] / e["device_rounds"],
                device_share_of_decode=e["device_rounds"] * round_s / decode_s if decode_s > 0 else None)


def _maybe(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"


def measure_auto(run: Run, w: Worlds, plan: Plan, batch: int) -> None:
    """Engine(num_draft_tokens="auto", max_draft_tokens=G) on every world at this batch, beside the best fixed
    gamma measured before it: tokens/s, tau, and the gammas its rounds ran. Compiled and its round costs
    measured (or loaded) by an untimed generate of the same prompts and tokens and Engine.round_costs at this
    batch."""
    prompts, G = w.world.prompts(batch, plan.prompt_len, seed=batch), max(plan.gammas)
    fixed = [r for r in run.results.get("planted", []) if r["batch"] == batch]
    for tau in plan.taus:
        a, drafter = w.drafters[tau]
        eng = eagle3_jax.Engine(w.target, drafter, num_draft_tokens="auto", max_draft_tokens=G, max_len=plan.max_len,
                                max_batch=batch, rounds_per_call=plan.rounds_per_call, kv_tokens=batch * plan.max_len)
        start = time.perf_counter()
        eng.generate(prompts, plan.new_tokens, progress=False)
        eng.round_costs(batch, 0.0)
        warm_s = time.perf_counter() - start
        results, seconds, compiles, calls = timed_generate(eng, prompts, plan.new_tokens)
        chosen = collections.Counter(g for r in results for g in r.gammas)
        entry = {"batch": batch, "gamma": "auto", "tau_target": tau, "a": a,
                 **acceptance(w.world, plan, prompts, a, G, results, auto=True), "seconds": seconds,
                 "calls": calls, "compilations": compiles, "warm_s": warm_s,
                 "rounds_by_gamma": {str(g): chosen[g] for g in eng.gammas}}
        entry["tokens_per_s"] = entry["tokens"] / seconds
        mine = [r for r in fixed if r["tau_target"] in (tau, None)]
        if mine:
            best = max(mine, key=lambda r: r["tokens_per_s"])
            entry.update(best_fixed_gamma=best["gamma"], vs_best_fixed=entry["tokens_per_s"] / best["tokens_per_s"])
        run.add("auto", entry, {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})


def best_gammas(rows: list[dict], taus) -> list[dict]:
    """The fastest fixed gamma per (batch, tau target), measured and projected; spec-off counts for every tau."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        for tau in taus:
            mine = [r for r in rows if r["batch"] == batch and r["tau_target"] in (tau, None)]
            if not any(r["gamma"] for r in mine):
                continue
            best = max(mine, key=lambda r: r["tokens_per_s"])
            projected = max(mine, key=lambda r: r["projected_tokens_per_s"])
            out.append({"batch": batch, "tau_target": tau, "best_gamma": best["gamma"],
                        "tokens_per_s": best["tokens_per_s"], "best_gamma_projected": projected["gamma"],
                        "projected_tokens_per_s": projected["projected_tokens_per_s"]})
    return out


def run_all(run: Run, plan: Plan, dtype) -> dict:
    w = build(run, plan, dtype)
    for batch in plan.batches:
        for gamma in plan.gammas:
            if run.time_left(f"planted b{batch} g{gamma}"):
                measure(run, w, plan, batch, gamma)
        if plan.auto and run.time_left(f"auto b{batch}"):
            measure_auto(run, w, plan, batch)
    run.record("best", best_gammas(run.results.get("planted", []), plan.taus))
    return run.results


def holds(row: dict) -> bool:
    """Whether a row's run decoded the world as planted: its tokens and accept lengths."""
    return row["accepts_match_simulation"] and row["tokens_follow_f"]


def summary(results: dict) -> str:
    world = results["world"]
    lines = [f"planted world {world['model']}: universe {world['universe']}, rows {world['rows']} (period "
             f"{world['period']}), a per tau {world['acceptance']}",
             f"{'batch':>5s} {'gamma':>5s} {'tau*':>4s} {'tau':>5s} {'expect':>6s} {'tok/s':>9s} {'decode':>9s} "
             f"{'project':>9s} {'ratio':>6s} {'r.dec':>6s} {'rounds':>7s} {'run':>5s} {'ok':>3s}"]
    for r in results.get("planted", []):
        tau_target = "-" if r["tau_target"] is None else f"{r['tau_target']:.1f}"
        lines.append(f"{r['batch']:5d} {r['gamma']:5d} {tau_target:>4s} {r['tau']:5.2f} {r['tau_expected']:6.2f} "
                     f"{r['tokens_per_s']:9.1f} {_maybe(r['decode_tokens_per_s'], 9, 1)} "
                     f"{r['projected_tokens_per_s']:9.1f} {r['ratio']:6.3f} {_maybe(r['ratio_decode'], 6, 3)} "
                     f"{r['rounds_per_row_mean']:7.1f} "
                     f"{r['device_rounds']:5d} {'yes' if holds(r) else 'NO':>3s}")
    for b in results.get("best", []):
        lines.append(f"best fixed gamma, batch {b['batch']}, tau {b['tau_target']}: {b['best_gamma']} "
                     f"({b['tokens_per_s']:.1f} tok/s); projection's: {b['best_gamma_projected']}")
    for r in results.get("auto", []):
        beside = (f", {r['vs_best_fixed']:.3f}x the best fixed gamma ({r['best_fixed_gamma']})"
                  if "vs_best_fixed" in r else "")
        lines.append(f"auto, batch {r['batch']}, tau {r['tau_target']}: {r['tokens_per_s']:.1f} tok/s at tau "
                     f"{r['tau']:.2f}{beside}; rounds by gamma {r['rounds_by_gamma']}; "
                     f"{'as planted' if holds(r) else 'NOT as planted'}")
    if results["skipped"]:
        lines.append(f"skipped for time: {', '.join(results['skipped'])}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.planted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=tuple(BATCHES), default="qwen3-8b")
    parser.add_argument("--rows", choices=ROWS, default=ROWS[0],
                        help="lockstep: every row of a batch meets the same agreements (its rounds accept alike, no "
                             "row waits on a slower one); independent: each row its own")
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 8 32 (qwen3-8b), 1 8 (qwen3-30b-a3b)")
    parser.add_argument("--taus", type=float, nargs="+", default=[1.5, 2.5, 3.5],
                        help="tau targets at the largest gamma, each in [1, that gamma + 1]")
    parser.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds-per-call", type=int, default=engine_lib.ROUNDS_PER_CALL,
                        help="the engines' rounds per device call (fewer: fewer rounds run after the rows are done)")
    parser.add_argument("--auto", action="store_true",
                        help="also num_draft_tokens='auto' per (batch, tau), max_draft_tokens the largest gamma")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=1e9, help="no new (batch, gamma) starts after this")
    return parser


def plan_of(parser: argparse.ArgumentParser, args) -> Plan:
    """The plan of the parsed flags; a bad value is refused by the parser (exit 2), naming the flag."""
    gammas = sorted(set(args.gammas))
    if min(gammas) < 0 or max(gammas) < 1:
        parser.error(f"--gammas must be >= 0 with one >= 1, got {args.gammas}")
    bad = [t for t in args.taus if not 1.0 <= t <= max(gammas) + 1]
    if bad:
        parser.error(f"--taus must be in [1, {max(gammas) + 1}] (the largest gamma + 1), got {bad}")
    batches = tuple(args.batches or BATCHES[args.model])
    for flag, value, least in (("--batches", min(batches), 1), ("--prompt-len", args.prompt_len, 1),
                               ("--new-tokens", args.new_tokens, 2), ("--reps", args.reps, 1),
                               ("--inner", args.inner, 1), ("--rounds-per-call", args.rounds_per_call, 1)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    return Plan(args.model, args.rows, batches, tuple(args.taus), tuple(gammas), args.prompt_len, args.new_tokens,
                args.reps, args.inner, args.rounds_per_call, args.auto)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    plan = plan_of(parser, args)
    # bf16 as served on the GPU; float32 on the CPU, whose XLA lacks some bf16 dot kernels.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    run = Run(args.budget_s, args.out, "planted_bench.json")
    run.record("versions", versions())
    run.record("plan", dataclasses.asdict(plan))
    run_all(run, plan, dtype)
    print(summary(run.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
