"""Is the Mosaic GPU prefill kernel deterministic? Bitwise comparison of 100 calls per shape.

A race in its barrier protocol (slot reuse, the skip loop, ping-pong turns) would show as calls
that differ. Shapes: the engine's prefill (start 0, both tiles of a pair take the same steps) and
starts off the key-block grid (the first tile of a pair skips steps: the skip loop runs).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.prefill_attention_mgpu import prefill_attention_mgpu
from pallas_kernels.prefill_attention import prefill_attention

SHAPES = [  # B, T, S, N, K, H, starts
    (1, 256, 512, 32, 8, 128, (0,)),
    (2, 520, 1024, 32, 8, 128, (0, 300)),
    (1, 2048, 4096, 32, 8, 128, (64,)),
    (3, 384, 512, 8, 8, 64, (0, 64, 128)),
]
for B, T, S, N, K, H, starts in SHAPES:
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(x, (B, K, S, H), jnp.bfloat16) for x in keys[1:])
    start = jnp.array(starts, jnp.int32)
    for name, fn in (("mosaic", prefill_attention_mgpu), ("triton", prefill_attention)):
        f = jax.jit(lambda q, k, v, s: fn(q, k, v, s, scale=H**-0.5))
        first = f(q, k, v, start)
        differ = sum(int(jnp.any(f(q, k, v, start) != first)) for _ in range(100))
        # Also inside a larger jit, beside other work, as in the engine.
        g = jax.jit(lambda q, k, v, s: fn(q * 1, k, v, s, scale=H**-0.5) + 0)
        differ_in_jit = sum(int(jnp.any(g(q, k, v, start) != first)) for _ in range(20))
        print(f"{name} {[B, T, S, N, K, H]} starts {starts}: {differ}/100 calls differ from the first; "
              f"in a larger jit {differ_in_jit}/20", flush=True)
