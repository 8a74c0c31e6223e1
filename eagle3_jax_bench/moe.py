"""`eagle3-jax bench --model qwen3-30b-a3b`: a Qwen3-MoE target with an EAGLE-3 drafter against the GPU's limits.

Random bf16 weights at Qwen3-30B-A3B's shapes (48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts,
8 per token, moe_intermediate 768, vocab 151936; about 61 GB) and a drafter in SpecBundle's layout for it
(hidden 2048, intermediate 12288, 32 / 4 heads; head_dim 128 assumed; draft vocab 32000). Sections:

* routing: how many distinct experts a step of B rows x T tokens reads per layer, from the target's own
  routing (`qwen3.expert_ids`) of random tokens through its random routers.
* decode (batch 1 and 8), verify of 2, 3, 4 tokens, and rounds at gamma 1, 2, 3: the whole target with
  random routers. Floor: attention and dense weights, lm_head, the distinct routed experts' bytes (from
  the routing section), KV; over the copy rate measured in the same run.
* projection: tokens/s against spec-off at SpecBundle's published tau (2.5 at gamma 3), other gammas by
  an i.i.d. acceptance model fitted to it; the best gamma per batch.
* experts: the MoE layers alone (the plan's first ffn_layers of them): the expert kernel at 1 to 64 tokens,
  then the other paths and the kernel's other tunings at 8, 64 and 1 (_expert_paths' order), on random
  routing and on synthetic local routing (`--routing` says which is timed first; both are measured). Floor: the
  distinct experts' bytes and the routers' over the copy rate.
* chunks: the same layers at prefill-chunk widths (2048, 256, 64) through XLA's grouped GEMMs and the tiled
  batched GEMMs at several tiles; floors by bytes and by FLOPs (the matmul rate measured in the run).
`--experts-only` runs one decoder layer's ops (moe_layer.py), the chunk section and the experts section on
the MoE layers alone; `--steps-only` the routing and the whole target's decode and verify steps (steps_only),
each decode step with a profiler trace of its kernels (trace).
On the CPU it runs the same code at tiny shapes (a smoke test).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models import moe
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import Qwen3Config

from . import dense, moe_layer, presets, profile, steps
from .core import Run, compile_timed, import_absl_library, time_chain
from .inputs import normal, random_cache

ROUTINGS = ("random", "local")
PUBLISHED_TAU = (3, 2.5)  # SpecForge / SpecBundle Qwen3-30B-A3B, SGLang batch 8 chain, MT-bench: tau 2.5 at 3 steps
LOCAL_REUSE = 0.5  # synthetic local routing: chance that each choice repeats one of the previous token's
LOCAL_ZIPF = 1.0  # ... and the per-layer expert popularity of the other choices, p(rank r) ~ 1 / r^s
TRACE_TOP = 24  # the largest kernels a trace row lists, with the model's ops each runs


@dataclasses.dataclass(frozen=True)
class MoePlan:
    base: dense.Plan
    ffn_layers: int  # MoE layers in the experts section
    ffn_tokens: tuple[int, ...]  # the kernel's token counts there (its defaults), in the order they are timed
    others_tokens: tuple[int, ...] | None = None  # the other paths' and tunings' (None: ffn_tokens)
    chunk_tokens: tuple[int, ...] = ()  # prefill-chunk widths for the chunk section's XLA paths


def qwen3_30b_a3b_plan() -> MoePlan:
    base = dense.Plan(*presets.pair("qwen3-30b-a3b"), batches=(1, 8), kv_lengths=(1024,), spec_batches=(1, 8),
                      spec_kv_length=1024, gammas=(1, 2, 3), reps=10, inner=5, copy_bytes=4 << 30, matmul_n=8192)
    # The other paths and tunings at 8 tokens (batch 8 decode), 64 (past the kernel's threshold) and 1 (batch 1
    # decode) only: an H200 timed the paths at 1 to 32 (models/moe.py's docstring), tokamax compiles for 13 to
    # 20 s a count, and the budget is one call's.
    # Chunks: 2048 is the GPU's default prefill_chunk, 256 a small one.
    return MoePlan(base, ffn_layers=8, ffn_tokens=(1, 2, 4, 8, 16, 32, 64), others_tokens=(8, 64, 1),
                   chunk_tokens=(2048, 256, 64))


def tiny_plan() -> MoePlan:
    base = dense.Plan(*presets.pair("tiny-moe"), batches=(1,), kv_lengths=(32,), spec_batches=(1,), spec_kv_length=32,
                      gammas=(1, 2), reps=2, inner=2, copy_bytes=1 << 20, matmul_n=128)
    return MoePlan(base, ffn_layers=2, ffn_tokens=(1, 3), chunk_tokens=(40,))


def synthetic_routing(kind: str, layers: int, rows: int, tokens: int, experts: int, top_k: int,
                      seed: int = 0) -> np.ndarray:
    """Expert ids [layers, rows * tokens, top_k]. "random": k distinct experts uniformly per token.
    "local" (synthetic, not replayed from a real model): each choice repeats one of the previous token's
    experts in the same row with probability LOCAL_REUSE, the others follow a per-layer Zipf popularity."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return np.argsort(rng.random((layers, rows * tokens, experts)), -1)[..., :top_k].astype(np.int32)
    out = np.zeros((layers, rows, tokens, top_k), np.int32)
    for layer in range(layers):
        popularity = 1.0 / np.arange(1, experts + 1) ** LOCAL_ZIPF
        popularity = popularity[np.argsort(rng.permutation(experts))]
        for row in range(rows):
            previous: list[int] = []
            for t in range(tokens):
                chosen = [e for e in previous if rng.random() < LOCAL_REUSE]
                p = popularity.copy()
                p[chosen] = 0
                chosen += list(rng.choice(experts, top_k - len(chosen), replace=False, p=p / p.sum()))
                out[layer, row, t] = previous = chosen
    return out.reshape(layers, rows * tokens, top_k)


