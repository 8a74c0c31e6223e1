"""`train_drafter`: an EAGLE-3 drafter for a loaded Qwen3 target, trained in JAX with the target's features
computed inside the step (nothing written to disk), data parallel over every device of a "data" mesh axis.

Output folder:
  config.json, model.safetensors   the drafter in SpecForge's flat format (`export.py`)
  metrics.jsonl                    one line per logged step (loss, per-step losses and accuracies, ...)
  eval.jsonl                       tau at each evaluation (greedy, per gamma)
  checkpoints/<step>/              orbax: parameters, optimizer state, step (for `resume`)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle3_jax.checkpoints import drafter_export as export
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.checkpoints.tokenizer import eos_stop_ids, load_tokenizer
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.training import batching, evaluate, step, vocab
from eagle3_jax.training.data import load_samples

_COMPUTE_DTYPES = ("bfloat16", "float32")


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
    resume: bool = False  # continue from the latest checkpoint in out_dir
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
    tparams: dict
    eval_prompts: list
    stop_ids: tuple
    plans: dict = dataclasses.field(default_factory=dict)  # epoch -> its batches (the latest epoch only)

    def plan(self, config: "TrainConfig", epoch: int) -> list[list[int]]:
        """The batches of one epoch, built once per epoch rather than per step (it shuffles every sample)."""
        if epoch not in self.plans:
            self.plans = {epoch: batching.epoch_plan(self.lengths, config.batch_size, self.seq_len, config.seed,
                                                     epoch)}
        return self.plans[epoch]


def _prepare(target: Target, data, config: TrainConfig) -> tuple[_Run, np.ndarray]:
    """Everything checked on the host first (data, vocabulary, devices): bad input fails before device work."""
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
    kernels = kernels_lib.check(config.kernels or kernels_lib.default(tcfg.head_dim), tcfg.head_dim)
    spec = step.StepSpec(target=tcfg, drafter=step.drafter_config(tcfg, draft_vocab), ttt_steps=config.ttt_steps,
                         loss_decay=config.loss_decay, compute_dtype=config.compute_dtype, kernels=kernels,
                         learning_rate=config.learning_rate, warmup_steps=int(config.warmup_ratio * total),
                         total_steps=total, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm)
    stop_ids = eos_stop_ids(tokenizer)
    replicated = NamedSharding(mesh, PartitionSpec())
    tparams = jax.device_put(target.params, replicated)
    return _Run(samples, lengths, seq_len, num_batches, spec, mesh, tparams, eval_prompts, stop_ids), d2t


def _batch(run: _Run, config: TrainConfig, index: int) -> batching.Batch:
    """The batch of update `index`: a pure function of the data, the seed and the index (exact resume)."""
    epoch, i = divmod(index, run.num_batches)
    return batching.assemble(run.samples, run.plan(config, epoch)[i], config.batch_size, run.seq_len)


def checkpoint_manager(out_dir: Path):
    """Orbax checkpoints under out_dir/checkpoints, the latest two kept (the drafter's and `pretrain`'s)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager((out_dir / "checkpoints").absolute(), options=options)


def _as_tree(state: step.TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "d2t": state.d2t}


def _run_record(run: _Run, config: TrainConfig) -> dict:
    """What an update depends on besides the data: a resumed run must match it to continue exactly."""
    return {"step_spec": repr(run.spec), "batch_size": config.batch_size, "seq_len": run.seq_len,
            "seed": config.seed, "num_batches": run.num_batches}


def _initial_state(run: _Run, config: TrainConfig, d2t: np.ndarray, manager, out_dir: Path) -> step.TrainState:
    replicated = NamedSharding(run.mesh, PartitionSpec())
    state = jax.device_put(step.init_state(run.spec, step.init_params(run.spec.drafter, config.seed), d2t), replicated)
    record_file = out_dir / "checkpoints" / "run.json"
    latest = manager.latest_step() if config.resume else None
    if latest is None:
        if config.resume:
            print(f"resume: no checkpoint in {out_dir / 'checkpoints'}; starting from step 0", flush=True)
        record_file.write_text(json.dumps(_run_record(run, config), indent=1))
        return state
    saved = json.loads(record_file.read_text()) if record_file.exists() else {}
    changed = [k for k, v in _run_record(run, config).items() if saved.get(k) != v]
    if changed:
        raise ValueError(f"--resume: the checkpoints in {out_dir / 'checkpoints'} were trained with other settings "
                         f"({', '.join(changed)} differ); resume with the same data and settings, or a new --out")
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _as_tree(state))
    tree = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    if not np.array_equal(np.asarray(tree["d2t"]), d2t):
        raise ValueError(f"--resume: the checkpoint at step {latest} was trained on another draft vocabulary "
                         "(different data or --draft-vocab-size)")
    return step.TrainState(tree["step"], tree["params"], tree["opt_state"], tree["d2t"])


