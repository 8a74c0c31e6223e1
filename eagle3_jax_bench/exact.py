"""`python -m eagle3_jax_bench.exact`: what `Engine(exact=True)` costs on the GPU, at Qwen3-8B shapes.

Sections (`--sections` picks; no new row starts after `--budget-s`; the step's rows at batch 1 and 8 and
the verify at batch 1 run first, then the rounds, the matmul table, the other step rows, then agreement):
  step       the engine's spec-off step (one target token, argmax, commit; rounds_per_call rounds to a
             call, reported per round) at batch 1, 8 and 32, and the verify of 4 tokens (one call each) at
             batch 1 and 8, at KV length 1024: the exact kernels against the default ("pallas"), each
             against its floor (the weights and live KV it must read, over the copy rate measured here),
             as dense.py's tables (a) and (b) count it
  round      the engine's gamma-3 round (a random drafter) at batch 1, 8 and 32, KV length 1024: exact
             against the default kernels (the drafter runs the default kernels in both, as in the Engine)
  matmul     pallas_kernels.skinny_matmul against XLA's current choice (layers.linear: a row reduction for
             one row, a GEMM for more; the lm_head's einsum with float32 logits) at Qwen3-8B's five weight
             shapes and 1, 4, 8, 16, 32, 64 rows: wall time per call in a jit of back-to-back calls, each
             on its own copy of the weight (at least 256 MB in all, so no call is served from L2), against
             the weight's floor; --tunings adds Pallas rows for other SkinnyConfig fields (a tuning the
             kernel or the GPU refuses is recorded as refused)
  agreement  greedy output of a Qwen3-1.7B-shaped target in bf16 (random weights, 8 prompts of 16-500
             tokens, 128 new tokens each): speculative (gamma 3) against spec-off, with and without exact
On a CPU (or with --tiny) it runs at tiny shapes, the Pallas kernels in interpret mode: a smoke test.
Rows go to $OUT/bench_exact.json (--out) after each measurement; a summary is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import layers
from eagle3_jax.models import qwen3 as target_lib

from . import dense, presets, steps
from .core import Run, Timed, compile_timed, time_chain, time_pure, versions
from .inputs import normal, random_cache, random_models, random_state, random_tree

SECTIONS = ("step", "round", "matmul", "agreement")
L2_BYTES = 256 << 20  # weight copies per timed jit: several times the H200's 50 MB L2


@dataclasses.dataclass(frozen=True)
class ExactPlan:
    models: dense.Plan  # the step's target, the copy size, reps and inner calls per sample
    batches: tuple[int, ...]  # spec-off step
    verify_batches: tuple[int, ...]
    verify_tokens: int
    kv_length: int
    capacity: int
    matmul_rows: tuple[int, ...]
    matmul_shapes: tuple[str, ...]  # which of the target's weights
    agreement_models: tuple  # (Qwen3Config, DrafterConfig)
    prompt_lengths: tuple[int, ...]
    new_tokens: int
    max_len: int
    gamma: int


def qwen3_8b_plan() -> ExactPlan:
    return ExactPlan(dense.qwen3_8b_plan(), batches=(1, 8, 32), verify_batches=(1, 8), verify_tokens=4,
                     kv_length=1024, capacity=1088, matmul_rows=(1, 4, 8, 16, 32, 64),
                     matmul_shapes=("wqkv", "wo", "w_gate_up", "w_down", "lm_head"),
                     agreement_models=presets.pair("qwen3-1.7b"),
                     prompt_lengths=(16, 200, 37, 500, 64, 90, 128, 300), new_tokens=128, max_len=1024, gamma=3)


def tiny_plan() -> ExactPlan:
    """One layer (interpret mode compiles slowly), whose input the drafter captures three times; the
    agreement run is the one tests/test_exact.py makes, so that in one process the exact engines compile
    once."""
    target, drafter = presets.pair("tiny")
    models = (dataclasses.replace(target, num_layers=1), dataclasses.replace(drafter, capture_layers=(0, 0, 0)))
    step = dataclasses.replace(dense.tiny_plan(), target=models[0], drafter=models[1])
    return ExactPlan(step, batches=(3,), verify_batches=(3,), verify_tokens=4, kv_length=16, capacity=64,
                     matmul_rows=(4,), matmul_shapes=("wo", "lm_head"), agreement_models=models,
                     prompt_lengths=(5, 19, 11), new_tokens=40, max_len=64, gamma=3)


def prompts_for(plan: ExactPlan) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, plan.agreement_models[0].vocab_size, n).tolist() for n in plan.prompt_lengths]


@dataclasses.dataclass(frozen=True)
class Setup:
    plan: ExactPlan
    dtype: object
    kernels: str  # the default kernels the exact ones are measured against


def step_section(run: Run, s: Setup, tparams, batches: tuple[int, ...], verify_batches: tuple[int, ...]) -> None:
    plan, cfg = s.plan, s.plan.models.target
    kv = lambda batch, length: steps.kv_bytes(cfg.num_layers, batch, length, cfg.num_kv_heads,  # noqa: E731
                                              cfg.head_dim, jnp.dtype(s.dtype).itemsize)
    weights = steps.target_weight_bytes(tparams)
    for batch in batches:
        for exact in (False, True):
            if run.time_left(f"step b{batch} exact={exact}"):
                timed = spec_off_step(s, tparams, batch, exact)
                run.row("step", {"batch": batch, "kv_len": plan.kv_length, "exact": exact,
                                 "compile_s": timed.compile_s}, timed.seconds, weights + kv(batch, plan.kv_length))
    for batch in verify_batches:
        for exact in (False, True):
            if run.time_left(f"verify b{batch} exact={exact}"):
                timed = verify_step(s, tparams, batch, exact)
                run.row("verify", {"batch": batch, "kv_len": plan.kv_length, "tokens": plan.verify_tokens,
                                   "exact": exact, "compile_s": timed.compile_s},
                        timed.seconds, weights + kv(batch, plan.kv_length + plan.verify_tokens))


def spec_off_step(s: Setup, tparams, batch: int, exact: bool) -> steps.EngineCall:
    """The engine's call of spec-off rounds, as dense.py times it."""
    plan = s.plan
    spec = spec_round.StepSpec(target=plan.models.target, proposer=None, gamma=0, max_len=plan.capacity,
                               kernels=s.kernels, exact=exact)
    state = random_state((plan.models.target, plan.models.drafter), batch, plan.kv_length, plan.capacity, s.dtype,
                         with_drafter=False)
    return steps.engine_rounds(spec, tparams, None, state, engine_lib.ROUNDS_PER_CALL, plan.models.reps,
                               plan.models.inner)


