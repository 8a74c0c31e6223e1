"""Sixth session, device call 1: the Mosaic GPU decode kernel against the reference and the Triton kernel.

  PYTHONPATH=. python3 experiments/s6/decode_mgpu_probe.py
"""
import json, os, sys, time
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import bench_attention as ba
from pallas_kernels.attention import attention_reference, decode_attention
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu, MosaicDecodeConfig

OUT = os.environ.get("OUT", "./out")
ROWS = []


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


# (B, T, S, N, K, H, starts, tuning)
CHECKS = [
    (1, 1, 16384, 32, 8, 128, (16383,), {}),
    (1, 8, 16384, 32, 8, 128, (16376,), {}),
    (1, 4, 16384, 32, 8, 128, (5000,), {}),
    (1, 1, 256, 32, 8, 128, (0,), {}),
    (1, 1, 256, 32, 8, 128, (126,), {}),
    (1, 2, 1024, 32, 8, 128, (127,), {}),
    (1, 1, 1024, 32, 8, 128, (128,), {}),
    (4, 4, 2048, 32, 8, 128, (0, 127, 1500, 2044), {}),
    (2, 8, 4096, 32, 8, 128, (4000, 4090), {}),
    (8, 4, 4096, 32, 8, 128, (0, 1, 127, 128, 129, 1000, 4000, 4092), {}),
    (32, 1, 1024, 32, 8, 128, tuple(range(0, 1024, 32)), {}),
    (1, 8, 2048, 16, 16, 128, (1000,), {}),     # G = 1
    (1, 8, 2048, 16, 8, 128, (1001,), {}),      # G = 2
    (1, 4, 2048, 64, 8, 128, (999,), {}),       # G = 8
    (1, 2, 2048, 64, 4, 128, (777,), {}),       # G = 16
    (2, 4, 2048, 32, 8, 64, (5, 2000), {}),     # head_dim 64
    (1, 8, 16384, 32, 8, 128, (9000,), {"compute_warpgroups": 1, "block_kv": 128}),
    (1, 1, 16384, 32, 8, 128, (9000,), {"compute_warpgroups": 3}),
    (1, 8, 16384, 32, 8, 128, (9000,), {"max_splits": 16}),
    (2, 8, 16384, 32, 8, 128, (9000, 16376), {}),
]


def check():
    for B, T, S, n, kvh, h, starts, tuning in CHECKS:
        keys = jax.random.split(jax.random.key(T + S + B), 3)
        q = jax.random.normal(keys[0], (B, T, n, h), jnp.bfloat16)
        k, v = (jax.random.normal(x, (B, kvh, S, h), jnp.bfloat16) for x in keys[1:])
        start = jnp.array(starts, jnp.int32)
        ref = attention_reference(q, k, v, start, scale=h**-0.5)
        row = {"kind": "check", "shape": [B, T, S, n, kvh, h], "starts": list(starts), "tuning": tuning}
        try:
            cfg = MosaicDecodeConfig(**tuning)
            row["splits"] = cfg.splits_for(B, kvh, S)
            out = jax.block_until_ready(decode_attention_mgpu(q, k, v, start, scale=h**-0.5, **tuning))
            row["err"] = ba._rel_err(out, ref)
            outs = [decode_attention_mgpu(q, k, v, start, scale=h**-0.5, **tuning) for _ in range(20)]
            row["deterministic"] = all(bool((o == out).all()) for o in outs)
        except Exception as e:
            row["error"] = ba._short(e)
        ROWS.append(row)
        save()
        ok = row.get("err", 9) <= 2e-2
        print(f"check {row['shape']} starts {starts[:4]} {tuning} splits {row.get('splits')}: err {row.get('err')} "
              f"det {row.get('deterministic')} {'ok' if ok else 'FAIL'} {row.get('error', '')}", flush=True)


