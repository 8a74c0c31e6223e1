"""num_draft_tokens="auto": the policy's arithmetic (gamma_policy.py), the cost table's measure, cache, reload and
staleness (round_costs.py), and the engine choosing gamma per call: lossless against spec-off through every
switch, the drafter consistent after gamma-0 calls, no recompilation when gamma changes, bad arguments."""

import json

import jax
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax.decoding import gamma_policy as policy
from eagle3_jax.decoding import round_costs, spec_round
from eagle3_jax_bench.profile import count_compilations

import spec_worlds as worlds

# ----------------------------------------------------------------------------- the policy


def rounds_of(gamma, accepted, emitted, done=None, shadow=None):
    """One round's outputs as the policy reads them."""
    n = len(accepted)
    return (gamma, np.array(accepted), np.array(emitted), np.zeros(n, bool) if done is None else np.array(done),
            np.zeros((n, 2), int) if shadow is None else np.array(shadow))


def test_round_counts_censor_cut_rounds_and_read_the_shadow():
    # gamma 3: row 0 rejected position 2; row 1 accepted all; row 2 cut after 1 draft (emitted == accepted);
    # row 3 finished in the round (a stop at its correction token): censored after its drafts; row 4 frozen.
    hits, tries = policy.round_counts(3, 4, *rounds_of(3, [1, 3, 1, 0, 0], [2, 4, 1, 1, 0],
                                                       done=[0, 0, 1, 1, 1])[1:])
    assert hits.tolist() == [3, 1, 1, 0] and tries.tolist() == [3, 2, 1, 0]
    # A flushing gamma-0 call's last round: per row, (held pairs whose token was the would-be draft, pairs).
    hits, tries = policy.round_counts(0, 2, *rounds_of(0, [0, 0, 0], [1, 1, 0], shadow=[[3, 8], [0, 8], [0, 0]])[1:])
    assert hits.tolist() == [3, 0] and tries.tolist() == [16, 0]


def observed(max_gamma, rounds):
    stats = policy.Acceptance.fresh(max_gamma)
    for r in rounds:
        stats = policy.observe(stats, *r)
    return stats


def test_a_drafter_never_right_goes_to_gamma_0_and_a_perfect_one_to_the_largest():
    costs = [1.0, 1.05, 1.1, 1.15]  # gamma g costs 5% more a draft: an 8B target at batch 1
    assert policy.choose(policy.rates(policy.Acceptance.fresh(3)), costs) == 3  # the prior tries speculation
    never = observed(3, [rounds_of(3, [0], [1])] * 3 + [rounds_of(0, [0], [1], shadow=[[0, 1]])] * 40)
    assert policy.rates(never)[0] < 0.02 and policy.choose(policy.rates(never), costs) == 0
    perfect = observed(3, [rounds_of(3, [3] * 8, [4] * 8)] * 3)
    assert policy.rates(perfect).min() > 0.95 and policy.choose(policy.rates(perfect), costs) == 3


def test_a_cheap_gamma_wins_and_unseen_positions_take_the_last_seen_rate():
    assert policy.choose(np.full(3, 0.3), [1.0, 1.0, 1.0, 0.5]) == 3
    stats = observed(3, [rounds_of(1, [1, 1, 0], [2, 2, 1])] * 5)  # positions 2, 3 never drafted
    alpha = policy.rates(stats)
    assert alpha[0] == alpha[1] == alpha[2] == pytest.approx(2 / 3, abs=0.03)
    assert policy.expected_tokens(np.array([0.5, 0.5])).tolist() == [1.0, 1.5, 1.75]
    with pytest.raises(ValueError, match="4 positive costs"):
        policy.choose(np.full(3, 0.5), [1.0, 0.0, 1.0, 1.0])


def test_rounds_that_hold_their_pairs_fade_nothing_and_a_flush_fades_what_it_covers():
    stats = observed(1, [rounds_of(1, [0], [1])] * 4)
    held = observed(1, [rounds_of(1, [0], [1])] * 4 + [rounds_of(0, [0], [1])] * 12)
    assert held.reached.tolist() == stats.reached.tolist() and held.accepted.tolist() == stats.accepted.tolist()
    flushed = policy.observe(stats, *rounds_of(0, [0], [1], shadow=[[16, 16]]))
    assert flushed.reached[0] == pytest.approx(policy.DECAY**16 * stats.reached[0] + 16)
    assert policy.rates(flushed)[0] > 0.8  # one flush shows a drafter turned good


