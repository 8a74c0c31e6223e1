"""The steps the benchmarks time, each jitted with its state (the last argument) donated, the bytes a
step must read (its floor's numerator), and the engine's own call of rounds compiled and timed."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import spec_round
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import layers
from eagle3_jax.models import qwen3 as target_lib

from .core import compile_timed, time_chain


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def target_weight_bytes(params) -> int:
    """Bytes a target step reads: every weight but the embedding, which is a gather of B x T rows."""
    return nbytes({k: v for k, v in params.items() if k != "embed"})


def kv_bytes(num_layers, batch, length, kv_heads, head_dim, itemsize) -> int:
    return num_layers * 2 * batch * length * kv_heads * head_dim * itemsize


def jit_step(fn, num_args, **static):
    """jit with the state (last argument) donated, so the step updates its buffers in place."""
    return jax.jit(functools.partial(fn, **static), donate_argnums=(num_args - 1,))


def target_step(params, tokens, cache, *, cfg, capture, kernels):
    hidden, cache, features = target_lib.forward_rows(params, cfg, tokens, cache, capture, kernels)
    return cache, (jnp.argmax(target_lib.logits(params, hidden, kernels), -1), features)


def draft_step(params, embed, h, token, cache, *, cfg, kernels):
    out, cache = drafter_lib.forward_rows(params, cfg, embed, h[:, None], token[:, None], cache, kernels)
    return cache, drafter_lib.draft_token(params, cfg, out[:, 0])


def rebuild_step(params, embed, features, tokens, cache, *, cfg, kernels):
    h = drafter_lib.project_features(params, cfg, features)
    out, cache = drafter_lib.forward_rows(params, cfg, embed, h, tokens, cache, kernels)
    return cache, out[:, -1]


def chain_step(params, embed, h, cache, *, cfg, gamma, kernels):
    drafts, pages = drafter_lib.draft_chain(params, cfg, embed, h, cache.pages, cache.table, cache.lengths, gamma,
                                            kernels)
    return cache.written(pages), drafts


def forward_only(params, tokens, cache, *, cfg, kernels):
    hidden, cache, _ = target_lib.forward_rows(params, cfg, tokens, cache, (), kernels)
    return cache, hidden


def matmuls_only(params, x, state, *, cfg):
    """Only the step's weight reads: each layer's four matmuls (`layers.linear`, as the step runs them)
    and the lm_head, chained so none is dropped, with no norm, RoPE, attention or cache write. The bound
    a step built from these matmuls can reach."""
    N, H, I = cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    for layer in params["layers"]:
        qkv = layers.linear(x, layer["wqkv"])
        x = layers.linear(qkv[:, : N * H], layer["wo"])
        gate_up = layers.linear(x, layer["w_gate_up"])
        x = layers.linear(gate_up[:, :I], layer["w_down"])
    return state + 1, target_lib.logits(params, x).argmax(-1)


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """The engine's call of `rounds` rounds, compiled and timed from a random state."""

    seconds: float  # per round
    compile_s: float
    compiled: object  # the executable: (tparams, dparams, state) -> (state, packed round output)
    call: object  # state -> (state, packed round output), on the timed weights
    state: spec_round.DecodeState  # what the timed calls left (donate it to the next call)
    rounds: int


def engine_rounds(spec: spec_round.StepSpec, tparams, dparams, state, rounds: int, reps: int,
                  inner: int) -> EngineCall:
    """Compiles the engine's own jitted call of rounds (engine.jit_rounds) for `spec` and times it."""
    compiled, compile_s = compile_timed(engine_lib.jit_rounds, tparams, dparams, state, spec=spec, num_rounds=rounds)

    def call(s):
        return compiled(tparams, dparams, s)

    seconds, state = time_chain(call, state, (), reps, inner)
    return EngineCall(seconds / rounds, compile_s, compiled, call, state, rounds)
