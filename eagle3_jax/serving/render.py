"""OpenAI's shapes for a choice of a response, whole or as stream chunks: its text (with echo, the prompt's first)
and its logprobs.

Logprobs are the target's raw log-softmax (logprobs.py). A token's text is its own decoding (special tokens
shown), as vLLM gives it; a token that ends inside a multi-byte character decodes to U+FFFD there.
* completions: `tokens`, `token_logprobs`, `top_logprobs` (a dict of the most likely tokens' texts and the
  chosen token's, as vLLM returns it: up to logprobs + 1 entries) and `text_offset` (each token's offset in the
  choice's text: the running sum of the tokens' texts); with echo, the prompt's tokens first, the first of them
  with None for its logprob and its dict (nothing predicts it).
* chat: `content`, a list of {token, logprob, bytes (the token text's UTF-8), top_logprobs: [{token, logprob,
  bytes}]}.
A stream's chunk carries the logprobs of the tokens its text came from.
"""

from __future__ import annotations


class _Texts:
    """Token id -> its text, each decoded once per response."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._known.get(token)
        if text is None:
            text = self._known[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return text


class CompletionChoices:
    """/v1/completions' choices. echo: each prompt's text by prompt index (None: no echo); logprobs: whether asked."""

    def __init__(self, tokenizer, n: int, echo: list[str] | None, logprobs: bool):
        self._text, self._n, self._echo, self._asked = _Texts(tokenizer), n, echo, logprobs
        self._offsets: dict[int, int] = {}  # each choice's text_offset so far

    def _head(self, run) -> tuple[str, list[int], list]:
        """(the echo text, its tokens, their logprobs) a choice starts with, once."""
        if self._echo is None or run.index in self._offsets:
            return "", [], []
        entries = run.prompt_logprobs or [None] * len(run.prompt)
        return self._echo[run.index // self._n], list(run.prompt), entries

    def _logprobs(self, run, tokens: list[int], entries: list) -> dict | None:
        if not self._asked:
            return None
        texts = [self._text(t) for t in tokens]
        offsets, at = [], self._offsets.get(run.index, 0)
        for text in texts:
            offsets.append(at)
            at += len(text)
        self._offsets[run.index] = at
        top = []
        for text, entry in zip(texts, entries):
            if entry is None:
                top.append(None)
                continue
            alternatives = {self._text(t): v for t, v in entry.top}
            alternatives.setdefault(text, entry.logprob)
            top.append(alternatives)
        return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def chunk(self, run, piece, finish: str | None) -> dict:
        """A stream chunk's choice: the piece (None: the choice's end)."""
        head, tokens, entries = self._head(run)
        self._offsets.setdefault(run.index, 0)
        text = head + (piece.text if piece else "")
        tokens = tokens + (piece.tokens if piece else [])
        entries = entries + ((piece.logprobs or [None] * len(piece.tokens)) if piece else [])
        return {"index": run.index, "text": text, "logprobs": self._logprobs(run, tokens, entries),
                "finish_reason": finish}

    def whole(self, run, pieces: list) -> dict:
        """The choice of a whole response, from all its pieces."""
        head, tokens, entries = self._head(run)
        for piece in pieces:
            tokens += piece.tokens
            entries += piece.logprobs or [None] * len(piece.tokens)
        return {"index": run.index, "text": head + "".join(p.text for p in pieces),
                "logprobs": self._logprobs(run, tokens, entries), "finish_reason": run.finish_reason}


class ChatChoices:
    """/v1/chat/completions' choices. logprobs: the alternatives each token reports (None: no logprobs)."""

    def __init__(self, tokenizer, logprobs: int | None):
        self._text, self._count, self._started = _Texts(tokenizer), logprobs, set()

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, tokens: list[int], entries: list) -> dict | None:
        if self._count is None:
            return None
        return {"content": [{**self._entry(t, e.logprob), "top_logprobs": [self._entry(i, v) for i, v in e.top]}
                            for t, e in zip(tokens, entries) if e is not None]}

    def chunk(self, run, piece, finish: str | None) -> dict:
        text = piece.text if piece else ""
        delta = {"content": text} if text else {}
        if run.index not in self._started:
            self._started.add(run.index)
            delta = {"role": "assistant", "content": text}
        logprobs = self._logprobs(piece.tokens, piece.logprobs or []) if piece else None
        return {"index": run.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, run, pieces: list) -> dict:
        tokens = [t for p in pieces for t in p.tokens]
        entries = [e for p in pieces for e in (p.logprobs or [None] * len(p.tokens))]
        return {"index": run.index, "message": {"role": "assistant", "content": "".join(p.text for p in pieces)},
                "logprobs": self._logprobs(tokens, entries), "finish_reason": run.finish_reason}
