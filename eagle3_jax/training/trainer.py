"""`train_drafter`: an EAGLE-3 drafter for a loaded Qwen3 target, trained in JAX with the target's features
computed inside the step (nothing written to disk), data parallel over every device of a "data" mesh axis.

Output folder (the run's files; `loop.py` keeps the record, logs and checkpoints):
  config.json, model.safetensors   the drafter in SpecForge's flat format (`checkpoints/drafter_export.py`)
  run.json                         the settings a resume must match
  metrics.jsonl                    one line per logged step (loss, per-step losses and accuracies, ...)
  eval.jsonl                       tau at each evaluation (greedy, per gamma)
  checkpoints/<step>/              orbax: parameters, optimizer state, step (for `resume`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle3_jax.checkpoints import drafter_export as export
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.training import batching, evaluate, loop, step, vocab
from eagle3_jax.training.data import load_samples

_COMPUTE_DTYPES = ("bfloat16", "float32")
RUN_FILES = (*loop.RUN_FILES, "config.json", "model.safetensors")
# The settings an update depends on: a resume must give the same (with the target, the data's shape and the
# draft vocabulary, `_run_record`).
_RUN_SETTINGS = ("draft_vocab_size", "ttt_steps", "loss_decay", "max_seq_len", "batch_size", "learning_rate",
                 "warmup_ratio", "weight_decay", "max_grad_norm", "steps", "epochs", "seed", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training settings; defaults are SpecForge's (lr 1e-4, warmup 1.5%, clip 0.5, 7 TTT steps, decay 0.8)."""

    draft_vocab_size: int = vocab.DEFAULT_DRAFT_VOCAB_SIZE  # capped at the target's vocabulary
    ttt_steps: int = 7
    loss_decay: float = 0.8
    max_seq_len: int = 2048
    batch_size: int = 1  # global: split over the devices
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    steps: int | None = None  # total updates; None: `epochs` passes over the data
    epochs: int = 1
    seed: int = 0
    checkpoint_every: int = 1000  # orbax checkpoint every N updates (and at the end)
    resume: bool = False  # continue the run in out_dir from its latest checkpoint (the same settings)
    overwrite: bool = False  # replace the run in out_dir (its files are removed first)
    log_every: int = 10  # metrics line and progress figures every N updates (each costs a device sync)
    eval_data: tuple[str, ...] = ()  # held-out prompts for tau; none: no evaluation
    eval_every: int = 0  # also evaluate every N updates (0: at the end only)
    eval_gammas: tuple[int, ...] = (3, 5)
    eval_max_new_tokens: int = 64
    eval_prompts: int = 16  # at most this many eval records
    compute_dtype: str = "bfloat16"
    export_dtype: str = "bfloat16"
    num_devices: int = 0  # 0: every device
    kernels: str | None = None  # target forward and evaluation (eagle3_jax/models/kernels.py); None: default
    progress: bool = True

    def __post_init__(self):
        positive = ("draft_vocab_size", "ttt_steps", "max_seq_len", "batch_size", "epochs", "checkpoint_every",
                    "log_every", "eval_max_new_tokens", "eval_prompts")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"TrainConfig.steps must be a positive int or None, got {self.steps!r}")
        if self.max_seq_len < 2:
            raise ValueError("TrainConfig.max_seq_len must be at least 2")
        if not 0 <= self.warmup_ratio <= 1 or self.learning_rate <= 0 or self.max_grad_norm <= 0:
            raise ValueError("TrainConfig needs 0 <= warmup_ratio <= 1, learning_rate > 0 and max_grad_norm > 0")
        if self.compute_dtype not in _COMPUTE_DTYPES or self.export_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"TrainConfig.compute_dtype and export_dtype must be one of {_COMPUTE_DTYPES}")
        if self.resume and self.overwrite:
            raise ValueError("TrainConfig.resume and overwrite exclude each other")
        if any(g < 1 for g in self.eval_gammas) or self.eval_every < 0 or self.num_devices < 0:
            raise ValueError("TrainConfig needs eval_gammas >= 1, eval_every >= 0 and num_devices >= 0")