def distinct_per_layer(ids: np.ndarray) -> np.ndarray:
    """ids [layers, M, k] -> distinct experts read per layer [layers]."""
    return np.array([len(np.unique(layer)) for layer in ids])


def expert_bytes(cfg: Qwen3Config, itemsize: int) -> int:
    """One expert's gate, up and down weights."""
    return 3 * cfg.moe.moe_intermediate_size * cfg.hidden_size * itemsize


def tau_model(gamma: int) -> float:
    """tau at gamma when each draft is accepted with the same probability a, fitted to PUBLISHED_TAU:
    tau(gamma) = 1 + a + ... + a^gamma."""
    g0, t0 = PUBLISHED_TAU
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(g0 + 1)) < t0 else (lo, a)
    return sum(lo**i for i in range(gamma + 1))


def _ffn_stack(layers, ids, weights, x, *, path):
    """The MoE layers alone, chained through a residual add; x [M, D] (last: the state) donated."""
    for layer, layer_ids, layer_weights in zip(layers, ids, weights):
        x = x + path(x, layer_weights, layer_ids, layer["w_gate_up"], layer["w_down"])
    return x, None


@functools.cache
def _import_tokamax() -> tuple[object | None, str]:
    """(tokamax, "") or (None, why not): not installed, or an import that fails (a dependency missing or
    of another version where it was installed as wheels); recorded, never fatal."""
    try:
        return import_absl_library("tokamax"), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def tokamax_paths() -> dict:
    """tokamax's Mosaic GPU grouped GEMM as an expert path, on [E, in, out] weights (the only layout it takes);
    {} when tokamax cannot be imported. (Its Triton implementation needs the triton package, which jax's
    GPU wheels do not bring: tokamax 0.0.17 reports it as an unknown implementation.)"""
    tokamax, _ = _import_tokamax()
    if tokamax is None:
        return {}
    dot = functools.partial(tokamax.ragged_dot, implementation="mosaic")
    return {"tokamax_mosaic": functools.partial(moe.experts_grouped, ragged_dot=dot)}


def _lax_in_out(lhs, w, sizes):
    return jax.lax.ragged_dot(lhs, w, sizes)


def routing(run: Run, s: dense.Setup) -> np.ndarray:
    """The target's own routing of random tokens [B max, T max]: a verify of T tokens routes exactly like
    the first T tokens of this block (causal), so one pass gives every (batch, tokens) block's count.
    Returns the distinct experts of each sub-block [sparse layers, rows, tokens]."""
    t, plan = s.plan.target, s.plan
    B, T = max(plan.spec_batches + plan.batches), max(plan.gammas) + 1
    L = plan.spec_kv_length
    cache = random_cache(t.num_layers, B, t.num_kv_heads, L + T, t.head_dim, L, s.dtype, 3)
    tokens = jax.random.randint(jax.random.key(13), (B, T), 0, t.vocab_size, jnp.int32)
    ids = jax.jit(target_lib.expert_ids, static_argnums=1)(s.tparams, t, tokens, cache.pages, cache.layout(T))
    ids = np.stack([np.asarray(i).reshape(B, T, -1) for i in ids])  # [layers, B, T, k]
    distinct = np.array([[[len(np.unique(ids[:, :b, :n][layer])) for n in range(1, T + 1)]
                          for b in range(1, B + 1)] for layer in range(len(ids))])
    table = {f"b{b}": {f"t{n}": float(distinct[:, b - 1, n - 1].mean()) for n in range(1, T + 1)}
             for b in sorted(set(plan.spec_batches + plan.batches))}
    run.results["routing"] = {"source": "the target's random routers on random tokens",
                              "mean_distinct_experts_per_layer": table}
    run.log(f"routing {json.dumps(run.results['routing'])}")
    return distinct


