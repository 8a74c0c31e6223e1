"""The server bench (eagle3_jax_bench/serve.py) at tiny shapes on the CPU: every level runs through HTTP with
outputs the planted world's, usage acceptance for spec on, and the 1-user comparison with Engine.generate
filled in (speed is the GPU's to measure)."""

import json

from eagle3_jax.decoding import round_costs
from eagle3_jax_bench import serve


def test_serve_bench_dry_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(round_costs, "default_folder", lambda: tmp_path / "costs")
    monkeypatch.setattr(round_costs, "STALE_RATIO", 1e6)  # a shared CPU's timings wander: no re-measuring here
    assert serve.main(["--out", str(tmp_path), "--dry-run", "--users", "1", "--requests", "2"]) == 0
    rows = json.loads((tmp_path / "serve_bench.json").read_text())["serve"]
    assert [(r["mode"], r["users"]) for r in rows] == [("auto", 1), ("off", 1)]
    for r in rows:
        assert r["outputs_follow_f"] and r["requests"] == 2 and r["tokens"] >= 4
        assert r["tokens_per_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["one_user_vs_generate"] > 0 and len(r["request_speeds"]) == 2
    assert rows[0]["acceptance"] > 0 and rows[1]["acceptance"] is None
    assert "vs gen" in capsys.readouterr().out
