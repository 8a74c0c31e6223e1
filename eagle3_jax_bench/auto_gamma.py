"""num_draft_tokens="auto" against spec-off and every fixed gamma, end to end, and the round-cost table it
chooses from.

    python -m eagle3_jax_bench.auto_gamma --out DIR [--model qwen3-8b] [--batches 1 8 32] [--max-gamma 3]
        [--prompt-len 128] [--max-new-tokens 256] [--reps 3]

* model: a preset's shapes with random bf16 weights (eagle3_jax_bench/presets.py; a random drafter, so tau is
  about 1 and the best fixed gamma is spec-off), or `tiny` in float32 (a CPU dry run).
* per batch: `batch` random prompts of --prompt-len tokens, --max-new-tokens each, no stop ids, through
  Engine.generate: spec off, each fixed gamma 1 .. --max-gamma, and auto (max_draft_tokens = --max-gamma).
  Each engine runs the request once untimed (it compiles; auto also measures its round costs for the batch
  size on this first use, or loads them), then --reps times timed: the median is reported.
* reports tokens/s, tau, auto's gammas per round, and auto against spec-off and against the best fixed gamma
  of the same batch (the goals: at most 2% slower than spec-off with a random drafter, within 5% of the best
  fixed gamma in hindsight).
`calibrate` is `eagle3-jax bench --calibrate`: the cost table at the bench's shapes, measured or loaded.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax
from eagle3_jax.decoding import gamma_policy, round_costs

from . import inputs, presets
from .core import versions


def engines(target, drafter, max_gamma: int, max_len: int, batch: int) -> dict:
    """Spec-off (gamma 0), each fixed gamma and auto, each with a pool of `batch` slots and KV for all of them
    (alive together: each holds its own pages)."""
    kv = dict(max_len=max_len, max_batch=batch, kv_tokens=batch * max_len)
    out = {"0": eagle3_jax.Engine(target, **kv)}
    for g in range(1, max_gamma + 1):
        out[str(g)] = eagle3_jax.Engine(target, drafter, num_draft_tokens=g, **kv)
    out["auto"] = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=max_gamma, **kv)
    return out


def timed(engine, prompts, max_new: int, reps: int) -> dict:
    """One untimed request, then `reps` timed: the median's tokens/s, tau and gammas per round."""
    engine.generate(prompts, max_new, progress=False)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        results = engine.generate(prompts, max_new, progress=False)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(r.token_ids) for r in results)
    accepts = [a for r in results for a in r.accept_lengths]
    row = {"tokens": tokens, "seconds": statistics.median(seconds), "all_seconds": seconds,
           "tokens_per_s": tokens / statistics.median(seconds),
           "tau": float(np.mean(accepts) + 1) if accepts else 1.0}
    if engine.auto:
        used = collections.Counter(g for r in results[:1] for g in r.gammas)
        row["gammas_of_row_0"] = {str(g): used[g] for g in engine.gammas}
    return row


def compare(target, drafter, batches, max_gamma: int, prompt_len: int, max_new: int, reps: int) -> list[dict]:
    rows = []
    max_len = prompt_len + max_new + max_gamma + 2
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(0, target.config.vocab_size, (batch, prompt_len)).tolist()
        by_name = {name: timed(e, prompts, max_new, reps) for name, e in
                   engines(target, drafter, max_gamma, max_len, batch).items()}
        best = max((n for n in by_name if n != "auto"), key=lambda n: by_name[n]["tokens_per_s"])
        auto = by_name["auto"]["tokens_per_s"]
        row = {"batch": batch, "runs": by_name, "best_fixed_gamma": int(best),
               "auto_vs_spec_off": auto / by_name["0"]["tokens_per_s"],
               "auto_vs_best_fixed": auto / by_name[best]["tokens_per_s"],
               "catch_up": catch_up(target, drafter, max_len, batch, prompt_len + max_new // 2)}
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        rows.append(row)
    return rows


def catch_up(target, drafter, max_len: int, batch: int, length: int) -> dict:
    """What keeping the drafter consistent costs gamma 0: a call of plain rounds that holds its pairs back
    from the drafter, one that then brings the drafter up to date over every held pair (one in FLUSH_CALLS),
    and their mean over a cycle, against the spec-off call (no drafter)."""
    kv = dict(max_len=max_len, max_batch=batch, kv_tokens=batch * max_len)
    auto = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=1, **kv)
    hold, flush = (auto.time_call(batch, length, 0, flush=f) for f in (False, True))
    spec_off = eagle3_jax.Engine(target, **kv).time_call(batch, length, 0)
    cycle = ((gamma_policy.FLUSH_CALLS - 1) * hold + flush) / gamma_policy.FLUSH_CALLS
    row = {"kv_len": length, "hold_ms": hold * 1e3, "flush_ms": flush * 1e3, "spec_off_ms": spec_off * 1e3,
           "overhead": cycle / spec_off - 1}
    print(json.dumps({"batch": batch, **row}), flush=True)
    return row


def calibrate(target, drafter, batches, max_gamma: int, max_len: int) -> dict:
    """The auto engine's round-cost table at each batch size: seconds per call of each gamma at each KV
    length of the grid (measured now unless a fresh table is cached on disk)."""
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=max_gamma,
                               max_len=max_len, max_batch=max(batches))
    lengths = round_costs.grid_lengths(max_len, round_costs.margin(engine.rounds_per_call, max_gamma))
    table = {b: [engine.round_costs(b, n).tolist() for n in lengths] for b in batches}
    print(f"seconds per call of {engine.rounds_per_call} rounds, gamma {' / '.join(map(str, engine.gammas))}; "
          f"stored in {round_costs.default_folder()}")
    for b, rows in table.items():
        for n, seconds in zip(lengths, rows):
            print(f"  batch {b:4d} kv {n:6d}: " + " / ".join(f"{s * 1e3:8.3f} ms" for s in seconds))
    return {"lengths": lengths, "seconds": table}


def calibrate_preset(name: str, batches=(1, 8, 32), max_gamma: int = 3, max_len: int = 2048) -> dict:
    """`calibrate` for a preset's shapes with random weights (`models`); max_len within the preset's limit."""
    target, drafter = models(name)
    return calibrate(target, drafter, batches, max_gamma, min(max_len, target.config.max_position_embeddings))


def models(name: str):
    """Random weights at a preset's shapes: bf16, or float32 for `tiny` (the CPU's dry run)."""
    dtype = jnp.float32 if name.startswith("tiny") else jnp.bfloat16
    return inputs.random_models(presets.pair(name), dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.auto_gamma",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=tuple(presets.PRESETS), default="qwen3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-gamma", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    target, drafter = models(args.model)
    results = {"versions": versions(), "model": args.model, "device": jax.devices()[0].device_kind,
               "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
               "rows": compare(target, drafter, args.batches, args.max_gamma, args.prompt_len,
                               args.max_new_tokens, args.reps)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_gamma.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
