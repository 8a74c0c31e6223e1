"""The planted-acceptance world (eagle3_jax_bench/planted_world.py) and its end-to-end bench (planted.py) at tiny
shapes on the CPU: the engine's accept lengths are those the world's simulation replays, the simulation's tau
follows the formula, and the bench's JSON has its rows (times are not asserted: speed is measured on the GPU)."""

import json

import numpy as np
import pytest

from eagle3_jax_bench import bench, planted, planted_world, presets


def test_simulated_tau_follows_the_formula():
    """At Qwen3-8B's universe (4,096 tokens), 32 prompts of 256 new tokens: the simulated tau is the formula's
    within 4% at every gamma; a solves the formula; a = 0 and 1 give 1 and gamma + 1."""
    world = planted_world.make_world(*presets.pair("qwen3-8b"))
    assert world.size == 4096 and sorted(world.universe) == list(world.universe)
    assert len({int(world.successor[i]) for i in range(world.size)}) == world.size  # a permutation ...
    i, steps = 0, 0
    while True:
        i, steps = world.successor[i], steps + 1
        if i == 0:
            break
    assert steps == world.size  # ... and one cycle
    prompts = world.prompts(32, 4, seed=1)
    for tau in (1.5, 2.5, 3.5):
        a = planted_world.solve_acceptance(tau, 4)
        assert planted_world.expected_tau(a, 4) == pytest.approx(tau, abs=1e-9)
        assert abs(np.mean(world.drafter_successor(a) == world.successor) - a) <= 1 / world.size
        for gamma in (1, 2, 4):
            accepts = planted_world.simulate(world, a, prompts, 257, gamma)
            simulated = np.mean([x + 1 for row in accepts for x in row])
            assert simulated == pytest.approx(planted_world.expected_tau(a, gamma), rel=0.04), (tau, gamma)
    assert planted_world.expected_tau(0.0, 4) == 1.0 and planted_world.expected_tau(1.0, 4) == 5.0


def test_rows_in_lockstep_accept_alike():
    """With the agreement pattern repeating every 128 positions and the prompts ending at multiples of it, 32 rows
    of distinct tokens accept alike, near the formula's tau (one period of 128 positions is a small sample)."""
    world = planted_world.make_world(*presets.pair("qwen3-8b"), period=128)
    prompts = world.prompts(32, 4, seed=1)
    assert len({p[-1] for p in prompts}) == 32
    for tau in (1.5, 2.5, 3.5):
        a = planted_world.solve_acceptance(tau, 4)
        assert np.mean(world.drafter_successor(a) == world.successor) == round(a * 128) / 128
        for gamma in (1, 4):
            accepts = planted_world.simulate(world, a, prompts, 257, gamma)
            assert all(row == accepts[0] for row in accepts)
            simulated = np.mean([x + 1 for x in accepts[0]])
            assert simulated == pytest.approx(planted_world.expected_tau(a, gamma), rel=0.08), (tau, gamma)


def test_world_refuses_what_it_cannot_plant():
    cfg, dcfg = presets.pair("tiny")
    with pytest.raises(ValueError, match=r"universe size must be in \[2, 64\] for these shapes, got 65"):
        planted_world.make_world(cfg, dcfg, size=65)
    with pytest.raises(ValueError, match="the agreement period must divide the universe's size 64, got 48"):
        planted_world.make_world(cfg, dcfg, period=48)
    with pytest.raises(ValueError, match="ties it to the embedding"):
        planted_world.make_world(*presets.pair("qwen3-1.7b"))
    with pytest.raises(ValueError, match=r"acceptance a must be in \[0, 1\], got 1.5"):
        planted_world.make_world(cfg, dcfg).drafter_successor(1.5)
    with pytest.raises(ValueError, match=r"tau must be in \[1, gamma \+ 1 = 3\]"):
        planted_world.solve_acceptance(3.5, 2)


