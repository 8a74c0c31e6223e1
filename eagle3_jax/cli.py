"""The `eagle3-jax` command: generate, serve, convert, train, regenerate, bench."""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import secrets
import sys
import time
from pathlib import Path

from eagle3_jax.checkpoints.generation import GREEDY, generation_sampling
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
from eagle3_jax.decoding import engine_args
from eagle3_jax.decoding.engine import CPU_PREFILL_CHUNK, DEFAULT_EXACT, PREFILL_CHUNK, ROUNDS_PER_CALL
from eagle3_jax.decoding.engine_args import DEFAULT_MAX_LEN, DEFAULT_PROPOSAL, PROPOSALS
from eagle3_jax.decoding.request import check_room
from eagle3_jax.models.kernels import CHOICES as KERNEL_CHOICES

MAX_LEN_HELP = f"a sequence's capacity, prompt + output (default: min({DEFAULT_MAX_LEN}, the model's limit))"
PREFILL_CHUNK_HELP = (f"the most prompt tokens one target forward (each round of a call) carries (default: "
                      f"{PREFILL_CHUNK} on a GPU, {CPU_PREFILL_CHUNK} on the CPU)")


def _ids(flag: str):
    """The parser of a flag of token ids, its errors naming the flag."""
    def parse(text: str) -> list[int]:
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be integers separated by commas or spaces, got {text!r}") from None

    return parse


