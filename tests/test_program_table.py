"""tests/conftest.py's count of the programs each test file compiles (jax's compile events), and the table
tools/program_table.py makes of its lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.program_table import table, totals

ROOT = Path(__file__).resolve().parents[1]


def test_each_file_counts_its_compilations_and_the_table_sums_the_processes(tmp_path):
    """A test file that compiles three programs (and one of them again, from jit's cache) in a pytest of its own
    counts 3; lines of two processes for one file sum in the table, the costliest file first."""
    (tmp_path / "test_two.py").write_text(
        "import jax, numpy as np\n"
        "def test_two():\n"
        "    jax.jit(lambda x: x + 1)(np.ones(3)); jax.jit(lambda x: x * 2)(np.ones(3))\n"
        "    f = jax.jit(lambda x: x - 1); f(np.ones(4)); f(np.ones(4))\n")
    lines = tmp_path / "programs.jsonl"
    env = {**os.environ, "EAGLE3_JAX_PROGRAM_TABLE": str(lines), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", str(ROOT / "pyproject.toml"), "--confcutdir", str(ROOT / "tests"),
                           "-p", "tests.conftest", str(tmp_path / "test_two.py")], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [json.loads(line) for line in lines.read_text().splitlines()]
    assert row["file"].endswith("test_two.py") and row["programs"] == 3 and row["compile_s"] > 0
    lines.write_text(json.dumps({"file": "a.py", "programs": 2, "compile_s": 1.0, "trace_s": 0.5, "lower_s": 0.5})
                     + "\n" + json.dumps({"file": "a.py", "programs": 3, "compile_s": 2.0, "trace_s": 0, "lower_s": 0})
                     + "\n" + json.dumps({"file": "b.py", "programs": 9, "compile_s": 9.0, "trace_s": 1, "lower_s": 0})
                     + "\n")
    assert totals(lines)["a.py"]["programs"] == 5
    assert table(totals(lines)).splitlines()[2:] == ["| `b.py` | 9 | 9 | 1 |", "| `a.py` | 5 | 3 | 1 |",
                                                      "| all | 14 | 12 | 2 |"]