def round_section(run: Run, s: Setup, tparams, batches: tuple[int, ...]) -> None:
    """The engine's gamma-3 round (a random drafter: about one token a round), without and with exact, from
    the plan's KV length; the capacity leaves the timed rounds room to grow (L + 512)."""
    plan, (cfg, dcfg) = s.plan, (s.plan.models.target, s.plan.models.drafter)
    dparams = random_tree(drafter_lib.abstract_params(dcfg, s.dtype), seed=2)
    capacity = plan.kv_length + 512
    read = (steps.target_weight_bytes(tparams) + steps.nbytes(dparams)
            + steps.kv_bytes(cfg.num_layers, 1, plan.kv_length, cfg.num_kv_heads, cfg.head_dim,
                             jnp.dtype(s.dtype).itemsize))
    for batch in batches:
        for exact in (False, True):
            if not run.time_left(f"round b{batch} exact={exact}"):
                continue
            spec = spec_round.StepSpec(target=cfg, proposer=Eagle3(dcfg), gamma=plan.gamma, max_len=capacity,
                                       kernels=s.kernels, exact=exact)
            state = random_state((cfg, dcfg), batch, plan.kv_length, capacity, s.dtype, with_drafter=True)
            timed = steps.engine_rounds(spec, tparams, dparams, state, engine_lib.ROUNDS_PER_CALL, plan.models.reps,
                                        plan.models.inner)
            # The floor counts one row's KV: rows are compared with each other, exact against the default.
            run.row("round", {"batch": batch, "kv_len": plan.kv_length, "gamma": plan.gamma, "exact": exact,
                              "compile_s": timed.compile_s}, timed.seconds, read)


