"""The server bench (eagle3_jax_bench/serve.py) at tiny shapes on the CPU: every level runs through HTTP with
outputs the planted world's, usage acceptance for spec on, and the 1-user comparison with Engine.generate
filled in (speed is the GPU's to measure)."""

import json

import pytest

import eagle3_jax
from eagle3_jax_bench import serve


def test_serve_bench_dry_run(tmp_path, monkeypatch, capsys):
    # Drafting costs little (a shared CPU's measured costs wander): "auto" speculates, so acceptance is reported.
    monkeypatch.setattr(eagle3_jax.Engine, "round_costs", lambda self, batch, length, template=None,
                        mixed=False: [1.0, 1.01, 1.02, 1.03])
    assert serve.main(["--out", str(tmp_path), "--dry-run", "--users", "1", "--requests", "2"]) == 0
    rows = json.loads((tmp_path / "serve_bench.json").read_text())["serve"]
    assert [(r["mode"], r["users"]) for r in rows] == [("auto", 1), ("off", 1)]  # levels in order, modes beside
    for r in rows:
        assert r["outputs_follow_f"] and r["requests"] == 2 and r["tokens"] >= 4
        assert r["tokens_per_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["one_user_vs_generate"] > 0 and len(r["request_speeds"]) == 2
    assert rows[0]["acceptance"] > 0 and rows[1]["acceptance"] is None
    assert "vs gen" in capsys.readouterr().out


def test_serve_bench_with_logprobs_dry_run(tmp_path, monkeypatch, capsys):
    """--logprobs K: every request asks for them (each completion token's comes back), and so does the
    Engine.generate the 1-user level is compared with."""
    monkeypatch.setattr(eagle3_jax.Engine, "round_costs", lambda self, batch, length, template=None,
                        mixed=False: [1.0, 1.01, 1.02, 1.03])
    with pytest.raises(SystemExit):
        serve.main(["--out", str(tmp_path), "--dry-run", "--logprobs", "21"])
    assert "--logprobs must be in [0, 20], got 21" in capsys.readouterr().err
    assert serve.main(["--out", str(tmp_path), "--dry-run", "--users", "1", "--requests", "2", "--modes", "auto",
                       "--logprobs", "5"]) == 0
    (row,) = json.loads((tmp_path / "serve_bench.json").read_text())["serve"]
    assert row["logprobs"] == 5 and row["outputs_follow_f"] and row["scored_tokens"] == row["tokens"] >= 4
    assert row["one_user_vs_generate"] > 0