def test_the_shadow_leaves_gamma_0_when_the_drafter_turns_good():
    costs = [1.0, 1.3, 1.6]
    stats = observed(2, [rounds_of(0, [0], [1], shadow=[[0, 1]])] * 30)
    assert policy.choose(policy.rates(stats), costs) == 0
    for _ in range(20):
        stats = policy.observe(stats, *rounds_of(0, [0], [1], shadow=[[1, 1]]))
    assert policy.choose(policy.rates(stats), costs) > 0


def test_gamma_0_holds_its_pairs_and_flushes_every_few_calls_and_before_drafting():
    """Plain gamma-0 calls hold their pairs, flushing every FLUSH_CALLS; one that carries prompt tokens always
    flushes (its chunks read the drafter anyway); the held pairs go to the drafter before a call drafts; costs are
    asked at the call's rows and whether it carries prompt tokens."""
    costs, asked = {"now": [1.0, 2.0]}, []
    auto = policy.Auto(1, lambda length, rows, mixed: asked.append((rows, mixed)) or costs["now"])
    auto.stats = observed(1, [rounds_of(1, [0], [1])] * 10)  # a drafter never right: gamma 0
    calls = []
    for _ in range(2 * policy.FLUSH_CALLS + 1):
        calls.append(auto.choose(0.0, 4, False))
        auto.dispatched(calls[-1])
    assert [c.flush for c in calls] == ([False] * (policy.FLUSH_CALLS - 1) + [True]) * 2 + [False]
    assert {c.gamma for c in calls} == {0} and set(asked) == {(4, False)}
    assert auto.choose(0.0, 2, True) == policy.Call(0, flush=True) and asked[-1] == (2, True)
    costs["now"] = [2.0, 1.0]  # drafting is now cheaper: first the held pairs go to the drafter
    assert auto.choose(0.0, 4, False) == policy.Call(0, flush=True)
    auto.dispatched(policy.Call(0, flush=True))
    assert auto.choose(0.0, 4, False) == policy.Call(1)
    assert policy.Fixed(3).choose(0.0, 4, False) == policy.Call(3)


# ----------------------------------------------------------------------------- the cost table


class FakeDevice:
    """time_call: seconds (1 + gamma + length / 100) times the key's rows, times `scale`, counting its calls."""

    def __init__(self, scale=1.0):
        self.scale, self.calls = scale, 0

    def __call__(self, key, length, gamma):
        self.calls += 1
        return self.scale * int(key.split("+")[0]) * (1 + gamma + length / 100)


def test_costs_are_measured_once_cached_reloaded_and_remeasured_when_stale(tmp_path):
    lengths = round_costs.grid_lengths(128, round_costs.margin(4, 2))
    assert lengths == [8, 64, 115] and round_costs.margin(4, 2) == 13  # a call of 4 rounds of 3 tokens, and 1
    device = FakeDevice()
    costs = round_costs.RoundCosts("k", tmp_path, lengths, 3)
    assert costs.seconds("2", 36.0, device) == pytest.approx([2 * (1 + g + 0.36) for g in range(3)])
    assert device.calls == 9 and costs.measured == ["2"]
    costs.seconds("2", 50.0, device)
    assert device.calls == 9  # in memory
    costs.seconds("2+chunks", 50.0, device)
    assert device.calls == 18 and costs.measured == ["2", "2+chunks"]  # each key its own table
    again = round_costs.RoundCosts("k", tmp_path, lengths, 3)
    again.seconds("2", 10.0, device)
    assert device.calls == 19 and again.measured == []  # loaded, one spot check
    slower = FakeDevice(scale=1.5)
    stale = round_costs.RoundCosts("k", tmp_path, lengths, 3)
    assert stale.seconds("2", 8.0, slower)[0] == pytest.approx(1.5 * 2 * 1.08)
    assert slower.calls == 10 and stale.measured == ["2"]  # the spot check failed: all 9 again
    (tmp_path / "k.json").write_text("{not json")
    broken = round_costs.RoundCosts("k", tmp_path, lengths, 3)
    broken.seconds("1", 8.0, device)
    assert broken.measured == ["1"] and list(json.loads((tmp_path / "k.json").read_text())["seconds"]) == ["1"]
    (tmp_path / "file").write_text("")
    unwritable = round_costs.RoundCosts("k", tmp_path / "file", lengths, 3)  # its folder is a file
    assert unwritable.seconds("1", 8.0, device)[0] == pytest.approx(1.08) and unwritable.measured == ["1"]


