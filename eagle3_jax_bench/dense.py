"""Every step the engine runs for a dense target, each against its floor (the bytes it must read: weights
and live KV, over the copy rate measured in the same run): the spec-off decode step, the verify step, one
draft step, the drafter rebuild, the draft chain and whole speculative rounds, and where a decode step's
time goes (`variants`). Spec-off steps and rounds are timed as the engine runs them, rounds_per_call
rounds to a call, and reported per round. The MoE bench (moe.py) runs the same rows with its own
`Setup.target_read`."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.decoding.engine import ROUNDS_PER_CALL
from eagle3_jax.decoding.tree import TreeShape
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import DrafterConfig, Qwen3Config

from . import checks, presets, profile, steps
from .core import Run, compile_timed, time_chain
from .inputs import normal, random_cache, random_state, random_tree


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure."""

    target: Qwen3Config
    drafter: DrafterConfig
    batches: tuple[int, ...]  # spec-off decode
    kv_lengths: tuple[int, ...]  # spec-off decode
    spec_batches: tuple[int, ...]  # verify, draft, rebuild, rounds
    spec_kv_length: int
    gammas: tuple[int, ...]
    reps: int
    inner: int
    copy_bytes: int
    matmul_n: int


def qwen3_8b_plan() -> Plan:
    return Plan(*presets.pair("qwen3-8b"), batches=(1, 8, 32), kv_lengths=(1024, 8192), spec_batches=(1, 8),
                spec_kv_length=1024, gammas=(1, 3, 5, 7), reps=15, inner=10, copy_bytes=4 << 30, matmul_n=8192)


def tiny_plan() -> Plan:
    return Plan(*presets.pair("tiny"), batches=(2,), kv_lengths=(32,), spec_batches=(1,), spec_kv_length=32,
                gammas=(2,), reps=2, inner=2, copy_bytes=1 << 20, matmul_n=128)


@dataclasses.dataclass(frozen=True)
class Setup:
    """The models a run measures and how: weights on the device, the kernel choices (the first is used
    throughout), rounds per engine call, and the target weight bytes a step of B rows x T tokens reads."""

    plan: Plan
    target: Target
    drafter: Drafter
    dtype: Any
    kernels: tuple[str, ...]
    rounds_per_call: int
    target_read: Callable[[int, int], int]

    @property
    def tparams(self):
        return self.target.params

    @property
    def dparams(self):
        return self.drafter.params


def setup(run: Run, plan: Plan, kernels: tuple[str, ...], dtype, rounds_per_call: int = ROUNDS_PER_CALL,
          target: Target | None = None, drafter: Drafter | None = None) -> Setup:
    """Random weights at the plan's shapes, unless a loaded target and drafter are given. Every target
    weight but the embedding is read by each step (moe.py counts only the routed experts)."""
    start = time.perf_counter()
    target = target or Target(plan.target, random_tree(target_lib.abstract_params(plan.target, dtype), seed=1), None)
    drafter = drafter or Drafter(plan.drafter, random_tree(drafter_lib.abstract_params(plan.drafter, dtype), seed=2),
                                 None)
    jax.block_until_ready((target.params, drafter.params))
    run.results["init_s"] = time.perf_counter() - start
    weights = steps.target_weight_bytes(target.params)
    return Setup(plan, target, drafter, dtype, kernels, rounds_per_call, lambda batch, tokens: weights)


def _kv(s: Setup, layers: int, kv_heads: int, head_dim: int, batch: int, length: int) -> int:
    return steps.kv_bytes(layers, batch, length, kv_heads, head_dim, jnp.dtype(s.dtype).itemsize)


def _target_kv(s: Setup, batch: int, length: int) -> int:
    t = s.plan.target
    return _kv(s, t.num_layers, t.num_kv_heads, t.head_dim, batch, length)


