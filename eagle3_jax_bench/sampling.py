"""`eagle3-jax bench --sampling-only`: a sampled round against a greedy round as the engine runs them (the
aim: at most 3% more), spec off and at gamma 3, in each of the sampling builds (the candidate filter's for
Qwen3's settings, the radix search's for top-p alone); then the parts of a round's sampling work timed
alone: the target's filter (the candidate filter at three choices of blocks and with 32 candidates, the
radix search, one sort per row), one draft step's filter and draw over the draft vocabulary (the three
choices of blocks), and the rejection sampler with argmax and with sampled drafts, and its last draw alone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.decoding import candidate_filter, engine_args, spec_round
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding.eagle3_proposer import Eagle3
from eagle3_jax.models import eagle3 as drafter_lib

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
    """A call of rounds from a random state at the plan's KV length (gamma 0: spec-off steps, no drafter):
    greedy when proposal is None, else every row sampling with settings (temperature, top_k, top_p), in the
    build the engine picks for them."""
    capacity = min(s.plan.spec_kv_length + 512, s.plan.target.max_position_embeddings)
    spec = spec_round.StepSpec(target=s.plan.target, proposer=Eagle3(s.plan.drafter) if gamma else None, gamma=gamma,
                               max_len=capacity, kernels=kernels, sampling=proposal is not None,
                               proposal=proposal or "argmax")
    state = random_state((s.plan.target, s.plan.drafter), batch, s.plan.spec_kv_length, capacity, s.dtype,
                         with_drafter=gamma > 0)
    if proposal is not None:
        t, k, p = settings
        params = sampling_lib.SamplingParams(
            temperature=jnp.full((batch,), t, jnp.float32), top_k=jnp.full((batch,), k, jnp.int32),
            top_p=jnp.full((batch,), p, jnp.float32), seed=jnp.zeros((batch, 2), jnp.uint32))
        state = dataclasses.replace(state, sampling=params)
        spec = dataclasses.replace(spec, filter=sampling_lib.filter_for(params))
    return steps.engine_rounds(spec, s.tparams, s.dparams if gamma else None, state, s.rounds_per_call, s.plan.reps,
                               s.plan.inner)


# The candidate filter's block sizes timed beside its default (candidate_filter.BLOCKS; any give the same cuts).
OTHER_BLOCKS = ((32,), (16, 16))


def _named(field: str, blocks: tuple[int, ...]) -> str:
    """The bench field of a part timed with the candidate filter at `blocks`: `field`_ms at the default."""
    return f"{field}_ms" if blocks == candidate_filter.BLOCKS else f"{field}_blocks{'x'.join(map(str, blocks))}_ms"


def _filters() -> dict:
    """The target's filters timed alone over [rows, V], each returning what the verify reads (field -> fn)."""
    def by_blocks(blocks):
        def candidates(logits, t, k, p):  # the candidate build's filter, exact for top_k in [1, 64]
            return candidate_filter.filter_rows(sampling_lib.tempered(logits, t), k, p, blocks)
        return candidates

    def radix(logits, t, k, p):  # the radix build's filter, exact for any settings
        f = sampling_lib.filter_rows(logits, t, k, p, filter="radix")
        return f.cut, f.tie_id, f.total

    def fewer(logits, t, k, p):  # 32 candidates a row (exact for top_k in [1, 32], as Qwen3's 20)
        return candidate_filter.filter_rows(sampling_lib.tempered(logits, t), k, p, count=32)

    blocks = {_named("filter", b): by_blocks(b) for b in (candidate_filter.BLOCKS, *OTHER_BLOCKS)}
    return {**blocks, "filter_k32_ms": fewer, "filter_radix_ms": radix, "filter_sort_ms": sorted_filter}


def _draft_steps() -> dict:
    """One draft step's sampling work over the draft vocabulary (spec_round._draft's propose: the filter, the
    distribution q kept for the verify, the draw), at the default blocks and the others (field -> fn)."""
    def by_blocks(blocks):
        def step(logits, t, k, p, key):
            x = sampling_lib.tempered(logits, t)
            q = sampling_lib.Filtered(x, *candidate_filter.filter_rows(x, k, p, blocks)).probs()
            return sampling_lib.categorical(jax.random.split(key, logits.shape[0]), q), q
        return step

    return {_named("draft_step", b): by_blocks(b) for b in (candidate_filter.BLOCKS, *OTHER_BLOCKS)}