def test_the_cache_lives_beside_the_compilation_cache_and_its_key_sees_the_configuration(tmp_path):
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
        assert round_costs.default_folder() == tmp_path / "round_costs"
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert round_costs.cache_key({"a": 1}) == round_costs.cache_key({"a": 1}) != round_costs.cache_key({"a": 2})


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    out = {"t:permutation": worlds.save_target("permutation", root / "permutation")[1],
           "t:random": worlds.save_target("random", root / "random")[1]}
    out["d:arc"] = worlds.save_drafter("arc", root / "arc", out["t:permutation"])[2]
    # pi1 beside a random target: a drafter about as good as chance, of the arc drafter's shapes, so that
    # every engine here shares one compilation per gamma (max_len 128, 2 rounds a call, one slot).
    out["d:unrelated"] = worlds.save_drafter("pi1", root / "unrelated", out["t:random"])[2]
    return out


def auto_engine(target, drafter, **kwargs):
    return eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=1, rounds_per_call=2,
                             max_batch=1, **{"max_len": 128, **kwargs})


def fixed_costs(*seconds):
    return lambda batch, length: list(seconds)


def rounds_with_starts(prompt, result):
    """(the sequence so far's newest-but-one token x_{n-1}, gamma, accepted, cut) per round."""
    sequence, out = list(prompt) + result.token_ids[:1], []
    at = 1
    for gamma, a in zip(result.gammas, result.accept_lengths):
        emitted = min(a + 1, len(result.token_ids) - at)
        out.append((sequence[-2], gamma, a, emitted < a + 1))
        sequence += result.token_ids[at : at + emitted]
        at += emitted
    return out


def test_auto_follows_a_drafter_good_on_part_of_the_text_and_stays_lossless(world):
    """The arc drafter is right (d_1 only) where x_{n-1} is on ARC: gamma 1 pays there at these costs, gamma
    0 elsewhere. The text walks the cycle twice, so gamma goes 1 -> 0 -> 1 -> 0; every gamma-1 round accepts
    exactly when the drafter is right, which needs its cache rebuilt through the gamma-0 calls."""
    target, drafter = world["t:permutation"], world["d:arc"]
    prompt = [int(worlds.ORDER[-1]), int(worlds.ORDER[0])]
    engine = auto_engine(target, drafter, round_costs=fixed_costs(1.0, 1.5))
    (got,) = engine.generate([prompt], 100)
    # Greedy decoding of this target follows the cycle (spec_worlds; test_spec_engine checks spec-off does).
    assert got.token_ids == [int(x) for x in worlds.ORDER[np.arange(1, 101) % worlds.V]]
    assert len(got.gammas) == len(got.accept_lengths)
    spans = "".join("0" if g == 0 else "s" for g in got.gammas)  # s: a round that drafted
    assert "s0" in spans and "0s" in spans[spans.index("s0"):] and "s0" in spans[spans.index("0s"):], got.gammas
    for previous, gamma, accepted, cut in rounds_with_starts(prompt, got):
        if gamma and not cut:
            assert accepted == (previous in worlds.ARC), (previous, gamma, accepted)
    assert len(got.gammas) < len(got.token_ids) - 10  # fewer target steps than tokens
    # The second call waits for the first's rounds: chosen ahead, it would be the prior's choice again.
    assert [kind for kind, _ in engine.device_events][:5] == ["allocate", "call", "transfer", "call", "call"]


def test_auto_through_a_pool_of_three_holds_and_flushes_rows_of_different_ages(world):
    """Seven prompts through 3 slots: rows finish and refill while gamma-0 calls hold pairs, so a flush catches
    up rows that held different numbers of them. Every row follows the cycle, and every drafting round not cut
    short accepts exactly when the arc drafter is right: its cache stayed consistent for every slot."""
    target, drafter = world["t:permutation"], world["d:arc"]
    order = [int(x) for x in worlds.ORDER]
    starts, budgets = [0, 7, 20, 31, 3, 40, 15], [30, 45, 61, 25, 50, 40, 33]
    prompts = [[order[(s - 1) % worlds.V], order[s]] for s in starts]
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens="auto", max_draft_tokens=3, max_len=128,
                               rounds_per_call=2, max_batch=3, round_costs=fixed_costs(1.0, 1.4, 1.7, 2.0))
    results = engine.generate(prompts, budgets)
    gammas = []
    for prompt, start, budget, got in zip(prompts, starts, budgets, results):
        assert got.token_ids == [order[(start + i) % worlds.V] for i in range(1, budget + 1)]
        gammas += got.gammas
        for previous, gamma, accepted, cut in rounds_with_starts(prompt, got):
            if gamma and not cut:
                assert (accepted >= 1) == (previous in worlds.ARC), (start, previous, gamma, accepted)
    assert gammas.count(0) > 8 and len(set(gammas)) > 1, gammas  # gamma 0 held and flushed, and it drafted


