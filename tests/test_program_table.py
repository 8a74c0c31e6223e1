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


def test_a_warm_start_marker_counts_only_with_every_program_cached_and_the_cache_there(tmp_path):
    """decoding/warm_start.py: no marker where jax's cache keeps only slow programs (its default minimum compile
    time); with the CLI's 0, the marker's key sees the configuration, and a marker left beside an emptied cache
    folder does not count as warm."""
    import jax

    from eagle3_jax.decoding import warm_start

    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs")
    previous = [getattr(jax.config, name) for name in names]
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        assert warm_start.marker({"a": 1}) is None
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        path = warm_start.marker({"a": 1})
        assert path.parent == tmp_path / "compiled" and path != warm_start.marker({"a": 2})
        warm_start.mark(path, 3)
        (tmp_path / "xla").mkdir()
        assert not warm_start.is_warm(path)  # the cache folder is empty
        (tmp_path / "xla" / "entry-cache").write_bytes(b"x")
        assert warm_start.is_warm(path) and json.loads(path.read_text()) == {"programs": 3}
    finally:
        for name, value in zip(names, previous):
            jax.config.update(name, value)
