"""Token ids to text as they stream: incremental detokenization and stop strings, both pure host code.

`Detokenizer` emits, for each chunk of new tokens, the text they add: the decoding of a short window of
tokens less the decoding of the window's head, held back while the window ends inside a multi-byte
character (the replacement character U+FFFD at its end). Its deltas are the response's text: a streamed
response and a whole one are the same concatenation. `StopStrings` cuts that text at the first stop string,
which may span any number of tokens and chunks, holding back the characters a stop could still begin with.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of a growing list of tokens, as deltas (`add`, then `flush` once at the end)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self._prefix = 0  # the window's start: tokens before it are already text
        self._read = 0  # the window's head ends here: its text is already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _delta(self, final: bool) -> str:
        head = self._decode(self.tokens[self._prefix : self._read])
        text = self._decode(self.tokens[self._prefix :])
        if len(text) <= len(head) or (text.endswith(REPLACEMENT) and not final):
            return ""  # nothing new yet, or the window ends inside a character: wait for its other bytes
        self._prefix, self._read = self._read, len(self.tokens)
        return text[len(head) :]

    def add(self, new: list[int]) -> str:
        """The text `new` completes (possibly empty)."""
        self.tokens.extend(new)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text still held back at the end of the tokens (an incomplete character as U+FFFD)."""
        return self._delta(final=True) if self._read < len(self.tokens) else ""


class StopStrings:
    """Text cut before the first occurrence of any stop string (`add` each delta, `flush` at the end)."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self._stops), default=1) - 1  # a stop may begin in these
        self._held = ""

    @property
    def active(self) -> bool:
        """Whether there is a stop string to look for."""
        return bool(self._stops)

    def add(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found: the text is then everything before it)."""
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        cut = max(len(text) - self._keep, 0)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