def _mesh(config: TrainConfig) -> Mesh:
    devices = jax.devices()
    n = config.num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"TrainConfig.num_devices={n}, but only {len(devices)} devices are visible")
    if config.batch_size % n:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of the {n} data-parallel devices")
    return Mesh(np.array(devices[:n]), ("data",))


@dataclasses.dataclass
class _Run:
    """What the loop needs besides the state: the data, the jitted step's spec and the mesh."""

    samples: list
    lengths: list[int]  # tokens per sample
    seq_len: int  # the longest row: max_seq_len, capped at the target's max_position_embeddings
    num_batches: int
    spec: step.StepSpec
    mesh: Mesh
    eval_prompts: list
    stop_ids: tuple
    tparams: dict | None = None  # the target's parameters on the mesh, put there after every host check
    plans: dict = dataclasses.field(default_factory=dict)  # epoch -> its batches (the latest epoch only)

    def plan(self, config: "TrainConfig", epoch: int) -> list[list[int]]:
        """The batches of one epoch, built once per epoch rather than per step (it shuffles every sample)."""
        if epoch not in self.plans:
            self.plans = {epoch: batching.epoch_plan(self.lengths, config.batch_size, self.seq_len, config.seed,
                                                     epoch)}
        return self.plans[epoch]


def _prepare(target: Target, data, config: TrainConfig) -> tuple[_Run, np.ndarray]:
    """Everything checked on the host (data, vocabulary, devices): bad input fails before device work."""
    tokenizer = load_tokenizer(target.folder)
    tcfg = target.config
    paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    samples = load_samples(paths, tokenizer, tcfg.vocab_size)
    draft_vocab = min(config.draft_vocab_size, tcfg.vocab_size)
    d2t, _ = vocab.draft_vocabulary(vocab.token_counts((s.tokens, s.loss_mask) for s in samples), draft_vocab,
                                    tcfg.vocab_size)
    seq_len = min(config.max_seq_len, tcfg.max_position_embeddings)
    samples = batching.split_long(samples, seq_len)
    if not samples:
        raise ValueError(f"{', '.join(map(str, paths))}: no sample has two tokens or more with the loss on them")
    eval_prompts = []
    if config.eval_data:
        eval_samples = load_samples(list(config.eval_data), tokenizer, tcfg.vocab_size)[:config.eval_prompts]
        eval_prompts = evaluate.prompts_of(eval_samples, seq_len)
    mesh = _mesh(config)
    lengths = [len(s.tokens) for s in samples]
    num_batches = len(batching.epoch_plan(lengths, config.batch_size, seq_len, config.seed, 0))
    total = config.steps or config.epochs * num_batches
    kernels = kernels_lib.check(config.kernels or kernels_lib.default())
    spec = step.StepSpec(target=tcfg, drafter=step.drafter_config(tcfg, draft_vocab), ttt_steps=config.ttt_steps,
                         loss_decay=config.loss_decay, compute_dtype=config.compute_dtype, kernels=kernels,
                         learning_rate=config.learning_rate, warmup_steps=int(config.warmup_ratio * total),
                         total_steps=total, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm)
    return _Run(samples, lengths, seq_len, num_batches, spec, mesh, eval_prompts, eos_stop_ids(tokenizer)), d2t


def _batch(run: _Run, config: TrainConfig, index: int) -> batching.Batch:
    """The batch of update `index`: a pure function of the data, the seed and the index (exact resume)."""
    epoch, i = divmod(index, run.num_batches)
    return batching.assemble(run.samples, run.plan(config, epoch)[i], config.batch_size, run.seq_len)


def _run_record(run: _Run, config: TrainConfig, d2t: np.ndarray) -> dict:
    """What an update depends on besides the data's order: a resumed run must match it to continue exactly."""
    settings = {name: getattr(config, name) for name in _RUN_SETTINGS}
    return {**settings, "kernels": run.spec.kernels, "target": repr(run.spec.target), "seq_len": run.seq_len,
            "num_batches": run.num_batches, "draft_vocabulary": hashlib.sha256(d2t.tobytes()).hexdigest()[:16]}


