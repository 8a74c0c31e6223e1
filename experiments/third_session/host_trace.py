"""Where does the batch-1 step's wall time beyond its kernels go? Host events and the GPU timeline's real gaps."""
import glob, json, os, shutil, sys, tempfile
import jax, jax.numpy as jnp
from eagle3_jax import bench as bench_lib

plan = bench_lib.qwen3_8b_plan()
b = bench_lib.Bench(plan, ("pallas",), 400, jnp.bfloat16, None)
res = {}
for kernels in sys.argv[1:] or ["pallas", "pallas_attention"]:
    seconds, _, compiled, read, _ = b._spec_off_step(1, 1024, kernels)
    engine_state = bench_lib.decode_state(plan, 1, 1024, 1024 + 64, jnp.bfloat16, with_drafter=False)
    holder = [engine_state]
    def run():
        holder[0], out = compiled(b.tparams, None, holder[0])
        return out
    for _ in range(5):
        jax.block_until_ready(run())
    reps = 5
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(reps):
        jax.block_until_ready(run())
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    host, gpu_iv, streams = {}, [], {}
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if plane.name.startswith("/device:GPU"):
                    if "stream" in line.name.lower():
                        gpu_iv.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                        streams[line.name] = streams.get(line.name, 0) + 1
                else:
                    e = host.setdefault(f"{plane.name[:20]}|{ev.name[:80]}", [0, 0.0])
                    e[0] += 1 / reps
                    e[1] += ev.duration_ns / reps / 1e3
    gpu_iv.sort()
    union, span_lo, span_hi, cur = 0.0, gpu_iv[0][0], max(e for _, e in gpu_iv), None
    gaps = []
    for s, e in gpu_iv:
        if cur is None or s > cur[1]:
            if cur is not None:
                union += cur[1] - cur[0]
                gaps.append(s - cur[1])
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    union += cur[1] - cur[0]
    busy = sum(e - s for s, e in gpu_iv)
    gaps.sort()
    big = [g for g in gaps if g > 5000]
    row = {"wall_ms": seconds * 1e3, "kernel_sum_ms": busy / reps / 1e6, "kernel_union_ms": union / reps / 1e6,
           "span_ms_5_steps": (span_hi - span_lo) / 1e6, "gaps_per_step": len(gaps) / reps,
           "gap_total_ms_per_step": sum(gaps) / reps / 1e6, "gaps_over_5us_per_step": len(big) / reps,
           "gap_over_5us_ms_per_step": sum(big) / reps / 1e6, "median_gap_us": gaps[len(gaps) // 2] / 1e3,
           "streams": streams,
           "host_top": sorted(((k, round(v[0], 1), round(v[1], 1)) for k, v in host.items()), key=lambda x: -x[2])[:30]}
    res[kernels] = row
    print(kernels, json.dumps({k: v for k, v in row.items() if k != "host_top"}), flush=True)
    for h in row["host_top"]:
        print("   ", h)
    shutil.rmtree(d)
if os.environ.get("OUT"):
    json.dump(res, open(os.path.join(os.environ["OUT"], "host_trace.json"), "w"), indent=1)
