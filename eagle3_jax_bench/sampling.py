"""`eagle3-jax bench --sampling-only`: a sampled round against a greedy round as the engine runs them (the
aim: at most 3% more), spec off and at gamma 3, and the engine's top-k / top-p filter against the radix search
alone and the textbook one sort per row."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import candidate_filter, spec_round
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import sampling as sampling_lib

from . import steps
from .core import Run, time_pure
from .dense import Setup
from .inputs import random_state

SETTINGS = (("qwen3_defaults", (0.6, 20, 0.95)), ("top_p_only", (1.0, 0, 0.95)))  # (temperature, top_k, top_p)


def sorted_filter(logits, temperature, top_k, top_p):
    """The textbook top-k / top-p, one descending sort per row, for timing against the engine's filter
    (sampling.filtered_probs, which needs no sort). Ties at the boundary are not treated as the engine does."""
    x = logits / temperature[:, None]
    ordered = -jnp.sort(-x, axis=-1)  # descending
    rows = jnp.arange(x.shape[0])
    kth = jnp.where(top_k > 0, ordered[rows, jnp.maximum(top_k - 1, 0)], -jnp.inf)
    ordered = jnp.where(ordered >= kth[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each one
    cut = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1)
    kept = jnp.where(x >= jnp.maximum(kth, cut)[:, None], x, -jnp.inf)
    return jax.nn.softmax(kept, axis=-1)


def sampled_round(s: Setup, batch: int, gamma: int, kernels: str, proposal: str | None,
                  settings: tuple | None) -> steps.EngineCall:
    """A call of rounds from a random state at the plan's KV length: greedy when proposal is None, else
    every row sampling with settings (temperature, top_k, top_p)."""
    capacity = min(s.plan.spec_kv_length + 512, s.plan.target.max_position_embeddings)
    spec = spec_round.StepSpec(target=s.plan.target, drafter=s.plan.drafter, gamma=gamma, max_len=capacity,
                               kernels=kernels, sampling=proposal is not None, proposal=proposal or "argmax")
    state = random_state((s.plan.target, s.plan.drafter), batch, s.plan.spec_kv_length, capacity, s.dtype,
                         with_drafter=True)
    if proposal is not None:
        t, k, p = settings
        state = dataclasses.replace(state, sampling=sampling_lib.SamplingParams(
            temperature=jnp.full((batch,), t, jnp.float32), top_k=jnp.full((batch,), k, jnp.int32),
            top_p=jnp.full((batch,), p, jnp.float32), seed=jnp.zeros((batch, 2), jnp.uint32)))
    return steps.engine_rounds(spec, s.tparams, s.dparams, state, s.rounds_per_call, s.plan.reps, s.plan.inner)


def _candidates_only(logits, temperature, top_k, top_p) -> sampling_lib.Filtered:
    """sampling.filter_rows without its radix branch: exact only while every row's top_k is in [1, 64]. Timed
    in place of the engine's filter, it shows what the branch (a device-side lax.cond) costs a round."""
    x = sampling_lib.tempered(logits, temperature)
    return sampling_lib.Filtered(x, *candidate_filter.filter_rows(x, top_k, top_p)[0])


@contextlib.contextmanager
def _without_radix_branch():
    """The engine's rounds traced with `_candidates_only` as the filter, within the block."""
    original = sampling_lib.filter_rows
    sampling_lib.filter_rows = _candidates_only
    engine_lib.jit_rounds.clear_cache()
    try:
        yield
    finally:
        sampling_lib.filter_rows = original
        engine_lib.jit_rounds.clear_cache()


