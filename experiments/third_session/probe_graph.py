"""Probe: are Mosaic GPU Pallas calls captured in XLA's command buffers, and what does a chain cost?"""
import json, os, re, sys, time
import jax, jax.numpy as jnp
from jax import lax
sys.path.insert(0, os.path.dirname(__file__))
from mgpu_arn import add_rms_norm as mgpu_arn
from pallas_kernels.add_rms_norm import add_rms_norm as triton_arn
from eagle3_jax import measure

def xla_arn(x, d, w, eps):
    s = x + d
    s32 = s.astype(jnp.float32)
    return s, w * (s32 * lax.rsqrt((s32 * s32).mean(-1, keepdims=True) + eps)).astype(x.dtype)

IMPLS = {"xla": xla_arn, "triton": lambda x, d, w, eps: triton_arn(x, d, w, eps=eps), "mosaic": mgpu_arn}
out = {"jax": jax.__version__, "device": str(jax.devices()[0])}

def chain(impl, n, kind):
    def f(h, delta, w, W):
        for _ in range(n):
            h, normed = impl(h, delta, w, 1e-6)
            delta = normed @ W if kind == "gemm" else normed * 0.5 + 0.25
        return h
    return jax.jit(f)

TAG = os.environ.get("TAG", "default")

CASES = ((1, "tiny"), (1, "gemm"), (8, "tiny"))
if os.environ.get("ONLY"):
    CASES = CASES[:1]
for M, kind in CASES:
    D = 4096
    ks = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    d = jax.random.normal(ks[1], (M, D), jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(ks[2], (D,), jnp.bfloat16)
    W = 0.01 * jax.random.normal(ks[3], (D, D), jnp.bfloat16)
    ref = None
    for name, impl in IMPLS.items():
        row = {}
        try:
            f = chain(impl, 72, kind)
            c = f.lower(h, d, w, W).compile()
            txt = c.as_text()
            if False:
                open(os.path.join(os.environ["OUT"], f"hlo_{TAG}_{name}.txt"), "w").write(txt)
            row["command_buffer_calls"] = len(re.findall(r"command_buffer", txt))
            row["custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', txt)))
            # is each custom call inside a command-buffer computation?
            comps = re.split(r"\n(?=\S)", txt)
            row["custom_calls_in_cmd_buffer_comps"] = sum(
                c2.count("custom-call(") for c2 in comps if c2.lstrip().startswith("%command_buffer"))
            row["custom_calls_total"] = txt.count("custom-call(")
            res = jax.block_until_ready(c(h, d, w, W))
            if ref is None:
                ref = res
            row["max_abs_diff_vs_xla"] = float(jnp.abs(res.astype(jnp.float32) - ref.astype(jnp.float32)).max())
            for _ in range(3):
                jax.block_until_ready(c(h, d, w, W))
            samples = []
            for _ in range(15):
                t = time.perf_counter()
                for _ in range(10):
                    r = c(h, d, w, W)
                jax.block_until_ready(r)
                samples.append((time.perf_counter() - t) / 10)
            samples.sort()
            row["wall_ms"] = samples[len(samples) // 2] * 1e3
            kt = measure.gpu_kernel_times(lambda: c(h, d, w, W))
            row["busy_ms"] = sum(us for _, us in kt.values()) / 1e3
            row["launches"] = sum(n for n, _ in kt.values())
            row["norm_kernel_us"] = {k: v for k, v in kt.items() if "norm" in k.lower() or "mosaic" in k.lower()}
        except Exception as e:  # report and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        out[f"{TAG}/{kind}/M{M}/{name}"] = row
        print(f"{TAG} {kind} M={M} {name}: wall {row.get('wall_ms')} busy {row.get('busy_ms')} launches {row.get('launches')} diff {row.get('max_abs_diff_vs_xla')} norm {row.get('norm_kernel_us')} {row.get('error', '')[:600]}", flush=True)

if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], f"probe_graph_{TAG}.json"), "w"), indent=1)
