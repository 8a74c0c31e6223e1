"""The demo pair: a small Qwen3 trained on the Python standard library and its EAGLE-3 drafter, shipped in
`pair/`, built by tools/build_demo_pair.py (outside the library); `python -m eagle3_jax.demo` (`make demo`)
runs it."""

from pathlib import Path

PAIR = Path(__file__).parent / "pair"  # the shipped pair: target/, drafter/, prompts.json, manifest.json, record.json


def timed_generate(engine, prompts, max_new_tokens, stop_token_ids, **sampling):
    """engine.generate's results and seconds for a request, timed after a first run of the same request
    (which compiles every shape it uses)."""
    import time

    engine.generate(prompts, max_new_tokens, stop_token_ids, **sampling)
    start = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens, stop_token_ids, **sampling)
    return results, time.perf_counter() - start