def _filters() -> dict:
    """The filters timed alone over [rows, V], each returning what the verify reads (bench field -> fn)."""
    def engine(logits, t, k, p):  # candidates for top_k in [1, 64], the radix search otherwise
        f = sampling_lib.filter_rows(logits, t, k, p)
        return f.cut, f.tie_id, f.total

    def radix(logits, t, k, p):  # the radix search alone, for every setting
        return sampling_lib.radix_filter(logits / t[:, None], k, p)

    def fallback(logits, t, k, p):  # the engine's filter when one row has no top-k: the radix branch
        return engine(logits, t, k.at[0].set(0), p)

    return {"filter_ms": engine, "filter_radix_ms": radix, "filter_fallback_ms": fallback,
            "filter_sort_ms": sorted_filter}


def sampling(run: Run, s: Setup, batch: int, gamma: int, kernels: str, no_branch: bool = True) -> None:
    """The sampled round (gamma 0: the spec-off step) for each proposal mode at Qwen3's generation_config
    settings (temperature 0.6, top-k 20, top-p 0.95) and with top-p alone (temperature 1, top-p 0.95: the
    radix branch), against the greedy round, and at Qwen3's settings without the radix branch
    (`_without_radix_branch`; no_branch False: not measured). Then, for a round (gamma > 0), the filters
    alone over the verify's logits [batch (gamma + 1), V] at Qwen3's settings (`_filters`)."""
    greedy = sampled_round(s, batch, gamma, kernels, None, None)
    entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "rounds_per_call": s.rounds_per_call,
             "greedy_ms": greedy.seconds * 1e3, "compile_s": {"greedy": greedy.compile_s}}
    proposals = engine_lib.PROPOSALS if gamma else ("argmax",)  # no drafts: nothing is proposed
    for proposal in proposals:
        for label, settings in SETTINGS:
            timed = sampled_round(s, batch, gamma, kernels, proposal, settings)
            entry[f"{proposal}_{label}_ms"] = timed.seconds * 1e3
            entry[f"{proposal}_{label}_extra"] = timed.seconds / greedy.seconds - 1
            entry["compile_s"].setdefault(proposal, timed.compile_s)  # new settings reuse the executable
    for proposal in proposals if no_branch else ():  # Qwen3's settings again, the filter without its branch
        with _without_radix_branch():
            timed = sampled_round(s, batch, gamma, kernels, proposal, SETTINGS[0][1])
        entry[f"{proposal}_no_branch_ms"] = timed.seconds * 1e3
        entry[f"{proposal}_no_branch_extra"] = timed.seconds / greedy.seconds - 1
    if gamma == 0:  # the step filters [batch, V]: the round's figures at a quarter of its batch say as much
        run.add("sampling", entry)
        return
    rows, V = batch * (gamma + 1), s.plan.target.vocab_size
    logits = jax.random.normal(jax.random.key(9), (rows, V), jnp.float32) * 3
    settings = (jnp.full((rows,), 0.6), jnp.full((rows,), 20, jnp.int32), jnp.full((rows,), 0.95))
    for name, fn in _filters().items():
        compiled = jax.jit(fn).lower(logits, *settings).compile()
        entry[name] = time_pure(compiled, (logits, *settings), s.plan.reps, s.plan.inner) * 1e3
    run.add("sampling", entry)


def summary_lines(results: dict) -> list[str]:
    lines = []
    for e in results.get("sampling", []):
        rounds = ", ".join(f"{p} {label} {e[f'{p}_{label}_ms']:.3f} ms ({e[f'{p}_{label}_extra'] * 100:+.1f}%)"
                           for p in engine_lib.PROPOSALS for label in [lb for lb, _ in SETTINGS] + ["no_branch"]
                           if f"{p}_{label}_ms" in e)
        lines.append(f"sampling b{e['batch']} g{e['gamma']}: greedy round {e['greedy_ms']:.3f} ms; sampled "
                     f"{rounds} (no_branch: qwen3_defaults, the filter without its radix branch)")
        lines.append(f"{'':2s}over [{e['batch'] * (e['gamma'] + 1)}, V]: " + ", ".join(
            f"{k[:-3]} {e[k]:.3f} ms" for k in _filters() if k in e))
    return lines
