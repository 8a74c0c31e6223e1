"""The drafter's training step on one device: tokens per second and MFU at Qwen3-8B shapes, random weights.

    python -m eagle3_jax_bench.training                 # Qwen3-8B shapes, sequence 2048 (a GPU)
    python -m eagle3_jax_bench.training --tiny          # tiny shapes: a smoke test that runs on the CPU

MFU = useful FLOPs per step / seconds per step / the bf16 matmul rate measured in the same run
(`core.matmul_rate`). Useful FLOPs: the target's forward (matmuls, lm_head, causal attention) plus
the drafter's k TTT steps, forward and backward (3x the forward): its matmuls, lm_head over the draft
vocabulary, fc at step 0, and attention over the causal half of the step-0 keys plus the diagonal ones.
It also searches the largest batch that fits (doubling until the device runs out of memory) and reports the
most expensive kernels of a profiled step (GPU only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import qwen3
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.training import step

from . import presets, profile
from .core import matmul_rate, time_chain
from .inputs import random_tree

QWEN3_8B = presets.pair("qwen3-8b")[0]
TINY = dataclasses.replace(presets.pair("tiny")[0], vocab_size=512, max_position_embeddings=32768)


def layer_matmul_params(D: int, N: int, K: int, H: int, inter: int, in_width: int) -> int:
    return (N + 2 * K) * H * in_width + D * N * H + 3 * inter * D


def step_flops(spec: step.StepSpec, batch: int, seq: int) -> dict[str, float]:
    """Useful FLOPs of one training step, by part."""
    t, d = spec.target, spec.drafter
    tokens = batch * seq
    causal_pairs = batch * seq * (seq + 1) / 2  # (query, key) pairs a causal pass uses
    target = (2 * tokens * (t.num_layers * layer_matmul_params(t.hidden_size, t.num_heads, t.num_kv_heads,
                                                                t.head_dim, t.intermediate_size, t.hidden_size)
                            + t.vocab_size * t.hidden_size)
              + t.num_layers * 4 * t.num_heads * t.head_dim * causal_pairs)
    per_step = 2 * tokens * (layer_matmul_params(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim,
                                                 d.intermediate_size, 2 * d.hidden_size)
                             + d.draft_vocab_size * d.hidden_size)
    k = spec.ttt_steps
    attention = 4 * d.num_heads * d.head_dim * (k * causal_pairs + tokens * k * (k - 1) / 2)
    drafter_forward = k * per_step + 2 * tokens * d.feature_width * d.hidden_size + attention
    return {"target_forward": float(target), "drafter_forward_backward": float(3 * drafter_forward),
            "total": float(target + 3 * drafter_forward)}


def make_spec(cfg: Qwen3Config, draft_vocab: int, ttt_steps: int, kernels: str) -> step.StepSpec:
    return step.StepSpec(target=cfg, drafter=step.drafter_config(cfg, draft_vocab), ttt_steps=ttt_steps,
                         loss_decay=0.8, compute_dtype="bfloat16", kernels=kernels, learning_rate=1e-4,
                         warmup_steps=10, total_steps=1000, weight_decay=0.0, max_grad_norm=0.5)


def inputs(spec: step.StepSpec, batch: int, seq: int):
    tparams = random_tree(qwen3.abstract_params(spec.target, jnp.bfloat16), seed=0)
    state = step.init_state(spec, step.init_params(spec.drafter, 0), np.zeros(spec.drafter.draft_vocab_size, np.int32))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, spec.target.vocab_size, (batch, seq)), jnp.int32)
    return state, tparams, tokens, jnp.ones((batch, seq), jnp.float32)


def seconds_per_step(spec: step.StepSpec, batch: int, seq: int, reps: int) -> float:
    """Median seconds of one training step, after one call that compiles it."""
    state, tparams, tokens, mask = inputs(spec, batch, seq)

    def train_step(tparams, tokens, mask, state):
        return step.jit_train_step(state, tparams, tokens, mask, spec=spec)

    return time_chain(train_step, state, (tparams, tokens, mask), reps, inner=1, warmup=1)[0]


def largest_batch(spec: step.StepSpec, seq: int, limit: int) -> int:
    """The largest power-of-two batch up to `limit` whose step runs (0 if not even batch 1 fits)."""
    fits, batch = 0, 1
    while batch <= limit:
        try:
            seconds_per_step(spec, batch, seq, reps=1)
        except Exception as e:  # XLA reports running out of memory as a runtime error
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            break
        fits, batch = batch, batch * 2
    return fits


def biggest_costs(spec: step.StepSpec, batch: int, seq: int, top: int = 5) -> list:
    """The most expensive kernels of a profiled step: [name, launches, GPU microseconds] (empty off the GPU)."""
    state, tparams, tokens, mask = inputs(spec, batch, seq)

    def run():
        nonlocal state
        state, metrics = step.jit_train_step(state, tparams, tokens, mask, spec=spec)
        jax.block_until_ready(metrics)

    run()
    times = profile.gpu_kernel_times(run)
    return [[name, *v] for name, v in sorted(times.items(), key=lambda kv: -kv[1][1])[:top]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--seq", type=int, help="sequence length (default 2048, tiny 64)")
    parser.add_argument("--batch", type=int, default=1, help="batch of the timed step")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, help="default 32000 (tiny 128)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch tried by the fit search (0: skip)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kernels", choices=kernels_lib.CHOICES)
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else QWEN3_8B
    seq = args.seq or (64 if args.tiny else 2048)
    kernels = kernels_lib.check(args.kernels or kernels_lib.default())
    spec = make_spec(cfg, args.draft_vocab or (128 if args.tiny else 32000), args.ttt_steps, kernels)
    matmul_tflops = matmul_rate(512 if args.tiny else 8192)
    seconds = seconds_per_step(spec, args.batch, seq, args.reps)
    flops = step_flops(spec, args.batch, seq)
    result = {
        "device": jax.devices()[0].device_kind, "shapes": "tiny" if args.tiny else "Qwen3-8B", "seq": seq,
        "batch": args.batch, "ttt_steps": args.ttt_steps, "kernels": kernels, "seconds_per_step": seconds,
        "tokens_per_s": args.batch * seq / seconds, "step_tflop": flops["total"] / 1e12,
        "flops_by_part": flops, "matmul_tflops_bf16": matmul_tflops,
        "mfu": flops["total"] / seconds / (matmul_tflops * 1e12),
        "largest_batch": largest_batch(spec, seq, args.max_batch) if args.max_batch else None,
        "biggest_costs": biggest_costs(spec, args.batch, seq),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
