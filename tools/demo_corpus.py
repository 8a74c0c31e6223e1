"""The demo pair's corpus: the `.py` sources of the Python standard library that runs the build, found through
`sysconfig`, so every machine with Python has it and nothing is downloaded.

A file is held out (never trained on) when the sha256 of its path relative to the library root is 0 modulo
HOLDOUT_MODULUS: the same files on every machine with the same Python, without a list to keep. The build
records every file it read, its sha256 and its split in the pair's manifest.json (`manifest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import sysconfig
from pathlib import Path

HOLDOUT_MODULUS = 40  # about 2.5% of the files
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the library root, '/'-separated
    sha256: str  # of the file's bytes
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % HOLDOUT_MODULUS == 0


def read_sources(root: Path | None = None, limit: int | None = None) -> list[SourceFile]:
    """Every UTF-8 `.py` file under root (the standard library by default), sorted by path; installed
    packages and files that are not UTF-8 (the test suite's deliberate encoding cases) are left out.
    limit: only the first `limit` files of each split, for small trial builds."""
    root = stdlib_root() if root is None else Path(root)
    files, counts = [], {True: 0, False: 0}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS & set(relative.parts) or not path.is_file():
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        source = SourceFile(relative.as_posix(), hashlib.sha256(data).hexdigest(), text)
        if limit is not None and counts[source.held_out] >= limit:
            continue
        counts[source.held_out] += 1
        files.append(source)
    if not any(f.held_out for f in files) or all(f.held_out for f in files):
        raise ValueError(f"{root}: found no training or no held-out .py files")
    return files


def manifest(files: list[SourceFile]) -> dict:
    """Provenance of a build: the Python that supplied the corpus and every file with its hash and split."""
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "holdout_rule": f"sha256(relative path) % {HOLDOUT_MODULUS} == 0",
        "files": [{"path": f.path, "sha256": f.sha256, "held_out": f.held_out} for f in files],
    }


def first_lines(text: str, max_chars: int) -> str:
    """Whole lines from the start of text, with their newlines, as many as fit in max_chars; at least one,
    cut to max_chars if it alone is longer."""
    out = ""
    for line in text.splitlines(keepends=True):
        if out and len(out) + len(line) > max_chars:
            break
        out += line
    return out[:max_chars]


def lines_from(text: str, line: int, max_chars: int) -> str:
    """first_lines of text starting at 0-based line `line`."""
    return first_lines("".join(text.splitlines(keepends=True)[line:]), max_chars)


def held_out_prompts(files: list[SourceFile], max_chars: int, min_lines: int = 20) -> list[dict]:
    """Prompts from held-out files with at least min_lines lines: each file's first lines, and the lines
    from its middle. Each prompt names its file and line; demo prompts come first: the first lines of
    library modules (not tests)."""
    prompts = []
    for f in files:
        lines = f.text.splitlines()
        if not f.held_out or len(lines) < min_lines:
            continue
        is_test = any(part.startswith(("test", "idle_test")) for part in f.path.split("/"))
        prompts.append({"file": f.path, "line": 0, "text": first_lines(f.text, max_chars), "demo": not is_test})
        middle = len(lines) // 2
        prompts.append({"file": f.path, "line": middle, "text": lines_from(f.text, middle, max_chars),
                        "demo": False})
    return sorted(prompts, key=lambda p: not p["demo"])
