"""Sampling through Engine.generate: the distribution of the first three tokens against an exact float64
enumeration (chi-square, spec off and both proposal modes at gamma 1-3, and through a change of gamma under
"auto"), the gate's power against two
wrong samplers, rows that behave (greedy rows in mixed batches, seeds), the edges, bad settings, and no
recompilation when settings change."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers import Qwen3Config, Qwen3ForCausalLM, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle3_jax
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import request as request_lib
from eagle3_jax.decoding import sampling, spec_round
from eagle3_jax_bench.profile import count_compilations

import drafter_oracle as oracle
import spec_worlds as worlds
from transfer_guard import no_implicit_transfers

V, VD, H = 16, 10, 16  # target vocabulary, the drafter's (a strict subset), width
PROMPT = [3, 9, 1]
N = 50_000  # samples per case
MAX_LEN = 8  # prompt 3 + a first round of up to gamma + 1 = 4 tokens, so the prefill bucket is 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 16-token Qwen3 built by transformers (kept in float64 as the oracle) and a random drafter over 10
    of its tokens, both loaded in float32."""
    root = tmp_path_factory.mktemp("sampling")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                      initializer_range=0.3, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(root / "target")
    target = eagle3_jax.load_target(root / "target", dtype="float32", progress=False)
    spec = oracle.DraftSpec(hidden_size=H, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                            target_hidden_size=H, target_vocab_size=V, draft_vocab_size=VD)
    oracle.write_specforge(root / "drafter", spec, oracle.random_drafter_state(spec, 3))
    drafter = eagle3_jax.load_drafter(root / "drafter", target, dtype="float32")
    return model.double(), target, drafter


def oracle_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """transformers' warpers in generate's order, in float64, then softmax: [N, V] -> [N, V]."""
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def exact_first_three(model, settings) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] in float64, enumerated from the target's own next-token distributions."""
    def next_probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1]
        return oracle_probs(logits, *settings)

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(V)])
    p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def gate_p_value(tokens: np.ndarray, exact: np.ndarray) -> float:
    """Chi-square of the observed first three tokens [n, 3] against the exact distribution, outcomes merged
    (least likely first) until each bin expects >= 5. A sample of an impossible outcome gives 0."""
    observed = np.bincount(tokens @ np.array([V * V, V, 1]), minlength=V**3)
    expected = exact.ravel() * len(tokens)
    if observed[expected == 0].any():
        return 0.0
    bins_o, bins_e, acc_o, acc_e = [], [], 0, 0.0
    for i in np.argsort(expected):
        if expected[i] == 0:
            continue
        acc_o, acc_e = acc_o + observed[i], acc_e + expected[i]
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o, acc_e = 0, 0.0
    bins_o[-1] += acc_o
    bins_e[-1] += acc_e
    return float(stats.chisquare(bins_o, np.array(bins_e) * len(tokens) / np.sum(bins_e)).pvalue)


def sample_first_three(engine, settings_list, seed0: int) -> list[np.ndarray]:
    """N rows of PROMPT per settings, all in one generate call, each row with its own seed."""
    rows = [s for s in settings_list for _ in range(N)]
    results = engine.generate([PROMPT] * len(rows), 3, temperature=[s[0] for s in rows],
                              top_k=[s[1] for s in rows], top_p=[s[2] for s in rows],
                              seed=list(range(seed0, seed0 + len(rows))))
    tokens = np.array([r.token_ids for r in results])
    return [tokens[i * N : (i + 1) * N] for i in range(len(settings_list))]


# (temperature, top_k, top_p): plain, top-k, top-p, both, spread over the configurations below. The
# filters themselves are checked against transformers on many more settings in test_sampling.py.
PLAIN_07, TOPK_10, TOPP_13, BOTH_10 = (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (1.0, 8, 0.85)
# Settings with top_k run the candidate filter's build, the others the radix search's (sampling.filter_for):
# each proposal meets both.
CONFIGS = [  # (gamma, proposal, settings); gamma 2 lies between these and is left out for the suite's time
    (0, "argmax", [TOPK_10]),
    (1, "argmax", [PLAIN_07]), (3, "argmax", [TOPK_10]),
    (1, "sample", [TOPP_13]), (3, "sample", [BOTH_10]),
]


@pytest.fixture(scope="module")
def exact(tiny):
    model = tiny[0]
    return {s: exact_first_three(model, s) for s in (PLAIN_07, TOPK_10, TOPP_13, BOTH_10)}


def make_engine(tiny, gamma, proposal, pool=N, **kwargs):
    """Every sample in one batch (one chunk holds every prompt), unless `pool` is smaller."""
    _, target, drafter = tiny
    return eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens=max(gamma, 1), max_len=MAX_LEN,
                             proposal=proposal, rounds_per_call=1, max_batch=pool, prefill_chunk=len(PROMPT) * pool,
                             prefill_sequences=pool, **kwargs)


