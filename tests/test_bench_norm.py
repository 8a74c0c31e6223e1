"""eagle3_jax_bench/norm.py in its dry-run mode (tiny shapes on the CPU, the kernels interpreted): every
implementation is measured both ways, agrees with XLA, and the JSON holds the rows the table shows."""

import json

import pytest

from eagle3_jax_bench import norm


def test_norm_bench_dry_run(tmp_path, capsys):
    assert norm.main(["--out", str(tmp_path), "--dry-run", "--budget-s", "900"]) == 0  # a busy CPU skips nothing
    results = json.loads((tmp_path / "norm.json").read_text())
    assert results["skipped"] == []
    assert results["ceilings"]["copy_tbps"] > 0
    for section in ("call", "chain"):
        assert [(r["impl"], r["rows"]) for r in results[section]] == [(impl, 3) for impl in norm.IMPLS]
        for r in results[section]:
            assert r["sum_max_abs_diff"] == 0 and r["norm_rel_diff"] < 1e-2, r
    for r in results["chain"]:
        assert r["calls"] == 2 and r["time_ms"] > 0 and r["floor_ms"] > 0
        assert r["bytes_read"] == norm.call_bytes(3, 256, "bfloat16") == (4 * 3 * 256 + 256) * 2
    table = capsys.readouterr().out
    assert all(impl in table for impl in norm.IMPLS)


def test_norm_bench_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="'cudnn'"):
        norm.norm_fn("cudnn", interpret=True)
