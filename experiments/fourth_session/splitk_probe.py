"""Can the split-K reduce kernels after XLA's batch-1 GEMMs go? Times x @ W.T as XLA emits it (GEMM +
reduce) against a GEMM batched over S slices of the contraction dim with float32 partials out (what a
fused consumer kernel would sum), at the target's four weight shapes. GPU kernel times from a trace."""
import json
import os

import jax
import jax.numpy as jnp

from eagle3_jax import measure

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CHAIN = 6  # distinct weights per jit, so nothing is served from L2
results = []
for name, (O, D) in SHAPES.items():
    ws = [measure.normal(jax.random.key(i), (O, D), jnp.bfloat16) for i in range(CHAIN)]
    x = measure.normal(jax.random.key(99), (1, D), jnp.bfloat16)
    floor_us = O * D * 2 / 4.27e12 * 1e6
    variants = {"xla": None, "rowreduce": 0, **{f"S{s}": s for s in (4, 8, 16) if D % (s * 64) == 0}}
    for label, S in variants.items():
        def chain(x, ws, S=S):
            # A dependent chain, as in the model: each matmul's input comes from the one before.
            for w in ws:
                if S is None:
                    out = jnp.einsum("bd,od->bo", x, w)
                elif S == 0:  # the matvec as a row reduction: one kernel, no split-K
                    out = jnp.sum(x[:, None, :].astype(jnp.float32) * w.astype(jnp.float32), -1).astype(x.dtype)
                else:  # float32 partials, summed after a barrier (a fused consumer kernel would sum them)
                    parts = jnp.einsum("bsk,osk->sbo", x.reshape(1, S, D // S), w.reshape(O, S, D // S),
                                       preferred_element_type=jnp.float32)
                    out = jax.lax.optimization_barrier(parts).sum(0).astype(x.dtype)
                x = jnp.tile(out, (1, -(-D // O)))[:, :D]
            return x
        f = jax.jit(chain)
        compiled = f.lower(x, ws).compile()
        times = measure.gpu_kernel_times(lambda: f(x, ws), reps=5)
        total = sum(us for _, us in times.values()) / CHAIN
        kernels = {k: round(us / CHAIN, 2) for k, (_, us) in times.items()}
        row = {"weight": name, "variant": label, "us_per_matmul": round(total, 2),
               "x_floor": round(total / floor_us, 3),
               "kernels_per_matmul": round(sum(n for n, _ in times.values()) / CHAIN, 2), "kernels": kernels,
               "hlo_kernels": measure.kernel_count(compiled)}
        results.append(row)
        print(json.dumps(row), flush=True)
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "out"), "splitk.json"), "w"), indent=1)