@pytest.mark.parametrize("gamma, proposal, settings", CONFIGS, ids=[f"{p}-g{g}" for g, p, _ in CONFIGS])
def test_first_three_tokens_follow_the_exact_distribution(tiny, exact, gamma, proposal, settings):
    # gamma 1, argmax: the samples pass through a pool of a quarter of them (slots refilled three times).
    pool = N // 4 if (gamma, proposal) == (1, "argmax") else N
    samples = sample_first_three(make_engine(tiny, gamma, proposal, pool), settings, seed0=1000 * gamma)
    for s, tokens in zip(settings, samples):
        assert gate_p_value(tokens, exact[s]) > 1e-4, s


def test_first_three_tokens_follow_the_exact_distribution_through_a_change_of_gamma(tiny, exact):
    """num_draft_tokens="auto" with costs that make gamma 2 cheapest up to the KV length after the first token and
    gamma 0 beyond it: the call that prefills the prompt gives the first token (its row joins the call's rounds
    after the round its chunk ran in, and there is one), the next call drafts 2, and a row that accepted no draft
    takes its third token from a plain step (a gamma-0 call holding its pair back from the drafter). A fifth of
    the samples, for the suite's time: the gate still rejects the "accept every draft" sampler of
    test_the_gate_rejects_wrong_samplers at p < 1e-12 in such a configuration."""
    _, target, drafter = tiny
    n = N // 5
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=2, max_len=MAX_LEN,
                               proposal="sample", rounds_per_call=1, max_batch=n, prefill_chunk=len(PROMPT) * n,
                               prefill_sequences=n,
                               round_costs=lambda batch, length: [3, 2, 1] if length < 4.5 else [1, 2, 3])
    results = engine.generate([PROMPT] * n, 3, temperature=PLAIN_07[0], seed=list(range(31, 31 + n)))
    assert {tuple(r.gammas) for r in results} == {(2,), (2, 0)}
    assert gate_p_value(np.array([r.token_ids for r in results]), exact[PLAIN_07]) > 1e-4


# Draft trees (N, D, K) and their settings: max_len 8 leaves slots for nodes 1 .. 4 after the 3-token prompt, so
# (6, 3, 2)'s nodes 5 and 6 are never judged (decoding/tree.usable). A fifth of the samples, for the suite's time:
# the gate rejects the wrong tree sampler below at p near 1e-107 with as many.
TREE_CONFIGS = [((4, 2, 2), PLAIN_07), ((6, 3, 2), TOPK_10), ((5, 2, 3), TOPP_13)]
TREE_N = N // 5


def make_tree_engine(tiny, shape, pool=TREE_N):
    _, target, drafter = tiny
    n, d, k = shape
    return eagle3_jax.Engine(target, drafter, num_draft_tokens=n, draft_depth=d, draft_top_k=k, max_len=MAX_LEN,
                             rounds_per_call=1, max_batch=pool, prefill_chunk=len(PROMPT) * pool,
                             prefill_sequences=pool)


@pytest.mark.parametrize("shape, settings", TREE_CONFIGS, ids=[f"tree-{n}-{d}-{k}" for (n, d, k), _ in TREE_CONFIGS])
def test_first_three_tokens_of_a_draft_tree_follow_the_exact_distribution(tiny, exact, shape, settings):
    """A tree's multi-draft rule (decoding/tree.py): siblings accepted by one uniform over their cumulative target
    probabilities, the next token drawn from p without them."""
    results = make_tree_engine(tiny, shape).generate([PROMPT] * TREE_N, 3, temperature=settings[0],
                                                     top_k=settings[1], top_p=settings[2],
                                                     seed=list(range(5000, 5000 + TREE_N)))
    assert gate_p_value(np.array([r.token_ids for r in results]), exact[settings]) > 1e-4
    accepted = np.bincount([r.accept_lengths[0] for r in results])
    assert len(accepted) >= 3 and accepted[:3].min() > TREE_N / 500  # paths of 0, 1 and 2 nodes: the rule is exercised


