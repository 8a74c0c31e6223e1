"""`eagle3-jax bench --outputs-only`: what logprobs and penalties cost a call of rounds (the goal: at most 3% each),
at the plan's first and last batch (Qwen3-8B: 1 and 32), spec off and at gamma 3, greedy.

Each row times the engine's own call of rounds (steps.engine_rounds) in four builds over the same random state:
the default build, with logprobs (StepSpec.logprobs: each verified position's log-softmax and top 20, packed into
the output; a request's `logprobs=5` runs this build, its k only cuts what the host reads), with penalties
(StepSpec.penalties: frequency, presence and repetition penalties and a logit_bias of BIAS_ENTRIES tokens on every
row, counted over a sequence of the engine's default max_len, half of it output) and with both. Every build runs
over the same state, the penalty fields included, as the engine's pool carries them in every build.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import penalties as penalties_lib
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.decoding.engine_args import DEFAULT_MAX_LEN

from . import steps
from .dense import Setup
from .inputs import random_state

BUILDS = {"default": (False, False), "logprobs": (True, False), "penalties": (False, True), "both": (True, True)}
BIAS_ENTRIES = 16  # logit_bias tokens per row


def penalty_state(batch: int, max_len: int, length: int, vocab_size: int) -> penalties_lib.PenaltyState:
    """Rows with every penalty and a logit_bias, over random sequences of `length` tokens (x_length the newest),
    the first half of them prompt."""
    key = jax.random.key(batch + length)
    settings = penalties_lib.Penalties(
        frequency=jnp.full((batch,), 0.5), presence=jnp.full((batch,), 0.3), repetition=jnp.full((batch,), 1.1),
        bias_ids=jnp.full((batch, penalties_lib.BIAS_WIDTH), -1, jnp.int32).at[:, :BIAS_ENTRIES].set(
            jnp.arange(BIAS_ENTRIES, dtype=jnp.int32) * 997),
        bias=jnp.zeros((batch, penalties_lib.BIAS_WIDTH), jnp.float32).at[:, :BIAS_ENTRIES].set(2.0))
    sequence = jax.random.randint(key, (batch, max_len), 0, vocab_size, jnp.int32)
    return penalties_lib.PenaltyState(settings, sequence, jnp.full((batch,), length // 2, jnp.int32))


def outputs_round(s: Setup, batch: int, gamma: int, kernels: str, logprobs: bool, penalties: bool):
    """A call of rounds (gamma 0: spec-off steps) of one build, from a random state at the plan's KV length."""
    t = s.plan.target
    max_len = min(max(s.plan.spec_kv_length + 512, DEFAULT_MAX_LEN), t.max_position_embeddings)
    spec = spec_round.StepSpec(target=t, proposer=Eagle3(s.plan.drafter) if gamma else None, gamma=gamma,
                               max_len=max_len, kernels=kernels, logprobs=logprobs, penalties=penalties)
    state = random_state((t, s.plan.drafter), batch, s.plan.spec_kv_length, max_len, s.dtype, with_drafter=gamma > 0)
    state = dataclasses.replace(state, penalty=penalty_state(batch, max_len, s.plan.spec_kv_length, t.vocab_size))
    return steps.engine_rounds(spec, s.tparams, s.dparams if gamma else None, state, s.rounds_per_call, s.plan.reps,
                               s.plan.inner)


def outputs(run, s: Setup, batch: int, gamma: int, kernels: str) -> None:
    """One row: each build's round and its cost over the default build's."""
    entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "rounds_per_call": s.rounds_per_call,
             "compile_s": {}}
    for name, (logprobs, penalties) in BUILDS.items():
        timed = outputs_round(s, batch, gamma, kernels, logprobs, penalties)
        entry[f"{name}_ms"] = timed.seconds * 1e3
        entry["compile_s"][name] = timed.compile_s
    for name in list(BUILDS)[1:]:
        entry[f"{name}_extra"] = entry[f"{name}_ms"] / entry["default_ms"] - 1
    run.add("outputs", entry)


def summary_lines(results: dict) -> list[str]:
    return [f"outputs b{e['batch']} g{e['gamma']}: round {e['default_ms']:.3f} ms; " + ", ".join(
        f"{name} {e[f'{name}_ms']:.3f} ms ({e[f'{name}_extra'] * 100:+.1f}%)" for name in list(BUILDS)[1:])
        for e in results.get("outputs", [])]
