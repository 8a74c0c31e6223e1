"""eagle3_jax_bench/attention.py in its dry-run mode (tiny shapes, float32, interpret mode): every
section runs and each kernel result it reports matches the reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_attention_bench_dry_run(tmp_path):
    """Every section, with the sweep's shapes and tunings taken from the environment."""
    tunings = [{"block_k": 16, "num_splits": 2}, {"block_k": 32}]
    env = {**os.environ, "BENCH_DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(REPO),
           "SWEEP_SHAPES": "[[2, 40, 4]]", "SWEEP_TUNINGS": json.dumps(tunings)}
    subprocess.run([sys.executable, "-m", "eagle3_jax_bench.attention"], env=env, check=True,
                   capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "bench_attention.json").read_text())
    assert {r["kind"] for r in rows} == {"ceilings", "sweep", "prefill", "decode"}
    sweep = [r for r in rows if r["kind"] == "sweep"]
    assert [(r["B"], r["L"], r["T"], r["tuning"]) for r in sweep] == [(2, 40, 4, t) for t in tunings]
    decode = [r for r in rows if r["kind"] == "decode"]
    shapes = {(2, 200, t) for t in (1, 4, 8)}
    assert {(r["B"], r["L"], r["T"]) for r in decode} == shapes
    for r in rows:
        errors = [v for k, v in r.items() if k.endswith("_err")]
        assert all(e < 1e-5 for e in errors), r
        assert not any(k.endswith("_error") and not k.startswith("cudnn") for k in r), r  # no cuDNN on the CPU
    assert all("pallas_err" in r and r["pallas_us"] > 0 for r in decode)
