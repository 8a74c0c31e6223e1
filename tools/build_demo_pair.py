"""Builds the demo pair that `make demo` ships: a small Qwen3 trained from scratch on the Python standard
library's sources, and its EAGLE-3 drafter trained by `train_drafter` on the target's own continuations. It is a
developer tool, not part of the installed library; run it from the repository root:

    python -m tools.build_demo_pair --work DIR [--out eagle3_jax/demo/pair] [--deadline-s S] [--until STAGE] [--tiny]

Stages, each skipped when its output is already in DIR, so a build stopped by --deadline-s (no stage starts
after it; pre-training stops at it, checkpointed) or killed continues where it was when run again with the
same DIR:
  corpus      the library's .py files (eagle3_jax/demo/corpus.py), their manifest, the held-out prompts
  tokenizer   a byte-level BPE trained with `tokenizers` on the training files (AutoTokenizer reads it)
  tokens      the training and held-out files as token streams, documents joined by <|endoftext|>
  target      next-token pre-training (`training/pretrain.py`, orbax, resumable), exported as a Hugging Face
              folder in bfloat16 (the shipped weights; later stages run them in float32)
  regenerate  `training/regenerate.py`: the target's greedy and sampled continuations of prompts cut from the
              training files (resumable by line)
  drafter     `training/trainer.py`'s `train_drafter` on those continuations (resumable from its orbax
              checkpoints)
  evaluate    tau on the held-out prompts: greedy at gamma 1..7 and sampled at temperature 0.7 (gamma 3)
  ship        the pair (bfloat16 safetensors), the tokenizer, the prompts, the manifest and record.json
              (settings, stage times, loss curves, tau) into --out
On the GPU the build runs float32 matmuls at full float32 precision, as the CPU demo computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from eagle3_jax.demo import PAIR, corpus

EOS = "<|endoftext|>"
SAMPLED_TEMPERATURE = 0.7


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Every setting of a build; record.json keeps them."""

    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    seq_len: int = 1024
    batch_size: int = 64
    pretrain_epochs: float = 8.0  # passes over the training tokens (the step count follows from it)
    learning_rate: float = 2e-3
    prompt_chars: int = 240  # prompts are whole lines, at most this many characters
    prompts_per_file: int = 2  # regeneration prompts per training file: its start and random lines
    sampled_share: float = 0.25  # of those prompts, regenerated at SAMPLED_TEMPERATURE rather than greedily
    regen_max_new_tokens: int = 192
    regen_batch_size: int = 512
    raw_chunks_per_record: float = 1.0  # windows of plain training text per regenerated record
    drafter_seq_len: int = 256
    draft_vocab_size: int = 4096
    drafter_batch_size: int = 64
    drafter_learning_rate: float = 1e-3
    drafter_epochs: int = 8
    eval_prompts: int = 32
    eval_max_new_tokens: int = 128
    files_per_split: int = 0  # 0: every file; otherwise a small trial build on this many files per split
    seed: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("files_per_split", "seed", "sampled_share") and not value > 0:
                raise ValueError(f"BuildConfig.{f.name} must be positive, got {value!r}")
        if self.vocab_size > 65535:
            raise ValueError("BuildConfig.vocab_size must fit the uint16 token streams (at most 65535)")

    @classmethod
    def tiny(cls) -> "BuildConfig":
        """A trial build through every stage on a few files: a few minutes on a CPU (`--tiny`)."""
        return cls(vocab_size=384, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
                   intermediate_size=64, max_position_embeddings=256, seq_len=64, batch_size=4, pretrain_epochs=0.5,
                   prompt_chars=80, prompts_per_file=1, regen_max_new_tokens=8, regen_batch_size=8,
                   draft_vocab_size=128, drafter_seq_len=32, drafter_batch_size=4, drafter_epochs=1, eval_prompts=2,
                   eval_max_new_tokens=8, files_per_split=6)

    def target_config(self):
        from eagle3_jax.models.config import Qwen3Config, RopeConfig

        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, head_dim=self.head_dim),
                           tie_word_embeddings=True, max_position_embeddings=self.max_position_embeddings)


