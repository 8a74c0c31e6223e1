"""The speculative engine: lossless against plain greedy decoding, acceptance as predicted, the
cache edge, stops inside accepted spans, one transfer per call of rounds, abandoned streams."""

import jax
import numpy as np
import pytest
import torch

import eagle3_jax
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding.live import device_chunks
from eagle3_jax.decoding.live_plan import empty_chunk
from eagle3_jax.decoding.spec_round import split_pages, with_pages
from eagle3_jax_bench.profile import count_compilations

import drafter_oracle as oracle
import spec_worlds as worlds
from transfer_guard import no_implicit_transfers

GAMMAS = [1, 2, 3, 5, 7]
PROMPTS = [[3, 17, 5, 40, 22, 9, 1], [30, 2], [7, 7, 7, 21, 44, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """All targets and drafters, built once."""
    root = tmp_path_factory.mktemp("worlds")
    out = {}
    for kind in ("permutation", "constant", "random", "random2"):
        out["t:" + kind] = worlds.save_target(kind, root / kind)
    for target_kind, drafter_kind in [("permutation", "pi1"), ("permutation", "pi2"), ("permutation", "pi3"),
                                      ("constant", "constant"), ("random", "random"), ("random2", "random2")]:
        out["d:" + drafter_kind] = worlds.save_drafter(drafter_kind, root / drafter_kind, out["t:" + target_kind][1])
    return out


def spec_off(target, prompts, max_new, max_len=128, stops=()):
    return eagle3_jax.Engine(target, max_len=max_len).generate(prompts, max_new, stop_token_ids=stops)


def committed_accepts(accepts: list[int], kept: int) -> list[int]:
    """The accept lengths of a run cut to its first `kept` tokens, from an uncut run's `accepts`: round k
    began at token s_k and accepted a_k drafts, so cut it emits min(a_k + 1, kept - s_k) tokens, of which
    min(a_k, emitted) are drafts."""
    start, out = 1, []  # prefill emits token 0
    for a in accepts:
        if start >= kept:
            break
        emitted = min(a + 1, kept - start)
        out.append(min(a, emitted))
        start += emitted
    return out


# Every gamma on the second random pair (the first's gammas 2 and 5 run through a pool in test_pool.py); the
# structural pairs, whose accept lengths are known, at 1, 3 and 7.
LOSSLESS_CASES = ([(g, "random", "random") for g in (1, 3, 7)] + [(g, "random2", "random2") for g in GAMMAS]
                  + [(g, t, d) for t, d in (("permutation", "pi2"), ("permutation", "pi1"), ("constant", "constant"))
                     for g in (1, 3, 7)])


@pytest.mark.parametrize("gamma, target_kind, drafter_kind", LOSSLESS_CASES)
def test_lossless_for_every_gamma(world, gamma, target_kind, drafter_kind):
    target = world["t:" + target_kind][1]
    drafter = world["d:" + drafter_kind][2]
    expected = spec_off(target, PROMPTS, 30)
    got = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=128).generate(PROMPTS, 30)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
        # Each round emits accepted + 1 tokens; the first token comes from prefill.
        assert 1 + sum(a + 1 for a in g.accept_lengths) >= len(g.token_ids) > sum(a + 1 for a in g.accept_lengths[:-1])
        assert all(0 <= a <= gamma for a in g.accept_lengths)
    accepts = [a for g in got for a in g.accept_lengths]
    if drafter_kind == "constant":  # every draft accepted; a round cut by max_new_tokens commits what it emits
        assert all(g.accept_lengths == committed_accepts([gamma] * len(g.accept_lengths), 30) for g in got)
    elif drafter_kind == "pi2":
        assert accepts == [1] * len(accepts)  # d_1 right, the rest not (see spec_worlds)
    elif drafter_kind == "pi1":
        assert accepts == [0] * len(accepts)  # every draft rejected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_dtype_speculates_at_batch_above_one(world, dtype):
    """Every dtype the API offers, batch 3, spec on and off: the permutation world's answer is known
    exactly (x_{n+1} = pi(x_n), and pi2's first draft is always right), so rounding cannot move it."""
    target = eagle3_jax.load_target(world["t:permutation"][1].folder, dtype=dtype, progress=False)
    drafter = eagle3_jax.load_drafter(world["d:pi2"][2].folder, target, dtype=dtype)
    expected = []
    for prompt in PROMPTS:
        tokens = [int(worlds.PI[prompt[-1]])]
        while len(tokens) < 12:
            tokens.append(int(worlds.PI[tokens[-1]]))
        expected.append(tokens)
    spec = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64).generate(PROMPTS, 12)
    plain = eagle3_jax.Engine(target, max_len=64).generate(PROMPTS, 12)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain] == expected
    assert all(r.accept_lengths == [1] * len(r.accept_lengths) for r in spec)


def test_pairing_off_by_one_would_be_caught(world):
    """Only the drafter that is right under the (g_t, x_{t+1}) pairing gets anything accepted: pi^1
    and pi^3 are what a drafter would need if the engine paired features and tokens one off."""
    target = world["t:permutation"][1]
    for kind, expected in [("pi1", 0), ("pi2", 1), ("pi3", 0)]:
        results = eagle3_jax.Engine(target, world["d:" + kind][2], num_draft_tokens=3, max_len=64).generate(PROMPTS, 12)
        assert {a for r in results for a in r.accept_lengths} == {expected}, kind


