"""Seventh session, device call 2: the loop alone (merge "none") with 16 splits and no cluster, against
8 splits in clusters, at batch 1; and a profile of the 16-split loop.

  PYTHONPATH=.:experiments/s7 python3 -W ignore::DeprecationWarning experiments/s7/probe2.py
"""
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp

import probe
from decode_mgpu import decode_attention_mgpu
from pallas_kernels import bench_attention as ba
from pallas_kernels.attention import decode_attention


def timing(copy_bw):
    key = jax.random.key(2)
    tunings = [{"merge": "none"}, {"merge": "none", "max_splits": 16, "cluster": False},
               {"merge": "none", "max_splits": 16, "cluster": False, "num_stages": 3},
               {"merge": "none", "max_splits": 16, "cluster": False, "compute_warpgroups": 1},
               {"merge": "none", "max_splits": 16, "cluster": False, "compute_warpgroups": 1, "num_stages": 4}]
    for B, L, T in [(1, 16384, 1), (1, 16384, 4), (1, 16384, 8), (1, 32768, 1), (1, 32768, 8)]:
        kv_sets = ba._kv_sets(key, B, L)
        start = jnp.full((B,), L - T, jnp.int32)
        qs = ba._queries(key, B, T, len(kv_sets))
        kv_bytes = 2 * B * ba.K * L * ba.H * 2
        ops = {"triton": partial(decode_attention, scale=ba.SCALE)}
        for i, t in enumerate(tunings):
            ops[f"m{i}"] = partial(decode_attention_mgpu, scale=ba.SCALE, **t)
        row = {"kind": "loop", "B": B, "L": L, "T": T, "tunings": tunings}
        for name, op in ops.items():
            try:
                run, _ = ba._batched(op, qs, kv_sets, start)
                row[f"{name}_dev_us"] = sum(ba.kernel_ns(run).values()) / len(qs) / 1e3
                row[f"{name}_dev_of_copy"] = kv_bytes / row[f"{name}_dev_us"] / 1e6 / copy_bw["copy_dev_TBps"]
            except Exception as e:
                row[f"{name}_error"] = ba._short(e)
        probe.ROWS.append(row)
        probe.save()
        probe.log(f"B={B} L={L} T={T}: " + "; ".join(
            f"{n} {row.get(n + '_dev_us', float('nan')):.2f}us ({row.get(n + '_dev_of_copy', float('nan')):.0%})"
            + (f" ERR {row[n + '_error']}" if n + "_error" in row else "") for n in ops))
        del kv_sets


if __name__ == "__main__":
    os.makedirs(probe.OUT, exist_ok=True)
    probe.LOG = open(os.path.join(probe.OUT, "log.txt"), "a")
    overhead = ba.dispatch_overhead()
    lim = ba.ceilings(overhead)
    copy_bw = {k: v for k, v in lim.items() if k.startswith("copy_")}
    probe.log("copy", copy_bw)
    timing(copy_bw)
    L, key = 16384, jax.random.key(2)
    kv = ba._caches(key, 1, L, 1)[0]
    for T in (1, 8):
        q, start = ba._queries(key, 1, T, 1)[0], jnp.full((1,), L - T, jnp.int32)
        d = os.path.join(probe.OUT, f"prof16_T{T}")
        os.makedirs(d, exist_ok=True)
        out = decode_attention_mgpu(q, *kv, start, scale=ba.SCALE, profile_dir=d, merge="none", max_splits=16,
                                    cluster=False)
        jax.block_until_ready(out)
        jax.effects_barrier()
        files = sorted(os.listdir(d))
        probe.log(f"profile T={T} 16 splits: {files}")
        if files:
            probe.summarize(os.path.join(d, files[-1]))
    sys.exit(0)