def engine_call(s: Setup, batch: int, length: int, capacity: int, kernels: str, rounds: int,
                gamma: int = 0, tree: TreeShape | None = None) -> steps.EngineCall:
    """The engine's call of `rounds` rounds (spec-off when gamma is 0; a draft tree's, gamma its depth, when `tree`
    is given) from a random state at `length`. Built from its StepSpec directly: the ablation kernels
    (kernels_lib.ABLATION) are the model's to run, not Engine's to offer."""
    spec = spec_round.StepSpec(target=s.plan.target, proposer=Eagle3(s.plan.drafter) if gamma else None, gamma=gamma,
                               max_len=capacity, kernels=kernels, tree=tree)
    state = random_state((s.plan.target, s.plan.drafter), batch, length, capacity, s.dtype, with_drafter=gamma > 0)
    return steps.engine_rounds(spec, s.tparams, s.dparams if gamma else None, state, rounds, s.plan.reps,
                               s.plan.inner)


def spec_off(s: Setup, batch: int, length: int, kernels: str, rounds: int | None = None) -> steps.EngineCall:
    """The engine's spec-off step: a round with no drafter (one target token, argmax, commit)."""
    return engine_call(s, batch, length, length + 64, kernels, rounds or s.rounds_per_call)


def spec_off_read(s: Setup, batch: int, length: int) -> int:
    return s.target_read(batch, 1) + _target_kv(s, batch, length)


def decode(run: Run, s: Setup, batch: int, length: int, kernels: str) -> steps.EngineCall:
    """The spec-off step, per round of the engine's calls of several rounds; returns the timed call."""
    timed = spec_off(s, batch, length, kernels)
    entry = {"batch": batch, "kv_len": length, "kernels": kernels, "tokens_per_s": batch / timed.seconds,
             "rounds_per_call": s.rounds_per_call}
    run.row("decode", entry, timed.seconds, spec_off_read(s, batch, length), timed.compile_s)
    return timed


def verify(run: Run, s: Setup, batch: int, tokens: int, kernels: str) -> None:
    t, L = s.plan.target, s.plan.spec_kv_length
    cache = random_cache(t.num_layers, batch, t.num_kv_heads, L + 64, t.head_dim, L, s.dtype, 5)
    toks = jax.random.randint(jax.random.key(3), (batch, tokens), 0, t.vocab_size, jnp.int32)
    step = steps.jit_step(steps.target_step, 3, cfg=t, capture=s.plan.drafter.capture_layers, kernels=kernels)
    compiled, compile_s = compile_timed(step, s.tparams, toks, cache)
    seconds, _ = time_chain(compiled, cache, (s.tparams, toks), s.plan.reps, s.plan.inner)
    read = s.target_read(batch, tokens) + _target_kv(s, batch, L + tokens)
    run.row("verify", {"batch": batch, "kv_len": L, "tokens": tokens, "kernels": kernels}, seconds, read, compile_s)


def _drafter_cache(s: Setup, batch: int):
    d, L = s.plan.drafter, s.plan.spec_kv_length
    return random_cache(1, batch, d.num_kv_heads, L + 64, d.head_dim, L, s.dtype, 7)


def _drafter_read(s: Setup, batch: int, tokens: int, with_fc: bool, with_head: bool) -> int:
    d, p = s.plan.drafter, s.dparams
    layer = steps.nbytes({k: v for k, v in p.items() if k not in ("fc", "lm_head", "d2t")})
    read = layer + (steps.nbytes(p["fc"]) if with_fc else 0) + (steps.nbytes(p["lm_head"]) if with_head else 0)
    return read + _kv(s, 1, d.num_kv_heads, d.head_dim, batch, s.plan.spec_kv_length + tokens)


def _drafter_row(run: Run, s: Setup, section: str, entry: dict, step, args: tuple, read: int) -> None:
    """Times a drafter step on (dparams, the target's embedding, *args, a random drafter cache)."""
    cache, head = _drafter_cache(s, entry["batch"]), (s.dparams, s.tparams["embed"])
    compiled, compile_s = compile_timed(step, *head, *args, cache)
    seconds, _ = time_chain(compiled, cache, head + args, s.plan.reps, s.plan.inner)
    run.row(section, entry, seconds, read, compile_s)


