"""`eagle3-jax bench`: where a Qwen3-8B + EAGLE-3 decode stands against the GPU's limits.

One process, random bf16 weights at real shapes built on the device (no downloads). It measures the
ceilings (device-to-device copy bandwidth, bf16 matmul rate), then every step the engine runs, each
against its floor (bytes it must read: weights + live KV, over the copy bandwidth measured here):
the spec-off decode step, the verify step, one draft step, the drafter rebuild, the draft chain and
whole speculative rounds, plus compile times, transfers per call and the peer a user would run
instead (transformers `generate`, eager). On the CPU it runs the same code at tiny shapes (a smoke
test). Prints a table, writes bench.json and bench.png under --out.

Timing: warm-up, then the median over `reps` of `inner` back-to-back calls each,
synchronised with block_until_ready; random data, never zeros; functions are compiled ahead of the
timed region (`lower().compile()`), so nothing can recompile inside it. Spec-off steps and whole rounds
are timed as the engine runs them, `--rounds-per-call` rounds to a call, and reported per round.

This module is the command line and the summary; the rows are dense.py's, moe.py's, sampling.py's, outputs.py's and
checks.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax.decoding.engine import ROUNDS_PER_CALL
from eagle3_jax.models import kernels as kernels_lib

from . import auto_gamma, checks, dense, moe, outputs, planted, sampling
from .core import Run, versions


def summary(results: dict) -> str:
    """The headline table: each step against its floor and against the spec-off step."""
    lines = [f"device {results['versions']['device']}, jax {results['versions']['jax']}"]
    if "ceilings" in results:
        c = results["ceilings"]
        lines[0] += f", copy {c['copy_tbps']:.2f} TB/s, matmul {c['matmul_tflops']:.0f} TFLOP/s"
    lines.append(f"{'step':34s} {'ms':>9s} {'floor ms':>9s} {'x floor':>8s} {'compile s':>9s}")
    for section in ("decode", "verify", "draft_step", "chain", "rebuild", "round"):
        for r in results.get(section, []):
            keys = [f"{k}={r[k]}" for k in ("batch", "kv_len", "tokens", "gamma", "kernels") if k in r]
            label = f"{section} {' '.join(keys)}"
            lines.append(f"{label:34s} {r['time_ms']:9.3f} {r['floor_ms']:9.3f} {r['ratio']:8.2f} "
                         f"{r['compile_s']:9.1f}")
            if section == "round" and "overhead" in r:
                proj = ", ".join(f"tau {k}: {v:.0f}" for k, v in r["projected_tokens_per_s"].items())
                lines.append(f"{'':34s} overhead beyond parts (each one call) {r['overhead'] * 100:+.1f}%; "
                             f"projected tok/s {proj}; spec-off {r.get('spec_off_tokens_per_s', float('nan')):.0f}")
    if "engine" in results:
        e = results["engine"]
        lines.append(f"engine: {e['transfers_per_call']:.2f} device-to-host transfers per call of "
                     f"{e['rounds_per_call']} rounds, "
                     f"{e['compilations_in_the_timed_request']} compilation(s) in the timed request, "
                     f"{e['tokens_per_s']:.1f} tok/s at tau {e['tau']:.2f}")
    for name, rows in results.get("agreement", {}).items():
        lines.append(f"agreement {name}: " + "; ".join(
            "identical" if r["identical"] else f"differs from token {r['first_difference']} (margin {r['margin']:.2e})"
            for r in rows))
    if "peer" in results:
        lines.append(f"peer: {results['peer']['name']}: {results['peer']['tokens_per_s']:.1f} tok/s")
    lines += sampling.summary_lines(results)
    lines += outputs.summary_lines(results)
    if results["skipped"]:
        lines.append(f"skipped for time: {', '.join(results['skipped'])}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{s} " + " ".join(str(r.get(k, "")) for k in ("batch", "kv_len", "tokens", "gamma")), r["ratio"])
            for s in ("decode", "verify", "draft_step", "chain", "rebuild", "round") for r in results.get(s, [])]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.3 * len(rows))))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("time / memory-bandwidth floor")
    ax.set_title(f"eagle3-jax on {results['versions']['device']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-jax bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (default on the CPU)")
    parser.add_argument("--kernels", nargs="+", choices=kernels_lib.CHOICES + (kernels_lib.ABLATION,),
                        help="kernel choices to compare (eagle3_jax/models/kernels.py; the first is used throughout)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new measurements after this")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for bench.json and bench.png")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    parser.add_argument("--agreement-only", action="store_true",
                        help="only the output agreement check (speculative vs spec-off, Pallas vs XLA), 96 tokens")
    parser.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL,
                        help="rounds per device call, as the engine runs them (see eagle3_jax.Engine)")
    parser.add_argument("--sampling-only", action="store_true",
                        help="only a sampled round against a greedy round (batch 1, 8 and 32; spec off and gamma 3) "
                             "and the filters")
    parser.add_argument("--outputs-only", action="store_true",
                        help="only what logprobs and penalties cost a call of rounds (batch 1 and 32; spec off and "
                             "gamma 3; eagle3_jax_bench/outputs.py)")
    parser.add_argument("--variants-only", action="store_true",
                        help="only the ceilings and the decode-step breakdown (batch 1, first KV length)")
    parser.add_argument("--variants-at", type=int, nargs=2, action="append", metavar=("BATCH", "KV"),
                        help="with --variants-only: the breakdown at this batch and KV length (repeatable)")
    parser.add_argument("--model", choices=("qwen3-8b", "qwen3-30b-a3b"), default="qwen3-8b",
                        help="the target's shapes: dense Qwen3-8B, or Qwen3-30B-A3B (MoE; eagle3_jax_bench/moe.py)")
    parser.add_argument("--routing", choices=("random", "local"), default=None,
                        help="MoE: the routing the experts section leads with (both are measured; the whole "
                             "steps route through random routers)")
    parser.add_argument("--experts-only", action="store_true",
                        help="MoE: only the ceilings, one decoder layer's ops and the expert paths, on the "
                             "experts section's layers alone")
    parser.add_argument("--calibrate", action="store_true",
                        help="only the round costs num_draft_tokens='auto' chooses from, at the model's shapes: "
                             "measured (or loaded, if fresh) and printed (eagle3_jax_bench/auto_gamma.py)")
    parser.add_argument("--steps-only", action="store_true",
                        help="MoE: only the ceilings, the routing and the whole target's decode and verify steps")
    parser.add_argument("--planted", action="store_true",
                        help="only end-to-end tokens/s on a planted-acceptance world against its projection, "
                             "and the best fixed gamma per batch (eagle3_jax_bench/planted.py, its defaults)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Leave GPU memory to the transformers peer measured in the same process (read when the backend starts).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds_per_call < 1:
        parser.error(f"--rounds-per-call must be >= 1, got {args.rounds_per_call}")
    is_moe = args.model == "qwen3-30b-a3b"
    for flag, given in (("--routing", args.routing is not None), ("--experts-only", args.experts_only),
                        ("--steps-only", args.steps_only)):
        if given and not is_moe:
            parser.error(f"{flag} is for --model qwen3-30b-a3b")
    if args.experts_only and args.steps_only:
        parser.error("--experts-only and --steps-only are two runs: give one")
    if is_moe and args.kernels is not None and len(args.kernels) > 1:
        parser.error("--model qwen3-30b-a3b measures one --kernels choice")
    tiny = args.tiny or jax.default_backend() == "cpu"
    if args.calibrate:
        auto_gamma.calibrate_preset(("tiny-moe" if is_moe else "tiny") if tiny else args.model)
        return 0
    if args.planted:
        model = ("tiny-moe" if is_moe else "tiny") if tiny else args.model
        return planted.main(["--model", model, "--out", args.out, "--budget-s", str(args.budget_s)])
    on_gpu = jax.default_backend() == "gpu"
    kernels = tuple(args.kernels or (["pallas", "pallas_attention", "xla"] if on_gpu else ["xla"]))
    # bf16 as served on the GPU; float32 on the CPU, whose XLA lacks some bf16 dot kernels.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    out = Path(args.out)
    if is_moe:
        plan = moe.tiny_plan() if tiny else moe.qwen3_30b_a3b_plan()
        run = _start(args, plan.base, kernels[:1], dtype, out, tiny)
        if args.experts_only:
            moe.experts_only(run, plan, kernels[0], dtype, args.routing or "random")
            return _finish(run, moe.summary(run.results))
        s = dense.setup(run, plan.base, kernels[:1], dtype, rounds_per_call=args.rounds_per_call)
        if args.steps_only:
            moe.steps_only(run, s)
            return _finish(run, summary(run.results) + "\n" + moe.summary(run.results))
        moe.run_all(run, s, plan, args.routing or "random")
        return _finish(run, summary(run.results) + "\n" + moe.summary(run.results))
    plan = dense.tiny_plan() if tiny else dense.qwen3_8b_plan()
    run = _start(args, plan, kernels, dtype, out, tiny)
    s = dense.setup(run, plan, kernels, dtype, rounds_per_call=args.rounds_per_call)
    if args.agreement_only:
        checks.agreement(run, s.target, s.drafter, kernels, gamma=3, new_tokens=96)
    elif args.sampling_only:
        # Fewer timed calls than the other sections: 24 rounds and 24 parts, each compiled once, in one run.
        s = dataclasses.replace(s, plan=dataclasses.replace(plan, reps=7, inner=5))
        for batch in plan.batches:
            for gamma in (0, 3):
                if run.time_left(f"sampling b{batch} g{gamma}"):
                    sampling.sampling(run, s, batch, gamma, kernels[0])
    elif args.outputs_only:
        s = dataclasses.replace(s, plan=dataclasses.replace(plan, reps=7, inner=5))
        for batch in dict.fromkeys((plan.batches[0], plan.batches[-1])):
            for gamma in (0, 3):
                if run.time_left(f"outputs b{batch} g{gamma}"):
                    outputs.outputs(run, s, batch, gamma, kernels[0])
    elif args.variants_only:
        run.ceilings(plan.copy_bytes, plan.matmul_n)
        for choice in kernels:
            for batch, length in args.variants_at or [(plan.batches[0], plan.kv_lengths[0])]:
                dense.variants(run, s, batch, length, choice)
    else:
        dense.run_all(run, s, with_peer=not args.no_peer)
    return _finish(run, summary(run.results) + "".join("\n" + line for line in variants_lines(run.results)))


def _start(args, plan: dense.Plan, kernels, dtype, out: Path, tiny: bool) -> Run:
    run = Run(args.budget_s, out, "bench.json")
    run.results.update(versions=versions(), plan={"tiny": tiny, "target": dataclasses.asdict(plan.target),
                                                   "drafter": dataclasses.asdict(plan.drafter)})
    if args.model != "qwen3-8b":
        run.results["plan"]["model"] = args.model
    return run


def _finish(run: Run, text: str) -> int:
    """The results written once more, plotted, and the summary printed."""
    run.save()
    try:
        plot(run.results, run.out / "bench.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(text)
    return 0


def variants_lines(results: dict) -> list[str]:
    """The decode-step breakdown (--variants-only): each variant's time and kernel count, the top kernels."""
    lines = []
    for v in results.get("variants", []):
        parts = ", ".join(f"{k} {v[k]['time_ms']:.3f} ms ({v[k]['kernel_count']} kernels)"
                          for k in ("step", "step_one_round_per_call", "forward_no_head", "matmuls_only"))
        lines.append(f"variants b{v['batch']} l{v['kv_len']} {v['kernels']} [{v['xla_flags']}]: "
                     f"floor {v['floor_ms']:.3f} ms; {parts}")
        step = v["step"]
        if "kernel_busy_ms" in step:
            groups = ", ".join(f"{g} {us / 1e3:.3f}" for g, us in step["groups_us"].items())
            lines.append(f"  kernel times summed {step['kernel_busy_ms']:.3f} ms in {step['launches']:.0f} launches "
                         f"({groups} ms), wall minus that {step['wall_minus_kernel_sum_ms']:.3f} ms; "
                         "top kernels (launches, us per step):")
            lines += [f"    {us:8.1f} us {count:5.0f}x  {name[:90]}" for name, (count, us) in
                      list(step["kernels"].items())[:24]]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