def timing(overhead, copy_bw):
    key = jax.random.key(2)
    shapes = [(1, 16384, 1), (1, 16384, 4), (1, 16384, 8), (1, 32768, 1), (1, 32768, 8), (1, 4096, 1),
              (8, 16384, 1), (8, 16384, 8), (32, 4096, 1)]
    tunings = [{}, {"compute_warpgroups": 3}, {"compute_warpgroups": 1, "block_kv": 128}, {"max_splits": 16}]
    for B, L, T in shapes:
        kv_sets = ba._kv_sets(key, B, L)
        start = jnp.full((B,), L - T, jnp.int32)
        qs = ba._queries(key, B, T, len(kv_sets))
        ref = ba.ORACLE(qs[0], *kv_sets[0], start)
        kv_bytes = 2 * B * ba.K * L * ba.H * 2
        ops = {"triton": partial(decode_attention, scale=ba.SCALE)}
        for i, t in enumerate(tunings if (B == 1 and L >= 16384) else tunings[:1]):
            ops[f"mosaic{i}"] = partial(decode_attention_mgpu, scale=ba.SCALE, **t)
        row = {"kind": "time", "B": B, "L": L, "T": T, "calls": len(qs)}
        for name, op in ops.items():
            try:
                run, out = ba._batched(op, qs, kv_sets, start)
                row[f"{name}_err"] = ba._rel_err(out, ref)
                row[f"{name}_us"] = ba.median_wall(run, overhead) / len(qs) * 1e6
                kern = ba.kernel_ns(run)
                row[f"{name}_dev_us"] = sum(kern.values()) / len(qs) / 1e3
                row[f"{name}_kernels"] = {k: v / len(qs) / 1e3 for k, v in kern.items()}
                row[f"{name}_dev_of_copy"] = kv_bytes / row[f"{name}_dev_us"] / 1e6 / copy_bw["copy_dev_TBps"]
                row[f"{name}_of_copy"] = kv_bytes / row[f"{name}_us"] / 1e6 / copy_bw["copy_TBps"]
            except Exception as e:
                row[f"{name}_error"] = ba._short(e)
        ROWS.append(row)
        save()
        print(f"B={B} L={L} T={T}: " + "; ".join(
            f"{n} {row.get(n + '_us', float('nan')):.1f}us dev {row.get(n + '_dev_us', float('nan')):.2f}us "
            f"({row.get(n + '_dev_of_copy', float('nan')):.0%}) err {row.get(n + '_err', float('nan')):.1e}"
            + (f" ERR {row[n + '_error']}" if n + "_error" in row else "") for n in ops), flush=True)
        if B == 1 and L == 16384:
            print("   kernels:", {n: row.get(n + "_kernels") for n in ops}, flush=True)
        del kv_sets


if __name__ == "__main__":
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    overhead = ba.dispatch_overhead()
    lim = ba.ceilings(overhead)
    copy_bw = {k: v for k, v in lim.items() if k.startswith("copy_")}
    t0 = time.time()
    if "check" in sys.argv[1:] or len(sys.argv) == 1:
        check()
    print(f"checks {time.time() - t0:.0f}s", flush=True)
    if "time" in sys.argv[1:] or len(sys.argv) == 1:
        timing(overhead, copy_bw)
    print(f"total {time.time() - t0:.0f}s", flush=True)


def variants(overhead, copy_bw):
    """Where the batch-1 time goes: the kernel without its merge, without its compute, and whole."""
    import importlib
    key = jax.random.key(2)
    for L in (4096, 16384):
        kv_sets = ba._kv_sets(key, 1, L)
        kv_bytes = 2 * ba.K * L * ba.H * 2
        start = jnp.full((1,), L - 1, jnp.int32)
        qs = ba._queries(key, 1, 1, len(kv_sets))
        for variant in ("", "no_merge", "no_compute"):
            os.environ["VARIANT"] = variant
            sys.path.insert(0, "experiments/s6")
            import decode_variants
            importlib.reload(decode_variants)
            op = partial(decode_variants.decode_attention_mgpu, scale=ba.SCALE)
            row = {"kind": "variant", "L": L, "variant": variant}
            try:
                run, _ = ba._batched(op, qs, kv_sets, start)
                row["dev_us"] = sum(ba.kernel_ns(run).values()) / len(qs) / 1e3
                row["dev_of_copy"] = kv_bytes / row["dev_us"] / 1e6 / copy_bw["copy_dev_TBps"]
            except Exception as e:
                row["error"] = ba._short(e)
            ROWS.append(row)
            save()
            print(row, flush=True)
        del kv_sets


if __name__ == "__main__" and "variants" in sys.argv[1:]:
    variants(overhead, copy_bw)