def test_auto_on_a_random_target_is_lossless_compiles_every_gamma_once_and_never_again(world):
    """Three prompts through one slot: the policy's evidence carries from one prompt to the next. Engine.compile
    compiles the one bucket's calls of rounds, each once: without prompt tokens gamma 0 (holding its pairs, and
    flushing) and 1, with them gamma 0 (flushing) and 1; and the release of stopped rows: 6 programs (max_len 127:
    a configuration of this test's own, so that each compiles here)."""
    target, drafter = world["t:random"], world["d:unrelated"]
    prompts = [[3, 17, 5, 40], [30, 2], [7, 7, 7, 21, 44, 1]]
    expected = eagle3_jax.Engine(target, max_len=128, max_batch=1).generate(prompts, 24)
    engine = auto_engine(target, drafter, round_costs=fixed_costs(1.0, 1.05), max_len=127)
    assert engine.gammas == (0, 1)
    with count_compilations(spec_round.spec_rounds.__name__) as rounds_compiled:
        assert engine.compile() == 6
    assert rounds_compiled.count == 5
    with count_compilations() as compiles:
        got = engine.generate(prompts, 24)
        shorter = engine.generate(prompts, 8)  # a second request, other budgets: nothing new to compile
    assert compiles.count == 0 and [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [s.token_ids for s in shorter] == [e.token_ids[:8] for e in expected]
    gammas = [g for r in got for g in r.gammas]
    assert gammas[0] == 1 and gammas.count(0) > len(gammas) // 2  # tried, then a plain step
    assert all(0 <= a <= g for r in got for a, g in zip(r.accept_lengths, r.gammas))


def test_auto_measures_its_costs_on_first_use_and_reloads_them(world, tmp_path, monkeypatch):
    monkeypatch.setattr(round_costs, "default_folder", lambda: tmp_path)
    # The stale path is FakeDevice's to show; a shared CPU's timings of millisecond calls wander too far.
    monkeypatch.setattr(round_costs, "STALE_RATIO", 1e6)
    target, drafter = world["t:random"], world["d:unrelated"]
    engine = auto_engine(target, drafter)
    (first,) = engine.generate([[3, 17, 5, 40]], 6)
    (table,) = tmp_path.glob("*.json")
    stored = json.loads(table.read_text())
    # the one bucket's calls without prompt tokens and with them (the first call carries the prompt)
    assert sorted(stored["seconds"]) == ["1", "1+chunks"] and np.array(stored["seconds"]["1"]).shape == (3, 2)
    again = auto_engine(target, drafter)
    assert again.generate([[3, 17, 5, 40]], 6)[0].token_ids == first.token_ids
    assert again._costs[False].measured == []  # loaded


@pytest.mark.parametrize("kwargs, message", [
    ({"num_draft_tokens": "auto", "drafter": None}, "needs a drafter"),
    ({"num_draft_tokens": "often"}, "an int or 'auto'"),
    ({"num_draft_tokens": "auto", "max_draft_tokens": 0}, r"max_draft_tokens must be None or an int in \[1, 16\]"),
    ({"num_draft_tokens": "auto", "max_draft_tokens": 17}, r"in \[1, 16\], got 17"),
    ({"num_draft_tokens": "auto", "max_draft_tokens": True}, "got True"),
    ({"num_draft_tokens": "auto", "max_draft_tokens": 2.0}, "got 2.0"),
    ({"num_draft_tokens": 3, "max_draft_tokens": 3}, "max_draft_tokens is for num_draft_tokens='auto'"),
])
def test_bad_auto_arguments_are_refused(world, kwargs, message):
    args = {"drafter": world["d:unrelated"], **kwargs}
    with pytest.raises(ValueError, match=message):
        eagle3_jax.Engine(world["t:random"], max_len=64, **args)