def draft_step(run: Run, s: Setup, batch: int, kernels: str) -> None:
    d = s.plan.drafter
    h = normal(jax.random.key(4), (batch, d.hidden_size), s.dtype)
    token = jnp.zeros((batch,), jnp.int32) + 17
    _drafter_row(run, s, "draft_step", {"batch": batch, "kernels": kernels},
                 steps.jit_step(steps.draft_step, 5, cfg=d, kernels=kernels), (h, token),
                 _drafter_read(s, batch, 1, False, True))


def rebuild(run: Run, s: Setup, batch: int, tokens: int, kernels: str) -> None:
    d = s.plan.drafter
    feats = normal(jax.random.key(5), (batch, tokens, d.feature_width), s.dtype)
    toks = jax.random.randint(jax.random.key(6), (batch, tokens), 0, d.target_vocab_size, jnp.int32)
    _drafter_row(run, s, "rebuild", {"batch": batch, "tokens": tokens, "kernels": kernels},
                 steps.jit_step(steps.rebuild_step, 5, cfg=d, kernels=kernels), (feats, toks),
                 _drafter_read(s, batch, tokens, True, False))


def chain(run: Run, s: Setup, batch: int, gamma: int, kernels: str) -> None:
    d = s.plan.drafter
    h = normal(jax.random.key(4), (batch, d.hidden_size), s.dtype)
    read = _drafter_read(s, batch, gamma, False, True) * (gamma - 1) + steps.nbytes(s.dparams["lm_head"])
    _drafter_row(run, s, "chain", {"batch": batch, "gamma": gamma, "kernels": kernels},
                 steps.jit_step(steps.chain_step, 4, cfg=d, gamma=gamma, kernels=kernels), (h,), read)


def spec_rounds(s: Setup, batch: int, gamma: int, kernels: str, rounds: int,
                tree: TreeShape | None = None) -> steps.EngineCall:
    """The engine's call of `rounds` speculative rounds (a draft tree's, gamma its depth, when `tree` is given) from
    the plan's KV length, capacity L + 512."""
    L = s.plan.spec_kv_length
    return engine_call(s, batch, L, min(L + 512, s.plan.target.max_position_embeddings), kernels, rounds, gamma,
                       tree)


def _parts(run: Run, batch: int, gamma: int, kernels: str) -> list[dict]:
    """The verify, chain and rebuild rows a round of (batch, gamma) is made of, each with its section."""
    wanted = {("verify", gamma + 1), ("chain", gamma), ("rebuild", gamma + 1)}
    keys = (("verify", "tokens"), ("chain", "gamma"), ("rebuild", "tokens"))
    return [dict(r, section=section) for section, key in keys for r in run.results.get(section, [])
            if r["batch"] == batch and r["kernels"] == kernels and (section, r[key]) in wanted]


def speculative_round(run: Run, s: Setup, batch: int, gamma: int, kernels: str) -> None:
    """A whole speculative round, per round as the engine runs them (rounds_per_call to a call). Its
    overhead is against its parts timed one call each, so it is taken from the round timed one call
    each too. The timed rounds grow the cache by about a token each, up to capacity (L + 512), so the
    KV read is up to 512 tokens longer than the floor counts (at batch 8, up to 3% more bytes)."""
    timed = spec_rounds(s, batch, gamma, kernels, s.rounds_per_call)
    single = timed.seconds if s.rounds_per_call == 1 else spec_rounds(s, batch, gamma, kernels, 1).seconds
    L = s.plan.spec_kv_length
    measured = _parts(run, batch, gamma, kernels)
    parts = {r["section"]: r["time_ms"] for r in measured}
    read = (s.target_read(batch, gamma + 1) + _target_kv(s, batch, L + gamma + 1)
            + sum(r["bytes_read"] for r in measured if r["section"] != "verify"))
    entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "parts_ms": parts,
             "rounds_per_call": s.rounds_per_call, "time_ms_one_round_per_call": single * 1e3}
    if len(parts) == 3:
        entry["overhead"] = single * 1e3 / sum(parts.values()) - 1
    run.row("round", entry, timed.seconds, read, timed.compile_s)
    spec_off_rows = [r for r in run.results.get("decode", [])
                     if r["batch"] == batch and r["kv_len"] == L and r["kernels"] == kernels]
    entry["projected_tokens_per_s"] = {tau: batch * tau / timed.seconds for tau in range(1, gamma + 2)}
    if spec_off_rows:
        entry["spec_off_tokens_per_s"] = spec_off_rows[0]["tokens_per_s"]