@pytest.fixture
def wrong(monkeypatch):
    """Swaps a function of sampling.py for a wrong one; the jitted rounds are retraced around the swap
    (prefill calls neither accept nor residual, so its compilations stay)."""
    def swap(name, fn):
        monkeypatch.setattr(sampling, name, fn)
        engine_lib.jit_rounds.clear_cache()
    yield swap
    engine_lib.jit_rounds.clear_cache()


@pytest.mark.parametrize("mistake, proposal", [("accept every draft", "argmax"), ("resample from p", "sample"),
                                             ("a tree drawing from p with its rejected siblings", "tree")])
def test_the_gate_rejects_wrong_samplers(tiny, exact, wrong, mistake, proposal):
    if mistake == "accept every draft":
        wrong("accept", lambda u, p_x, q_x: jnp.ones(u.shape, bool))
    else:  # the chain's residual, which a tree's final draw also takes: p itself, the rejected drafts' mass kept
        wrong("residual", lambda p, q: p)
    # No filter: every outcome is possible, so only the chi-square statistic itself can reject.
    if proposal == "tree":
        results = make_tree_engine(tiny, TREE_CONFIGS[0][0]).generate([PROMPT] * TREE_N, 3, temperature=PLAIN_07[0],
                                                                      seed=list(range(7, 7 + TREE_N)))
        tokens = np.array([r.token_ids for r in results])
    else:
        (tokens,) = sample_first_three(make_engine(tiny, 2, proposal), [PLAIN_07], seed0=7)
    assert exact[PLAIN_07].min() > 0 and gate_p_value(tokens, exact[PLAIN_07]) < 1e-6


# ----------------------------------------------------------------------------- rows, seeds, edges, settings

