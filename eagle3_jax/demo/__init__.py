"""The demo pair: a small Qwen3 trained on the Python standard library and its EAGLE-3 drafter, shipped in
`pair/`, built by `build.py` from the corpus of `corpus.py`; `python -m eagle3_jax.demo` (`make demo`) runs it."""

from pathlib import Path

PAIR = Path(__file__).parent / "pair"  # the shipped pair: target/, drafter/, prompts.json, manifest.json, record.json
