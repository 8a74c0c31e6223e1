"""bf16 logits of the pallas and xla paths against an f32 reference, at Qwen3-8B shapes (random weights)."""
import json, os, time
import jax, jax.numpy as jnp, numpy as np
from eagle3_jax import bench as bench_lib, measure
from eagle3_jax import target as target_lib
t0 = time.time()
plan = bench_lib.tiny_plan() if os.environ.get("TINY") else bench_lib.qwen3_8b_plan(); cfg = plan.target
b = bench_lib.Bench(plan, ("pallas",), 400, jnp.bfloat16, None)
p16 = b.tparams
p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p16)
rng = np.random.default_rng(0)
prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 32)), jnp.int32)

def fwd(params, tokens, cache, kernels):
    hidden, cache, _ = target_lib.forward(params, cfg, tokens, cache, (), kernels)
    return target_lib.logits(params, hidden).astype(jnp.float32), cache.with_lengths(cache.lengths + tokens.shape[1])
fwd = jax.jit(fwd, static_argnames=("kernels",))
paths = {"f32_xla": (p32, jnp.float32, "xla"), "bf16_xla": (p16, jnp.bfloat16, "xla"), "bf16_pallas": (p16, jnp.bfloat16, "pallas")}
logits = {k: [] for k in paths}
caches = {k: measure.random_cache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, 0, dt, 5) for k, (_, dt, _) in paths.items()}
tokens = prompt
for step in range(9):  # the prompt (prefill), then 8 single-token steps fed with the f32 path's argmax
    for k, (p, dt, kern) in paths.items():
        lg, caches[k] = fwd(p, tokens, caches[k], kern)
        logits[k].append(np.asarray(lg[0, -1]))
    tokens = jnp.asarray([[int(np.argmax(logits["f32_xla"][-1]))]], jnp.int32)
ref = np.stack(logits["f32_xla"])
out = {"logit_std": float(ref.std()), "top2_margin_f32": [float(np.sort(r)[-1] - np.sort(r)[-2]) for r in ref]}
for k in ("bf16_xla", "bf16_pallas"):
    x = np.stack(logits[k])
    out[k] = {"max_abs_diff_vs_f32": float(np.abs(x - ref).max()), "mean_abs_diff_vs_f32": float(np.abs(x - ref).mean()),
              "argmax_agrees_with_f32": [bool(a) for a in (x.argmax(-1) == ref.argmax(-1))]}
x, y = np.stack(logits["bf16_xla"]), np.stack(logits["bf16_pallas"])
out["pallas_vs_xla_max_abs_diff"] = float(np.abs(x - y).max())
out["seconds"] = time.time() - t0
print(json.dumps(out))
if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "bf16_vs_f32.json"), "w"), indent=1)