def verify_logits(params, tokens, cache, *, cfg, capture, kernels):
    """The target's verify step (forward with the drafter's capture layers, then the logits): (cache,
    (logits, features)). The logits, not their argmax, so that tests/test_exact.py can compare bits."""
    hidden, cache, features = target_lib.forward_rows(params, cfg, tokens, cache, capture, kernels)
    return cache, (target_lib.logits(params, hidden, kernels), features)


jit_verify = jax.jit(verify_logits, static_argnames=("cfg", "capture", "kernels"), donate_argnames=("cache",))


def verify_step(s: Setup, tparams, batch: int, exact: bool) -> Timed:
    """One call of the target's verify step."""
    plan, cfg = s.plan, s.plan.models.target
    cache = random_cache(cfg.num_layers, batch, cfg.num_kv_heads, plan.capacity, cfg.head_dim, plan.kv_length,
                         s.dtype, 5)
    tokens = jax.random.randint(jax.random.key(3), (batch, plan.verify_tokens), 0, cfg.vocab_size, jnp.int32)
    static = dict(cfg=cfg, capture=plan.models.drafter.capture_layers,
                  kernels=kernels_lib.EXACT if exact else s.kernels)
    compiled, compile_s = compile_timed(jit_verify, tparams, tokens, cache, **static)
    seconds, _ = time_chain(compiled, cache, (tparams, tokens), plan.models.reps, plan.models.inner)
    return Timed(seconds, compile_s)


