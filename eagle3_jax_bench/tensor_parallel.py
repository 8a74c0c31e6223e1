"""What tensor parallelism's code path costs on one device: the engine's call of rounds through the sharded
steps (a shard_map over a mesh of one device, eagle3_jax/decoding/parallel_steps.py) against the unsharded engine's
own jitted call, at a preset's shapes with random weights (no downloads).

    python -m eagle3_jax_bench.tensor_parallel --out DIR [--model qwen3-8b] [--batches 1 8] [--gammas 0 3]

gamma 0 is the spec-off decode step; gamma > 0 a speculative round with a random drafter. Both paths run
the same weights (at tp 1 the mesh's shards are the unsharded arrays, relabelled), from copies of one random
state at --kv-len, compiled ahead of the timed region; each is timed twice, alternating, and the faster
median kept. Reported per round: ms unsharded, ms sharded, and their ratio (the goal: at most 1.01); and
whether both paths, after the same calls, hold the same tokens and lengths (tp 1 decodes as one device).
With --tp N > 1: the spec-off step on a mesh of N devices against its floor instead (tp_floor.py).
Writes tensor_parallel.json under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import parallel_steps, spec_round
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import weights
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.mesh import tp_mesh

from . import presets, tp_floor
from .core import Run, compile_timed, time_chain, versions
from .inputs import random_models, random_state


def on_mesh(tree, specs, mesh):
    """A pytree's arrays relabelled onto a one-device mesh by a prefix tree of PartitionSpecs."""
    return jax.tree.map(lambda spec, sub: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), sub),
                        specs, tree, is_leaf=lambda x: isinstance(x, P) or x is None)


def measure(run: Run, models, target, drafter, batch: int, gamma: int, args) -> None:
    mesh = tp_mesh(1)
    capacity = args.kv_len + 1024
    spec = spec_round.StepSpec(target=models[0], proposer=Eagle3(models[1]) if gamma else None, gamma=gamma,
                               max_len=capacity, kernels=args.kernels)
    local = parallel_steps.local_spec(spec, 1)
    dparams = drafter.params if gamma else None
    tparams_tp = on_mesh(target.params, weights.partition_specs(weights.target_weights(local.target),
                                                                layout.TARGET_RULES), mesh)
    dparams_tp = on_mesh(dparams, P(), mesh) if gamma else None

    def state():
        return random_state(models, batch, args.kv_len, capacity, target.params["embed"].dtype, gamma > 0)

    one, one_s = compile_timed(engine_lib.jit_rounds, target.params, dparams, state(), spec=spec,
                               num_rounds=args.rounds_per_call)
    sharded, sharded_s = compile_timed(parallel_steps.jit_rounds, tparams_tp, dparams_tp,
                                       on_mesh(state(), parallel_steps.state_specs(local), mesh), spec=local,
                                       num_rounds=args.rounds_per_call, mesh=mesh)
    calls = {"unsharded": lambda s: one(target.params, dparams, s),
             "sharded": lambda s: sharded(tparams_tp, dparams_tp, s)}
    states = {"unsharded": state(), "sharded": on_mesh(state(), parallel_steps.state_specs(local), mesh)}
    best = {}
    for _ in range(2):
        for name, call in calls.items():
            seconds, states[name] = time_chain(call, states[name], (), args.reps, args.inner)
            best[name] = min(best.get(name, seconds), seconds)
    per_round = {k: v / args.rounds_per_call * 1e3 for k, v in best.items()}
    # Both paths ran the same calls from the same state: a greedy engine's tokens and lengths must agree.
    ends = [jax.device_get((s.last_token, s.num_generated, s.lengths)) for s in states.values()]
    same = all(np.array_equal(a, b) for a, b in zip(*ends))
    run.add("rounds", {"batch": batch, "gamma": gamma, "kv_len": args.kv_len, "unsharded_ms": per_round["unsharded"],
                       "sharded_ms": per_round["sharded"], "ratio": per_round["sharded"] / per_round["unsharded"],
                       "same_tokens": same, "compile_s": {"unsharded": one_s, "sharded": sharded_s}})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(presets.PRESETS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gammas", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--rounds-per-call", type=int, default=engine_lib.ROUNDS_PER_CALL)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget-s", type=float, default=170.0)
    parser.add_argument("--tp", type=int, default=1, help="> 1: the step on this many devices against its floor")
    parser.add_argument("--copy-mb", type=int, default=4096, help="--tp > 1: the copy-rate probe's size")
    parser.add_argument("--allreduce-mb", type=int, default=256, help="--tp > 1: the all-reduce-rate probe's size")
    args = parser.parse_args(argv)
    models = presets.pair(args.model)
    args.kernels = kernels_lib.default()
    run = Run(args.budget_s, args.out, "tensor_parallel.json")
    run.record("versions", versions())
    if args.tp > 1:
        run.ceilings(args.copy_mb << 20, None)
        mesh = tp_mesh(args.tp)
        for batch in args.batches:
            if run.time_left(f"tp {args.tp} batch {batch}"):
                tp_floor.measure(run, models[0], mesh, batch, args)
        return 0
    target, drafter = random_models(models, jax.numpy.dtype(args.dtype))
    for gamma in args.gammas:
        for batch in args.batches:
            if run.time_left(f"batch {batch} gamma {gamma}"):
                measure(run, models, target, drafter, batch, gamma, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
