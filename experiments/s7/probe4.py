"""Seventh session, device call 6: the swapped-matmul decode loop (decode_swap.py) against the reference
(partials merged in XLA) and its kernel time against the unswapped loop and the Triton kernel.

  PYTHONPATH=.:experiments/s7 python3 -W ignore::DeprecationWarning experiments/s7/probe4.py
"""
import os
from functools import partial

import jax
import jax.numpy as jnp

import probe
from decode_mgpu import decode_attention_mgpu
from decode_swap import decode_swap_partials, merge_partials
from pallas_kernels import bench_attention as ba
from pallas_kernels.attention import attention_reference, decode_attention

CHECKS = [  # (B, T, S, N, K, H, starts, splits, W)
    (1, 1, 16384, 32, 8, 128, (16383,), 8, 2),
    (1, 8, 16384, 32, 8, 128, (16376,), 16, 1),
    (1, 4, 16384, 32, 8, 128, (5000,), 8, 2),
    (2, 2, 2048, 64, 4, 128, (0, 1500), 4, 2),
    (2, 8, 1024, 16, 16, 128, (127, 1016), 2, 1),
    (1, 4, 2048, 32, 8, 64, (999,), 8, 2),
]


def check():
    for B, T, S, n, kvh, h, starts, splits, W in CHECKS:
        keys = jax.random.split(jax.random.key(T + S + B), 3)
        q = jax.random.normal(keys[0], (B, T, n, h), jnp.bfloat16)
        k, v = (jax.random.normal(x, (B, kvh, S, h), jnp.bfloat16) for x in keys[1:])
        start = jnp.array(starts, jnp.int32)
        ref = attention_reference(q, k, v, start, scale=h**-0.5)
        try:
            part = decode_swap_partials(q, k, v, start, scale=h**-0.5, splits=splits, W=W)
            err = ba._rel_err(merge_partials(part, num_heads=n, dtype=q.dtype), ref)
        except Exception as e:
            err = ba._short(e)
        probe.ROWS.append({"kind": "swap_check", "shape": [B, T, S, n, kvh, h], "splits": splits, "W": W, "err": err})
        probe.save()
        probe.log(f"check {[B, T, S, n, kvh, h]} starts {starts} splits {splits} W {W}: err {err}")


def timing(copy_bw):
    key = jax.random.key(2)
    for B, L, T in [(1, 16384, 1), (1, 16384, 4), (1, 16384, 8), (1, 32768, 1), (1, 32768, 8)]:
        kv_sets = ba._kv_sets(key, B, L)
        start = jnp.full((B,), L - T, jnp.int32)
        qs = ba._queries(key, B, T, len(kv_sets))
        kv_bytes = 2 * B * ba.K * L * ba.H * 2
        ops = {"triton": partial(decode_attention, scale=ba.SCALE),
               "loop64": partial(decode_attention_mgpu, scale=ba.SCALE, merge="none"),
               "loop128": partial(decode_attention_mgpu, scale=ba.SCALE, merge="none", max_splits=16, cluster=False,
                                  compute_warpgroups=1)}
        for splits, W in ((8, 2), (8, 1), (16, 1), (16, 2)):
            ops[f"swap{splits}w{W}"] = partial(decode_swap_partials, scale=ba.SCALE, splits=splits, W=W)
        row = {"kind": "swap_time", "B": B, "L": L, "T": T}
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
    check()
    timing(copy_bw)
