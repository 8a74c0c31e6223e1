"""`make demo` (`python -m eagle3_jax.demo`): the shipped demo pair, with real text (on the CPU in `make demo`).

The pair (eagle3_jax/demo/pair, built by tools/build_demo_pair.py) is a 6-layer Qwen3 trained from scratch on
the Python standard library's sources and its EAGLE-3 drafter. For a few prompts cut from files that were
never trained on, it prints the prompt and the greedy continuation, decoded; checks that speculative output
equals spec-off output token for token; prints tau, the histogram of accepted drafts and tokens/s both ways;
then one sampled continuation at temperature 0.7 with its tau.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from eagle3_jax.demo import PAIR, timed_generate


def _tau(results) -> tuple[float, dict]:
    accepts = [a for r in results for a in r.accept_lengths]
    return float(np.mean(accepts) + 1), dict(sorted(collections.Counter(accepts).items()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=PAIR, help="a folder with target/, drafter/ and prompts.json")
    parser.add_argument("--prompts", type=int, default=3, help="how many held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.num_draft_tokens < 1:
        parser.error("--prompts, --max-new-tokens and --num-draft-tokens must be positive")

    import jax

    import eagle3_jax
    from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer

    # float32 at full precision wherever it runs (a GPU's float32 matmuls default to TF32), as the pair was built.
    jax.config.update("jax_default_matmul_precision", "highest")
    target = eagle3_jax.load_target(args.pair / "target", dtype="float32", progress=False)
    drafter = eagle3_jax.load_drafter(args.pair / "drafter", target, dtype="float32")
    tokenizer = load_tokenizer(args.pair / "target")
    stops = eos_stop_ids(tokenizer)
    chosen = [p for p in json.loads((args.pair / "prompts.json").read_text()) if p["demo"]][:args.prompts]
    prompts = [tokenizer(p["text"].rstrip("\n"))["input_ids"] for p in chosen]
    gamma, max_new = args.num_draft_tokens, args.max_new_tokens
    max_len = max(map(len, prompts)) + max_new + gamma + 2

    plain, t_plain = timed_generate(eagle3_jax.Engine(target, max_len=max_len), prompts, max_new, stops)
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=max_len)
    spec, t_spec = timed_generate(engine, prompts, max_new, stops)
    if [r.token_ids for r in spec] != [r.token_ids for r in plain]:
        raise SystemExit("speculative output differs from spec-off output")
    for p, ids, r in zip(chosen, prompts, plain):
        print(f"=== {p['file']} (held out), {len(ids)} prompt tokens ===")
        print(p["text"].rstrip("\n"), end="")
        print(f"\033[1m{tokenizer.decode(r.token_ids)}\033[0m\n")
    tau, hist = _tau(spec)
    tokens = sum(len(r.token_ids) for r in plain)
    print(f"greedy, {len(prompts)} prompts x {max_new} new tokens, batched, float32 on {jax.devices()[0].device_kind}:")
    print(f"  spec off         : {tokens / t_plain:7.1f} tokens/s")
    print(f"  gamma {gamma} (EAGLE-3): {tokens / t_spec:7.1f} tokens/s, tau {tau:.2f}, "
          f"accepted drafts per round {hist}; output identical to spec off")

    sampled, _ = timed_generate(engine, prompts[:1], max_new, stops, temperature=0.7, seed=0)
    s_tau, s_hist = _tau(sampled)
    print(f"\nsampled at temperature 0.7 (seed 0), gamma {gamma}: tau {s_tau:.2f}, accepted drafts {s_hist}")
    print(chosen[0]["text"].rstrip("\n"), end="")
    print(f"\033[1m{tokenizer.decode(sampled[0].token_ids)}\033[0m")
    return {"tau": tau, "histogram": hist, "spec_off_tokens_per_s": tokens / t_plain,
            "spec_tokens_per_s": tokens / t_spec, "sampled_tau": s_tau}


if __name__ == "__main__":
    main()
