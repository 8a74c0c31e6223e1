"""Draft trees against chains at Qwen3-8B shapes on the current device: the engine's call of rounds, per round, for
a chain and for trees of the same depth at batch 1, 8 and 32, beside the spec-off step at the same KV length; and
what each would decode at the demo pair's measured taus: tau x batch / round tokens/s, a speedup of tau x step /
round over spec-off.

    python -m eagle3_jax_bench.trees --out DIR [--tiny] [--batches 1 8 32] [--kernels pallas]

The rounds are the engine's own jitted call (spec_round.spec_rounds through engine.jit_rounds, rounds_per_call
rounds to a call, random bf16 weights, KV length 1024, greedy), built from a StepSpec as dense.py builds its rounds
(dense.spec_rounds). A tree's round drafts D steps of K beams (K tokens a row per drafter forward), verifies N + 1
tokens under the tree mask and copies its accepted path's KV into place; its cost over the chain of the same depth
is the first figure to read, and it grows with the batch (verification then reads tokens, not only weights).
The taus (DEMO_TAUS) are the demo pair's on the CPU (BENCHMARKS.md (i): eagle3_jax_bench/pair.py --trees, float32,
24 held-out prompts, 96 new tokens, max_batch 8); a random-weight round's acceptance is not the point.
--tiny runs the tiny preset with small trees (a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax.decoding.tree import TreeShape
from eagle3_jax.models import kernels as kernels_lib

from . import dense
from .core import Run, versions

# (chain depth, trees of that depth as (N, D, K)): the shapes measured on the demo pair.
CONFIGS = ((3, ()), (4, ((8, 4, 2), (16, 4, 4))), (5, ((16, 5, 4),)), (7, ((24, 7, 4), (32, 7, 6), (32, 7, 8))))
TINY_CONFIGS = ((2, ((4, 2, 2),)),)
# The demo pair's taus (greedy, sampled at temperature 0.7) per configuration: ("chain", gamma) or ("tree", N, D, K),
# measured on the CPU (BENCHMARKS.md (i), docs/demo.md: `python -m eagle3_jax_bench.pair --trees`).
DEMO_TAUS = {
    ("chain", 3): (3.08, 2.24), ("chain", 4): (3.56, 2.25), ("chain", 5): (3.85, 2.52), ("chain", 7): (4.60, 2.57),
    ("tree", 8, 4, 2): (3.83, 2.83), ("tree", 16, 4, 4): (4.09, 2.98), ("tree", 16, 5, 4): (4.51, 3.24),
    ("tree", 24, 7, 4): (5.35, 3.87), ("tree", 32, 7, 6): (5.52, 3.75), ("tree", 32, 7, 8): (5.48, 3.60),
}
# The dry run's taus are made up: it checks the arithmetic, not a drafter.
TINY_TAUS = {("chain", 2): (2.0, 1.5), ("tree", 4, 2, 2): (2.5, 2.0)}


def rows(s: dense.Setup, batches, configs, kernels: str, taus: dict) -> list[dict]:
    """Per batch: the spec-off step, then per depth its chain's round and each tree's, with the projections at the
    configurations' taus (`taus`, as DEMO_TAUS)."""
    out = []
    L = s.plan.spec_kv_length
    for batch in batches:
        step_s = dense.spec_off(s, batch, L, kernels).seconds
        for depth, shapes in configs:
            chain_s = None
            for shape in (None,) + tuple(shapes):
                tree = None if shape is None else TreeShape(*shape)
                timed = dense.spec_rounds(s, batch, depth, kernels, s.rounds_per_call, tree)
                chain_s = chain_s or timed.seconds
                key = ("chain", depth) if shape is None else ("tree", *shape)
                row = {"batch": batch, "kv_len": L, "kernels": kernels, "config": list(key), "depth": depth,
                       "round_ms": timed.seconds * 1e3, "step_ms": step_s * 1e3,
                       "round_over_step": timed.seconds / step_s,
                       "round_over_chain_of_its_depth": timed.seconds / chain_s, "compile_s": timed.compile_s}
                if key in taus:
                    for name, tau in zip(("greedy", "sampled"), taus[key]):
                        row[f"{name}_tau"] = tau
                        row[f"{name}_tokens_per_s"] = batch * tau / timed.seconds
                        row[f"{name}_speedup"] = tau * step_s / timed.seconds
                out.append(row)
                print(json.dumps(row), flush=True)
    shallowest = ["chain", configs[0][0]]
    for row in out:  # tokens/s over the shallowest chain's (gamma 3 at Qwen3-8B shapes) at the same batch
        base = next((r for r in out if r["batch"] == row["batch"] and r["config"] == shallowest), None)
        if base and "greedy_tokens_per_s" in row and "greedy_tokens_per_s" in base:
            for name in ("greedy", "sampled"):
                row[f"{name}_over_first_chain"] = row[f"{name}_tokens_per_s"] / base[f"{name}_tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.trees", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny preset and small trees (a CPU dry run)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32 (--tiny: 2)")
    parser.add_argument("--kernels", choices=kernels_lib.CHOICES, default=None,
                        help="default: pallas on a GPU, xla elsewhere")
    args = parser.parse_args(argv)
    plan = dense.tiny_plan() if args.tiny else dense.qwen3_8b_plan()
    batches = tuple(args.batches or ((2,) if args.tiny else (1, 8, 32)))
    kernels = args.kernels or kernels_lib.default()
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    run = Run(budget_s=1e9, out=None, filename="")
    s = dense.setup(run, plan, (kernels,), dtype)
    results = {"device": jax.devices()[0].device_kind, "versions": versions(), "shape": "tiny" if args.tiny else
               "Qwen3-8B", "rounds_per_call": s.rounds_per_call,
               "rows": rows(s, batches, TINY_CONFIGS if args.tiny else CONFIGS, kernels,
                            TINY_TAUS if args.tiny else DEMO_TAUS)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trees.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
