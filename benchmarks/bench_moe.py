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
* experts: the MoE layers alone (the plan's first ffn_layers of them, as issue 20's probe), every expert
  path at 1 to 32 tokens, on random routing and on synthetic local routing (`--routing` says which is
  timed first; both are measured). Floor: the distinct experts' bytes and the routers' over the copy rate.
On the CPU it runs the same code at tiny shapes (a smoke test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench, measure
from eagle3_jax.models import moe
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import MoeConfig, Qwen3Config, RopeConfig
from eagle3_jax.models.eagle3 import DrafterConfig

ROUTINGS = ("random", "local")
PUBLISHED_TAU = (3, 2.5)  # SpecForge / SpecBundle Qwen3-30B-A3B, SGLang batch 8 chain, MT-bench: tau 2.5 at 3 steps
LOCAL_REUSE = 0.5  # synthetic local routing: chance that each choice repeats one of the previous token's
LOCAL_ZIPF = 1.0  # ... and the per-layer expert popularity of the other choices, p(rank r) ~ 1 / r^s


@dataclasses.dataclass(frozen=True)
class MoePlan:
    base: bench.Plan
    ffn_layers: int  # MoE layers in the experts section
    ffn_tokens: tuple[int, ...]


def _pair(*, vocab, hidden, layers, heads, kv_heads, head_dim, experts, top_k, moe_intermediate,
          draft_intermediate, draft_vocab, max_positions=40960) -> tuple[Qwen3Config, DrafterConfig]:
    rope = RopeConfig(theta=1e6, head_dim=head_dim)
    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * moe_intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope=rope, tie_word_embeddings=False,
                         max_position_embeddings=max_positions,
                         moe=MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                                       moe_intermediate_size=moe_intermediate, norm_topk_prob=True))
    drafter = DrafterConfig(hidden_size=hidden, intermediate_size=draft_intermediate, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope=rope,
                            draft_vocab_size=draft_vocab, target_vocab_size=vocab, target_hidden_size=hidden,
                            capture_layers=target.default_capture_layers)
    return target, drafter


def qwen3_30b_a3b_plan() -> MoePlan:
    target, drafter = _pair(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                            top_k=8, moe_intermediate=768, draft_intermediate=12288, draft_vocab=32000)
    base = bench.Plan(target, drafter, batches=(1, 8), kv_lengths=(1024,), spec_batches=(1, 8), spec_kv_length=1024,
                      gammas=(1, 2, 3), reps=10, inner=5, copy_bytes=4 << 30, matmul_n=8192)
    return MoePlan(base, ffn_layers=8, ffn_tokens=(1, 2, 3, 4, 8, 32))


def tiny_moe_plan() -> MoePlan:
    target, drafter = _pair(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, experts=16, top_k=4,
                            moe_intermediate=32, draft_intermediate=128, draft_vocab=64, max_positions=1024)
    base = bench.Plan(target, drafter, batches=(1,), kv_lengths=(32,), spec_batches=(1,), spec_kv_length=32,
                      gammas=(1, 2), reps=2, inner=2, copy_bytes=1 << 20, matmul_n=128)
    return MoePlan(base, ffn_layers=2, ffn_tokens=(1, 3))


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


def _tokamax_paths() -> dict:
    """tokamax's grouped GEMMs as expert paths, on [E, in, out] weights (the only layout its Triton and
    Mosaic GPU kernels take); {} when tokamax is not installed."""
    try:
        import tokamax
    except ImportError:
        return {}

    def run(impl):
        dot = functools.partial(tokamax.ragged_dot, implementation=impl)
        return functools.partial(moe.experts_grouped, ragged_dot=lambda lhs, w, sizes: dot(lhs, w, sizes))

    return {f"tokamax_{impl}": run(impl) for impl in ("mosaic", "triton")}


def _lax_in_out(lhs, w, sizes):
    return jax.lax.ragged_dot(lhs, w, sizes)


# lax.ragged_dot's own Pallas (Triton) lowering on the GPU, off by default in JAX: XLA's ragged dot measured
# near the cost of reading every expert at one token (issue 20's probe: 15.9 ms against a 13.8 ms
# all-experts floor), so this is timed as the alternative.
PALLAS_LOWERING_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