PROMPTS = [[3, 17, 5, 40, 22, 9, 1], [30, 2], [7, 7, 7, 21, 44, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
# Six rows, gamma 3, max_len 64, 4 rounds per call: the tests below share these programs (one compilation
# per build), so most of them use this batch.
SIX = PROMPTS + [[9, 8], [1, 2, 3, 4, 5], [44, 45, 46, 47]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """spec_worlds' random pair (draft vocabulary 32 of 48) and its permutation target with the pi2 drafter
    (first draft always right), in float32."""
    root = tmp_path_factory.mktemp("sampling_worlds")
    out = {}
    for kind, drafter_kind in (("random", "random"), ("permutation", "pi2")):
        _, target = worlds.save_target(kind, root / kind)
        out[kind] = target, worlds.save_drafter(drafter_kind, root / drafter_kind, target)[2]
    return out


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_greedy_rows_in_a_mixed_batch_equal_greedy_decoding(world, proposal):
    target, drafter = world["random"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, proposal=proposal)
    prompts = SIX
    greedy = engine.generate(prompts, 20)
    mixed = engine.generate(prompts, 20, temperature=[0.0, 1.0, 0.0, 0.8, 0.0, 1.3], top_k=[0, 5, 3, 0, 0, 10],
                            top_p=[1.0, 0.9, 0.5, 1.0, 1.0, 0.95], seed=[1, 2, 3, 4, 5, 6])
    for i in (0, 2, 4):
        assert mixed[i] == greedy[i]
    assert any(mixed[i].token_ids != greedy[i].token_ids for i in (1, 3, 5))


@pytest.mark.parametrize("gamma, proposal", [(0, "argmax"), (3, "sample")])
def test_seeds_fix_the_output_and_rows_are_independent(world, gamma, proposal):
    """Same seeds, same tokens, whatever the other rows and the rounds per call; other seeds, other
    tokens; seed None, fresh ones."""
    target, drafter = world["random"]

    def run(prompts, seeds, rounds_per_call=4, **kwargs):
        engine = eagle3_jax.Engine(target, drafter if gamma else None, num_draft_tokens=max(gamma, 1), max_len=64,
                                   proposal=proposal, rounds_per_call=rounds_per_call)  # as the tests below
        return [r.token_ids for r in engine.generate(prompts, 24, temperature=1.0, seed=seeds, **kwargs)]

    seeds = list(range(11, 17))
    first = run(SIX, seeds)
    assert run(SIX, seeds, rounds_per_call=1) == first
    order = [2, 0, 1, 5, 3, 4]
    assert run([SIX[i] for i in order], [seeds[i] for i in order]) == [first[i] for i in order]
    assert run([SIX[1]] * 6, 12)[3] == first[1]  # beside other rows, with a scalar seed: the same row
    assert run(SIX, seeds, top_k=[0] * 6, top_p=1.0) == first
    other = run(SIX, [s + 10 for s in seeds])
    assert all(a != b for a, b in zip(first, other))
    assert run(SIX, None) != run(SIX, None)


def test_stops_and_max_new_inside_accepted_spans_while_sampling(world):
    """A sampled row's draws depend on its seed and positions only, so cutting its output with a stop token
    or max_new_tokens leaves the tokens before the cut as they were. The permutation world at temperature 2
    samples, and pi2's first draft is often accepted: cuts fall inside accepted spans."""
    target, drafter = world["permutation"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, proposal="sample")
    settings = {"temperature": 2.0, "seed": 5}
    (full,) = engine.generate([PROMPTS[0]], 24, **settings)
    assert max(full.accept_lengths) >= 1 and full.token_ids != spec_off_greedy(target, [PROMPTS[0]], 24)[0]
    for cut in range(1, 10):
        stop = full.token_ids[cut]
        first = full.token_ids.index(stop)
        (result,) = engine.generate([PROMPTS[0]], 24, stop_token_ids=[stop], **settings)
        assert result.token_ids == full.token_ids[: first + 1] and result.finish_reason == "stop"
        (result,) = engine.generate([PROMPTS[0]], cut, **settings)
        assert result.token_ids == full.token_ids[:cut] and result.finish_reason == "length"


def spec_off_greedy(target, prompts, max_new, max_len=64):
    return [r.token_ids for r in eagle3_jax.Engine(target, max_len=max_len).generate(prompts, max_new)]


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_cache_edge_while_sampling(world, proposal):
    """Every start length within gamma + 2 of max_len, sampling through the rejection sampler: no error,
    every row filled to max_len. With top_k 1 sampling is deterministic (p and q one-hot at their argmax),
    so the output must also be plain greedy decoding's, accept lengths and all."""
    target, drafter = world["random"]
    gamma, max_len = 3, 64
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=gamma, max_len=max_len, proposal=proposal)
    rng = np.random.default_rng(gamma)
    # 6 prompts (lengths 59 .. 64): the batch of the mixed-batch test above, so its programs are reused.
    prompts = [rng.integers(0, worlds.V, size=L).tolist() for L in range(max_len - gamma - 2, max_len)]
    greedy = engine.generate(prompts, 50)
    top1 = engine.generate(prompts, 50, temperature=1.0, top_k=1, seed=list(range(len(prompts))))
    sampled = engine.generate(prompts, 50, temperature=1.0, seed=list(range(len(prompts))))
    for p, g, t, s in zip(prompts, greedy, top1, sampled):
        assert t == g
        assert len(p) + len(s.token_ids) == max_len and s.finish_reason == "length"
        assert all(0 <= a <= gamma for a in s.accept_lengths)


BAD = [
    ({"temperature": -0.5}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05, got -0.5"),
    ({"temperature": 1e-38}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05, got 1e-38"),
    ({"temperature": float("nan")}, "temperature must be 0"),
    ({"temperature": "hot"}, "temperature must be 0"),
    ({"temperature": [1.0, 1.0]}, "temperature has 2 values for 6 prompts"),
    ({"top_k": -1}, r"top_k must be an int >= 0 \(0: no top-k filter\), got -1"),
    ({"top_k": 2.5}, "top_k must be an int"),
    ({"top_k": True}, "top_k must be an int"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_p": [0.9] * 4}, "top_p has 4 values for 6 prompts"),
    ({"seed": 1.5}, r"seed must be None or an int in \[0, 2\*\*64\), got 1.5"),
    ({"seed": -1}, "seed must be None or an int"),
    ({"seed": 2**64}, "seed must be None or an int"),
    ({"seed": "7"}, "seed must be None or an int"),
    ({"seed": [1, 2]}, "seed has 2 values for 6 prompts"),
]


@pytest.mark.parametrize("settings, message", BAD, ids=[str(s) for s, _ in BAD])
def test_bad_settings_raise_before_device_work(world, settings, message):
    target, drafter = world["random"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64)
    engine.generate(SIX, 2, temperature=1.0)
    with count_compilations() as compiles:
        for call in (engine.generate, engine.stream):
            with pytest.raises(ValueError, match=message):
                call(SIX, 4, **{"temperature": 1.0, **settings})
    assert engine.device_events == [] and compiles.count == 0


def test_bad_proposal_is_refused(world):
    target, drafter = world["random"]
    with pytest.raises(ValueError, match=r"proposal must be one of \('argmax', 'sample'\), got 'greedy'"):
        eagle3_jax.Engine(target, drafter, max_len=64, proposal="greedy")


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_new_settings_never_recompile_and_one_transfer_per_call(world, proposal, monkeypatch):
    """Settings are data: new temperatures, top_k, top_p and seeds (None among them) compile nothing, and each call
    is one transfer of its tokens. The seeds drawn for seed None come from a counter here: a row's rounds decide
    when it finishes, and so the row buckets of the calls after (the transfers' shapes) must not change per run."""
    seeds = itertools.count(1000)
    monkeypatch.setattr(request_lib.secrets, "randbits", lambda bits: next(seeds))
    target, drafter = world["random"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, proposal=proposal,
                               prefill_sequences=6)  # one chunk of the six prompts
    engine.generate(SIX, 16, temperature=0.7, seed=0)  # compiles the radix build (top_k 0)
    engine.generate(SIX, 16, temperature=0.7, top_k=20, seed=0)  # and the candidate filter's
    requests = [
        {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "seed": 3},
        {"temperature": [0.0, 0.6, 2.0] * 2, "top_k": [0, 20, 1] * 2, "top_p": [1.0, 0.95, 0.3] * 2,
         "seed": [1, None, 2**64 - 1] * 2},
        {"temperature": 0.6, "top_k": 10**12, "top_p": 1.0},
    ]
    with no_implicit_transfers(), count_compilations() as compiles:
        for settings in requests:
            results = engine.generate(SIX, 16, **settings)
            transfers = [shape for kind, shape in engine.device_events if kind == "transfer"]
            # the first call's first round carries the six prompts, whose rows run its other three rounds
            calls = 1 + -(-(max(len(r.accept_lengths) for r in results) - 3) // 4)
            assert transfers == [(4, 8 + 6, 2 * 3 + 6)] + [(4, 8, 2 * 3 + 6)] * (calls - 1)
            assert [kind for kind, _ in engine.device_events].count("call") == calls
    assert compiles.count == 0


def test_each_request_takes_the_filter_its_settings_need(world):
    """The candidate filter's build when every sampled row's top_k is in [1, 64] (a greedy row's top_k 0
    beside them too), else the radix search's, as top_k 0 beside top_k 20 needs; the candidate build's round
    holds no conditional."""
    target, drafter = world["random"]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=64, proposal="sample")

    def build(**settings):
        return engine.build_for(engine.request(SIX[:3], 4, **settings))

    assert not build().sampling and build(temperature=0.7).filter == "radix"
    assert build(temperature=0.7, top_k=[0, 20, 20]).filter == "radix"
    assert build(temperature=0.7, top_k=[20, 64, 1]).filter == "candidates"
    assert build(temperature=[0.0, 0.7, 0.7], top_k=[0, 20, 20]).filter == "candidates"
    assert build(temperature=0.7, top_k=[20, 65, 20]).filter == "radix"
    spec = build(temperature=0.6, top_k=20, top_p=0.95)
    params = (target.params, drafter.params)
    pages = jax.eval_shape(engine.page_pool._make_arrays)
    rows = jax.eval_shape(functools.partial(spec_round.new_rows, spec, 3, engine.table_width, 4, jnp.float32))
    state = spec_round.with_pages(rows, pages)
    jaxpr = str(jax.make_jaxpr(functools.partial(spec_round.spec_rounds, spec=spec, num_rounds=2))(*params, state))
    assert "top_k[" in jaxpr and not re.search(r"\bcond\[", jaxpr)
