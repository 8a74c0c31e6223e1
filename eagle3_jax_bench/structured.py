"""Structured outputs (docs/structured.md): what a constraint costs to compile at Qwen3's vocabulary, what its masks
cost in the call of rounds on the device, and the tau they keep on the demo pair.

    python -m eagle3_jax_bench.structured call --out call.json [--batches 1 32] [--gamma 3]   (GPU, Qwen3-8B shapes)
    python -m eagle3_jax_bench.structured compile --out compile.json [--vocab bpe]           (CPU)
    python -m eagle3_jax_bench.structured tau --out tau.json                                 (CPU, the demo pair)
    python -m eagle3_jax_bench.structured call --out call.json --dry-run                     (the tiny preset, CPU)

* call: planted_world.py's target and drafter (random weights at the preset's shapes, bf16; a = 0.5) and a
  vocabulary of the target's size (`--vocab`); per batch, the engine's jitted call of rounds at gamma (EAGLE-3)
  timed on a pool of that many rows at KV 1,024 (round_costs.timing_pool: the rows compute everything and write
  nothing) free, then with every row constrained by REGEX (a permissive regex, so a random model keeps going): the
  pool's automaton tables installed, each row at its initial state. ratio: constrained / free (goal: <= 1.10).
* compile: the compile of each of KINDS (a 5-field JSON schema among them) on a vocabulary of 151,936 tokens, the
  fastest of --reps fresh compiles (a new Compiler each: no cache), with the tables' states, classes and bytes.
* tau: the demo pair (float32, gamma 3, greedy) over --prompts held-out prompts for each kind: tau with the drafts
  constrained (Engine's default) and unconstrained (constrain_drafts=False); both outputs equal spec-off's.
Vocabularies (`--vocab`): "bpe", a byte-level BPE trained with `tokenizers` on the installed Python sources to
151,936 tokens (no hub is reachable; about a minute, cached in --cache); "synthetic", byte tokens then random
lowercase words (some with a leading space, digits or punctuation) of BPE-like lengths, instant (the call's cost
depends only on the tables' shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax
from eagle3_jax.decoding import grammar, round_costs, spec_round
from eagle3_jax.decoding.automaton import Vocabulary, compile_regex
from eagle3_jax.decoding.structured import Compiler, Structured

from . import planted_world, presets
from .core import versions

QWEN3_VOCAB = 151_936
REGEX = "[a-z ]{1,400}"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "active", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                         "active": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}}}
KINDS = {"json_schema (5 fields)": Structured(json_schema=SCHEMA), "regex " + REGEX: Structured(regex=REGEX),
         "choice (3)": Structured(choice=["positive", "negative", "neutral"]),
         "json_object": Structured(json_object=True)}
CALL_LENGTH = 1024  # the timed pool's KV length


def synthetic_vocabulary(size: int, seed: int = 0) -> Vocabulary:
    """`size` tokens: the 256 bytes (fewer for a smaller vocabulary), then random words of lengths 2-12 (mostly
    lowercase, half with a leading space, some digits, capitals and punctuation); the last id the end of sequence."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz" * 3 + b"ABCDEFGHIJ0123456789_.,:;(){}[]\"'", np.uint8)
    tokens, seen = [bytes([b]) for b in range(min(256, size - 1))], set()
    while len(tokens) < size - 1:
        length = rng.integers(2, 13)
        word = (b" " if rng.random() < 0.5 else b"") + letters[rng.integers(0, len(letters), length)].tobytes()
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    return Vocabulary(tuple(tokens) + (None,), (size - 1,), size)