def _evaluate(target: Target, run: _Run, config: TrainConfig, state: step.TrainState, out_dir: Path) -> dict:
    drafter = evaluate.as_drafter(run.spec.drafter, state.params, state.d2t, target.params["embed"].dtype)
    result = {"step": int(state.step)}
    for gamma in config.eval_gammas:
        result[f"tau_gamma{gamma}"] = evaluate.tau(target, drafter, run.eval_prompts, gamma,
                                                   config.eval_max_new_tokens, run.stop_ids, run.spec.kernels)
    loop.append_jsonl(out_dir / "eval.jsonl", result)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
    return result


def _show(bar, line: dict) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{line['loss']:.3f}", **{f"acc_{i}": f"{a:.2f}" for i, a in enumerate(line["acc"])},
                        tok_s=f"{line['tokens_per_s']:.0f}")


def _train(target: Target, run: _Run, config: TrainConfig, state: step.TrainState, out_dir: Path, resume: bool,
           bar) -> tuple[step.TrainState, dict]:
    """The updates from the state's step (the latest checkpoint's, on resume) to the last, with logging,
    checkpoints and periodic evaluation (`loop.run`)."""
    sharded = NamedSharding(run.mesh, PartitionSpec("data"))
    total, last_eval = run.spec.total_steps, {}

    def update(state, index):
        batch = _batch(run, config, index)
        tokens, mask = jax.device_put((batch.tokens, batch.loss_mask), sharded)
        return (*step.jit_train_step(state, run.tparams, tokens, mask, spec=run.spec), batch.num_tokens)

    def after_step(done, state):
        nonlocal last_eval
        if run.eval_prompts and config.eval_every and done % config.eval_every == 0 and done != total:
            last_eval = _evaluate(target, run, config, state, out_dir)
        if bar is not None:
            bar.update(done - bar.n)

    loop_spec = loop.LoopSpec(total=total, log_every=config.log_every, checkpoint_every=config.checkpoint_every,
                              on_log=lambda line: _show(bar, line), after_step=after_step)
    state = loop.run(state, out_dir, update, loop_spec, resume)
    return state, last_eval


def train_drafter(target: Target, data: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                  config: TrainConfig = TrainConfig()) -> dict:
    """Trains a drafter for `target` on `data` (files or folders, see eagle3_jax/training/data.py) and writes
    it to `out_dir` in SpecForge's flat format. Returns the last evaluation (tau per gamma), or {} without
    eval data. An out_dir that holds a run needs config.resume or config.overwrite (`loop.open_run`); SIGINT
    and SIGTERM checkpoint and raise `loop.Interrupted`."""
    out_dir = Path(out_dir)
    loop.check_reuse(out_dir, config.resume, config.overwrite, RUN_FILES)
    run, d2t = _prepare(target, data, config)
    resume = loop.open_run(out_dir, _run_record(run, config, d2t), config.resume, config.overwrite, RUN_FILES)
    if config.resume and not resume:
        print(f"resume: no run in {out_dir}; starting from step 0", flush=True)
    replicated = NamedSharding(run.mesh, PartitionSpec())
    run.tparams = jax.device_put(target.params, replicated)
    state = jax.device_put(step.init_state(run.spec, step.init_params(run.spec.drafter, config.seed), d2t), replicated)
    bar = None
    if config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.spec.total_steps, desc="training drafter", unit="step")
    try:
        state, last_eval = _train(target, run, config, state, out_dir, resume, bar)
    finally:
        if bar is not None:
            bar.close()
    if run.eval_prompts:
        last_eval = _evaluate(target, run, config, state, out_dir)
    export.export_specforge(out_dir, run.spec.drafter, state.params, state.d2t, target.config.max_position_embeddings,
                            config.export_dtype)
    return last_eval
