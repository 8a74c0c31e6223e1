"""The programs each test file compiles, as tests/README.md's table: sums the JSON lines tests/conftest.py appends
to $EAGLE3_JAX_PROGRAM_TABLE (one per file and process) and prints a Markdown table, the costliest files first.

    EAGLE3_JAX_PROGRAM_TABLE=/tmp/programs.jsonl make test
    python -m tools.program_table /tmp/programs.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

COLUMNS = ("programs", "compile_s", "trace_s", "lower_s")


def totals(path: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            for column in COLUMNS:
                out[row["file"]][column] += row[column]
    return dict(out)


def table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| file | programs | compile s | trace + lower s |", "|---|---|---|---|"]
    ordered = sorted(rows.items(), key=lambda kv: -(kv[1]["compile_s"] + kv[1]["trace_s"] + kv[1]["lower_s"]))
    for name, r in ordered:
        lines.append(f"| `{Path(name).name}` | {int(r['programs'])} | {r['compile_s']:.0f} | "
                     f"{r['trace_s'] + r['lower_s']:.0f} |")
    total = {c: sum(r[c] for r in rows.values()) for c in COLUMNS}
    lines.append(f"| all | {int(total['programs'])} | {total['compile_s']:.0f} | "
                 f"{total['trace_s'] + total['lower_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.program_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", type=Path)
    print(table(totals(parser.parse_args(argv).jsonl)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
