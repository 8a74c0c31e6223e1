"""Sixth session: how fast can Mosaic GPU CTAs stream one KV head's keys at batch 1, with and
without thread-block clusters? The decode kernel's loader protocol with no compute.

  PYTHONPATH=. python3 experiments/s6/read_probe.py
"""
import functools, json, os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import bench_attention as ba

K, H = 8, 128


def read_only(k_cache, v_cache, *, splits, cluster, bkv=128, stages=2):
    B, _, S, _ = k_cache.shape
    tiled = functools.partial(plgpu.SMEM, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))

    def body(k_ref, v_ref, o_ref, k_smem, v_smem, ready_k, ready_v, free_k, free_v):
        head, b = lax.axis_index("heads"), lax.axis_index("batch")
        split = lax.axis_index("split")
        blocks = S // bkv
        lo, hi = split * blocks // splits, (split + 1) * blocks // splits

        @pl.when(lax.axis_index("wg") == 0)
        def _():
            @pl.loop(lo, hi)
            def _(i):
                slot = lax.rem(i - lo, stages)
                for ready, free in ((ready_k, free_k), (ready_v, free_v)):
                    plgpu.barrier_wait(ready.at[slot])
                    plgpu.barrier_arrive(free.at[slot])
            o_ref.at[b, head, split][...] = plgpu.layout_cast(jnp.zeros((H,), jnp.float32),
                                                              plgpu.Layout.WG_STRIDED((H,), vec_size=1))

        @pl.when(lax.axis_index("wg") == 1)
        def _():
            @pl.loop(lo, hi)
            def _(i):
                slot = lax.rem(i - lo, stages)
                for ref, smem, ready, free in ((k_ref, k_smem, ready_k, free_k), (v_ref, v_smem, ready_v, free_v)):
                    @pl.when(i - lo >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])
                    plgpu.copy_gmem_to_smem(ref.at[b, head, pl.ds(i * bkv, bkv)], smem.at[slot], ready.at[slot])

    def entry(k_ref, v_ref, o_ref):
        pl.run_scoped(lambda *s: body(k_ref, v_ref, o_ref, *s),
                      tiled((stages, bkv, H), jnp.bfloat16), tiled((stages, bkv, H), jnp.bfloat16),
                      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                      collective_axes="wg")

    if cluster:
        mesh = dict(grid=(K, B), grid_names=("heads", "batch"), cluster=(splits,), cluster_names=("split",))
    else:
        mesh = dict(grid=(splits, K, B), grid_names=("split", "heads", "batch"))
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((B, K, splits, H), jnp.float32), num_threads=2,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                        **mesh)(k_cache, v_cache)


if __name__ == "__main__":
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    overhead = ba.dispatch_overhead()
    lim = ba.ceilings(overhead)
    rows = []
    for L in (16384, 32768):
        kv_sets = ba._kv_sets(jax.random.key(0), 1, L)
        kv_bytes = 2 * K * L * H * 2
        for splits, cluster, stages in [(16, True, 2), (8, True, 2), (16, False, 2), (8, False, 2), (8, False, 3),
                                        (16, False, 3), (4, True, 2)]:
            op = functools.partial(read_only, splits=splits, cluster=cluster, stages=stages)
            row = dict(L=L, splits=splits, cluster=cluster, stages=stages)
            try:
                run, _ = ba._batched(lambda q, k, v, s: op(k, v), [None] * len(kv_sets), kv_sets, None)
                ns = ba.kernel_ns(run)
                row["dev_us"] = sum(ns.values()) / len(kv_sets) / 1e3
                row["dev_of_copy"] = kv_bytes / row["dev_us"] / 1e6 / lim["copy_dev_TBps"]
            except Exception as e:
                row["error"] = ba._short(e)
            rows.append(row)
            print(row, flush=True)
            with open(os.path.join(out, "read_probe.json"), "w") as f:
                json.dump(rows, f, indent=1)
        del kv_sets
