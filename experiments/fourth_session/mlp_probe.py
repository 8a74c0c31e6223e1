"""The batch-1 MLP written as row reductions: which form of gate/up (one reduction then a silu-product
kernel, or gate and up as two reductions XLA may fuse with the product) and of down (GEMM or row
reduction) takes the least GPU time? A dependent chain of six Qwen3-8B MLPs per jit."""
import json
import os

import jax
import jax.numpy as jnp

from eagle3_jax import measure

D, I, CHAIN = 4096, 12288, 6


def rowreduce(x, w):
    return (x[:, None, :].astype(jnp.float32) * w.astype(jnp.float32)).sum(-1).astype(x.dtype)


def gemm(x, w):
    return jnp.einsum("bd,od->bo", x, w)


def gate_up_one(x, w):
    g, u = jnp.split(rowreduce(x, w), 2, axis=-1)
    return jax.nn.silu(g) * u


def gate_up_two(x, w):
    return jax.nn.silu(rowreduce(x, w[:I])) * rowreduce(x, w[I:])


def gate_up_stacked(x, w):
    o = (x[:, None, None, :].astype(jnp.float32) * w.reshape(2, I, D).astype(jnp.float32)).sum(-1)
    return (jax.nn.silu(o[:, 0]) * o[:, 1]).astype(x.dtype)


VARIANTS = {
    "one+down_rowreduce": (gate_up_one, rowreduce),
    "one+down_gemm": (gate_up_one, gemm),
    "two+down_gemm": (gate_up_two, gemm),
    "stacked+down_gemm": (gate_up_stacked, gemm),
    "two+down_rowreduce": (gate_up_two, rowreduce),
    "gemm+gemm (xla default)": (lambda x, w: (lambda g, u: jax.nn.silu(g) * u)(*jnp.split(gemm(x, w), 2, -1)), gemm),
}
w_gu = [measure.normal(jax.random.key(i), (2 * I, D), jnp.bfloat16) for i in range(CHAIN)]
w_d = [measure.normal(jax.random.key(100 + i), (D, I), jnp.bfloat16) for i in range(CHAIN)]
x = measure.normal(jax.random.key(99), (1, D), jnp.bfloat16)
floor_us = 3 * D * I * 2 / 4.27e12 * 1e6
rows = []
for name, (gu, down) in VARIANTS.items():
    def chain(x, w_gu, w_d, gu=gu, down=down):
        for a, b in zip(w_gu, w_d):
            x = x + down(gu(x, a), b)
        return x
    f = jax.jit(chain)
    compiled = f.lower(x, w_gu, w_d).compile()
    times = measure.gpu_kernel_times(lambda: f(x, w_gu, w_d), reps=5)
    total = sum(us for _, us in times.values()) / CHAIN
    row = {"variant": name, "us_per_mlp": round(total, 2), "x_floor": round(total / floor_us, 3),
           "kernels_per_mlp": round(sum(n for n, _ in times.values()) / CHAIN, 2),
           "kernels": {k: round(us / CHAIN, 2) for k, (_, us) in sorted(times.items(), key=lambda kv: -kv[1][1])}}
    rows.append(row)
    print(json.dumps(row), flush=True)
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "out"), "mlp.json"), "w"), indent=1)
