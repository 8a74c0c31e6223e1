"""Which row counts should `layers.linear` write as a row reduction? The spec-off step, the verify step
and the draft step at batch 1 and 8, with layers.MATVEC_MAX_ROWS set to 0 (GEMMs everywhere), 1, 4, 8, 32,
in one process; and the kernels of the batch-1 step for 0 and 1."""
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax import bench as bench_lib
from eagle3_jax import layers

out = Path(os.environ.get("OUT", "out"))
b = bench_lib.Bench(bench_lib.qwen3_8b_plan(), ("pallas",), 1e9, jnp.bfloat16, None)
b.ceilings()
print("copy TB/s", b.bw, flush=True)
rows = []
for limit in (0, 1, 4, 8, 32):
    layers.MATVEC_MAX_ROWS = limit
    jax.clear_caches()
    b.results = {"skipped": []}
    b.decode(1, 1024, "pallas")
    b.verify(1, 4, "pallas")
    b.draft_step(1, "pallas")
    b.decode(8, 1024, "pallas")
    b.verify(8, 4, "pallas")
    for section in ("decode", "verify", "draft_step"):
        for r in b.results[section]:
            row = {"limit": limit, "section": section, "batch": r["batch"], "ms": round(r["time_ms"], 4),
                   "ratio": round(r["ratio"], 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if limit in (0, 1):
        seconds, _, compiled, _, kt = b._spec_off_step(1, 1024, "pallas", profile=True)
        top = sorted(kt.items(), key=lambda kv: -kv[1][1])[:14]
        print(f"limit {limit}: b1 step {seconds * 1e3:.3f} ms, kernels summed "
              f"{sum(us for _, us in kt.values()) / 1e3:.3f} ms in {sum(n for n, _ in kt.values()):.0f} launches",
              flush=True)
        for name, (n, us) in top:
            print(f"   {us:8.1f} us {n:4.0f}x {name[:60]}", flush=True)
out.mkdir(parents=True, exist_ok=True)
(out / "matvec.json").write_text(json.dumps(rows, indent=1))