def routed_setup(s: dense.Setup, distinct: np.ndarray) -> dense.Setup:
    """s with floors that count only the routed experts a step reads: every target weight but the
    embedding and the experts, plus the distinct experts of its (batch, tokens) block."""
    cfg, itemsize = s.plan.target, jnp.dtype(s.dtype).itemsize
    sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
    experts = steps.nbytes([{k: s.tparams["layers"][i][k] for k in ("w_gate_up", "w_down")} for i in sparse])
    dense_part = steps.target_weight_bytes(s.tparams) - experts

    def target_read(batch: int, tokens: int) -> int:
        return dense_part + int(distinct[:, batch - 1, tokens - 1].sum()) * expert_bytes(cfg, itemsize)

    return dataclasses.replace(s, target_read=target_read)


# Other tunings of the expert kernel (pallas_kernels.ExpertsConfig fields), timed after its defaults ("kernel").
KERNEL_TUNINGS = {
    "kernel_g16": {"down_groups": 16},
    "kernel_g64": {"down_groups": 64},  # one slot a group to 8 tokens (partial sums: 4 MiB at 8, 32 MiB at 64)
    "kernel_i16": {"block_i": 16},  # twice the gate/up programs
    "kernel_d32_g16": {"block_d": 32, "down_groups": 16},  # wider down blocks, as many programs as the default
    "kernel_g1": {"down_groups": 1},  # the down stage's sum over experts in one program (no partial sums)
}


def _expert_paths() -> tuple[dict, set]:
    """({name: path} in the order they are timed, so that a short budget keeps the first: the kernel, the
    XLA paths it is chosen over, the kernel's other tunings, tokamax's grouped GEMM, lax.ragged_dot on an
    [E, in, out] copy; the names that take [E, in, out] copies of the weights)."""
    swapped = {**tokamax_paths(), "grouped_in_out": functools.partial(moe.experts_grouped, ragged_dot=_lax_in_out)}
    paths = {"kernel": moe.experts_kernel, "grouped": moe.experts_grouped, "gathered": moe.experts_gathered}
    if jax.default_backend() == "gpu":  # the kernel's tunings: interpreted off the GPU, only the defaults
        paths.update({name: functools.partial(moe.experts_kernel, **tuning) for name, tuning in KERNEL_TUNINGS.items()})
    return {**paths, **swapped}, set(swapped)


