"""Logprobs, penalties and logit_bias through Engine.generate, against transformers' float32 forward of the same
target: each token's logprob and its top alternatives (speculative and spec off, greedy and sampled, prompts
prefilled in several chunks, one joining a running pool), prompt logprobs computed whole despite the prefix
cache, penalties and logit_bias equal to a greedy reference that applies them to the oracle's logits (speculative,
spec off, per prompt, through a preemption), sampled rows never drawing a banned token, the default build
computing none of it, and every bad argument refused before device work."""

import dataclasses

import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax.decoding import round_output
from eagle3_jax.models.collectives import Shards

import spec_worlds as worlds

GAMMA, MAX_LEN, TOLERANCE = 3, 64, 2e-3
PROMPTS = [[3, 17, 5, 9, 30, 2, 11, 40, 8, 21, 6], [1, 2], [44, 7, 19, 25]]  # the first in 2 chunks of 8


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The random world's target (its transformers model, float32, the oracle) and random drafter."""
    root = tmp_path_factory.mktemp("outputs")
    model, target = worlds.save_target("random", root / "target", layers=4)
    _, _, drafter = worlds.save_drafter("random", root / "drafter", target)
    return model.float(), target, drafter


@pytest.fixture(scope="module")
def engines(world):
    """Speculative (gamma 3), spec-off and draft-tree ("tree": 6 nodes, 3 steps of 2 beams) engines of 2 slots,
    prompts in chunks of 8 tokens: the third prompt joins in a call of rounds, the first takes two chunks."""
    _, target, drafter = world
    out = {gamma: eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens=gamma, max_len=MAX_LEN,
                                    max_batch=2, prefill_chunk=8)
           for gamma in (GAMMA, 0)}
    out["tree"] = eagle3_jax.Engine(target, drafter, num_draft_tokens=6, draft_depth=3, draft_top_k=2, max_len=MAX_LEN,
                                    max_batch=2, prefill_chunk=8)
    return out


def oracle_logprobs(model, sequence: list[int]) -> np.ndarray:
    """[len(sequence), V]: the log-softmax after each position, transformers in float32."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([sequence])).logits[0], -1).double().numpy()


def check_logprobs(model, prompt, result, k, prompt_k=None):
    """Each generated token's logprob and top k equal the oracle's (within TOLERANCE; the top ids exactly); with
    prompt_k, the prompt's too (None for its first token)."""
    lp = oracle_logprobs(model, prompt + result.token_ids)
    assert len(result.logprobs) == len(result.token_ids)
    for i, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        row = lp[len(prompt) - 1 + i]
        assert abs(entry.logprob - row[token]) < TOLERANCE
        assert [t for t, _ in entry.top] == np.argsort(-row, kind="stable")[:k].tolist()
        assert np.allclose([v for _, v in entry.top], np.sort(row)[::-1][:k], atol=TOLERANCE)
    if prompt_k is None:
        assert result.prompt_logprobs is None
        return
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for i, entry in enumerate(result.prompt_logprobs[1:], start=1):
        assert abs(entry.logprob - lp[i - 1, prompt[i]]) < TOLERANCE and len(entry.top) == prompt_k
        assert entry.top[0][0] == int(np.argmax(lp[i - 1]))


@pytest.mark.parametrize("gamma", [GAMMA, 0, "tree"])
def test_logprobs_equal_transformers(world, engines, gamma):
    """Greedy and sampled rows side by side, logprobs of the raw target whatever the sampling settings; the first
    prompt's logprobs come from two chunks, the third's from a chunk riding in a call of rounds (before it, its
    prompt logprobs make its chunk a call of its own)."""
    model = world[0]
    results = engines[gamma].generate(PROMPTS, 12, temperature=[0.0, 1.5, 0.0], top_k=[0, 5, 0], seed=3,
                                      logprobs=[5, 2, 0], prompt_logprobs=[3, None, 1])
    for prompt, result, k, prompt_k in zip(PROMPTS, results, (5, 2, 0), (3, None, 1)):
        check_logprobs(model, prompt, result, k, prompt_k)
    plain = engines[gamma].generate(PROMPTS, 12, temperature=[0.0, 1.5, 0.0], top_k=[0, 5, 0], seed=3)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]  # asking for logprobs changes nothing
    assert all(r.logprobs is None and r.prompt_logprobs is None for r in plain)