def simulate_accepts(model, spec, state, prompt, output, gamma):
    """Accept lengths by an independent route: transformers' features + SpecForge's chain drafts,
    compared with the greedy continuation (`output` runs past what the engine emitted)."""
    seq = list(prompt) + list(output)
    n, accepts = len(prompt), []
    capture = (2, worlds.LAYERS // 2, worlds.LAYERS - 3)
    while n + 1 + gamma < len(seq):
        with torch.no_grad():
            hidden = model(torch.tensor([seq[:n]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i] for i in capture], dim=-1)
        drafts = oracle.reference_chain(state, spec, model.model.embed_tokens.weight.detach(), feats,
                                        torch.tensor([seq[1 : n + 1]]), gamma).draft_ids[0].tolist()
        a = 0
        while a < gamma and drafts[a] == seq[n + 1 + a]:
            a += 1
        accepts.append(a)
        n += a + 1
    return accepts


@pytest.mark.parametrize("target_kind, drafter_kind", [("random", "random"), ("permutation", "pi2")])
def test_accept_lengths_match_independent_simulation(world, target_kind, drafter_kind):
    model, target = world["t:" + target_kind]
    spec, state, drafter = world["d:" + drafter_kind]
    gamma = 3
    long = spec_off(target, PROMPTS[:2], 40)
    got = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=128).generate(PROMPTS[:2], 24)
    for prompt, ref, result in zip(PROMPTS, long, got):
        expected = simulate_accepts(model, spec, state, prompt, ref.token_ids, gamma)
        assert result.accept_lengths == expected[: len(result.accept_lengths)]


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("drafter_kind, target_kind", [("constant", "constant"), ("random", "random")])
def test_cache_edge(world, gamma, drafter_kind, target_kind):
    """Every start length within gamma + 2 of max_len: no error, output equal to spec-off."""
    target, drafter = world["t:" + target_kind][1], world["d:" + drafter_kind][2]
    max_len = 100
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=max_len)
    rng = np.random.default_rng(gamma)
    prompts = [rng.integers(0, worlds.V, size=L).tolist() for L in range(max_len - gamma - 2, max_len)]
    expected = spec_off(target, prompts, 50, max_len=max_len)
    got = engine.generate(prompts, 50)
    for p, e, g in zip(prompts, expected, got):
        assert g.token_ids == e.token_ids and len(p) + len(g.token_ids) == max_len and g.finish_reason == "length"
        if drafter_kind == "constant":
            # All drafts accepted until the room runs out: the seed review's case is L=97, gamma=3.
            n, expected_accepts = len(p), []
            while n + 1 < max_len:
                a = min(gamma, max_len - n - 2)
                expected_accepts.append(a)
                n += a + 1
            assert g.accept_lengths == expected_accepts


def test_stops_and_max_new_inside_accepted_spans(world):
    target, drafter = world["t:permutation"][1], world["d:pi2"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128)
    (full,) = spec_off(target, [PROMPTS[0]], 20)
    for cut in range(1, 8):  # every position of the first rounds' accepted spans
        stop = full.token_ids[cut]
        (result,) = engine.generate([PROMPTS[0]], 20, stop_token_ids=[stop])
        (reference,) = spec_off(target, [PROMPTS[0]], 20, stops=[stop])
        assert result.token_ids == reference.token_ids == full.token_ids[: cut + 1] and result.finish_reason == "stop"
        (result,) = engine.generate([PROMPTS[0]], cut)
        assert result.token_ids == full.token_ids[:cut] and result.finish_reason == "length"


def test_calls_update_the_pages_and_rows_in_place(world):
    """An exact engine's chunk in a call of its own, and a call of rounds with a chunk in every round, donate their
    state, page pools and rows alike: nothing is copied."""
    target, drafter = world["t:random"][1], world["d:random"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, max_batch=3)
    params = (target.params, drafter.params)
    rows = engine_lib.jit_empty(engine.spec, 3, engine.table_width, 8, np.float32)
    plan = empty_chunk(engine.prefill_chunk, engine.prefill_sequences, engine.table_width, 8, 3, alone=False,
                       rounds=4)
    chunks = jax.device_put(device_chunks(plan))
    state = with_pages(rows, engine.page_pool.arrays)
    after_chunk, _ = engine_lib.jit_prefill(*params, state, jax.tree.map(lambda x: x[0], chunks), spec=engine.spec)
    after_call, _ = engine_lib.jit_rounds(*params, after_chunk, chunks, spec=engine.spec, num_rounds=4)

    def buffers(s):
        return [x for pool in (s.target_pages, s.draft_pages) for x in pool.k + pool.v] + jax.tree.leaves(
            split_pages(s)[0])

    assert all(x.is_deleted() for x in buffers(state) + buffers(after_chunk))
    assert not any(x.is_deleted() for x in buffers(after_call))


