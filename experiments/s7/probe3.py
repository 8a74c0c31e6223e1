"""Seventh session, device call 3: what the owner's combine costs (8 kcycles in call 1): variants that load
only the o rows, or load the CTA's own buffers instead of the peers'; profiles with the load and the math
scoped apart.

  PYTHONPATH=.:experiments/s7 python3 -W ignore::DeprecationWarning experiments/s7/probe3.py
"""
import os
from functools import partial

import jax
import jax.numpy as jnp

import probe
from decode_mgpu import decode_attention_mgpu
from pallas_kernels import bench_attention as ba

if __name__ == "__main__":
    os.makedirs(probe.OUT, exist_ok=True)
    probe.LOG = open(os.path.join(probe.OUT, "log.txt"), "a")
    overhead = ba.dispatch_overhead()
    lim = ba.ceilings(overhead)
    copy_bw = {k: v for k, v in lim.items() if k.startswith("copy_")}
    probe.log("copy", copy_bw)
    key, L = jax.random.key(2), 16384
    variants = [{}, {"combine": "o_only"}, {"combine": "local"}, {"merge": "none"}]
    for T in (1, 8):
        kv_sets = ba._kv_sets(key, 1, L)
        start = jnp.full((1,), L - T, jnp.int32)
        qs = ba._queries(key, 1, T, len(kv_sets))
        for t in variants:
            run, _ = ba._batched(partial(decode_attention_mgpu, scale=ba.SCALE, **t), qs, kv_sets, start)
            us = sum(ba.kernel_ns(run).values()) / len(qs) / 1e3
            probe.ROWS.append({"kind": "combine", "T": T, "tuning": t, "dev_us": us})
            probe.save()
            probe.log(f"T={T} {t}: {us:.2f} us")
            d = os.path.join(probe.OUT, f"prof_T{T}_{t.get('combine', t.get('merge', 'full'))}")
            os.makedirs(d, exist_ok=True)
            out = decode_attention_mgpu(qs[0], *kv_sets[0], start, scale=ba.SCALE, profile_dir=d, **t)
            jax.block_until_ready(out)
            jax.effects_barrier()
            files = sorted(os.listdir(d))
            if files:
                probe.summarize(os.path.join(d, files[-1]))
        del kv_sets
