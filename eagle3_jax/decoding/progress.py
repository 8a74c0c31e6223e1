"""generate's progress bar: prompts done and tokens/s on stderr."""

from __future__ import annotations

import time


class ProgressBar:
    """Prompts done and tokens/s on stderr (tqdm)."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, unit="prompt", desc="generating")
        self._tokens, self._start = 0, time.perf_counter()

    def add(self, tokens: int, finished: bool) -> None:
        self._tokens += tokens
        if finished:
            self._bar.set_postfix(tokens_per_s=f"{self._tokens / (time.perf_counter() - self._start):.0f}",
                                  refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def checked(progress):
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress must be a bool or None, got {progress!r}")
    return progress


def progress_bar(prompts: int, slots: int, progress: bool | None) -> ProgressBar | None:
    show = prompts > slots if progress is None else progress
    return ProgressBar(prompts) if show else None