def test_prompt_logprobs_bypass_the_prefix_cache(world):
    """A cached page holds no logits: a prompt whose logprobs are asked for is computed whole (cached_tokens 0), and
    its pages still serve the next request."""
    model, target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=GAMMA, max_len=MAX_LEN, max_batch=1, page_size=8)
    prompt = list(range(1, 21))
    assert engine.generate([prompt], 3)[0].cached_tokens == 0
    (result,) = engine.generate([prompt], 3, logprobs=1, prompt_logprobs=2)
    assert result.cached_tokens == 0
    check_logprobs(model, prompt, result, 1, 2)
    assert engine.generate([prompt], 3)[0].cached_tokens == 16


def test_chunks_in_calls_of_their_own_report_prompt_logprobs(world, engines, monkeypatch):
    """An exact engine prefills each chunk in a call of its own (spec_round.prefill), whose rows then carry the
    chunk's prompt logprobs: the scheduler made to plan so (the same path without the exact kernels)."""
    from eagle3_jax.decoding import live_plan

    planned = live_plan.LiveScheduler.__init__

    def alone(self, *args, **kwargs):
        planned(self, *args, **{**kwargs, "alone": True})

    monkeypatch.setattr(live_plan.LiveScheduler, "__init__", alone)
    engine = engines[0]
    results = engine.generate(PROMPTS[:2], 4, logprobs=2, prompt_logprobs=2)
    assert ("prefill", (8,)) in engine.device_events  # the first prompt's first chunk, alone
    for prompt, result in zip(PROMPTS, results):
        check_logprobs(world[0], prompt, result, 2, 2)


def reference(model, prompt, steps, frequency=0.0, presence=0.0, repetition=1.0, bias=None):
    """Greedy decoding of the oracle's logits with vLLM's penalties (repetition over prompt and output, then
    frequency and presence over the output's counts) and logit_bias, in that order."""
    sequence, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, -1].double().numpy()
        counts = np.bincount(out, minlength=logits.shape[0])
        seen = counts > 0
        seen[prompt] = True
        x = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        x = x - frequency * counts - presence * (counts > 0)
        for token, b in (bias or {}).items():
            x[token] += b
        out.append(int(np.argmax(x)))
        sequence.append(out[-1])
    return out


SETTINGS = [dict(frequency=1.5), dict(presence=1.2), dict(repetition=1.8), dict(frequency=-0.5, presence=-0.5),
            dict(bias={4: 8.0, 0: -100.0}), dict(frequency=0.7, presence=0.4, repetition=1.3, bias={9: 3.0})]


def as_keywords(s: dict) -> dict:
    return dict(frequency_penalty=s.get("frequency", 0.0), presence_penalty=s.get("presence", 0.0),
                repetition_penalty=s.get("repetition", 1.0), logit_bias=s.get("bias"))


@pytest.mark.parametrize("gamma", [GAMMA, 0, "tree"])
def test_penalties_and_logit_bias_equal_a_greedy_reference(world, engines, gamma):
    """Each setting on its own prompt, one value per prompt, in one request (rows of other settings side by side);
    the same through speculation and spec off."""
    model = world[0]
    prompts = [PROMPTS[i % 3] for i in range(len(SETTINGS))]
    keywords = [as_keywords(s) for s in SETTINGS]
    per_prompt = {k: [kw[k] for kw in keywords] for k in keywords[0]}
    results = engines[gamma].generate(prompts, 14, **per_prompt)
    for prompt, settings, result in zip(prompts, SETTINGS, results):
        assert result.token_ids == reference(model, prompt, 14, **settings), settings
    plain = engines[gamma].generate(prompts[:1], 14)[0].token_ids
    assert plain != results[0].token_ids  # the penalties change this output (the check can fail)