def test_one_transfer_per_call_and_no_recompile(world):
    target, drafter = world["t:random"][1], world["d:random"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128)
    engine.generate(PROMPTS, 16)
    with no_implicit_transfers(), count_compilations() as compiles:
        engine.generate(PROMPTS, 16)
        transfers = [shape for kind, shape in engine.device_events if kind == "transfer"]
        # one [4 rounds, the call's rows (a bucket of the running rows: 4, fewer as rows finish) and, in the first
        # call, its chunks' segments, 2 gamma + 6] per call
        calls = [shape for kind, shape in engine.device_events if kind == "call"]
        assert calls[0] == (4, 4, sum(map(len, PROMPTS))) and all(tokens == 0 for _, _, tokens in calls[1:])
        width = 2 * 3 + 6
        assert transfers == [(4, 4 + engine.prefill_sequences, width)] + [(4, b, width) for _, b, _ in calls[1:]]
        assert [b for _, b, _ in calls] == sorted((b for _, b, _ in calls), reverse=True) and calls[-1][1] < 4
        engine.generate([[5, 6], [1], [2, 3, 4]], 16)  # other prompt lengths fill the same chunk shapes
    assert compiles.count == 0


def test_no_call_runs_in_vain_at_the_end(world):
    """With 2 tokens a round (pi2: d_1 accepted), a call of 4 rounds emits 8 tokens while the host must
    allow for 16: the early dispatch stops while a call could end every row, and each call dispatched is
    needed. The first call carries the prompt in its first round and runs its row in the other three; the second
    follows it before its tokens are fetched, the third before the second's are, and the fourth only once the
    third's tokens are fetched."""
    target, drafter = world["t:permutation"][1], world["d:pi2"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128)
    (result,) = engine.generate([PROMPTS[0]], 30)
    assert len(result.token_ids) == 30 and result.accept_lengths == [1] * 15  # prefill + 29 in 15 rounds
    assert [kind for kind, _ in engine.device_events] == [
        "allocate", "call", "call", "transfer", "call", "transfer", "transfer", "call", "transfer"]


@pytest.mark.parametrize("rounds_per_call", [1, 2, 5])
def test_rounds_per_call_changes_nothing(world, rounds_per_call):
    """Calls of several rounds (a scan on the device) give what one round per call gives: tokens, finish
    reasons, accept lengths and traces, with rows that stop, run out of room or of tokens mid-call."""
    target, drafter = world["t:random"][1], world["d:random"][2]
    prompts = PROMPTS + [[i % worlds.V for i in range(59)]]  # this one reaches max_len = 64 within a few rounds
    (full,) = spec_off(target, [PROMPTS[0]], 20)
    kwargs = dict(max_new_tokens=15, stop_token_ids=[full.token_ids[6]], trace=True)

    engines = {k: eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, rounds_per_call=k)
               for k in (rounds_per_call, 4)}
    got, default = (engines[k].generate(prompts, **kwargs) for k in (rounds_per_call, 4))
    assert got == default
    assert [r.finish_reason for r in default] == ["stop", "length", "length", "length"]
    # Streams yield the same (prompt, tokens) chunks, none empty, and none after a row is done.
    chunks = [list(engines[k].stream(prompts, 15, kwargs["stop_token_ids"])) for k in (rounds_per_call, 4)]
    assert chunks[0] == chunks[1] and all(tokens for _, tokens in chunks[1])
    assert [sum((c for i, c in chunks[1] if i == p), []) for p in range(len(prompts))] == [
        r.token_ids for r in default]


def test_abandoned_stream_leaves_engine_usable(world):
    target, drafter = world["t:random"][1], world["d:random"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128)
    stream = engine.stream(PROMPTS, 30)
    first = [next(stream) for _ in range(4)]
    # the first round's chunk holds two prompts (prefill_sequences), whose first tokens come first, then the second
    # round's rows, then (its chunk) the third prompt's first token
    assert [i for i, _ in first] == [0, 1, 0, 1] and all(tokens for _, tokens in first)
    del stream
    again = engine.generate(PROMPTS, 30)
    fresh = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128).generate(PROMPTS, 30)
    assert again == fresh
    # The stream's (prompt, tokens) chunks concatenate to the generated tokens.
    chunks = list(engine.stream(PROMPTS, 30))
    assert [sum((c for i, c in chunks if i == p), []) for p in range(len(PROMPTS))] == [r.token_ids for r in fresh]


def test_trace_records_drafts_and_target_choices(world):
    target, drafter = world["t:permutation"][1], world["d:pi2"][2]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=128)
    (result,) = engine.generate([PROMPTS[0]], 13, trace=True)
    (plain,) = engine.generate([PROMPTS[0]], 13)
    assert plain.rounds is None and result.token_ids == plain.token_ids
    emitted = result.token_ids[1:]
    for r in result.rounds:
        assert len(r.drafted) == 3 and len(r.target) == 4 and r.accepted == 1
        assert r.drafted[0] == r.target[0] and r.drafted[1] != r.target[1]
        assert r.target[: r.accepted + 1] == emitted[: r.accepted + 1]
        emitted = emitted[r.accepted + 1 :]
    assert emitted == []