def _verify_parts(s: Setup, batch: int, gamma: int, settings) -> dict:
    """The rejection sampler alone (sampling.verify) on a round's filtered target rows, with argmax drafts
    (q one-hot) and with sampled drafts (q over the draft vocabulary: p at the drafts and the residual over
    the union of the two vocabularies), and its last draw alone (one token from each batch row's [V]
    distribution, as either ends): field -> (fn, args). settings: (temperature, top_k, top_p), one
    value per verify row [batch (gamma + 1)]."""
    V, Vd = s.plan.target.vocab_size, s.plan.drafter.draft_vocab_size
    logits = jax.random.normal(jax.random.key(5), (batch * (gamma + 1), V), jnp.float32) * 3
    p = sampling_lib.filter_rows(logits, *settings, filter="candidates")
    q = jax.nn.softmax(jax.random.normal(jax.random.key(6), (batch, gamma, Vd), jnp.float32) * 3, axis=-1)
    q_ids = drafter_lib.to_target_id(s.dparams, jnp.arange(Vd))
    drafts = jnp.broadcast_to(q_ids[:gamma], (batch, gamma))
    keys = sampling_lib.row_keys(jnp.zeros((batch, 2), jnp.uint32), jnp.arange(batch))
    room = jnp.full((batch,), gamma, jnp.int32)
    probs = p.rows(jnp.arange(batch) * (gamma + 1)).probs()
    return {"verify_argmax_ms": (lambda p, d, r: sampling_lib.verify(keys, p, d, None, r), (p, drafts, room)),
            "verify_sample_ms": (lambda p, d, q, r, i: sampling_lib.verify(keys, p, d, q, r, i),
                                 (p, drafts, q, room, q_ids)),
            "final_draw_ms": (lambda w: sampling_lib.categorical(keys, w), (probs,))}


def _time(s: Setup, fn, args) -> float:
    return time_pure(jax.jit(fn).lower(*args).compile(), args, s.plan.reps, s.plan.inner) * 1e3


def sampling(run: Run, s: Setup, batch: int, gamma: int, kernels: str) -> None:
    """The sampled round (gamma 0: the spec-off step) for each proposal mode at Qwen3's generation_config
    settings (temperature 0.6, top-k 20, top-p 0.95: the candidate build) and with top-p alone (temperature
    1, top-p 0.95: the radix build), against the greedy round. Then, for a round (gamma > 0), its sampling
    work in parts at Qwen3's settings: the target's filters over [batch (gamma + 1), V] (`_filters`), one
    draft step over [batch, draft vocabulary] (`_draft_steps`, gamma of them a round) and the rejection
    sampler (`_verify_parts`)."""
    greedy = sampled_round(s, batch, gamma, kernels, None, None)
    entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "rounds_per_call": s.rounds_per_call,
             "greedy_ms": greedy.seconds * 1e3, "compile_s": {"greedy": greedy.compile_s}}
    proposals = engine_args.PROPOSALS if gamma else ("argmax",)  # no drafts: nothing is proposed
    for proposal in proposals:
        for label, settings in SETTINGS:
            timed = sampled_round(s, batch, gamma, kernels, proposal, settings)
            entry[f"{proposal}_{label}_ms"] = timed.seconds * 1e3
            entry[f"{proposal}_{label}_extra"] = timed.seconds / greedy.seconds - 1
            entry["compile_s"][f"{proposal}_{label}"] = timed.compile_s
    if gamma == 0:  # the step filters [batch, V]: the round's figures at a quarter of its batch say as much
        run.add("sampling", entry)
        return
    rows, V = batch * (gamma + 1), s.plan.target.vocab_size
    logits = jax.random.normal(jax.random.key(9), (rows, V), jnp.float32) * 3
    t, k, p = SETTINGS[0][1]
    settings = (jnp.full((rows,), t), jnp.full((rows,), k, jnp.int32), jnp.full((rows,), p))
    for name, fn in _filters().items():
        entry[name] = _time(s, fn, (logits, *settings))
    draft_logits = jax.random.normal(jax.random.key(8), (batch, s.plan.drafter.draft_vocab_size), jnp.float32) * 3
    for name, fn in _draft_steps().items():
        entry[name] = _time(s, fn, (draft_logits, *(x[:batch] for x in settings), jax.random.key(0)))
    for name, (fn, args) in _verify_parts(s, batch, gamma, settings).items():
        entry[name] = _time(s, fn, args)
    run.add("sampling", entry)


def summary_lines(results: dict) -> list[str]:
    lines = []
    for e in results.get("sampling", []):
        rounds = ", ".join(f"{p} {label} {e[f'{p}_{label}_ms']:.3f} ms ({e[f'{p}_{label}_extra'] * 100:+.1f}%)"
                           for p in engine_args.PROPOSALS for label, _ in SETTINGS if f"{p}_{label}_ms" in e)
        lines.append(f"sampling b{e['batch']} g{e['gamma']}: greedy round {e['greedy_ms']:.3f} ms; sampled "
                     f"{rounds} (qwen3_defaults: the candidate build; top_p_only: the radix build)")
        if "filter_ms" in e:
            lines.append(f"{'':2s}over [{e['batch'] * (e['gamma'] + 1)}, V]: " + ", ".join(
                f"{k[:-3]} {e[k]:.3f} ms" for k in _filters()))
            steps = ", ".join(f"{k[:-3]} {e[k]:.3f} ms" for k in _draft_steps())
            lines.append(f"{'':2s}over [{e['batch']}, Vd], x{e['gamma']} a round: {steps}; verify: argmax drafts "
                         f"{e['verify_argmax_ms']:.3f} ms, sampled drafts {e['verify_sample_ms']:.3f} ms, its last "
                         f"draw over [{e['batch']}, V] {e['final_draw_ms']:.3f} ms")
    return lines
