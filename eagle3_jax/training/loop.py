"""The training loop both trainers run (`train_drafter` in trainer.py, `pretrain` in pretrain.py), and the
output folder it keeps:

  run.json        what an update depends on (`open_run`); a resumed run must match it
  metrics.jsonl   one line per logged step, each step once: a resume drops the lines past its checkpoint
  eval.jsonl      the caller's evaluations, kept to the same rule
  checkpoints/    orbax: the state at the latest two checkpoints

A folder that already holds a run is refused unless the run is resumed (its settings checked and any
difference named) or overwritten (the run's files removed first; nothing else in the folder is touched).
SIGINT and SIGTERM stop the loop after the update in progress: it saves a checkpoint at that step, waits for
the write, closes the checkpoint manager and raises `Interrupted`, whose message says how to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

RUN_FILES = ("run.json", "metrics.jsonl", "eval.jsonl", "checkpoints")
_LOGS = ("metrics.jsonl", "eval.jsonl")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped by a signal after its checkpoint at `step` was written."""

    def __init__(self, signal_name: str, step: int, total: int, out_dir: Path, resume_hint: str):
        self.signal_name, self.step, self.total, self.out_dir = signal_name, step, total, out_dir
        super().__init__(f"stopped by {signal_name} at step {step} of {total}; the checkpoint of step {step} is "
                         f"in {out_dir / 'checkpoints'}: {resume_hint}")

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + signal.Signals[self.signal_name].value


def check_reuse(out_dir: Path, resume: bool, overwrite: bool, files: tuple[str, ...] = RUN_FILES) -> list[str]:
    """The run files already in out_dir; refuses them unless resume or overwrite is given. Touches nothing."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue the run in the folder, or replace it")
    present = [name for name in files if (out_dir / name).exists()]
    if overwrite and present and not {"run.json", "checkpoints"} & set(present):
        # A folder with a model's files but no run record or checkpoints (a model folder typed as --out, say).
        raise ValueError(f"{out_dir} holds {', '.join(present)} but no run.json or checkpoints/: not a training "
                         "run, so --overwrite removes nothing there; train into another folder")
    if present and not (resume or overwrite):
        raise ValueError(f"{out_dir} already holds a run ({', '.join(present)}): continue it with --resume "
                         "(the same settings) or replace it with --overwrite")
    return present


def open_run(out_dir: Path, record: dict, resume: bool, overwrite: bool,
             files: tuple[str, ...] = RUN_FILES) -> bool:
    """Makes out_dir ready for the run described by `record` (JSON values). With overwrite, the run files
    already there are removed; with resume, the saved record must equal this one, and a difference is refused
    naming each setting. Writes run.json for a new run. Returns whether there is a run to resume."""
    present = check_reuse(out_dir, resume, overwrite, files)
    record = json.loads(json.dumps(record))  # tuples as lists, as run.json holds them
    path = out_dir / "run.json"
    if overwrite:
        for name in present:
            target = out_dir / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    elif resume and present:
        if not path.exists():
            raise ValueError(f"{out_dir}: its run has no run.json, so its settings cannot be checked; "
                             "replace it with --overwrite or train into a new folder")
        _compare(out_dir, json.loads(path.read_text()), record)
        return True
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return False


def _compare(out_dir: Path, saved: dict, record: dict) -> None:
    changed = [k for k in record if saved.get(k) != record[k]] + [k for k in saved if k not in record]
    if not changed:
        return
    scalar = (int, float, str, bool, type(None))
    values = [f"{k}: {saved.get(k)!r} in the run, {record.get(k)!r} now" for k in changed
              if isinstance(saved.get(k), scalar) and isinstance(record.get(k), scalar)]
    raise ValueError(f"--resume: the run in {out_dir} was trained with other settings ({', '.join(changed)} "
                     f"differ{'s' if len(changed) == 1 else ''}){': ' + '; '.join(values) if values else ''}; "
                     "resume with the same data and settings, or start a new run (a new folder or --overwrite)")


def append_jsonl(path: Path, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def drop_lines_after(path: Path, step: int) -> None:
    """Keeps the lines of a log up to `step`: those past it belong to updates a resume runs again (a cut-off
    last line, from a process killed while writing it, goes too)."""
    if not path.exists():
        return
    kept = []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and isinstance(line.get("step"), int) and line["step"] <= step:
            kept.append(text + "\n")
    path.write_text("".join(kept))


def checkpoint_manager(out_dir: Path):
    """Orbax checkpoints under out_dir/checkpoints, the latest two kept."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager((out_dir / "checkpoints").absolute(), options=options)