def _num_draft_tokens(text: str):
    """--num-draft-tokens: an int, or "auto" (the engine picks gamma per call)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-draft-tokens must be an int or 'auto', got {text!r}") from None


def _use_compile_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache in `folder` (None: off), so that a second run of the same command
    loads its compiled programs instead of compiling them again."""
    if folder is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(Path(folder).expanduser()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, even a fast one


def _default_cache_dir() -> str | None:
    """$EAGLE3_JAX_COMPILE_CACHE when set (empty: off), else eagle3_jax/xla in the user's cache folder."""
    if "EAGLE3_JAX_COMPILE_CACHE" in os.environ:
        return os.environ["EAGLE3_JAX_COMPILE_CACHE"] or None
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3_jax" / "xla")


def _sampling(args) -> dict:
    """The sampling settings, as transformers' generate settles them: the target folder's
    generation_config.json (its do_sample, temperature, top_k and top_p, transformers' defaults for any it
    leaves out; greedy without the file or without do_sample), with each flag given laid over it. A run
    without --seed draws one, so the printed settings repeat it."""
    flags = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    given = {k: v for k, v in flags.items() if v is not None}
    settings, source = dict(GREEDY), "defaults"
    from_file = generation_sampling(args.target)
    if from_file is not None:
        settings, source = from_file, "generation_config.json"
    if given:
        source = "flags" if source == "defaults" else f"flags over {source}"
    settings = {**settings, **given}
    settings["seed"] = args.seed if args.seed is not None else secrets.randbits(32)
    return {"settings": settings, "source": source}


def _prompt_ids(args, tokenizer) -> list[int]:
    """--prompt-ids as given, or --prompt tokenized, through the tokenizer's chat template with --chat."""
    if args.prompt is None:
        if args.chat:
            raise SystemExit("error: --chat renders --prompt text; it cannot take --prompt-ids")
        return args.prompt_ids
    if tokenizer is None:
        raise SystemExit(f"error: {args.target} has no tokenizer; pass --prompt-ids instead of --prompt")
    if not args.chat:
        return tokenizer(args.prompt)["input_ids"]
    if not tokenizer.chat_template:
        raise SystemExit(f"error: {args.target}'s tokenizer has no chat template; drop --chat")
    extra = {} if args.thinking is None else {"enable_thinking": args.thinking}  # Qwen3's template reads it
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True, **extra)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def add_proposer_args(parser: argparse.ArgumentParser) -> None:
    """What proposes a command's drafts: --drafter (an EAGLE-3 drafter folder) or --prompt-lookup, exclusive, and
    prompt lookup's n-gram sizes. Any command that builds an Engine takes them (with `proposer_from_args`)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--drafter", help="EAGLE-3 drafter folder")
    which.add_argument("--prompt-lookup", action="store_true",
                       help="draft by prompt lookup: the continuation of the latest earlier occurrence of the last "
                            "n tokens, in the prompt and the output so far (no weights; eagle3_jax.PromptLookup)")
    parser.add_argument("--prompt-lookup-max", type=int, metavar="N",
                        help="with --prompt-lookup: the longest n-gram matched (default 4)")
    parser.add_argument("--prompt-lookup-min", type=int, metavar="N",
                        help="with --prompt-lookup: the shortest n-gram matched (default 1)")


def add_tree_args(parser) -> None:
    """--draft-depth and --draft-top-k: a draft tree (see eagle3_jax.Engine's draft_depth and draft_top_k)."""
    parser.add_argument("--draft-top-k", type=int, default=1,
                        help="beams of a draft tree: 1 (the default) drafts a chain of --num-draft-tokens; K > 1 "
                             "verifies a tree of --num-draft-tokens nodes from --draft-depth steps of K beams "
                             "(needs --drafter)")
    parser.add_argument("--draft-depth", type=int,
                        help="a draft tree's drafting steps (with --draft-top-k > 1; at most --num-draft-tokens)")


def proposer_from_args(args):
    """The proposer `add_proposer_args`' flags choose, checked before any model loads: a PromptLookup, the
    drafter folder (to load against the target), or None."""
    sizes = {"max_ngram": args.prompt_lookup_max, "min_ngram": args.prompt_lookup_min}
    if not args.prompt_lookup:
        if any(v is not None for v in sizes.values()):
            raise SystemExit("error: --prompt-lookup-max and --prompt-lookup-min are for --prompt-lookup")
        return args.drafter
    import eagle3_jax

    return eagle3_jax.PromptLookup(**{k: v for k, v in sizes.items() if v is not None})


def _check_gamma(args, proposer) -> None:
    """The engine's gamma and tree rules (engine_args.check_gamma, check_tree) in the flags' names, before any model
    loads (a drafter folder drafts trees; prompt lookup does not)."""
    try:
        _, auto = engine_args.check_gamma(proposer is not None, args.num_draft_tokens, args.max_draft_tokens,
                                          on_mesh=args.tp != 1, names=engine_args.FLAGS)
        engine_args.check_tree(isinstance(proposer, str), args.num_draft_tokens, args.draft_depth, args.draft_top_k,
                               auto=auto, proposal=getattr(args, "proposal", DEFAULT_PROPOSAL),
                               exact=getattr(args, "exact", False), on_mesh=args.tp != 1, names=engine_args.FLAGS)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _generate(args) -> int:
    proposer = proposer_from_args(args)
    _check_gamma(args, proposer)
    import jax

    import eagle3_jax
    from eagle3_jax.parallel.mesh import tp_mesh

    _use_compile_cache(None if args.no_compile_cache else args.compile_cache)
    # float32 on the CPU, where bfloat16 has no fast matmuls (about five times slower); bfloat16 elsewhere.
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    mesh = None if args.tp == 1 else tp_mesh(args.tp)  # refused here when fewer devices are present
    target = eagle3_jax.load_target(args.target, dtype=dtype, mesh=mesh)
    drafter = eagle3_jax.load_drafter(args.drafter, target, dtype=dtype) if args.drafter else proposer
    tokenizer = load_tokenizer(args.target)
    prompt = _prompt_ids(args, tokenizer)
    sampling = _sampling(args)
    settings = sampling["settings"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=args.num_draft_tokens, max_len=args.max_len,
                               kernels=args.kernels, rounds_per_call=args.rounds_per_call, proposal=args.proposal,
                               exact=args.exact, max_draft_tokens=args.max_draft_tokens, mesh=mesh,
                               prefill_chunk=args.prefill_chunk, draft_depth=args.draft_depth,
                               draft_top_k=args.draft_top_k)
    stops = args.stop_ids or list(eos_stop_ids(tokenizer))
    vocab = target.config.vocab_size
    if args.stop_ids and not all(0 <= t < vocab for t in args.stop_ids):
        bad = next(t for t in args.stop_ids if not 0 <= t < vocab)
        raise SystemExit(f"error: --stop-ids has {bad}, outside the vocabulary [0, {vocab})")
    try:  # refused as the server refuses it, not cut at --max-len
        check_room(len(prompt), args.max_new_tokens, engine.max_len, "--max-new-tokens",
                   f"--max-len {engine.max_len}{'' if args.max_len else ' (the default)'}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # Compile prefill and the round outside the timing (the same build: greedy or sampling).
    engine.generate([prompt], max_new_tokens=2, **settings)
    start = time.perf_counter()
    (result,) = engine.generate([prompt], max_new_tokens=args.max_new_tokens, stop_token_ids=stops, **settings)
    elapsed = time.perf_counter() - start
    if tokenizer is not None:
        print(tokenizer.decode(result.token_ids, skip_special_tokens=not args.show_special_tokens))
    else:
        print(" ".join(map(str, result.token_ids)))
    used = ", ".join(f"{k}={v}" for k, v in settings.items()) if settings["temperature"] else "greedy"
    print(f"\nsampling: {used} (from {sampling['source']})")
    print(f"dtype: {dtype} ({'from --dtype' if args.dtype else f'the default on {backend}'})")
    print(f"{len(result.token_ids)} tokens in {elapsed:.3f} s: {len(result.token_ids) / elapsed:.1f} tokens/s "
          f"(finish: {result.finish_reason})")
    if drafter is not None and result.accept_lengths:
        tau = sum(a + 1 for a in result.accept_lengths) / len(result.accept_lengths)
        print(f"tau (mean tokens per round) = {tau:.3f} over {len(result.accept_lengths)} rounds")
        counts = collections.Counter(result.accept_lengths)
        for a in range(engine.draft_depth + 1):
            print(f"  accepted {a}: {counts.get(a, 0):5d} {'#' * counts.get(a, 0)}")
        if engine.auto:
            used = collections.Counter(result.gammas)
            print("gamma per round: " + ", ".join(f"{g}: {used[g]}" for g in engine.gammas))
    return 0


def _serve(args) -> int:
    args.proposer = proposer_from_args(args)
    _check_gamma(args, args.proposer)
    if args.drain_s < 0:
        raise SystemExit(f"error: --drain-s must be >= 0, got {args.drain_s}")
    import jax

    from eagle3_jax.parallel.mesh import tp_mesh
    from eagle3_jax.serving.server import serve

    _use_compile_cache(None if args.no_compile_cache else args.compile_cache)
    args.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    args.mesh = None if args.tp == 1 else tp_mesh(args.tp)
    return serve(args)


def _convert(args) -> int:
    import eagle3_jax

    if args.drafter_of:
        target = eagle3_jax.load_target(args.drafter_of, dtype=args.dtype)
        out = eagle3_jax.convert_drafter(args.src, args.dst, target, dtype=args.dtype)
    else:
        out = eagle3_jax.convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def _train(args) -> int:
    import eagle3_jax
    from eagle3_jax.training import loop, trainer
    from eagle3_jax.training.data import data_files

    config = trainer.TrainConfig(
        draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps, max_seq_len=args.max_seq_len,
        batch_size=args.batch_size, learning_rate=args.learning_rate, steps=args.steps, epochs=args.epochs,
        seed=args.seed, resume=args.resume, overwrite=args.overwrite, checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every, eval_data=tuple(args.eval_data or ()), compute_dtype=args.compute_dtype,
        kernels=args.kernels,
    )
    # A mistyped path, or an --out that holds a run, fails before the target loads.
    data_files(args.data + (args.eval_data or []))
    loop.check_reuse(Path(args.out), args.resume, args.overwrite, trainer.RUN_FILES)
    try:
        target = eagle3_jax.load_target(args.target, dtype=args.dtype)
        result = eagle3_jax.train_drafter(target, args.data, args.out, config)
    except loop.Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # outside the training loop: before its first update or in the final export
        print(f"interrupted: nothing new saved; any checkpoints in {args.out} are kept (--resume continues)",
              file=sys.stderr)
        return 130
    print(f"wrote {args.out}" + "".join(f" {k}={v:.3f}" for k, v in result.items() if isinstance(v, float)))
    return 0


def _regenerate(args) -> int:
    import eagle3_jax
    from eagle3_jax.training.regenerate import regenerate

    target = eagle3_jax.load_target(args.target, dtype=args.dtype)
    drafter = eagle3_jax.load_drafter(args.drafter, target, dtype=args.dtype) if args.drafter else None
    stats = regenerate(target, args.data, args.out, tokenizer=load_tokenizer(args.target),
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_len=args.max_len,
                       drafter=drafter, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(f"wrote {stats.written} records to {args.out} (resumed after {stats.resumed_after}): "
          f"{stats.regenerated} regenerated, {stats.copied} copied (nothing to rewrite), "
          f"{stats.too_long} kept unchanged from the first turn longer than --max-len")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy or sampled generation, speculative with --drafter or "
                                          "--prompt-lookup")
    gen.add_argument("--target", required=True, help="Qwen3 target folder (Hugging Face or converted)")
    add_proposer_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs the target folder's tokenizer)")
    source.add_argument("--prompt-ids", type=_ids("--prompt-ids"), help="prompt token ids, e.g. '1,2,3'")
    gen.add_argument("--chat", action="store_true", help="render --prompt with the tokenizer's chat template")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction,
                     help="with --chat: the template's enable_thinking (Qwen3); default: the template's own")
    gen.add_argument("--temperature", type=float, help="0 is greedy (default: generation_config.json, else 0)")
    gen.add_argument("--top-k", type=int, help="0 is no top-k filter (default: generation_config.json, else 0)")
    gen.add_argument("--top-p", type=float, help="1 is no top-p filter (default: generation_config.json, else 1)")
    gen.add_argument("--seed", type=int, help="the sampling seed (default: a fresh one, printed)")
    gen.add_argument("--proposal", choices=PROPOSALS, default=DEFAULT_PROPOSAL,
                     help="how the drafter proposes for a sampled row (see eagle3_jax.Engine)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--num-draft-tokens", type=_num_draft_tokens, default=3,
                     help="drafts per round, or 'auto': the engine picks 0 .. --max-draft-tokens per call")
    gen.add_argument("--max-draft-tokens", type=int,
                     help="with --num-draft-tokens auto: the largest gamma it may pick (default 3)")
    add_tree_args(gen)
    gen.add_argument("--max-len", type=int, help=MAX_LEN_HELP)
    gen.add_argument("--stop-ids", type=_ids("--stop-ids"), help="stop token ids (default: the tokenizer's eos)")
    gen.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                     help="the weights' dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    gen.add_argument("--show-special-tokens", action="store_true",
                     help="print special tokens (an end-of-text stop token, chat markers) in the text")
    gen.add_argument("--kernels", choices=KERNEL_CHOICES,
                     help="hot-op implementation (eagle3_jax/models/kernels.py; default: pallas on a GPU, "
                          "xla elsewhere)")
    gen.add_argument("--exact", action=argparse.BooleanOptionalAction, default=DEFAULT_EXACT,
                     help="decode and verify on kernels whose result for a token does not depend on the batch or "
                          "the tokens verified with it: speculative output bit for bit spec-off output in 16-bit "
                          "too (see eagle3_jax.Engine; default: %(default)s)")
    gen.add_argument("--tp", type=int, default=1,
                     help="tensor parallel over this many devices (docs/tensor-parallel.md; default: one device)")
    gen.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL,
                     help="decoding rounds per device call, returned in one transfer (see eagle3_jax.Engine)")
    gen.add_argument("--prefill-chunk", type=int, help=PREFILL_CHUNK_HELP)
    gen.add_argument("--compile-cache", default=_default_cache_dir(), metavar="DIR",
                     help="JAX's persistent compilation cache: a second run of the same command compiles nothing "
                          "(default: $EAGLE3_JAX_COMPILE_CACHE, else %(default)s)")
    gen.add_argument("--no-compile-cache", action="store_true", help="compile every time, write no cache")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a live pool (docs/serving.md)")
    srv.add_argument("--target", required=True, help="Qwen3 target folder, with its tokenizer")
    add_proposer_args(srv)
    srv.add_argument("--num-draft-tokens", type=_num_draft_tokens, default=3,
                     help="drafts per round, or 'auto': the engine picks 0 .. --max-draft-tokens per call")
    srv.add_argument("--max-draft-tokens", type=int, help="with --num-draft-tokens auto: the largest gamma (default 3)")
    add_tree_args(srv)
    srv.add_argument("--max-len", type=int, help=MAX_LEN_HELP)
    srv.add_argument("--max-batch", type=int, help="slots of the pool (default: 256 on a GPU, 8 on the CPU)")
    srv.add_argument("--prefill-chunk", type=int, help=PREFILL_CHUNK_HELP)
    srv.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL,
                     help="decoding rounds per device call, returned in one transfer (see eagle3_jax.Engine)")
    srv.add_argument("--kv-tokens", type=int,
                     help="tokens of paged KV every running request shares (default: 80%% of the GPU's memory after "
                          "the weights; on the CPU max-batch x max-len)")
    srv.add_argument("--page-size", type=int, help="tokens per KV page (default: 64)")
    srv.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                     help="the weights' dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    srv.add_argument("--tp", type=int, default=1, help="tensor parallel over this many devices")
    srv.add_argument("--host", default="127.0.0.1", help="the address to bind (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (all but /health)")
    srv.add_argument("--served-model-name", help="the model name clients give (default: the target folder's name)")
    srv.add_argument("--drain-s", type=float, default=20.0,
                     help="on SIGTERM, seconds running requests get to finish before they are aborted")
    srv.add_argument("--compile-cache", default=_default_cache_dir(), metavar="DIR",
                     help="JAX's persistent compilation cache (default: $EAGLE3_JAX_COMPILE_CACHE, else %(default)s)")
    srv.add_argument("--no-compile-cache", action="store_true", help="compile every time, write no cache")
    srv.set_defaults(func=_serve)
    conv = sub.add_parser("convert", help="Hugging Face folder -> orbax folder that loads faster")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    conv.add_argument("--drafter-of", metavar="TARGET", help="SRC is an EAGLE-3 drafter for this target folder")
    conv.set_defaults(func=_convert)
    train = sub.add_parser("train", help="train an EAGLE-3 drafter for a target (SpecForge's training-time test)")
    train.add_argument("--target", required=True, help="Qwen3 target folder (Hugging Face or converted)")
    train.add_argument("--data", required=True, action="append",
                       help=".jsonl files (conversations, text or input_ids records), text files or folders; "
                            "repeatable")
    train.add_argument("--out", required=True, help="output folder: the drafter in SpecForge's format, metrics, "
                                                    "checkpoints")
    train.add_argument("--eval-data", action="append", help="held-out prompts for tau (greedy, gamma 3 and 5)")
    train.add_argument("--draft-vocab-size", type=int, default=32000)
    train.add_argument("--ttt-steps", type=int, default=7)
    train.add_argument("--max-seq-len", type=int, default=2048)
    train.add_argument("--batch-size", type=int, default=1, help="global batch, split over the devices")
    train.add_argument("--learning-rate", type=float, default=1e-4)
    length = train.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="total updates")
    length.add_argument("--epochs", type=int, default=1)
    train.add_argument("--checkpoint-every", type=int, default=1000)
    train.add_argument("--eval-every", type=int, default=0, help="also evaluate tau every N updates")
    reuse = train.add_mutually_exclusive_group()
    reuse.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its latest checkpoint (its settings are checked)")
    reuse.add_argument("--overwrite", action="store_true", help="replace the run in --out (its files removed first)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                       help="the target's dtype")
    train.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                       help="the drafter's forward and backward (master weights stay float32)")
    train.add_argument("--kernels", choices=KERNEL_CHOICES, help="hot-op implementation of the target forward")
    train.set_defaults(func=_train)
    regen = sub.add_parser("regenerate", help="rewrite assistant turns of a .jsonl file with the target's output")
    regen.add_argument("--target", required=True)
    regen.add_argument("--data", required=True, help="input .jsonl")
    regen.add_argument("--out", required=True, help="output .jsonl; an interrupted run resumes after its last line")
    regen.add_argument("--drafter", help="EAGLE-3 drafter to speed generation up (the output is the same)")
    regen.add_argument("--max-new-tokens", type=int, default=512)
    regen.add_argument("--batch-size", type=int, default=8, help="slots of the engine's pool (continuous batching)")
    regen.add_argument("--max-len", type=int, help=MAX_LEN_HELP)
    regen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (SpecForge's example: 0.8)")
    regen.add_argument("--top-p", type=float, default=1.0, help="nucleus filter when sampling (1: none)")
    regen.add_argument("--seed", type=int, help="makes a sampled regeneration repeatable")
    regen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    regen.set_defaults(func=_regenerate)
    # Sub-commands from outside the library (eagle3_jax_bench/) take their own arguments: `eagle3-jax bench --help`.
    for name in _plugin_commands():
        sub.add_parser(name, help=f"{name} (from the installed '{_PLUGIN_GROUP}' entry points)", add_help=False)
    return parser


_PLUGIN_GROUP = "eagle3_jax.commands"


def _plugin_commands() -> dict:
    """Sub-commands registered by other packages (pyproject.toml's entry points): `bench` comes from the
    benchmarks package this way, so the library never imports benchmark code."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=_PLUGIN_GROUP)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plugins = _plugin_commands()
    if argv[:1] and argv[0] in plugins:
        return plugins[argv[0]].load()(argv[1:])
    args = build_parser().parse_args(argv)
    from eagle3_jax.errors import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
