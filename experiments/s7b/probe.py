"""Seventh session, device call 1: the Mosaic GPU decode kernel with an owner-side (o / l, lse)
merge and conflict-free staging, against the reference and the Triton kernel, plus an on-device
profile of where a batch-1 CTA spends its time.

  PYTHONPATH=.:experiments/s7 python3 -W ignore::DeprecationWarning experiments/s7/probe.py [check] [time] [profile]
"""
import glob, json, os, statistics, sys, time
from collections import defaultdict
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import bench_attention as ba
from pallas_kernels.attention import attention_reference, decode_attention
from decode_mgpu import decode_attention_mgpu, MosaicDecodeConfig

OUT = os.environ.get("OUT", "./out")
ROWS = []
LOG = None


def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    LOG.write(msg + "\n")
    LOG.flush()


def save():
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


# (B, T, S, N, K, H, starts, tuning)
CHECKS = [
    (1, 1, 16384, 32, 8, 128, (16383,), {}),
    (1, 8, 16384, 32, 8, 128, (16376,), {}),
    (1, 4, 16384, 32, 8, 128, (5000,), {"num_stages": 3}),
    (1, 1, 256, 32, 8, 128, (0,), {}),
    (1, 1, 256, 32, 8, 128, (126,), {}),
    (1, 2, 1024, 32, 8, 128, (127,), {}),
    (4, 4, 2048, 32, 8, 128, (0, 127, 1500, 2044), {}),
    (8, 4, 4096, 32, 8, 128, (0, 1, 127, 128, 129, 1000, 4000, 4092), {}),
    (32, 1, 1024, 32, 8, 128, tuple(range(0, 1024, 32)), {}),
    (1, 8, 2048, 16, 16, 128, (1000,), {}),     # G = 1
    (1, 8, 2048, 16, 8, 128, (1001,), {}),      # G = 2
    (1, 4, 2048, 64, 8, 128, (999,), {}),       # G = 8
    (1, 2, 2048, 64, 4, 128, (777,), {}),       # G = 16
    (2, 4, 2048, 32, 8, 64, (5, 2000), {}),     # head_dim 64
    (1, 8, 16384, 32, 8, 128, (9000,), {"compute_warpgroups": 1, "block_kv": 128}),
    (2, 8, 16384, 32, 8, 128, (9000, 16376), {"num_stages": 3}),
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
            row["splits"] = MosaicDecodeConfig(**tuning).splits_for(B, kvh, S)
            out = jax.block_until_ready(decode_attention_mgpu(q, k, v, start, scale=h**-0.5, **tuning))
            row["err"] = ba._rel_err(out, ref)
            outs = [decode_attention_mgpu(q, k, v, start, scale=h**-0.5, **tuning) for _ in range(10)]
            row["deterministic"] = all(bool((o == out).all()) for o in outs)
        except Exception as e:
            row["error"] = ba._short(e)
        ROWS.append(row)
        save()
        ok = row.get("err", 9) <= 2e-2
        log(f"check {row['shape']} starts {starts[:4]} {tuning} splits {row.get('splits')}: err {row.get('err')} "
            f"det {row.get('deterministic')} {'ok' if ok else 'FAIL'} {row.get('error', '')}")


def timing(overhead, copy_bw):
    key = jax.random.key(2)
    shapes = [(1, 16384, 1), (1, 16384, 4), (1, 16384, 8), (1, 32768, 1), (1, 32768, 8), (1, 4096, 1),
              (8, 16384, 8), (32, 4096, 1)]
    tunings = [{}, {"num_stages": 3}, {"merge": "none"}, {"merge": "none", "num_stages": 3}]
    for B, L, T in shapes:
        kv_sets = ba._kv_sets(key, B, L)
        start = jnp.full((B,), L - T, jnp.int32)
        qs = ba._queries(key, B, T, len(kv_sets))
        ref = ba.ORACLE(qs[0], *kv_sets[0], start)
        kv_bytes = 2 * B * ba.K * L * ba.H * 2
        ops = {"triton": partial(decode_attention, scale=ba.SCALE)}
        for i, t in enumerate(tunings if (B == 1 and L == 16384 and T == 1) else tunings[:2]):
            ops[f"mosaic{i}"] = partial(decode_attention_mgpu, scale=ba.SCALE, **t)
        row = {"kind": "time", "B": B, "L": L, "T": T, "calls": len(qs), "tunings": tunings}
        for name, op in ops.items():
            try:
                run, out = ba._batched(op, qs, kv_sets, start)
                row[f"{name}_err"] = ba._rel_err(out, ref)
                kern = ba.kernel_ns(run)
                row[f"{name}_dev_us"] = sum(kern.values()) / len(qs) / 1e3
                row[f"{name}_kernels"] = {k: v / len(qs) / 1e3 for k, v in kern.items()}
                row[f"{name}_dev_of_copy"] = kv_bytes / row[f"{name}_dev_us"] / 1e6 / copy_bw["copy_dev_TBps"]
            except Exception as e:
                row[f"{name}_error"] = ba._short(e)
        ROWS.append(row)
        save()
        log(f"B={B} L={L} T={T}: " + "; ".join(
            f"{n} {row.get(n + '_dev_us', float('nan')):.2f}us ({row.get(n + '_dev_of_copy', float('nan')):.0%}) "
            f"err {row.get(n + '_err', float('nan')):.1e}" + (f" ERR {row[n + '_error']}" if n + "_error" in row else "")
            for n in ops))
        del kv_sets


SCOPES = ("q_wait", "k_wait", "block", "v_wait", "pv", "publish", "meet1", "combine", "meet2", "free_wait")


def summarize(trace_path):
    """Per role (trace index within a CTA: compute warpgroups, then the loader), the median over CTAs of
    each scope's summed time and of the span from the first event to the last, in kilocycles."""
    events = json.load(open(trace_path))["traceEvents"]
    per_tid = defaultdict(list)
    for e in events:
        per_tid[e["tid"]].append(e)
    roles = defaultdict(lambda: defaultdict(list))
    for tid, evs in per_tid.items():
        role = (tid - 1) % 3
        stack, sums = [], defaultdict(float)
        for e in evs:
            if e["ph"] == "B":
                stack.append(e)
            else:
                b = stack.pop()
                sums[b["name"]] += e["ts"] - b["ts"]
        sums["span"] = evs[-1]["ts"] - evs[0]["ts"]
        for name, v in sums.items():
            roles[role][name].append(v)
    out = {}
    for role, d in sorted(roles.items()):
        out[role] = {n: (statistics.median(v), max(v), len(v)) for n, v in d.items()}
        log(f"   role {role}: " + ", ".join(f"{n} {m:.2f} (max {x:.2f})" for n, (m, x, _) in sorted(out[role].items())))
    return out


def profile():
    key = jax.random.key(2)
    L = 16384
    for T in (1, 8):
        kv = ba._caches(key, 1, L, 1)[0]
        start = jnp.full((1,), L - T, jnp.int32)
        q = ba._queries(key, 1, T, 1)[0]
        for i, t in enumerate([{}, {"num_stages": 3}, {"merge": "none", "num_stages": 3}]):
            d = os.path.join(OUT, f"prof_T{T}_{i}")
            os.makedirs(d, exist_ok=True)
            try:
                out = decode_attention_mgpu(q, *kv, start, scale=ba.SCALE, profile_dir=d, **t)
                jax.block_until_ready(out)
                jax.effects_barrier()
                time.sleep(0.5)
                files = sorted(glob.glob(os.path.join(d, "*")))
                log(f"profile T={T} {t}: files {[os.path.basename(f) for f in files]}")
                if files:
                    ROWS.append({"kind": "profile", "T": T, "tuning": t, "summary": summarize(files[-1])})
                    save()
            except Exception as e:
                log(f"profile T={T} {t} ERROR {ba._short(e)}")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    LOG = open(os.path.join(OUT, "log.txt"), "a")
    log(jax.__version__, jax.devices()[0].device_kind)
    sections = sys.argv[1:] or ["check", "time", "profile"]
    overhead = ba.dispatch_overhead()
    lim = ba.ceilings(overhead)
    ROWS.append(lim)
    copy_bw = {k: v for k, v in lim.items() if k.startswith("copy_")}
    log("copy", copy_bw)
    t0 = time.time()
    if "check" in sections:
        check()
        log(f"checks done {time.time() - t0:.0f}s")
    if "time" in sections:
        timing(overhead, copy_bw)
    if "profile" in sections:
        profile()
        log(f"profile done {time.time() - t0:.0f}s")
    log(f"total {time.time() - t0:.0f}s")