def restore_latest(manager, state):
    """The state at the manager's latest checkpoint, laid out (shapes, dtypes, shardings) as `state`; `state`
    itself when there is none."""
    import orbax.checkpoint as ocp

    latest = manager.latest_step()
    if latest is None:
        return state
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return manager.restore(latest, args=ocp.args.StandardRestore(abstract))


class _Stop:
    """The first stop signal received while the loop runs (its name), or None."""

    def __init__(self):
        self.signal_name: str | None = None

    def handle(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name


@contextlib.contextmanager
def stop_signals():
    """SIGINT and SIGTERM recorded instead of acted on while the block runs (the main thread only: Python
    delivers signals there), the earlier handlers put back after it."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    earlier = {s: signal.signal(s, stop.handle) for s in _STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in earlier.items():
            signal.signal(s, handler)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """What `run` does around the updates, and when."""

    total: int  # the step the run ends at
    log_every: int
    checkpoint_every: int
    on_log: Callable[[dict], None] = lambda line: None  # sees each metrics.jsonl line once written
    after_save: Callable[[Any], None] | None = None  # (state) after each checkpoint but a stop signal's
    after_step: Callable[[int, Any], None] | None = None  # (updates done, state) after every other update
    out_of_time: Callable[[], bool] = lambda: False  # checked after each update: checkpoint and return
    resume_hint: str = "run the same command with --resume to continue"  # how `Interrupted` says to resume


def run(state, out_dir: Path, update: Callable, spec: LoopSpec, resume: bool):
    """Runs `update(state, index) -> (state, metrics, tokens it trained on)` for index = the state's step (the
    latest checkpoint's, with resume) up to spec.total. Every log_every updates and at the last, metrics.jsonl
    gets {"step", **metrics (floats, lists of floats), "tokens_per_s"} (the tokens of the updates since the
    previous line or checkpoint over their time). The state is checkpointed every checkpoint_every updates, at the last,
    when out_of_time() (then the run returns) and after a stop signal (then it raises `Interrupted`).
    Returns the last state."""
    manager = checkpoint_manager(out_dir)
    try:
        if resume:
            state = restore_latest(manager, state)
        for name in _LOGS:
            drop_lines_after(out_dir / name, int(state.step))
        with stop_signals() as stop:
            return _updates(state, out_dir, update, spec, manager, stop)
    finally:  # a stopped or failed run still completes the checkpoint it was writing
        manager.wait_until_finished()
        manager.close()


def _updates(state, out_dir: Path, update: Callable, spec: LoopSpec, manager, stop: _Stop):
    meter = _Throughput()
    for index in range(int(state.step), spec.total):
        state, metrics, tokens = update(state, index)
        meter.tokens += tokens
        done = index + 1
        if done % spec.log_every == 0 or done == spec.total:
            line = {"step": done, **_json_values(metrics), "tokens_per_s": meter.rate()}
            append_jsonl(out_dir / "metrics.jsonl", line)
            spec.on_log(line)
        late = spec.out_of_time()
        if done % spec.checkpoint_every == 0 or done == spec.total or late or stop.signal_name:
            _save(manager, done, state)
            if stop.signal_name:
                raise Interrupted(stop.signal_name, done, spec.total, out_dir, spec.resume_hint)
            if spec.after_save is not None:
                spec.after_save(state)
            meter.restart()
        if late:
            break
        if spec.after_step is not None:
            spec.after_step(done, state)
    return state


def _json_values(metrics: dict) -> dict:
    """An update's metrics (device scalars and vectors) as floats and lists of floats, in their order."""
    host = jax.device_get(metrics)
    return {k: float(v) if np.ndim(v) == 0 else [float(x) for x in np.ravel(v)] for k, v in host.items()}


class _Throughput:
    """Tokens per second of the updates since the last line or checkpoint (whose own time is left out)."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.tokens, self.clock = 0, time.perf_counter()

    def rate(self) -> float:
        seconds = time.perf_counter() - self.clock
        rate = self.tokens / seconds if seconds > 0 else math.nan
        self.restart()
        return rate


def _save(manager, step: int, state) -> None:
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.StandardSave(state))
