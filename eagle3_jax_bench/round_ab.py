"""Two checkouts' call of rounds timed side by side on one machine: an A/B of a change to the round.

    python -m eagle3_jax_bench.round_ab --trees OLD NEW --out results.json [--batches 1 8] [--gamma 3] [--repeats 2]
    python -m eagle3_jax_bench.round_ab --trees OLD NEW --out results.json --dry-run   (the tiny preset, on the CPU)

A tree is a folder holding a checkout's `eagle3_jax`, `eagle3_jax_bench` and `pallas_kernels` (for example
`git archive REV eagle3_jax eagle3_jax_bench pallas_kernels | tar -x -C OLD`). Each (repeat, tree) runs in a child
process of its own with PYTHONPATH=tree, the trees alternating (A B A B ...), so that drift of the machine over the
run falls on both alike. A child builds the planted world's target and drafter (planted_world.py, random weights at
the preset's shapes), an Engine of them at --gamma and a spec-off Engine (the control: code a change to the
round should not touch), and times each one's `Engine.time_call` (the engine's own jitted call of rounds, from a
pool at --kv-length, as round_costs.py measures it) at each batch TIMINGS times; per round, the median.
Only API both checkouts share is used: the Engine's constructor and time_call, and planted_world.

Reported per tree, batch and gamma (0: the control): the median over repeats of each child's median, and the last
tree's over the first's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TIMINGS = 5  # time_call runs per (batch, gamma) in a child; each is 3 calls after an untimed one
KV_LENGTH = 1280  # the pool's default KV length: about the pool bench's mean live tokens


def child(model: str, batches: list[int], gamma: int, dtype: str, kv_length: int) -> dict:
    """Runs in the tree's process: seconds per round at each batch for gamma and 0."""
    import jax
    import jax.numpy as jnp

    import eagle3_jax
    from eagle3_jax_bench import planted_world, presets

    cfg, dcfg = presets.pair(model)
    world = planted_world.make_world(cfg, dcfg)
    target = planted_world.planted_target(cfg, world, jnp.dtype(dtype))
    drafter = planted_world.planted_drafter(dcfg, world, 0.5, jnp.dtype(dtype))
    jax.block_until_ready((target.params, drafter.params))
    max_len = kv_length + 256
    # Both engines are alive together: a paged engine takes KV for its slots (its default would fill the device).
    paged = "kv_tokens" in inspect.signature(eagle3_jax.Engine).parameters
    kv = {"kv_tokens": max(batches) * max_len} if paged else {}
    engines = {g: eagle3_jax.Engine(target, drafter if g else None, num_draft_tokens=g or 3, max_len=max_len,
                                    max_batch=max(batches), **kv) for g in (gamma, 0)}
    rows = {}
    for batch in batches:
        for g, eng in engines.items():
            calls = [eng.time_call(batch, kv_length, g) for _ in range(TIMINGS)]
            rows[f"{batch}/{g}"] = statistics.median(calls) / eng.rounds_per_call
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "round_s": rows}


def run(trees: list[Path], model: str, batches: list[int], gamma: int, repeats: int, dtype: str,
        kv_length: int) -> dict:
    runs = []
    for repeat in range(repeats):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
            args = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model, "--gamma", str(gamma),
                    "--dtype", dtype, "--kv-length", str(kv_length), "--batches", *map(str, batches)]
            done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"the child of {tree} failed:\n{done.stderr[-4000:]}")
            runs.append({"tree": str(tree), "repeat": repeat, **json.loads(done.stdout.strip().splitlines()[-1])})
    out = {"model": model, "gamma": gamma, "batches": batches, "kv_length": kv_length, "runs": runs, "rows": []}
    for batch in batches:
        for g in (gamma, 0):
            key = f"{batch}/{g}"
            ms = [statistics.median(r["round_s"][key] for r in runs if r["tree"] == str(t)) * 1e3 for t in trees]
            out["rows"].append({"batch": batch, "gamma": g, "ms": ms, "last_over_first": ms[-1] / ms[0]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.round_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=Path, nargs="+", help="checkouts to compare, the baseline first")
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-length", type=int, default=KV_LENGTH)
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset in float32, one repeat: a CPU check")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.dtype, args.repeats, args.batches, args.kv_length = "tiny", "float32", 1, [1, 2], 128
    if args.child:
        print(json.dumps(child(args.model, args.batches, args.gamma, args.dtype, args.kv_length)))
        return 0
    if not args.trees or args.out is None:
        parser.error("--trees and --out are required")
    out = run(args.trees, args.model, args.batches, args.gamma, args.repeats, args.dtype, args.kv_length)
    for row in out["rows"]:
        print(f"batch {row['batch']:>3} gamma {row['gamma']}: " + " / ".join(f"{m:.3f}" for m in row["ms"])
              + f" ms a round; last / first {row['last_over_first']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    # Run as a file (a child), Python puts this folder first on the path, where its modules would shadow the
    # standard library's (profile.py): the tree's packages come from PYTHONPATH.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
    raise SystemExit(main())