def _evaluate(target: Target, run: _Run, config: TrainConfig, state: step.TrainState, out_dir: Path) -> dict:
    drafter = evaluate.as_drafter(run.spec.drafter, state.params, state.d2t, target.params["embed"].dtype)
    result = {"step": int(state.step)}
    for gamma in config.eval_gammas:
        result[f"tau_gamma{gamma}"] = evaluate.tau(target, drafter, run.eval_prompts, gamma,
                                                   config.eval_max_new_tokens, run.stop_ids, run.spec.kernels)
    with open(out_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
    return result


def _log(metrics, tokens: int, seconds: float, out_dir: Path, bar) -> None:
    m = jax.device_get(metrics)
    line = {"step": int(m["step"]), "loss": float(m["loss"]), "ploss": [float(x) for x in m["ploss"]],
            "acc": [float(x) for x in m["acc"]], "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
            "tokens_per_s": tokens / seconds if seconds > 0 else math.nan}
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    if bar is not None:
        bar.set_postfix(loss=f"{line['loss']:.3f}", **{f"acc_{i}": f"{a:.2f}" for i, a in enumerate(line["acc"])},
                        tok_s=f"{line['tokens_per_s']:.0f}")


def _loop(target: Target, run: _Run, config: TrainConfig, state: step.TrainState, manager, out_dir: Path, bar):
    """The updates from the state's step to the last, with logging, checkpoints and periodic evaluation."""
    import orbax.checkpoint as ocp

    sharded = NamedSharding(run.mesh, PartitionSpec("data"))
    total, last_eval = run.spec.total_steps, {}
    tokens_since, clock = 0, time.perf_counter()
    for index in range(int(state.step), total):
        batch = _batch(run, config, index)
        tokens, mask = jax.device_put((batch.tokens, batch.loss_mask), sharded)
        state, metrics = step.jit_train_step(state, run.tparams, tokens, mask, spec=run.spec)
        tokens_since += batch.num_tokens
        done = index + 1
        if done % config.log_every == 0 or done == total:
            _log({**metrics, "step": done}, tokens_since, time.perf_counter() - clock, out_dir, bar)
            tokens_since, clock = 0, time.perf_counter()
        if done % config.checkpoint_every == 0 or done == total:
            manager.save(done, args=ocp.args.StandardSave(_as_tree(state)))
        if run.eval_prompts and config.eval_every and done % config.eval_every == 0 and done != total:
            last_eval = _evaluate(target, run, config, state, out_dir)
        if bar is not None:
            bar.update(1)
    return state, last_eval


def train_drafter(target: Target, data: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                  config: TrainConfig = TrainConfig()) -> dict:
    """Trains a drafter for `target` on `data` (files or folders, see eagle3_jax/training/data.py) and writes
    it to `out_dir` in SpecForge's flat format. Returns the last evaluation (tau per gamma), or {} without
    eval data."""
    out_dir = Path(out_dir)
    run, d2t = _prepare(target, data, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint_manager(out_dir)
    state = _initial_state(run, config, d2t, manager, out_dir)
    bar = None
    if config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.spec.total_steps, initial=int(state.step), desc="training drafter", unit="step")
    last_eval: dict = {}
    try:
        state, last_eval = _loop(target, run, config, state, manager, out_dir, bar)
    finally:  # an interrupted run still completes the checkpoint it was writing
        manager.wait_until_finished()
        manager.close()
        if bar is not None:
            bar.close()
    if run.eval_prompts:
        last_eval = _evaluate(target, run, config, state, out_dir)
    export.export_specforge(out_dir, run.spec.drafter, state.params, state.d2t, target.config.max_position_embeddings,
                            config.export_dtype)
    return last_eval