def spec_set(run: Run, s: Setup, batch: int, gamma: int, kernels: str) -> None:
    """The rows of one (batch, gamma): the draft step once at the first batch, then verify, chain, rebuild
    and the round, each if the budget allows."""
    if batch == s.plan.spec_batches[0] and not any(r["batch"] == batch for r in run.results.get("draft_step", [])):
        if run.time_left(f"draft_step b{batch}"):
            draft_step(run, s, batch, kernels)
    for label, fn in (("verify", lambda: verify(run, s, batch, gamma + 1, kernels)),
                      ("chain", lambda: chain(run, s, batch, gamma, kernels)),
                      ("rebuild", lambda: rebuild(run, s, batch, gamma + 1, kernels)),
                      ("round", lambda: speculative_round(run, s, batch, gamma, kernels))):
        if run.time_left(f"{label} b{batch} g{gamma}"):
            fn()


def variants(run: Run, s: Setup, batch: int, length: int, kernels: str) -> None:
    """Where a decode step's time goes: the full step, the step without lm_head and argmax, and the
    matmuls alone; with the number of kernels XLA emits for each."""
    t, out = s.plan.target, {}
    cache = random_cache(t.num_layers, batch, t.num_kv_heads, length + 64, t.head_dim, length, s.dtype, 5)
    tokens = jnp.zeros((batch, 1), jnp.int32) + 3
    for name, step, args in (
        ("forward_no_head", steps.jit_step(steps.forward_only, 3, cfg=t, kernels=kernels), (s.tparams, tokens)),
        ("matmuls_only", steps.jit_step(steps.matmuls_only, 3, cfg=t),
         (s.tparams, normal(jax.random.key(8), (batch, t.hidden_size), s.dtype))),
    ):
        state = cache if name != "matmuls_only" else jnp.zeros((), jnp.int32)
        compiled, _ = compile_timed(step, *args, state)
        seconds, state = time_chain(compiled, state, args, s.plan.reps, s.plan.inner)
        if name != "matmuls_only":
            cache = state
        out[name] = {"time_ms": seconds * 1e3, "kernel_count": profile.kernel_count(compiled)}
    timed = spec_off(s, batch, length, kernels)
    holder = [timed.state]

    def one_call():
        holder[0], packed = timed.call(holder[0])
        return packed

    kernel_times = {name: [n / timed.rounds, us / timed.rounds]
                    for name, (n, us) in profile.gpu_kernel_times(one_call).items()}
    # One round per call: what the engine's scan of rounds saves, and the kernel count (a scan's kernels
    # are in its loop body, not in the entry computation that kernel_count reads).
    single = spec_off(s, batch, length, kernels, rounds=1)
    count = profile.kernel_count(single.compiled)
    out["step_one_round_per_call"] = {"time_ms": single.seconds * 1e3, "kernel_count": count}
    out["step"] = {"time_ms": timed.seconds * 1e3, "kernel_count": count, "rounds_per_call": s.rounds_per_call}
    if kernel_times:  # the kernels' times summed, against the step's wall time. Kernels in XLA's command
        # buffers can overlap, so the difference is not the time between kernels (BENCHMARKS.md).
        busy_ms = sum(us for _, us in kernel_times.values()) / 1e3
        out["step"].update(kernel_busy_ms=busy_ms, wall_minus_kernel_sum_ms=timed.seconds * 1e3 - busy_ms,
                           launches=sum(n for n, _ in kernel_times.values()),
                           groups_us=profile.kernel_groups(kernel_times),
                           kernels=dict(sorted(kernel_times.items(), key=lambda kv: -kv[1][1])))
    run.add("variants", {"batch": batch, "kv_len": length, "kernels": kernels,
                         "xla_flags": os.environ.get("XLA_FLAGS", ""),
                         "floor_ms": run.floor_s(spec_off_read(s, batch, length)) * 1e3, **out})