def test_penalties_through_a_preemption_and_a_scalar_for_every_prompt(world):
    """Two sequences of 40 tokens (5 pages of 8 each) in KV of 8 pages, both admitted: one is preempted and recomputed
    from its prompt and output, whose penalties must then count that output again."""
    model, target, drafter = world
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=GAMMA, max_len=MAX_LEN, max_batch=2,
                               kv_tokens=MAX_LEN, page_size=8)
    settings = SETTINGS[-1]
    prompts = [PROMPTS[1] + [9, 9], PROMPTS[2]]
    results = engine.generate(prompts, 36, **as_keywords(settings))
    assert engine.preemptions > 0
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(model, prompt, 36, **settings)


def test_sampled_rows_never_draw_a_banned_token(world, engines):
    """logit_bias -100 reaches the sampler (speculative sampling's p at the drafts and its residual too): tokens
    banned, the greedy choice among them, never appear in sampled rows, which are otherwise spread widely."""
    prompt = PROMPTS[2]
    banned = set(range(0, 48, 2)) | {reference(world[0], prompt, 1)[0]}
    results = engines[GAMMA].generate([prompt] * 4, 24, temperature=2.0, seed=[1, 2, 3, 4],
                                      logit_bias={t: -100.0 for t in banned})
    drawn = {t for r in results for t in r.token_ids}
    assert not drawn & banned and len(drawn) > 6


def test_the_default_build_computes_no_logprobs_or_penalties(world, engines):
    """A request without them runs the build without them (its transfers are a plain round's width); asking for
    logprobs widens the rows (round_output), and only then."""
    engine = engines[GAMMA]
    plain = engine.request([[1, 2]], 4)
    assert not (engine.build_for(plain).penalties or engine.build_for(plain).logprobs)
    assert engine.build_for(engine.request([[1, 2]], 4, presence_penalty=0.5)).penalties
    engine.generate([[1, 2]], 4)
    widths = {shape[-1] for kind, shape in engine.device_events if kind == "transfer"}
    assert widths == {round_output.width(GAMMA)}
    engine.generate([[1, 2]], 4, logprobs=0)
    widths = {shape[-1] for kind, shape in engine.device_events if kind == "transfer"}
    assert widths == {round_output.width(GAMMA, logprobs=True)}


@pytest.mark.parametrize("keywords, message", [
    (dict(frequency_penalty=2.5), "frequency_penalty must be a number in [-2, 2], got 2.5"),
    (dict(presence_penalty=[0.0, float("nan")]), "presence_penalty must be a number in [-2, 2], got nan (prompt 1)"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0 (1: none), got 0.0"),
    (dict(logit_bias={48: 1.0}), "logit_bias has token id 48, not an int in the vocabulary [0, 48)"),
    (dict(logit_bias={3: 101.0}), "logit_bias's bias for token 3 must be a number in [-100, 100], got 101.0"),
    (dict(logit_bias={True: 1.0}), "logit_bias has token id True"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias must be None or a dict of at most 300"),
    (dict(logit_bias=[{1: 1.0}]), "logit_bias has 1 values for 2 prompts"),
    (dict(logprobs=21), "logprobs must be None or an int in [0, 20]"),
    (dict(prompt_logprobs=[None, -1]), "prompt_logprobs must be None or an int in [0, 20] (the most likely tokens "
                                       "reported beside each token's own), got -1 (prompt 1)"),
])
def test_bad_arguments_are_refused_before_device_work(engines, keywords, message):
    engine = engines[0]
    with pytest.raises(ValueError) as error:
        engine.generate([[1, 2], [3]], 4, **keywords)
    assert message in str(error.value) and engine.device_events == []


def test_a_mesh_refuses_them(engines, monkeypatch):
    """On a tensor-parallel mesh the vocabulary is split: penalties and logprobs are refused there, by name."""
    engine = engines[0]
    monkeypatch.setattr(engine, "_spec", dataclasses.replace(engine.spec, tp=Shards(2)))
    for keywords, name in ((dict(logprobs=1), "logprobs"), (dict(logit_bias={1: 2.0}), "penalties and logit_bias")):
        with pytest.raises(ValueError, match=f"{name} are not built for a tensor-parallel mesh"):
            engine.request([[1, 2]], 4, **keywords)
