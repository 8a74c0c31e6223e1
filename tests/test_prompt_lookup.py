"""Prompt lookup: the on-device search against a plain-Python reference of its rule at every position; through
the engine, greedy output equal to spec-off at gammas 1-5 and "auto" through a pool (prompts that repeat
themselves and prompts that do not), every round's proposal the reference's over the tokens so far, rounds
without a match counted as 0; seeded sampling reproducible; the chi-square gate (test_sampling_engine's) with
PromptLookup, and its power against a wrong sampler; bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax.decoding import prompt_lookup

import spec_worlds as worlds
from test_sampling_engine import (  # noqa: F401 (module fixtures: tiny, exact)
    MAX_LEN,
    PLAIN_07,
    PROMPT,
    TOPK_10,
    N,
    exact,
    gate_p_value,
    sample_first_three,
    tiny,
    wrong,
)


def reference(tokens: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule of prompt_lookup.py in plain Python, over a row's tokens x_0 .. x_n: for k from max_ngram down to
    min_ngram, the latest earlier occurrence of the last k tokens, and the (at most gamma) known tokens after it."""
    n = len(tokens) - 1
    for k in range(max_ngram, min_ngram - 1, -1):
        if k > n + 1:
            continue
        for j in range(n - 1, k - 2, -1):
            if tokens[j - k + 1: j + 1] == tokens[n - k + 1:]:
                return tokens[j + 1: min(j + 1 + gamma, n + 1)]
    return []


SEQUENCES = [
    np.random.default_rng(0).integers(0, 3, 40).tolist(),  # many repeats of every length
    np.random.default_rng(1).integers(0, 6, 40).tolist(),
    [5, 5, 5, 5, 5, 5, 5, 5],  # overlapping occurrences
    list(range(30)),  # no repeats: no match anywhere
    [1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3, 4, 8, 2, 3, 4],
]


@pytest.mark.parametrize("gamma, max_ngram, min_ngram", [(3, 4, 1), (5, 2, 2), (1, 3, 1), (4, 3, 3)])
def test_lookup_equals_the_reference_at_every_position(gamma, max_ngram, min_ngram):
    L = 48
    history, n, expected = [], [], []
    for seq in SEQUENCES:
        for end in range(len(seq)):  # every prefix x_0 .. x_end; the stale entries past it hold the rest
            history.append(seq + [7] * (L - len(seq)))
            n.append(end)
            found = reference(seq[: end + 1], gamma, max_ngram, min_ngram)
            expected.append(found + [prompt_lookup.NO_DRAFT] * (gamma - len(found)))
    got = jax.jit(prompt_lookup.lookup, static_argnums=(2, 3, 4))(np.array(history, np.int32), np.array(n, np.int32),
                                                                  gamma, max_ngram, min_ngram)
    np.testing.assert_array_equal(np.asarray(got), np.array(expected))
    assert (np.asarray(got) == prompt_lookup.NO_DRAFT).all(axis=1).any()  # some positions have no match
    assert (np.asarray(got) != prompt_lookup.NO_DRAFT).all(axis=1).any()  # some a whole proposal


@pytest.mark.parametrize("args, message", [
    ((0,), "max_ngram must be an int >= 1"), ((2, 0), "min_ngram must be an int >= 1"),
    ((2, 3), "min_ngram \\(3\\) must be at most max_ngram \\(2\\)"), ((2.0,), "max_ngram must be an int"),
    (("3",), "max_ngram must be an int"), ((True,), "max_ngram must be an int"), ((3, None), "min_ngram"),
])
def test_bad_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        eagle3_jax.PromptLookup(*args)


# ----------------------------------------------------------------------------- through the engine

MAX_NEW = 24


@pytest.fixture(scope="module")
def permutation_target(tmp_path_factory):
    """spec_worlds' permutation target, 2 layers, float32: its greedy output walks a cycle of the tokens, so a
    prompt holding a stretch of the cycle is copied while the output retraces it."""
    return worlds.save_target("permutation", tmp_path_factory.mktemp("lookup") / "t", layers=2)[1]


def cycle_stretch(start: int, length: int) -> list[int]:
    return [int(worlds.ORDER[(start + i) % worlds.V]) for i in range(length)]


# Repeating themselves (a cycle stretch, a stretch then its own start again, a constant) and not (short, distinct).
PROMPTS = [cycle_stretch(0, 20) + cycle_stretch(0, 4), cycle_stretch(10, 30), [5, 5, 5, 5, 5, 5], [1, 2, 3],
           [40, 7, 33]]


@pytest.fixture(scope="module")
def spec_off(permutation_target):
    return eagle3_jax.Engine(permutation_target, max_len=96).generate(PROMPTS, MAX_NEW)