def bpe_vocabulary(size: int, cache: Path) -> Vocabulary:
    """A byte-level BPE of `size` tokens trained on the installed Python sources (cached as tokenizer JSON)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eagle3_jax.checkpoints.tokenizer import token_bytes

    path = cache / f"bpe{size}.json"
    if not path.exists():
        roots = [Path(sysconfig.get_paths()["stdlib"])] + [Path(p) for p in sys.path if p.endswith("site-packages")]
        files = [p for root in roots for p in sorted(root.rglob("*.py"))]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

        def texts():
            for f in files:
                try:
                    yield f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue

        tok.train_from_iterator(texts(), trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    return Vocabulary(tuple(token_bytes(tokenizer)), (tokenizer.eos_token_id,), size)


def vocabulary(kind: str, size: int, cache: Path) -> Vocabulary:
    return bpe_vocabulary(size, cache) if kind == "bpe" else synthetic_vocabulary(size)


def compile_rows(vocab: Vocabulary, reps: int) -> list[dict]:
    vocab.layout  # computed once per vocabulary, outside the timings
    rows = []
    for name, s in KINDS.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            automaton = Compiler(vocab)(s)
            times.append(time.perf_counter() - start)
        rows.append({"constraint": name, "compile_ms": min(times) * 1e3, "states": automaton.num_states,
                     "classes": automaton.num_classes, "table_bytes": automaton.nbytes})
    return rows


def call_seconds(eng: eagle3_jax.Engine, batch: int, automaton, length: int) -> float:
    """Seconds per call of rounds on a timed pool of `batch` rows at KV `length`, every row constrained by
    `automaton` (None: free)."""
    steps, pages, spec = eng.steps, eng.page_pool, eng.spec
    rows = steps.empty(spec, batch, eng.table_width, 8, eng.target.params["embed"].dtype)
    if automaton is not None:
        registry = grammar.Registry()
        for _ in range(batch):
            k, offset = registry.place(automaton)
        rows = grammar.installed(rows, registry, steps.put)
        start = jnp.full((batch,), offset + automaton.initial, jnp.int32)
        rows = dataclasses.replace(rows, grammar=grammar.Rows(jnp.full((batch,), k, jnp.int32), start))
    table = round_costs.timing_table(batch, pages.num_pages, eng.table_width)
    state = round_costs.timing_pool(spec_round.with_pages(rows, pages.arrays), steps.put(table), length,
                                    eng.target.config.vocab_size, eng.max_len)
    pages.acquire()
    try:
        seconds, state = round_costs.time_calls(
            lambda s: steps.rounds(eng.target.params, eng.draft_params, s, None, spec=spec,
                                   num_rounds=eng.rounds_per_call), state)
        _, pages.arrays = spec_round.split_pages(state)
    finally:
        pages.release()
    return seconds


def run_call(model: str, batches, gamma: int, vocab_kind: str, cache: Path, dtype: str, length: int) -> dict:
    cfg, dcfg = presets.pair(model)
    world = planted_world.make_world(cfg, dcfg)
    target = planted_world.planted_target(cfg, world, jnp.dtype(dtype))
    drafter = planted_world.planted_drafter(dcfg, world, 0.5, jnp.dtype(dtype))
    start = time.perf_counter()
    automaton = compile_regex(REGEX, vocabulary(vocab_kind, cfg.vocab_size, cache))
    out = {"device": jax.devices()[0].device_kind, "versions": versions(), "model": model, "gamma": gamma,
           "regex": REGEX, "compile_s": time.perf_counter() - start, "states": automaton.num_states,
           "classes": automaton.num_classes, "rows": []}
    for batch in batches:
        eng = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=2 * length, max_batch=batch,
                                kv_tokens=batch * 2 * length)
        free = call_seconds(eng, batch, None, length)
        constrained = call_seconds(eng, batch, automaton, length)
        out["rows"].append({"batch": batch, "free_ms": free * 1e3, "constrained_ms": constrained * 1e3,
                            "ratio": constrained / free})
    return out


def run_tau(prompts: int, max_new: int) -> dict:
    from eagle3_jax.checkpoints.tokenizer import load_tokenizer
    from eagle3_jax.demo import PAIR

    target = eagle3_jax.load_target(PAIR / "target", dtype="float32", progress=False)
    drafter = eagle3_jax.load_drafter(PAIR / "drafter", target, dtype="float32")
    tokenizer = load_tokenizer(PAIR / "target")
    texts = [p["text"] for p in json.loads((PAIR / "prompts.json").read_text())[:prompts]]
    ids = [tokenizer(t)["input_ids"][:64] for t in texts]
    off = eagle3_jax.Engine(target, max_len=256)
    engines = {flag: eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=256, constrain_drafts=flag)
               for flag in (True, False)}
    rows = []
    for name, s in list(KINDS.items()) + [("free", None)]:
        expected = [r.token_ids for r in off.generate(ids, max_new, structured=s)]
        row = {"constraint": name}
        for flag, e in engines.items():
            results = e.generate(ids, max_new, structured=s)
            assert [r.token_ids for r in results] == expected, (name, flag)
            accepts = [a for r in results for a in r.accept_lengths]
            row["tau_constrained_drafts" if flag else "tau_free_drafts"] = float(np.mean(accepts) + 1)
        rows.append(row)
    return {"versions": versions(), "prompts": prompts, "max_new": max_new, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax_bench.structured",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("call", "compile", "tau"))
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--vocab", choices=("bpe", "synthetic"), default=None,
                        help="compile: bpe by default; call: synthetic by default")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "eagle3_jax")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset in float32: a CPU check of the code")
    args = parser.parse_args(argv)
    if args.what == "compile":
        size = 4096 if args.dry_run else QWEN3_VOCAB
        out = {"versions": versions(), "vocab": args.vocab or "bpe", "size": size,
               "rows": compile_rows(vocabulary(args.vocab or "bpe", size, args.cache), args.reps)}
        lines = [f"{r['constraint']:>28} {r['compile_ms']:>9.1f} ms {r['states']:>6} states {r['classes']:>5} classes "
                 f"{r['table_bytes'] / 2**20:>6.2f} MiB" for r in out["rows"]]
    elif args.what == "tau":
        out = run_tau(2 if args.dry_run else args.prompts, 8 if args.dry_run else args.max_new)
        lines = [f"{r['constraint']:>28} tau {r['tau_constrained_drafts']:.2f} constrained drafts, "
                 f"{r['tau_free_drafts']:.2f} free drafts" for r in out["rows"]]
    else:
        model, dtype = ("tiny", "float32") if args.dry_run else ("qwen3-8b", "bfloat16")
        out = run_call(model, [2] if args.dry_run else args.batches, args.gamma, args.vocab or "synthetic",
                       args.cache, dtype, 64 if args.dry_run else CALL_LENGTH)
        lines = [f"batch {r['batch']:>3}: free {r['free_ms']:.3f} ms, constrained {r['constrained_ms']:.3f} ms, "
                 f"{r['ratio']:.3f}x" for r in out["rows"]]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