class Build:
    """One build's folders and record; each stage method reads the previous stages' files."""

    def __init__(self, work: Path, config: BuildConfig, deadline: float):
        self.work, self.config, self.deadline = work, config, deadline
        work.mkdir(parents=True, exist_ok=True)
        self.record_path = work / "record.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.exists() else {}
        saved = self.record.get("config")
        if saved is not None and saved != dataclasses.asdict(config):
            raise ValueError(f"{work} holds a build with other settings; use another --work folder")
        self.record["config"] = dataclasses.asdict(config)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.record_path.write_text(json.dumps(self.record, indent=1))

    def timed(self, name: str, fn) -> None:
        """Runs a stage unless it is recorded as done; adds its time to the stage's total."""
        times = self.record.setdefault("stage_seconds", {})
        if name in self.record.setdefault("done", []):
            return
        if self.left() <= 0:  # a stage that has started runs to its end; only pre-training stops inside
            raise _Deadline
        start = time.perf_counter()
        finished = fn()
        times[name] = round(times.get(name, 0.0) + time.perf_counter() - start, 1)
        if finished is not False:
            self.record["done"].append(name)
        self.save()
        print(f"[build] {name}: {'done' if finished is not False else 'stopped at the deadline'} "
              f"({times[name]:.0f} s in all)", flush=True)
        if finished is False:
            raise _Deadline

    # -- stages ---------------------------------------------------------------------------------------------

    def corpus(self) -> None:
        files = corpus.read_sources(limit=self.config.files_per_split or None)
        (self.work / "manifest.json").write_text(json.dumps(corpus.manifest(files), indent=1))
        prompts = corpus.held_out_prompts(files, self.config.prompt_chars)
        (self.work / "prompts.json").write_text(json.dumps(prompts, indent=1))
        self.record["corpus"] = {"train_files": sum(not f.held_out for f in files),
                                 "held_out_files": sum(f.held_out for f in files),
                                 "train_bytes": sum(len(f.text.encode()) for f in files if not f.held_out),
                                 "held_out_prompts": len(prompts)}

    def _sources(self) -> list[corpus.SourceFile]:
        """The manifest's files, read again and checked against their recorded hashes."""
        manifest = json.loads((self.work / "manifest.json").read_text())
        files = {f.path: f for f in corpus.read_sources()}
        missing = [m["path"] for m in manifest["files"]
                   if m["path"] not in files or files[m["path"]].sha256 != m["sha256"]]
        if missing:
            raise ValueError(f"{len(missing)} corpus files changed since the corpus stage (first: {missing[0]})")
        return [files[m["path"]] for m in manifest["files"]]

    def tokenizer(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=self.config.vocab_size, special_tokens=[EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((f.text for f in self._sources() if not f.held_out), trainer)
        folder = self.work / "target"
        folder.mkdir(exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
        # PreTrainedTokenizerFast reads tokenizer.json; no clean-up of spaces, which would alter code.
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
            "model_max_length": self.config.max_position_embeddings, "clean_up_tokenization_spaces": False}, indent=1))
        eos = tok.token_to_id(EOS)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))

    def _tok(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.work / "target" / "tokenizer.json"))

    def tokens(self) -> None:
        """The token streams, and every prompt later stages need, so that they need no corpus."""
        tok, files, c = self._tok(), self._sources(), self.config
        eos = tok.token_to_id(EOS)
        for name, held_out in (("train", False), ("held_out", True)):
            docs = tok.encode_batch([f.text for f in files if f.held_out == held_out])
            stream = np.concatenate([np.asarray(d.ids + [eos], np.uint16) for d in docs])
            np.save(self.work / f"{name}_tokens.npy", stream)
            self.record.setdefault("corpus", {})[f"{name}_tokens"] = int(stream.size)
        rng = random.Random(c.seed)
        records = {"greedy": [], "sampled": []}
        for f in files:
            lines = f.text.splitlines()
            if f.held_out or not lines:
                continue
            for start in [0] + [rng.randrange(len(lines)) for _ in range(c.prompts_per_file - 1)]:
                # No trailing newline: the model writes it, merged with the next line's indent as BPE merges.
                text = corpus.lines_from(f.text, start, c.prompt_chars).rstrip("\n")
                if text.strip():
                    kind = "sampled" if rng.random() < c.sampled_share else "greedy"
                    records[kind].append({"input_ids": tok.encode(text).ids})
        for kind, recs in records.items():
            _write_jsonl(self.work / f"regen_prompts_{kind}.jsonl", recs)

    def target(self):
        import jax

        from eagle3_jax.checkpoints.target_export import export_hf
        from eagle3_jax.training import pretrain

        c, cfg, stream = self.config, self.config.target_config(), np.load(self.work / "train_tokens.npy")
        held_out = np.load(self.work / "held_out_tokens.npy")
        steps = max(math.ceil(c.pretrain_epochs * stream.size / (c.batch_size * c.seq_len)), 2)
        config = pretrain.PretrainConfig(seq_len=c.seq_len, batch_size=c.batch_size, steps=steps,
                                         learning_rate=c.learning_rate, warmup_steps=max(steps // 50, 1), seed=c.seed)
        state = pretrain.pretrain(cfg, stream, self.work / "pretrain", config, time_budget_s=max(self.left() - 30, 1),
                                  log_every=max(steps // 100, 1), checkpoint_every=max(steps // 8, 1),
                                  held_out=held_out)
        if int(state.step) < steps:
            return False
        params = jax.device_get(state.params)
        self.record["pretrain_steps"] = steps
        self.record["target_held_out_loss"] = round(pretrain.evaluate_loss(params, cfg, held_out, c.seq_len), 4)
        self.record["pretrain_curve"] = _jsonl(self.work / "pretrain" / "metrics.jsonl")
        # bfloat16, as shipped: every later stage runs the weights the demo runs (the held-out loss above is the
        # float32 master weights').
        export_hf(self.work / "target", cfg, params, "bfloat16", eos_token_id=self._tok().token_to_id(EOS))

    def regenerate(self):
        import eagle3_jax
        from eagle3_jax.checkpoints.tokenizer import load_tokenizer
        from eagle3_jax.training.regenerate import regenerate

        c, folder = self.config, self.work / "target"
        prompts = {kind: self.work / f"regen_prompts_{kind}.jsonl" for kind in ("greedy", "sampled")}
        prompts = {kind: path for kind, path in prompts.items() if path.read_text().strip()}
        target = eagle3_jax.load_target(folder, dtype="float32") if prompts else None
        for kind, path in prompts.items():
            sampling = {"temperature": SAMPLED_TEMPERATURE, "seed": c.seed} if kind == "sampled" else {}
            stats = regenerate(target, path, self.work / f"regen_{kind}.jsonl", tokenizer=load_tokenizer(folder),
                               max_new_tokens=c.regen_max_new_tokens, batch_size=c.regen_batch_size,
                               max_len=c.max_position_embeddings, **sampling)
            print(f"[build] regenerate {kind}: {stats.written} records (resumed after {stats.resumed_after})",
                  flush=True)
        written = {kind: self.work / f"regen_{kind}.jsonl" for kind in ("greedy", "sampled")}
        self.record["regenerated_records"] = {k: len(_jsonl(p)) for k, p in written.items() if p.exists()}

    def drafter(self):
        import eagle3_jax
        from eagle3_jax.training.trainer import TrainConfig, train_drafter

        c = self.config
        data = self.write_drafter_data()
        config = TrainConfig(draft_vocab_size=c.draft_vocab_size, max_seq_len=c.drafter_seq_len,
                             batch_size=c.drafter_batch_size, learning_rate=c.drafter_learning_rate,
                             epochs=c.drafter_epochs, checkpoint_every=200, seed=c.seed, compute_dtype="float32",
                             resume=True)
        target = eagle3_jax.load_target(self.work / "target", dtype="float32")
        train_drafter(target, [data], self.work / "drafter", config)
        self.record["drafter_curve"] = _jsonl(self.work / "drafter" / "metrics.jsonl")

    def write_drafter_data(self) -> Path:
        """The regenerated records cut to drafter_seq_len tokens (those of half of it or less left out) and
        as many windows of plain training text (the target's distribution on real code, too): every sample
        one length, so the training step compiles once."""
        c, span = self.config, self.config.drafter_seq_len
        samples = []
        for path in sorted(self.work.glob("regen_[gs]*.jsonl")):
            for r in _jsonl(path):
                if len(r["input_ids"]) > span // 2:
                    samples.append({"input_ids": r["input_ids"][:span], "loss_mask": r["loss_mask"][:span]})
        regenerated = len(samples)
        stream, rng = np.load(self.work / "train_tokens.npy"), np.random.default_rng(c.seed)
        if stream.size <= span:
            raise ValueError(f"the training stream has {stream.size} tokens, not more than drafter_seq_len {span}")
        offsets = rng.integers(0, stream.size - span, int(c.raw_chunks_per_record * regenerated))
        samples += [{"input_ids": stream[o:o + span].tolist()} for o in offsets]
        _write_jsonl(self.work / "drafter_data.jsonl", samples)
        self.record["drafter_data"] = {"regenerated": regenerated, "raw_text_windows": len(offsets), "tokens": span}
        return self.work / "drafter_data.jsonl"

    def evaluate(self):
        import eagle3_jax
        from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
        from eagle3_jax.training import evaluate

        c = self.config
        target = eagle3_jax.load_target(self.work / "target", dtype="float32", progress=False)
        drafter = eagle3_jax.load_drafter(self.work / "drafter", target, dtype="float32")
        tokenizer = load_tokenizer(self.work / "target")
        prompts = [tokenizer(p["text"].rstrip("\n"))["input_ids"]
                   for p in json.loads((self.work / "prompts.json").read_text())[:c.eval_prompts]]
        stops = eos_stop_ids(tokenizer)
        taus = {g: evaluate.tau(target, drafter, prompts, g, c.eval_max_new_tokens, stops) for g in range(1, 8)}
        self.record["tau_greedy"] = {str(g): round(t, 3) for g, t in taus.items()}
        self.record["tau_sampled_gamma3"] = round(evaluate.tau(
            target, drafter, prompts, 3, c.eval_max_new_tokens, stops, temperature=SAMPLED_TEMPERATURE, seed=c.seed), 3)
        print(f"[build] tau greedy {self.record['tau_greedy']}, sampled (T={SAMPLED_TEMPERATURE}, gamma 3) "
              f"{self.record['tau_sampled_gamma3']}", flush=True)

    def ship(self, out: Path) -> None:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copytree(self.work / "target", tmp / "target")
        (tmp / "drafter").mkdir()
        for name in ("config.json", "model.safetensors"):  # the trainer's export is bfloat16
            shutil.copy(self.work / "drafter" / name, tmp / "drafter" / name)
        for name in ("prompts.json", "manifest.json"):
            shutil.copy(self.work / name, tmp / name)
        (tmp / "record.json").write_text(json.dumps(self.record, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)


class _Deadline(Exception):
    """A stage stopped at --deadline-s; running the build again continues it."""


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


STAGES = ("corpus", "tokenizer", "tokens", "target", "regenerate", "drafter", "evaluate", "ship")


def build(work: Path, out: Path, config: BuildConfig, deadline_s: float = math.inf, until: str = "ship") -> dict:
    """Runs every stage not yet done, up to `until`; returns the record. Raises nothing at the deadline: the
    record's "done" list says how far it got."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    b = Build(work, config, time.perf_counter() + deadline_s)
    try:
        for name in STAGES[:STAGES.index(until) + 1]:
            b.timed(name, (lambda: b.ship(out)) if name == "ship" else getattr(b, name))
    except _Deadline:
        print(f"[build] stopped at the deadline; run again with --work {work} to continue", flush=True)
    return b.record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.build_demo_pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path, help="working folder; rerun with it to continue")
    parser.add_argument("--out", type=Path, default=PAIR, help="where the finished pair goes")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="start no stage after this long, and stop pre-training cleanly at it")
    parser.add_argument("--until", choices=STAGES, default="ship",
                        help="stop after this stage (the corpus stages need no GPU: run them where the corpus is)")
    parser.add_argument("--tiny", action="store_true", help="a trial build on a few files: minutes on a CPU")
    args = parser.parse_args(argv)
    config = BuildConfig.tiny() if args.tiny else BuildConfig()
    record = build(args.work, args.out, config, args.deadline_s, args.until)
    return 0 if args.until in record.get("done", []) else 3


if __name__ == "__main__":
    sys.exit(main())