def test_planted_bench_dry_run(tmp_path, monkeypatch):
    """The bench at tiny shapes, float32, whose every run is checked against the world: the tokens are the target's
    f-chain and the accept lengths those `simulate` replays, for worlds of tau 1 (a = 0: no draft accepted), 1.5
    and 2 (a = 1: every draft, 1 + 12 x 2 new tokens filling whole rounds) at gamma 1, and under "auto" along
    the gammas its rounds ran. Nothing compiles in the timed generates or the round timing; the engines run 2
    rounds per call as asked; the best gamma per tau; and `bench --planted` runs it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # auto's round costs: measured here, kept here
    new = 25
    assert planted.main(["--out", str(tmp_path), "--model", "tiny", "--batches", "2", "--taus", "1", "1.5", "2",
                         "--gammas", "0", "1", "--prompt-len", "12", "--new-tokens", str(new), "--reps", "1",
                         "--inner", "1", "--rounds-per-call", "2", "--auto"]) == 0
    results = json.loads((tmp_path / "planted_bench.json").read_text())
    rows, auto = results["planted"], results["auto"]
    assert [(r["gamma"], r["tau_target"]) for r in rows] == [(0, None), (1, 1.0), (1, 1.5), (1, 2.0)]
    assert [(r["gamma"], r["tau_target"]) for r in auto] == [("auto", 1.0), ("auto", 1.5), ("auto", 2.0)]
    for r in rows + auto:
        assert r["accepts_match_simulation"] and r["tokens_follow_f"] and planted.holds(r), r
        assert r["compilations"] == 0 and r["tokens"] == 2 * new and r["tokens_per_s"] > 0, r
        assert 2 * r["calls"] >= r["rounds_per_row_max"] == r["rounds_per_row_mean"]  # lockstep
    for r in rows:
        # The decode figures subtract a separately timed prefill: None when noise makes that difference <= 0.
        assert r["round_compilations"] == 0 and r["ratio"] > 0 and (r["ratio_decode"] is None or r["ratio_decode"] > 0)
        assert r["device_rounds"] == 2 * r["calls"]
    assert [r["tau"] for r in (rows[0], rows[1], rows[3])] == [1.0, 1.0, 2.0]
    assert rows[0]["rounds_per_row_max"] == new - 1 and rows[3]["rounds_per_row_max"] == 12
    assert 1.0 < rows[2]["tau"] < 2.0 and all("speedup_projected" in r for r in rows[1:])
    assert rows[2]["tau_expected"] == pytest.approx(planted_world.expected_tau(rows[2]["a"], 1))
    assert results["world"]["rows"] == "lockstep" and results["world"]["period"] == 32
    assert results["world"]["acceptance"]["1.5"] == pytest.approx(planted_world.solve_acceptance(1.5, 1))
    assert [(b["batch"], b["tau_target"]) for b in results["best"]] == [(2, 1.0), (2, 1.5), (2, 2.0)]
    assert all(b["best_gamma"] in (0, 1) for b in results["best"])
    for r in auto:
        assert sum(r["rounds_by_gamma"].values()) == 2 * r["rounds_per_row_mean"] and r["best_fixed_gamma"] in (0, 1)
    text = planted.summary(results)
    assert "best fixed gamma, batch 2, tau 2.0" in text and "auto, batch 2, tau 2.0" in text
    assert bench.main(["--tiny", "--planted", "--out", str(tmp_path / "bench"), "--budget-s", "0"]) == 0
    skipped = json.loads((tmp_path / "bench" / "planted_bench.json").read_text())["skipped"]
    assert skipped[0] == "planted b1 g0" and len(skipped) == 2 * 5


@pytest.mark.parametrize("argv, message", [
    (["--taus", "3.5", "--gammas", "0", "2"], r"--taus must be in [1, 3] (the largest gamma + 1), got [3.5]"),
    (["--gammas", "0"], "--gammas must be >= 0 with one >= 1, got [0]"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2, got 1"),
    (["--batches", "0"], "--batches must be >= 1, got 0"),
    (["--rounds-per-call", "0"], "--rounds-per-call must be >= 1, got 0"),
])
def test_planted_bench_refuses_bad_flags(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        planted.main(["--out", str(tmp_path), "--model", "tiny"] + argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