def matmul_section(run: Run, s: Setup, tparams, tunings: list[dict]) -> None:
    """Each weight shape at each row count: XLA's current choice, the Pallas kernel at its default tuning,
    then at each of `tunings`. Pallas rows carry their error against the float32 reference."""
    for name in s.plan.matmul_shapes:
        w = tparams[name] if name == "lm_head" else tparams["layers"][0][name]
        copies = max(1, min(16, math.ceil(L2_BYTES / (w.size * w.dtype.itemsize)))) if not _dry() else 1
        weights = [w] + [normal(jax.random.key(50 + i), w.shape, w.dtype) for i in range(copies - 1)]
        for rows in s.plan.matmul_rows:
            x = normal(jax.random.key(rows), (rows, w.shape[1]), w.dtype)
            for impl, tuning in [("xla", None), ("pallas", {})] + [("pallas", t) for t in tunings]:
                if not run.time_left(f"matmul {name} rows={rows} {impl} {tuning}"):
                    continue
                fn = jax.jit(lambda x, ws, impl=impl, tuning=tuning, name=name: [
                    _matmul(x, w, name, impl, tuning) for w in ws])
                entry = {"weight": name, "shape": list(w.shape), "rows": rows, "impl": impl, "tuning": tuning}
                try:
                    compiled, compile_s = compile_timed(fn, x, weights)
                except Exception as e:  # a tuning the GPU refuses (shared memory, registers) is a row too
                    run.add("matmul_refused", {**entry, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                seconds = time_pure(compiled, (x, weights), s.plan.models.reps, s.plan.models.inner) / copies
                entry["compile_s"] = compile_s
                if impl == "pallas":
                    got = compiled(x, weights)[0]
                    want = pallas_kernels.skinny_matmul_reference(x, w, out_dtype=got.dtype)
                    entry["rel_err"] = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
                                             / jnp.abs(want.astype(jnp.float32)).max())
                run.row("matmul", entry, seconds, w.size * w.dtype.itemsize)
        del weights


def _matmul(x, w, name: str, impl: str, tuning: dict | None):
    """One weight's product as the step computes it: with `impl` "xla", the default op (layers.linear, or the
    lm_head's einsum); with "pallas", the skinny kernel the exact steps run, at the given tuning."""
    out_dtype = jnp.float32 if name == "lm_head" else None
    if impl == "xla":
        return target_lib.logits({"lm_head": w}, x) if name == "lm_head" else layers.linear(x, w)
    return pallas_kernels.skinny_matmul(x, w, out_dtype=out_dtype, interpret=kernels_lib.interpret(), **tuning)


def agreement_section(run: Run, s: Setup) -> None:
    """Speculative against spec-off greedy output, without and with exact: per prompt, identical or the
    first token where they differ."""
    plan = s.plan
    target, drafter = random_models(plan.agreement_models, s.dtype)
    prompts = prompts_for(plan)
    for exact in (False, True):
        if not run.time_left(f"agreement exact={exact}"):
            continue
        outs = [[r.token_ids for r in engine_lib.Engine(target, d, num_draft_tokens=plan.gamma, max_len=plan.max_len,
                                                         kernels=s.kernels, exact=exact)
                 .generate(prompts, plan.new_tokens)] for d in (None, drafter)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(*outs)]
        run.add("agreement", {"exact": exact, "gamma": plan.gamma, "prompts": len(prompts),
                              "tokens": plan.new_tokens, "identical": sum(f is None for f in first),
                              "first_differences": first})


def summary(results: dict) -> str:
    lines = [f"{results['versions']['device']}, jax {results['versions']['jax']}, copy {results['copy_tbps']:.2f} "
             f"TB/s, default kernels: {results['kernels']}"]
    for section in ("step", "verify", "round"):
        for r in results.get(section, []):
            lines.append(f"{section:6s} b{r['batch']:<3d} kv {r['kv_len']} exact={r['exact']!s:5s} "
                         f"{r['time_ms']:8.3f} ms  floor {r['floor_ms']:.3f}  x floor {r['ratio']:.3f}")
    for r in results.get("matmul", []):
        tuning = f" {r['tuning']}" if r["tuning"] else ""
        lines.append(f"matmul {r['weight']:9s} rows {r['rows']:3d} {r['impl']:6s}{tuning} {r['time_ms'] * 1e3:9.1f} us "
                     f" x floor {r['ratio']:.3f}")
    for r in results.get("matmul_refused", []):
        lines.append(f"matmul {r['weight']:9s} rows {r['rows']:3d} {r['tuning']} refused: {r['error']}")
    for r in results.get("agreement", []):
        lines.append(f"agreement exact={r['exact']}: {r['identical']}/{r['prompts']} prompts identical, "
                     f"first differences {r['first_differences']}")
    if results["skipped"]:
        lines.append(f"skipped for time: {', '.join(results['skipped'])}")
    return "\n".join(lines)


def _dry() -> bool:
    return jax.default_backend() != "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.exact", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (default off the GPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--tunings", type=json.loads, default=[],
                        help='JSON list of SkinnyConfig fields for extra Pallas matmul rows, e.g. [{"block_n": 64}]')
    parser.add_argument("--matmul-rows", type=int, nargs="+", help="matmul row counts (default: the plan's)")
    parser.add_argument("--matmul-shapes", nargs="+", help="the matmul section's weights (default: the plan's)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="no new row starts after this")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for bench_exact.json")
    args = parser.parse_args(argv)
    tiny = args.tiny or _dry()
    plan = tiny_plan() if tiny else qwen3_8b_plan()
    plan = dataclasses.replace(plan, matmul_rows=tuple(args.matmul_rows or plan.matmul_rows),
                               matmul_shapes=tuple(args.matmul_shapes or plan.matmul_shapes))
    # bf16 as served; on the CPU too, since the exact kernels run there in the interpreter.
    dtype = jnp.bfloat16
    s = Setup(plan, dtype, kernels_lib.default())
    run = Run(args.budget_s, Path(args.out), "bench_exact.json")
    run.results.update(versions=versions(), kernels=s.kernels)
    run.results["copy_tbps"] = run.ceilings(plan.models.copy_bytes, matmul_n=None)["copy_tbps"]
    if {"step", "round", "matmul"} & set(args.sections):
        tparams = random_tree(target_lib.abstract_params(plan.models.target, dtype), seed=1)
        # The headline rows first (the default's 3% test is at batch 1 and 8), so a short budget keeps them.
        if "step" in args.sections:
            step_section(run, s, tparams, plan.batches[:2], plan.verify_batches[:1])
        if "round" in args.sections:
            round_section(run, s, tparams, plan.batches)
        if "matmul" in args.sections:
            matmul_section(run, s, tparams, args.tunings)
        if "step" in args.sections:
            step_section(run, s, tparams, plan.batches[2:], plan.verify_batches[1:])
        del tparams
    if "agreement" in args.sections:
        agreement_section(run, s)
    print(summary(run.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