@contextlib.contextmanager
def _config(name: str, value):
    previous = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, previous)


class MoeBench(bench.Bench):
    """bench.Bench whose floors count only the routed experts a step reads."""

    def __init__(self, plan: MoePlan, *args, **kwargs):
        super().__init__(plan.base, *args, **kwargs)
        self.moe_plan = plan
        self.with_peer = False
        self.distinct: np.ndarray | None = None  # [sparse layers, rows, tokens]: distinct experts of a sub-block

    def routing(self) -> None:
        """The target's own routing of random tokens [B max, T max]: a verify of T tokens routes exactly like
        the first T tokens of this block (causal), so one pass gives every (batch, tokens) block's count."""
        t = self.plan.target
        B, T = max(self.plan.spec_batches + self.plan.batches), max(self.plan.gammas) + 1
        L = self.plan.spec_kv_length
        cache = measure.random_cache(t.num_layers, B, t.num_kv_heads, L + T, t.head_dim, L, self.dtype, 3)
        tokens = jax.random.randint(jax.random.key(13), (B, T), 0, t.vocab_size, jnp.int32)
        ids = jax.jit(target_lib.expert_ids, static_argnums=1)(self.tparams, t, tokens, cache)
        ids = np.stack([np.asarray(i).reshape(B, T, -1) for i in ids])  # [layers, B, T, k]
        self.distinct = np.array([[[len(np.unique(ids[:, :b, :n][layer])) for n in range(1, T + 1)]
                                   for b in range(1, B + 1)] for layer in range(len(ids))])
        table = {f"b{b}": {f"t{n}": float(self.distinct[:, b - 1, n - 1].mean()) for n in range(1, T + 1)}
                 for b in sorted(set(self.plan.spec_batches + self.plan.batches))}
        self.results["routing"] = {"source": "the target's random routers on random tokens",
                                   "mean_distinct_experts_per_layer": table}
        self.log(f"routing {json.dumps(self.results['routing'])}")

    def target_read(self, batch: int, tokens: int) -> int:
        cfg, itemsize = self.plan.target, jnp.dtype(self.dtype).itemsize
        sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
        experts = measure.nbytes([{k: self.tparams["layers"][i][k] for k in ("w_gate_up", "w_down")} for i in sparse])
        routed = int(self.distinct[:, batch - 1, tokens - 1].sum()) * expert_bytes(cfg, itemsize)
        return measure.target_weight_bytes(self.tparams) - experts + routed

    def experts(self, routings: tuple[str, ...]) -> None:
        """The MoE layers alone: every path at every token count of the plan, compiled once and timed on each
        routing, against the distinct experts' bytes and the routers' over the copy rate."""
        cfg, plan = self.plan.target, self.moe_plan
        sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)][: plan.ffn_layers]
        layers = [self.tparams["layers"][i] for i in sparse]
        paths = {"gathered": moe.experts_gathered, "grouped": moe.experts_grouped}
        extra = {"grouped_in_out": functools.partial(moe.experts_grouped, ragged_dot=_lax_in_out),
                 **_tokamax_paths()}
        if jax.default_backend() == "gpu" and hasattr(jax.config, PALLAS_LOWERING_FLAG):
            extra["grouped_in_out_pallas_lowering"] = extra["grouped_in_out"]
        # [E, in, out] copies for the paths that need that layout (tokamax's kernels, lax.ragged_dot's default)
        swapped = [{k: jnp.swapaxes(layer[k], 1, 2) for k in ("w_gate_up", "w_down")} for layer in layers]
        itemsize, E, k = jnp.dtype(self.dtype).itemsize, cfg.moe.num_experts, cfg.moe.num_experts_per_tok
        routers = measure.nbytes([w["router"] for w in layers])
        for tokens in plan.ffn_tokens:
            ids = {r: synthetic_routing(r, len(layers), 1, tokens, E, k, seed=tokens) for r in routings}
            weights = jnp.full((len(layers), tokens, k), 1.0 / k, self.dtype)
            x = measure.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), self.dtype)
            for name, path in {**paths, **extra}.items():
                if not self.time_left(f"experts t{tokens} {name}"):
                    return
                stack = swapped if name in extra else layers
                flag = name.endswith("_pallas_lowering")
                try:
                    step = measure.jit_step(_ffn_stack, 4, path=path)
                    with _config(PALLAS_LOWERING_FLAG, True) if flag else contextlib.nullcontext():
                        compiled, compile_s = measure.compile_timed(step, stack, jnp.asarray(ids[routings[0]]), weights,
                                                                    x)
                except Exception as e:  # a library kernel refusing a shape or a layout: recorded, not fatal
                    entry = {"tokens": tokens, "path": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    self.results.setdefault("experts", []).append(entry)
                    self.log(f"experts      {json.dumps(entry)}")
                    continue
                for routing, routed in ids.items():
                    distinct = distinct_per_layer(routed)
                    read = int(distinct.sum()) * expert_bytes(cfg, itemsize) + routers
                    seconds, x = self.time(compiled, x, (stack, jnp.asarray(routed), weights))
                    entry = {"routing": routing, "tokens": tokens, "path": name, "layers": len(layers),
                             "distinct_experts_per_layer": float(distinct.mean())}
                    self.row("experts", entry, seconds, read, compile_s)
        del swapped

    def projection(self) -> None:
        """Tokens/s of speculation against spec-off per batch and gamma, at the modelled tau, and the best gamma."""
        out = {}
        L = self.plan.spec_kv_length
        for batch in self.plan.spec_batches:
            off = [r for r in self.results.get("decode", []) if r["batch"] == batch and r["kv_len"] == L]
            rounds = [r for r in self.results.get("round", []) if r["batch"] == batch]
            if not off or not rounds:
                continue
            rows = {r["gamma"]: {"tau": tau_model(r["gamma"]), "round_ms": r["time_ms"],
                                 "break_even_tau": r["time_ms"] / off[0]["time_ms"],
                                 "speedup": tau_model(r["gamma"]) * off[0]["time_ms"] / r["time_ms"]} for r in rounds}
            best = max(rows, key=lambda g: rows[g]["speedup"])
            out[f"batch_{batch}"] = {"spec_off_ms": off[0]["time_ms"], "gammas": rows, "best_gamma": best,
                                     "best_speedup": rows[best]["speedup"]}
        self.results["projection"] = {"tau_model": f"i.i.d. acceptance fitted to tau {PUBLISHED_TAU[1]} at gamma "
                                      f"{PUBLISHED_TAU[0]}", **out}
        self.log(f"projection {json.dumps(self.results['projection'])}")
        self.save()

    def run(self, routing: str) -> dict:
        plan, kernels = self.plan, self.kernels[0]
        self.results["routing_used"] = {"steps": "random routers", "experts_section_first": routing}
        self.ceilings()
        self.routing()
        for batch in plan.batches:
            if self.time_left(f"decode b{batch}"):
                self.decode(batch, plan.kv_lengths[0], kernels)
        for batch in plan.spec_batches:
            for gamma in plan.gammas:
                self._spec_set(batch, gamma, kernels)
        self.projection()
        self.experts((routing,) + tuple(r for r in ROUTINGS if r != routing))
        return self.results


def summary(results: dict) -> str:
    """bench's table, then the experts section by path, the routing and the projection."""
    lines = [bench.summary(results)]
    if "routing" in results:
        lines.append(f"distinct experts per layer ({results['routing']['source']}): "
                     + json.dumps(results["routing"]["mean_distinct_experts_per_layer"]))
    lines.append(f"routing used: {json.dumps(results.get('routing_used', {}))}; local = synthetic (reuse "
                 f"{LOCAL_REUSE}, Zipf {LOCAL_ZIPF}), not replayed from a real model")
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
    if not _tokamax_paths():
        lines.append("tokamax: not installed, its ragged_dot not measured")
    lines.append("tokamax.gated_linear_unit: not measured (a dense GLU with no expert dimension: it does not "
                 "apply to routed experts without first gathering them)")
    return "\n".join(lines)
