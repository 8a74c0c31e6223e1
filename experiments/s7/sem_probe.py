"""Seventh session, device call 7: what a GMEM semaphore costs a Mosaic GPU kernel per call (Pallas
zero-fills the semaphore buffer before every call): 128 CTAs, 15 per KV head signal and one waits,
against the same kernel without the semaphore; kernel time per call and the kernels it launches.

  PYTHONPATH=. python3 -W ignore::DeprecationWarning experiments/s7/sem_probe.py run
"""
import sys
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def make(with_sem):
    def body(x_ref, o_ref):
        h, s = lax.axis_index("heads"), lax.axis_index("split")
        if with_sem:
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((8,)))
            @pl.when(s != 0)
            def _():
                pl.semaphore_signal(sem.at[h], 1)
            @pl.when(s == 0)
            def _():
                pl.semaphore_wait(sem.at[h], 15)
                o_ref[h] = x_ref[h] + 1.0
        else:
            @pl.when(s == 0)
            def _():
                o_ref[h] = x_ref[h] + 1.0
    def run(x):
        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8, 16),
                            grid_names=("heads", "split"),
                            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))(x)
    return run

def device_run():
    from pallas_kernels import bench_attention as ba
    x = jnp.ones((8, 128), jnp.float32)
    for w in (False, True):
        f = jax.jit(lambda x, f=make(w): [f(x + i) for i in range(16)])
        jax.block_until_ready(f(x))
        kern = ba.kernel_ns(lambda: f(x))
        print(f"semaphore {w}: {sum(kern.values()) / 16 / 1e3:.2f} us per call;",
              {k: round(v / 16 / 1e3, 2) for k, v in kern.items()}, flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["run"]:
    device_run()
elif __name__ == "__main__":
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    for w in (False, True):
        try:
            t = jax.jit(make(w)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
            print(w, "ok", len(t), "zeros" if "broadcast" in t else "")
        except Exception as e:
            print(w, "FAIL", type(e).__name__, str(e)[:800])