def experts(run: Run, s: dense.Setup, plan: MoePlan, routings: tuple[str, ...]) -> None:
    """The MoE layers alone: the kernel at the plan's ffn_tokens, the other paths and tunings at its
    others_tokens (path by path, in _expert_paths' order), each compiled once and timed on each routing,
    against the distinct experts' bytes and the routers' over the copy rate."""
    cfg = s.plan.target
    sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)][: plan.ffn_layers]
    layers = [s.tparams["layers"][i] for i in sparse]
    paths, in_out = _expert_paths()
    # [E, in, out] copies for the paths that need that layout (tokamax's kernel, lax.ragged_dot's default)
    swapped = [{k: jnp.swapaxes(layer[k], 1, 2) for k in ("w_gate_up", "w_down")} for layer in layers]
    itemsize, E, k = jnp.dtype(s.dtype).itemsize, cfg.moe.num_experts, cfg.moe.num_experts_per_tok
    routers = steps.nbytes([w["router"] for w in layers])
    others = plan.ffn_tokens if plan.others_tokens is None else plan.others_tokens
    ids = {tokens: {r: synthetic_routing(r, len(layers), 1, tokens, E, k, seed=tokens) for r in routings}
           for tokens in set(plan.ffn_tokens) | set(others)}
    for name, path in paths.items():
        stack = swapped if name in in_out else layers
        for tokens in plan.ffn_tokens if name == "kernel" else others:
            if not run.time_left(f"experts t{tokens} {name}"):
                return
            weights = jnp.full((len(layers), tokens, k), 1.0 / k, s.dtype)
            x = normal(jax.random.key(tokens), (tokens, cfg.hidden_size), s.dtype)
            try:
                step = steps.jit_step(_ffn_stack, 4, path=path)
                compiled, compile_s = compile_timed(step, stack, jnp.asarray(ids[tokens][routings[0]]), weights, x)
            except Exception as e:  # a library kernel refusing a shape or a layout: recorded, not fatal
                run.add("experts", {"tokens": tokens, "path": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            for routing_name, routed in ids[tokens].items():
                distinct = distinct_per_layer(routed)
                read = int(distinct.sum()) * expert_bytes(cfg, itemsize) + routers
                seconds, x = time_chain(compiled, x, (stack, jnp.asarray(routed), weights), s.plan.reps,
                                        s.plan.inner)
                entry = {"routing": routing_name, "tokens": tokens, "path": name, "layers": len(layers),
                         "distinct_experts_per_layer": float(distinct.mean())}
                run.row("experts", entry, seconds, read, compile_s)
    del swapped


# experts_tiled at fixed tiles, timed after its default (tile_rows); the default's own tile recurs among them,
# a second timing of the same program.
CHUNK_TILES = (32, 64, 128, 256)


def chunk_paths() -> dict:
    """{name: path} for a prefill chunk (past moe.GATHER_MAX_TOKENS, where XLA's paths run): lax.ragged_dot's
    grouped GEMMs, then the tiled batched GEMMs at tile_rows' tile and at CHUNK_TILES."""
    tiled = {f"tiled_{t}": functools.partial(moe.experts_tiled, tile=t) for t in CHUNK_TILES}
    return {"grouped": moe.experts_grouped, "tiled": moe.experts_tiled, **tiled}


def chunks(run: Run, s: dense.Setup, plan: MoePlan, matmul_tflops: float) -> None:
    """The MoE layers alone at prefill-chunk widths (plan.chunk_tokens), random routing, each path of
    chunk_paths compiled once. Two floors: the distinct experts' bytes over the copy rate (the row's ratio),
    and the routed pairs' FLOPs (2 x 3 D I each) over the matmul rate measured in the same run."""
    cfg = s.plan.target
    layers = [s.tparams["layers"][i] for i in range(cfg.num_layers) if cfg.is_sparse(i)][: plan.ffn_layers]
    itemsize, E, k = jnp.dtype(s.dtype).itemsize, cfg.moe.num_experts, cfg.moe.num_experts_per_tok
    for tokens in plan.chunk_tokens:
        routed = synthetic_routing("random", len(layers), 1, tokens, E, k, seed=tokens)
        weights = jnp.full((len(layers), tokens, k), 1.0 / k, s.dtype)
        flops = 2 * tokens * k * 3 * cfg.hidden_size * cfg.moe.moe_intermediate_size * len(layers)
        read = int(distinct_per_layer(routed).sum()) * expert_bytes(cfg, itemsize)
        for name, path in chunk_paths().items():
            if not run.time_left(f"chunks t{tokens} {name}"):
                return
            x = normal(jax.random.key(tokens), (tokens, cfg.hidden_size), s.dtype)
            step = steps.jit_step(_ffn_stack, 4, path=path)
            compiled, compile_s = compile_timed(step, layers, jnp.asarray(routed), weights, x)
            seconds, x = time_chain(compiled, x, (layers, jnp.asarray(routed), weights), s.plan.reps, s.plan.inner)
            compute_floor = flops / (matmul_tflops * 1e12)
            tile = moe.tile_rows(tokens * k, E) if name == "tiled" else getattr(path, "keywords", {}).get("tile")
            entry = {"tokens": tokens, "path": name, "layers": len(layers), "tile": tile,
                     "compute_floor_ms": compute_floor * 1e3, "x_compute_floor": seconds / compute_floor}
            run.row("chunks", entry, seconds, read, compile_s)


def experts_only(run: Run, plan: MoePlan, kernels: str, dtype, routing_first: str) -> dict:
    """`--experts-only`: the ceilings, one decoder layer's ops at batch 1 (moe_layer.py), the chunk section,
    then the experts section, on random weights for the plan's MoE layers only (not the whole target: minutes
    less to build)."""
    base = plan.base
    target = dataclasses.replace(base.target, num_layers=plan.ffn_layers)
    s = dense.setup(run, dataclasses.replace(base, target=target), (kernels,), dtype)
    run.results["routing_used"] = {"experts_section_first": routing_first}
    tokamax, why_not = _import_tokamax()
    run.results["tokamax"] = {"version": getattr(tokamax, "__version__", None), "not_imported": why_not}
    found = run.ceilings(base.copy_bytes, base.matmul_n)
    sparse = [i for i in range(target.num_layers) if target.is_sparse(i)]
    moe_layer.layer_ops(run, s.tparams, target, sparse, kernels, base.reps, base.inner)
    chunks(run, s, plan, found["matmul_tflops"])
    experts(run, s, plan, (routing_first,) + tuple(r for r in ROUTINGS if r != routing_first))
    return run.results


def projection(run: Run, s: dense.Setup) -> None:
    """Tokens/s of speculation against spec-off per batch and gamma, at the modelled tau, and the best gamma."""
    out = {}
    L = s.plan.spec_kv_length
    for batch in s.plan.spec_batches:
        off = [r for r in run.results.get("decode", []) if r["batch"] == batch and r["kv_len"] == L]
        rounds = [r for r in run.results.get("round", []) if r["batch"] == batch]
        if not off or not rounds:
            continue
        rows = {r["gamma"]: {"tau": tau_model(r["gamma"]), "round_ms": r["time_ms"],
                             "break_even_tau": r["time_ms"] / off[0]["time_ms"],
                             "speedup": tau_model(r["gamma"]) * off[0]["time_ms"] / r["time_ms"]} for r in rounds}
        best = max(rows, key=lambda g: rows[g]["speedup"])
        out[f"batch_{batch}"] = {"spec_off_ms": off[0]["time_ms"], "gammas": rows, "best_gamma": best,
                                 "best_speedup": rows[best]["speedup"]}
    run.record("projection", {"tau_model": f"i.i.d. acceptance fitted to tau {PUBLISHED_TAU[1]} at gamma "
                              f"{PUBLISHED_TAU[0]}", **out})


def steps_only(run: Run, s: dense.Setup) -> dict:
    """`--steps-only`: the ceilings, the routing, then the whole target's decode steps (the plan's batches)
    and verify steps of gamma + 1 tokens (largest gamma first, the plan's spec batches) on the routed
    floors, with the expert path each step's token count takes: the path choice timed in the steps it
    serves, without the drafter's rows or the experts section."""
    kernels = s.kernels[0]
    run.results["routing_used"] = {"steps": "random routers"}
    run.ceilings(s.plan.copy_bytes, s.plan.matmul_n)
    s = routed_setup(s, routing(run, s))
    counts = sorted({b for b in s.plan.batches} | {b * (g + 1) for b in s.plan.spec_batches for g in s.plan.gammas})
    run.results["expert_path_by_tokens"] = {t: moe.choose_path(t, s.dtype, kernels) for t in counts}
    for batch in s.plan.batches:
        if run.time_left(f"decode b{batch}"):
            trace(run, s.plan.target, batch, dense.decode(run, s, batch, s.plan.kv_lengths[0], kernels))
    for gamma in sorted(s.plan.gammas, reverse=True):
        for batch in s.plan.spec_batches:
            if run.time_left(f"verify b{batch} t{gamma + 1}"):
                dense.verify(run, s, batch, gamma + 1, kernels)
    return run.results


def trace(run: Run, cfg: Qwen3Config, batch: int, timed: steps.EngineCall) -> None:
    """Where one spec-off call (dense.decode's, timed) spends its time (jax.profiler, on the GPU): per layer of each
    round, each kind of kernel's GPU microseconds (profile.kernel_groups), the idle time between the call's first
    and last kernel (launches and the gaps between kernels), and the call's largest kernels; nothing off the GPU."""
    holder = [timed.state]

    def one_call():
        holder[0], packed = timed.call(holder[0])
        return packed

    events = profile.gpu_events(one_call)
    if not events:
        return
    per = timed.rounds * cfg.num_layers  # the call's layer applications
    busy, idle = profile.busy_and_idle(events)
    times: dict[str, list] = {}
    for name, _, us in events:
        entry = times.setdefault(name, [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + us
    top = sorted(times.items(), key=lambda kv: -kv[1][1])[:TRACE_TOP]
    sources = profile.kernel_sources(timed.compiled.as_text(), [name for name, _ in top])
    run.add("trace", {"batch": batch, "rounds": timed.rounds,
                      "step_ms": timed.seconds * 1e3, "kernels": len(events) / timed.rounds,
                      "per_layer_us": {"kernels": busy / per, "idle": idle / per,
                                       **{k: v / per for k, v in profile.kernel_groups(times).items()}},
                      "top_per_layer": {name: [n / per, us / per, sources[name]] for name, (n, us) in top}})


def run_all(run: Run, s: dense.Setup, plan: MoePlan, routing_first: str) -> dict:
    """Ceilings, routing, decode, every (batch, gamma) set on the routed floors, the projection, then the
    experts section on both routings, `routing_first` first."""
    kernels = s.kernels[0]
    run.results["routing_used"] = {"steps": "random routers", "experts_section_first": routing_first}
    run.ceilings(s.plan.copy_bytes, s.plan.matmul_n)
    s = routed_setup(s, routing(run, s))
    for batch in s.plan.batches:
        if run.time_left(f"decode b{batch}"):
            dense.decode(run, s, batch, s.plan.kv_lengths[0], kernels)
    for batch in s.plan.spec_batches:
        for gamma in s.plan.gammas:
            dense.spec_set(run, s, batch, gamma, kernels)
    projection(run, s)
    experts(run, s, plan, (routing_first,) + tuple(r for r in ROUTINGS if r != routing_first))
    return run.results


def summary(results: dict) -> str:
    """The experts section by path, the routing and the projection (after the dense table)."""
    lines = []
    if "routing" in results:
        lines.append(f"distinct experts per layer ({results['routing']['source']}): "
                     + json.dumps(results["routing"]["mean_distinct_experts_per_layer"]))
    lines.append(f"routing used: {json.dumps(results.get('routing_used', {}))}; local = synthetic (reuse "
                 f"{LOCAL_REUSE}, Zipf {LOCAL_ZIPF}), not replayed from a real model")
    if "expert_path_by_tokens" in results:
        lines.append(f"expert path by tokens per step: {json.dumps(results['expert_path_by_tokens'])}")
    for r in results.get("trace", []):
        layer = ", ".join(f"{k} {v:.1f}" for k, v in r["per_layer_us"].items())
        lines.append(f"trace batch {r['batch']}: step {r['step_ms']:.3f} ms, {r['kernels']:.0f} kernels a step; per "
                     f"layer (us): {layer}")
        lines.append("    largest (launches, us per layer): " + ", ".join(
            f"{name[:40]} {n:.2f} {us:.1f}" for name, (n, us, _) in list(r["top_per_layer"].items())[:8]))
    for r in results.get("layer_ops", []):
        if "error" in r:
            lines.append(f"layer op {r['op']:18s} not run: {r['error'][:100]}")
            continue
        lines.append(f"layer op {r['op']:18s} {r['time_ms'] * 1e3:9.1f} us  floor {r['floor_ms'] * 1e3:8.1f} us  "
                     f"x{r['ratio']:7.2f}  (batch 1, {r.get('expert_path', '')})")
        top = list(r.get("kernels_us_per_application", {}).items())[:6]
        if top:
            lines.append("    kernels (us): " + ", ".join(f"{name[:40]} {us:.1f}" for name, us in top))
    for r in results.get("experts", []):
        label = f"experts {r.get('routing', ''):6s} t={r['tokens']:<3d} {r['path']:16s}"
        if "error" in r:
            lines.append(f"{label} not run: {r['error'][:100]}")
        else:
            lines.append(f"{label} {r['time_ms']:8.3f} ms  floor {r['floor_ms']:7.3f}  x{r['ratio']:5.2f}  "
                         f"({r['distinct_experts_per_layer']:.1f} experts/layer, {r['layers']} layers)")
    proj = results.get("projection", {})
    for key, p in proj.items():
        if key.startswith("batch_"):
            per = "; ".join(f"gamma {g}: tau {v['tau']:.2f}, round {v['round_ms']:.2f} ms, break-even tau "
                            f"{v['break_even_tau']:.2f}, speedup {v['speedup']:.2f}x" for g, v in p["gammas"].items())
            lines.append(f"projection {key} (spec-off {p['spec_off_ms']:.2f} ms, {proj['tau_model']}): {per}; "
                         f"best gamma {p['best_gamma']} ({p['best_speedup']:.2f}x)")
    if not tokamax_paths():
        lines.append(f"tokamax: not imported ({_import_tokamax()[1]}), its ragged_dot not measured")
    lines.append("tokamax.gated_linear_unit: not measured (a dense GLU with no expert dimension: it does not "
                 "apply to routed experts without first gathering them)")
    return "\n".join(lines)
