"""How fast can a kernel read 67 MB (batch-1 K/V at 16k keys) or 134 MB (32k)? Kernel time, H200.

jnp.copy (read + write) and a read-only sum, at the decode attention's sizes and at 4 GiB; and
our decode kernel at batch 1, 16k and 32k keys, T=1, for the same run's comparison.
"""

import jax
import jax.numpy as jnp

from eagle3_jax import measure
from pallas_kernels.attention import decode_attention

for nbytes in (67_108_864, 134_217_728, 2**32):
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    for name, f, moved in (("copy", jax.jit(jnp.copy), 2 * nbytes),
                           ("sum", jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), nbytes)):
        jax.block_until_ready(f(x))
        times = measure.gpu_kernel_times(lambda: f(x), 5)
        us = sum(t for _, t in times.values())  # per run
        print(f"{name:4} {nbytes / 1e6:8.1f} MB: {us:8.2f} us kernel, {moved / us / 1e6:.2f} TB/s {list(times)}",
              flush=True)
    del x

for L in (16384, 32768):
    k = jax.random.normal(jax.random.key(0), (1, 8, L, 128), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), (1, 8, L, 128), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(2), (1, 1, 32, 128), jnp.bfloat16)
    start = jnp.array([L - 1], jnp.int32)
    f = jax.jit(lambda q, k, v, s: decode_attention(q, k, v, s, scale=128**-0.5))
    jax.block_until_ready(f(q, k, v, start))
    times = measure.gpu_kernel_times(lambda: f(q, k, v, start), 10)
    total = sum(t for _, t in times.values())  # per run
    print(f"decode B=1 L={L}: {total:.2f} us kernel, {k.nbytes * 2 / total / 1e6:.2f} TB/s; "
          + ", ".join(f"{n} {t:.2f}" for n, (_, t) in times.items()), flush=True)
