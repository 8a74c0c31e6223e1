"""How much of the batch-1 spec-off step is per-call overhead (graph launch, PJRT's host callback)?
The engine's round run k times inside one jit (unrolled, or a lax.scan): wall time per round, and the GPU
kernel time per round from a trace, in one process. Repeated twice to see the spread."""
import functools
import json
import os
import time

import jax
import jax.numpy as jnp

from eagle3_jax import bench as bench_lib
from eagle3_jax import measure, spec_round
from eagle3_jax.engine import Engine

plan = bench_lib.qwen3_8b_plan()
b = bench_lib.Bench(plan, ("pallas",), 1e9, jnp.bfloat16, None)
b.ceilings()
L = 1024
engine = Engine(b.target, None, max_len=L + 64, kernels="pallas")
one = functools.partial(spec_round.spec_round, spec=engine._spec)
compiled = {}
for k, how in ((1, "unrolled"), (4, "unrolled"), (4, "scan"), (8, "scan")):
    def rounds(tparams, state, k=k, how=how):
        if how == "scan":  # one loop in the graph, if XLA's command buffers take while loops
            return jax.lax.scan(lambda s, _: one(tparams, None, s), state, None, length=k)
        outs = []
        for _ in range(k):
            state, out = one(tparams, None, state)
            outs.append(out)
        return state, jnp.stack(outs)
    state = bench_lib.decode_state(plan, 1, L, L + 64, jnp.bfloat16, with_drafter=False)
    t0 = time.perf_counter()
    compiled[k, how] = jax.jit(rounds, donate_argnums=(1,)).lower(b.tparams, state).compile()
    print(f"compile k={k} {how}: {time.perf_counter() - t0:.1f} s", flush=True)
rows = []
for repeat in range(2):
    for (k, how), fn in compiled.items():
        state = bench_lib.decode_state(plan, 1, L, L + 64, jnp.bfloat16, with_drafter=False)
        seconds, state = measure.time_chain(lambda s, fn=fn: fn(b.tparams, s), state, (), plan.reps, plan.inner)
        holder = [state]

        def run(fn=fn):
            holder[0], out = fn(b.tparams, holder[0])
            return out
        kt = measure.gpu_kernel_times(run) if repeat == 0 else {}
        row = {"repeat": repeat, "rounds_per_call": k, "how": how, "ms_per_round": round(seconds * 1e3 / k, 4),
               "kernel_sum_ms_per_round": round(sum(us for _, us in kt.values()) / 1e3 / k, 4), "copy_tbps": b.bw}
        rows.append(row)
        print(json.dumps(row), flush=True)
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "out"), "steps_per_call.json"), "w"), indent=1)
