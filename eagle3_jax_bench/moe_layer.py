"""Where one Qwen3-MoE decoder layer's time goes in a decode step of batch 1 (`bench --model qwen3-30b-a3b
--experts-only`, section "layer_ops"): each op of the layer jitted on its own and chained through the
weights of the run's MoE layers REPEAT times over (the output of one application is the input of the next,
so the launches queue back to back and a row's time per application is the GPU's, not the host's); then
the router with the experts (moe_mlp), the whole layer, and the final norm with lm_head (one application).
Each row against the bytes it must read over the copy rate. The op rows summed against the layer row show
what launches between them cost; on the GPU the kernels of the PROFILED ops (jax.profiler) name what runs.

The router rows (top-k by ranks, by lax.top_k's sort, and by the router kernel as the model routes with the
Pallas kernels: moe.route's `select`) add
their weights' sum (scaled) to the state to chain; the experts row takes routing fixed ahead (k distinct
random experts); attention writes into a cache that is not donated (XLA copies it, a few MB per layer at
KV 1024, where the step updates its cache in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.models import moe
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.layers import add_rms_norm, rope_tables

from . import profile, steps
from .core import Run, compile_timed, time_chain, time_pure
from .inputs import normal, random_cache

REPEAT = 4
KV_LENGTH = 1024
# ops whose GPU kernels are listed (which kernel costs what)
PROFILED = ("router_topk", "router_topk_sort", "router_topk_kernel", "experts", "moe_mlp", "layer")


def _chain(per_layer, x, *, op, repeat):
    for _ in range(repeat):
        for args in per_layer:
            x = op(args, x)
    return x, None


def _ops(cfg, kernels: str, path: str) -> dict:
    """{name: op(args of one layer, x [1, 1, D]) -> x}."""
    eps, k = cfg.rms_norm_eps, cfg.moe.num_experts_per_tok

    def norm(a, x):
        return add_rms_norm(x, x, a["layer"]["mlp_norm"], eps, kernels)[1]

    def attention(a, x):
        return target_lib.attention_layer(a["layer"], cfg, x, a["cos"], a["sin"], a["k"], a["v"], a["layout"], kernels,
                                          None)[0]  # tp None: one device

    def router_topk(select):
        def op(a, x):
            weights, _ = moe.route(x.reshape(1, -1), a["layer"]["router"], k, cfg.moe.norm_topk_prob, select)
            return x + (jnp.sum(weights) * 1e-3).astype(x.dtype)

        return op

    def experts(a, x):
        y = moe.PATHS[path](x.reshape(1, -1), a["weights"], a["ids"], a["layer"]["w_gate_up"], a["layer"]["w_down"])
        return x + y.reshape(x.shape)

    def moe_mlp(a, x):
        return x + moe.moe_mlp(x, a["layer"], cfg.moe, kernels=kernels)[0]

    def layer(a, x):
        x, normed = add_rms_norm(x, None, a["layer"]["attn_norm"], eps, kernels)
        x, normed = add_rms_norm(x, attention(a, normed), a["layer"]["mlp_norm"], eps, kernels)
        return x + moe.moe_mlp(normed, a["layer"], cfg.moe, kernels=kernels)[0]

    return {"norm": norm, "attention": attention, "router_topk": router_topk("rank"),
            "router_topk_sort": router_topk("sort"), "router_topk_kernel": router_topk("kernel"), "experts": experts,
            "moe_mlp": moe_mlp, "layer": layer}


def _reads(layer: dict, cfg, itemsize: int) -> dict:
    """Bytes each op must read per application (weights, KV; activations are noise at batch 1)."""
    expert = 3 * cfg.moe.moe_intermediate_size * cfg.hidden_size * itemsize * cfg.moe.num_experts_per_tok
    kv = steps.kv_bytes(1, 1, KV_LENGTH, cfg.num_kv_heads, cfg.head_dim, itemsize)
    attention = steps.nbytes([layer[n] for n in ("wqkv", "wo", "q_norm", "k_norm")]) + kv
    router = steps.nbytes(layer["router"])
    norm = steps.nbytes(layer["mlp_norm"])
    return {"norm": norm, "attention": attention, "router_topk": router, "router_topk_sort": router,
            "router_topk_kernel": router, "experts": expert,
            "moe_mlp": router + expert, "layer": 2 * norm + attention + router + expert}


def layer_ops(run: Run, params: dict, cfg, layers: list[int], kernels: str, reps: int, inner: int) -> None:
    """The layer_ops rows (module docstring) over the sparse `layers` of params."""
    dtype = params["layers"][layers[0]]["mlp_norm"].dtype
    path = moe.choose_path(1, dtype, kernels)
    cache = random_cache(len(layers), 1, cfg.num_kv_heads, KV_LENGTH + 8, cfg.head_dim, KV_LENGTH, dtype, 7)
    cos, sin = rope_tables(jnp.full((1, 1), KV_LENGTH, jnp.int32), cfg.rope, dtype)
    E, k = cfg.moe.num_experts, cfg.moe.num_experts_per_tok
    per_layer = []
    for n, i in enumerate(layers):
        ids = jax.random.permutation(jax.random.key(n), E)[:k].reshape(1, k).astype(jnp.int32)
        per_layer.append({"layer": params["layers"][i], "k": cache.pages.k[n], "v": cache.pages.v[n], "cos": cos,
                          "sin": sin, "layout": cache.layout(1), "ids": ids,
                          "weights": jnp.full((1, k), 1.0 / k, dtype)})
    reads = _reads(params["layers"][layers[0]], cfg, jnp.dtype(dtype).itemsize)
    x = normal(jax.random.key(3), (1, 1, cfg.hidden_size), dtype)
    applications = REPEAT * len(layers)
    for name, op in _ops(cfg, kernels, path).items():
        if not run.time_left(f"layer_ops {name}"):
            return
        entry = {"op": name, "batch": 1, "kv_len": KV_LENGTH, "kernels": kernels, "expert_path": path,
                 "applications": applications}
        try:
            compiled, compile_s = compile_timed(steps.jit_step(_chain, 2, op=op, repeat=REPEAT), per_layer, x)
        except Exception as e:  # a kernel the GPU's compiler refuses: recorded, the other ops still measured
            run.add("layer_ops", {**entry, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        seconds, x = time_chain(compiled, x, (per_layer,), reps, inner)
        if name in PROFILED:
            entry["kernels_us_per_application"], x = _kernel_us(compiled, per_layer, x, applications)
        run.row("layer_ops", entry, seconds / applications, reads[name], compile_s)
    head = jax.jit(lambda p, h: target_lib.logits(p, add_rms_norm(h, None, p["final_norm"], cfg.rms_norm_eps,
                                                                      kernels)[1], kernels))
    head_params = {n: params[n] for n in ("final_norm", "lm_head") if n in params}
    compiled, compile_s = compile_timed(head, head_params, x)
    seconds = time_pure(compiled, (head_params, x), reps, inner)
    run.row("layer_ops", {"op": "final_norm_lm_head", "batch": 1, "kernels": kernels, "applications": 1},
            seconds, steps.nbytes(head_params), compile_s)


def _kernel_us(compiled, per_layer, x, applications: int) -> tuple[dict, jax.Array]:
    """({kernel: GPU microseconds per application} of a chained op, largest first ({} off the GPU), the state
    it leaves: x is donated)."""
    holder = [x]

    def one_call():
        holder[0], _ = compiled(per_layer, holder[0])
        return holder[0]

    times = profile.gpu_kernel_times(one_call)
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    return {name: round(us / applications, 2) for name, (_, us) in ranked}, holder[0]