def run_all(run: Run, s: Setup, with_peer: bool) -> dict:
    """The whole dense bench: ceilings, the first decode row per kernel choice, the agreement check, the
    engine end to end and the peer, then every decode shape and every (batch, gamma) set."""
    plan, primary = s.plan, s.kernels[0]
    run.ceilings(plan.copy_bytes, plan.matmul_n)
    first_batch, first_len = plan.batches[0], plan.kv_lengths[0]
    for kernels in s.kernels:
        if run.time_left(f"decode b{first_batch} l{first_len} {kernels}"):
            decode(run, s, first_batch, first_len, kernels)
    if run.time_left("agreement"):
        checks.agreement(run, s.target, s.drafter, s.kernels, gamma=3, new_tokens=24)
    mid, b = plan.gammas[len(plan.gammas) // 2], plan.spec_batches[0]
    spec_set(run, s, b, mid, primary)
    if run.time_left("engine"):
        checks.engine_generate(run, s.target, s.drafter, mid, primary, 48, s.rounds_per_call)
    if with_peer and run.time_left("peer"):
        checks.peer(run, plan.target, prompt_len=128, new_tokens=32)
    for batch in plan.batches:  # the spec-off step is the baseline: every kernel choice, every shape
        for length in plan.kv_lengths:
            for kernels in s.kernels:
                first = (batch, length) == (first_batch, first_len)
                if not first and run.time_left(f"decode b{batch} l{length} {kernels}"):
                    decode(run, s, batch, length, kernels)
    for batch in plan.spec_batches:
        for gamma in plan.gammas:
            if (batch, gamma) != (b, mid):
                spec_set(run, s, batch, gamma, primary)
    return run.results


def time_parts(target: Target, drafter: Drafter, gamma: int, kv_length: int = 256, batch: int = 1,
               kernels: str | None = None, reps: int = 5, inner: int = 5, with_floor: bool = False) -> dict:
    """Times a speculative round and its parts for loaded models on the current device (for notebooks):
    the spec-off step, one draft step, the draft chain, the verify step, the rebuild and the round, in ms.
    with_floor also measures the copy bandwidth so each row carries its memory-bandwidth floor."""
    plan = dataclasses.replace(tiny_plan(), target=target.config, drafter=drafter.config, batches=(batch,),
                               kv_lengths=(kv_length,), spec_batches=(batch,), spec_kv_length=kv_length,
                               gammas=(gamma,), reps=reps, inner=inner, copy_bytes=256 << 20)
    kernels = kernels or kernels_lib.default()
    run = Run(budget_s=1e9, out=None, filename="")
    s = setup(run, plan, (kernels,), target.params["embed"].dtype, target=target, drafter=drafter)
    if with_floor:
        run.ceilings(plan.copy_bytes, plan.matmul_n)
    decode(run, s, batch, kv_length, kernels)
    draft_step(run, s, batch, kernels)
    verify(run, s, batch, gamma + 1, kernels)
    chain(run, s, batch, gamma, kernels)
    rebuild(run, s, batch, gamma + 1, kernels)
    speculative_round(run, s, batch, gamma, kernels)
    return {name: run.results[name][0] for name in ("decode", "draft_step", "verify", "chain", "rebuild", "round")}