def auto_costs(batch, length):
    return [1.0, 1.04, 1.08, 1.12]


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, "auto"])
def test_greedy_output_is_spec_off_through_the_pool(permutation_target, spec_off, gamma):
    """Through a pool of 2 slots for 5 prompts; every round's proposal is the reference's over the prompt and
    the tokens emitted before it, and a round without one emits one token and counts 0 at the round's gamma."""
    engine = eagle3_jax.Engine(permutation_target, eagle3_jax.PromptLookup(), num_draft_tokens=gamma, max_len=96,
                               max_batch=2, round_costs=auto_costs if gamma == "auto" else None)
    got = engine.generate(PROMPTS, MAX_NEW, trace=True)
    matched = unmatched = 0
    for prompt, expected, result in zip(PROMPTS, spec_off, got):
        assert result.token_ids == expected.token_ids and result.finish_reason == expected.finish_reason
        tokens = prompt + result.token_ids[:1]
        for trace, g in zip(result.rounds, result.gammas):
            proposal = reference(tokens, g, 4, 1)
            assert trace.drafted == proposal + [prompt_lookup.NO_DRAFT] * (g - len(proposal))
            assert trace.accepted <= len(proposal)
            if not proposal and g:
                unmatched += 1
                assert trace.accepted == 0
            matched += bool(proposal)
            tokens += trace.target[: trace.accepted + 1]
        assert tokens[len(prompt):][: len(result.token_ids)] == result.token_ids
    assert matched and unmatched
    accepts = [a for r in got for a in r.accept_lengths]
    assert max(accepts) == (3 if gamma == "auto" else gamma)  # the copied stretch is accepted whole


def test_the_cache_edge(permutation_target):
    """Rows copying their prompt run into max_len mid-proposal: the same tokens as spec off, up to the edge."""
    prompts = [PROMPTS[0], cycle_stretch(3, 8) + cycle_stretch(3, 4)]
    max_len = len(PROMPTS[0]) + 11
    expected = eagle3_jax.Engine(permutation_target, max_len=max_len).generate(prompts, MAX_NEW)
    got = eagle3_jax.Engine(permutation_target, eagle3_jax.PromptLookup(), num_draft_tokens=4,
                            max_len=max_len).generate(prompts, MAX_NEW)
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in expected]
    assert len(got[0].token_ids) == max_len - len(PROMPTS[0]) and max(got[0].accept_lengths) == 4


def test_auto_drops_to_plain_rounds_where_nothing_matches_and_back(permutation_target, spec_off):
    """Rounds of gamma 0 keep the history (the output stays spec-off's) and report whether the lookup's first
    draft would have matched, so "auto" can return to drafting."""
    engine = eagle3_jax.Engine(permutation_target, eagle3_jax.PromptLookup(), num_draft_tokens="auto", max_len=96,
                               round_costs=lambda b, n: [1.0, 1.3, 1.6, 1.9], rounds_per_call=2)
    (result,) = engine.generate([PROMPTS[1]], 40)
    expected = eagle3_jax.Engine(permutation_target, max_len=96).generate([PROMPTS[1]], 40)[0]
    assert result.token_ids == expected.token_ids
    first_plain = result.gammas.index(0)  # the output leaves the prompt's stretch, then comes round the cycle to it
    assert max(result.gammas[first_plain:]) > 0 and max(result.accept_lengths[first_plain:]) > 0


def test_seeded_sampling_is_reproducible_and_proposal_sample_changes_nothing(permutation_target):
    def run(proposal, seeds):
        engine = eagle3_jax.Engine(permutation_target, eagle3_jax.PromptLookup(2), num_draft_tokens=3, max_len=96,
                                   proposal=proposal)
        return [r.token_ids for r in engine.generate(PROMPTS, MAX_NEW, temperature=0.8, seed=seeds)], engine

    first, engine = run("argmax", [1, 2, 3, 4, 5])
    assert [r.token_ids for r in engine.generate(PROMPTS, MAX_NEW, temperature=0.8, seed=[1, 2, 3, 4, 5])] == first
    assert run("argmax", [6, 7, 8, 9, 10])[0] != first
    # A proposal is a token, not a distribution: "sample" is "argmax" for it, the same build and the same draws.
    sampled, other = run("sample", [1, 2, 3, 4, 5])
    assert sampled == first and other._sampling_spec.proposal == "argmax"


def test_a_drafter_of_another_kind_is_refused(permutation_target):
    with pytest.raises(ValueError, match="drafter must be an EAGLE-3 Drafter"):
        eagle3_jax.Engine(permutation_target, "ngram")


# ----------------------------------------------------------------------------- the chi-square gate


def lookup_engine(tiny, gamma, proposal="argmax"):  # noqa: F811
    return eagle3_jax.Engine(tiny[1], eagle3_jax.PromptLookup(3), num_draft_tokens=gamma, max_len=MAX_LEN,
                             proposal=proposal, rounds_per_call=1, max_batch=N, prefill_chunk=len(PROMPT) * N,
                             prefill_sequences=N)


@pytest.mark.parametrize("gamma, settings", [(3, TOPK_10), (2, PLAIN_07)])
def test_first_three_tokens_follow_the_exact_distribution(tiny, exact, gamma, settings):  # noqa: F811
    """The prompt [3, 9, 1]: a first token among its own tokens gives the next round a proposal."""
    (tokens,) = sample_first_three(lookup_engine(tiny, gamma), [settings], seed0=500 + gamma)
    assert gate_p_value(tokens, exact[settings]) > 1e-4


def test_the_gate_rejects_a_wrong_sampler_with_prompt_lookup(tiny, exact, wrong):  # noqa: F811
    wrong("accept", lambda u, p_x, q_x: jnp.ones(u.shape, bool))
    (tokens,) = sample_first_three(lookup_engine(tiny, 2), [PLAIN_07], seed0=9)
    assert gate_p_value(tokens, exact[PLAIN_07]) < 1e-6
