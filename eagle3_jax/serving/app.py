"""The FastAPI application: OpenAI's /v1/completions and /v1/chat/completions over a live pool, /v1/models,
/health and /metrics.

A request is read (a JSON body labelled as such), checked (its model, prompts, lengths and settings, and every
field it gives: one the server does not honour is refused, never ignored: protocol.py) and split into its
choices, prompt-major (`n` per prompt), each a request of the live pool; nothing is submitted until every choice
is checked. Their tokens come back on the pool's thread and are handed to the choices' handlers on the event loop,
which detokenize them (detokenizer.py) and answer whole or as server-sent events. A stop string aborts its choice
in the pool; so does a client that disconnects (the response's generators are closed). While the server drains
(`ServerState.draining`) new requests and /health get 503. Every error is OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3_jax.decoding.request import check_room
from eagle3_jax.decoding.structured import Structured
from eagle3_jax.serving.detokenizer import Detokenizer, StopStrings
from eagle3_jax.serving.metrics import Metrics
from eagle3_jax.serving.protocol import (
    MAX_CHOICES,
    SEED_LIMIT,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    read_body,
)
from eagle3_jax.serving.render import ChatChoices, CompletionChoices


@dataclasses.dataclass
class ServerState:
    """What the app serves: the live pool, the tokenizer, and the defaults requests take."""

    pool: object  # decoding.live.LivePool
    tokenizer: object
    served_name: str
    defaults: dict  # temperature, top_k, top_p for a request that gives none
    eos: tuple[int, ...]  # stop ids unless ignore_eos
    api_key: str | None = None
    draining: bool = False
    live: set = dataclasses.field(default_factory=set)  # ids of requests in the pool
    metrics: Metrics | None = None

    def __post_init__(self):
        self.metrics = self.metrics or Metrics(self.pool)


@dataclasses.dataclass
class Usage:
    """A choice's usage, or a request's: the sum over its choices (each prompt's tokens counted once)."""

    prompt_tokens: int
    completion_tokens: int = 0
    accepted: int = 0
    drafted: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens_details": {"accepted_prediction_tokens": self.accepted,
                                              "rejected_prediction_tokens": self.drafted - self.accepted}}


def _settings(state: ServerState, body, prompt: list[int], max_tokens: int | None, seed: int | None,
              outputs: dict) -> dict:
    """The live pool's arguments for one choice (outputs: its penalty, logit_bias and logprobs arguments), checked:
    ApiError(400) naming what is wrong."""
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    max_len = state.pool.engine.max_len
    if max_tokens is None:
        max_tokens = max_len - len(prompt)
        if max_tokens < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens: it must be shorter than max_len={max_len}",
                           param="prompt")
    try:
        check_room(len(prompt), max_tokens, max_len, "max_tokens", f"this server's max_len={max_len}")
    except ValueError as e:
        raise ApiError(400, str(e), param="max_tokens") from None
    stops = list(body.stop_token_ids or []) + ([] if body.ignore_eos else list(state.eos))
    given = {"temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p}
    sampling = {k: state.defaults[k] if v is None else v for k, v in given.items()}
    return dict(prompt=prompt, max_new_tokens=max_tokens, stop_token_ids=list(dict.fromkeys(stops)), seed=seed,
                **sampling, **outputs)


async def _compile(state: ServerState, structured: Structured | None) -> None:
    """A new constraint compiled on a worker thread (up to its compile's bound), not on the event loop: the pool's
    check then finds it in the engine's cache. Its errors are the check's to report."""
    if structured is not None:
        try:
            await asyncio.to_thread(state.pool.engine.constraint, structured)
        except (ValueError, ImportError):
            pass  # raised again, as a 400 (or 501), by Generation's check


# The request field the live pool's check names in its message (the first word found).
_PARAMS = (("logit_bias", "logit_bias"), ("stop token", "stop_token_ids"), ("prompt", "prompt"),
           ("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("seed", "seed"),
           ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
           ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_tokens"), ("tensor-parallel", None))


@dataclasses.dataclass
class Piece:
    """What a choice adds to its response at once: text, the tokens it used and their logprobs (when asked for;
    logprobs.TokenLogprobs each)."""

    text: str
    tokens: list[int]
    logprobs: list | None = None


class Generation:
    """One choice's run through the pool: its pieces (`pieces`), finish reason and usage."""

    def __init__(self, state: ServerState, index: int, settings: dict, stops: list[str]):
        self.state, self.index = state, index
        if state.pool.error is not None:
            raise ApiError(503, f"the pool failed: {state.pool.error!r}", "server_error")
        try:
            self.row = state.pool.check(**settings)
        except ValueError as e:
            raise ApiError(400, str(e), param=next((p for word, p in _PARAMS if word in str(e)), None)) from None
        except ImportError as e:  # structured outputs' optional dependency is not installed
            raise ApiError(501, str(e), "server_error") from None
        self.prompt = settings["prompt"]
        self.prompt_logprobs: list | None = None  # with echo and logprobs: the prompt tokens' (its first None)
        self.usage = Usage(len(self.prompt))
        self.finish_reason: str | None = None
        self._request_id: int | None = None
        self._detokenizer, self._stops = Detokenizer(state.tokenizer), StopStrings(stops)

    async def pieces(self):
        """The choice's response, piece by piece; the request is aborted in the pool if this ends early."""
        state, metrics = self.state, self.state.metrics
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event):  # on the pool's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is closed: nobody waits for this request any more
                pass

        start = last = time.perf_counter()
        request_id = self._request_id = state.pool.submit(self.row, deliver)
        state.live.add(request_id)
        metrics.prompt_tokens += self.usage.prompt_tokens
        try:
            while self.finish_reason is None:
                event = await events.get()
                if event.tokens:
                    now = time.perf_counter()
                    (metrics.ttft if self.usage.completion_tokens == 0 else metrics.itl).observe(
                        now - (start if self.usage.completion_tokens == 0 else last))
                    last = now
                self.prompt_logprobs = self.prompt_logprobs or event.prompt_logprobs
                text, hit, used = self._text(event.tokens, event.finished)
                self.usage.completion_tokens += used
                # A round's tokens are its accepted drafts, then the target's own: the drafts past a stop string
                # are counted as rejected (accepted + rejected stays the drafted count).
                self.usage.accepted += min(event.accepted, used)
                self.usage.drafted += event.drafted
                metrics.generation_tokens += used
                if hit:
                    state.pool.abort(request_id)
                    self.finish_reason = "stop"
                elif event.finished:
                    self.finish_reason = event.finish_reason
                if text or used:
                    yield Piece(text, event.tokens[:used], None if event.logprobs is None else event.logprobs[:used])
        finally:
            state.live.discard(request_id)
            if self.finish_reason is None:  # the client went away, or the handler failed
                state.pool.abort(request_id)
                self.finish_reason = "abort"
            metrics.request_finished(self.finish_reason)

    def _text(self, tokens: list[int], finished: bool) -> tuple[str, bool, int]:
        """(the text these tokens add, cut before a stop string; whether one was found; the tokens used: up to the
        one that completed the stop string, so that usage counts no token past it). With stop strings the tokens
        are detokenized one at a time (the deltas are the same text at any chunking)."""
        text = ""
        for n, piece in enumerate([[t] for t in tokens] if self._stops.active else [tokens]):
            delta, hit = self._stops.add(self._detokenizer.add(piece))
            text += delta
            if hit:  # only with stop strings: one token a piece
                return text, True, n + 1
        if not finished:
            return text, False, len(tokens)
        delta, hit = self._stops.add(self._detokenizer.flush())
        return text + delta + ("" if hit else self._stops.flush()), hit, len(tokens)

    def cancel(self) -> None:
        """Aborts the request in the pool (a client gone): its stream then ends with finish_reason "abort"."""
        if self._request_id is not None and self.finish_reason is None:
            self.state.pool.abort(self._request_id)


def _prompt_ids(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer(prompt)["input_ids"] if prompt else []
    return prompt


def _chat_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.tokenizer
    if not tokenizer.chat_template:
        raise ApiError(400, f"the model {state.served_name} has no chat template: use /v1/completions")
    extra = dict(body.chat_template_kwargs or {})
    if body.template_tools() is not None:
        extra["tools"] = body.template_tools()
    try:
        text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                             tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # jinja raises many types for a template a message does not fit
        raise ApiError(400, f"the chat template failed on these messages: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _choices(state: ServerState, body, prompts: list[list[int]], max_tokens: int | None,
             outputs: dict) -> list[Generation]:
    """A request's choices, prompt-major (choice i n + j: prompt i's j-th), each checked before any is submitted.
    With a seed, choice j of each prompt takes seed + j: n seeded streams differ, and each is reproducible (the
    first is the request's with n 1). outputs: the penalty, logit_bias and logprobs arguments."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"a request has at most {MAX_CHOICES} choices (prompts x n), got {len(prompts)} prompts "
                            f"x n {body.n}", param="n")
    choices = []
    for i, prompt in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % SEED_LIMIT
            choices.append(Generation(state, i * body.n + j, _settings(state, body, prompt, max_tokens, seed, outputs),
                                      body.stop_strings()))
    return choices


def _usage(runs: list[Generation], n: int) -> Usage:
    """The request's usage: every choice's completion and drafts, each prompt's tokens once."""
    total = Usage(sum(run.usage.prompt_tokens for run in runs[::n]))
    for run in runs:
        total.completion_tokens += run.usage.completion_tokens
        total.accepted += run.usage.accepted
        total.drafted += run.usage.drafted
    return total


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="eagle3-jax", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(error_body(e.message, e.kind, e.status, e.param), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # an unknown path (404), a wrong method (405)
        if e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif e.status_code == 404:
            message = f"there is no {request.url.path} on this server"
        else:
            message = str(e.detail)
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(error_body(message, kind, e.status_code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):  # a fault of the server's own: the body is still OpenAI's
        return JSONResponse(error_body(f"the server failed on this request: {e!r}", "server_error", 500),
                            status_code=500)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        """The API key (every path but /health), and no new requests while draining."""
        if request.url.path != "/health":
            given = request.headers.get("authorization") or ""
            if state.api_key is not None and not secrets.compare_digest(given, f"Bearer {state.api_key}"):
                return JSONResponse(error_body("a missing or wrong API key", "authentication_error", 401),
                                    status_code=401)
        if state.draining and (request.url.path.startswith("/v1/") or request.url.path == "/health"):
            return JSONResponse(error_body("the server is shutting down", "service_unavailable", 503),
                                status_code=503)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.pool.error is not None:
            return JSONResponse(error_body(f"the pool failed: {state.pool.error!r}", "server_error", 503), 503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": state.served_name, "object": "model", "created": 0, "owned_by": "eagle3-jax"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    def check_model(name: str) -> None:
        if name != state.served_name:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves {state.served_name})",
                           "not_found_error", "model")

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await read_body(http, CompletionRequest)
        check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        ids = [_prompt_ids(state, p) for p in prompts]
        # echo with logprobs: the prompt's too, from its own prefill (a prefix cache hit would hold no logits)
        outputs = {**body.output_settings(body.logprobs, body.logprobs if body.echo else None),
                   "structured": body.structured()}
        await _compile(state, outputs["structured"])
        runs = _choices(state, body, ids, body.max_tokens, outputs)
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts] if body.echo else None
        return await _respond(state, body, http, runs, "cmpl", "text_completion", "text_completion",
                              CompletionChoices(state.tokenizer, body.n, echo, body.logprobs is not None))

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = await read_body(http, ChatCompletionRequest)
        check_model(body.model)
        prompt = _chat_ids(state, body)
        outputs = {**body.output_settings(body.logprob_count()), "structured": body.structured()}
        await _compile(state, outputs["structured"])
        runs = _choices(state, body, [prompt], body.max_completion_tokens or body.max_tokens, outputs)
        return await _respond(state, body, http, runs, "chatcmpl", "chat.completion", "chat.completion.chunk",
                              ChatChoices(state.tokenizer, body.logprob_count()))

    return app


async def _respond(state: ServerState, body, http: Request, runs: list[Generation], prefix: str, kind: str,
                   chunk_kind: str, choices):
    """The whole response (`choices.whole(run, pieces)` per choice), or the stream of chunks (`choices.chunk(run,
    piece or None, finish_reason or None)`), the choices' pieces interleaved as they come (render.py). Every choice is
    aborted as soon as the client disconnects (`_watch`), not at the next chunk's send."""
    head = {"id": f"{prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": state.served_name}
    if not body.stream:
        watcher = asyncio.create_task(_watch(http, runs))  # a client gone before the answer: the choices abort

        async def whole(run):
            return [piece async for piece in run.pieces()]

        try:
            pieces = await asyncio.gather(*(whole(run) for run in runs))
        finally:
            watcher.cancel()
        if any(run.finish_reason == "error" for run in runs):
            raise ApiError(500, f"the pool failed: {state.pool.error!r}", "server_error")
        return {**head, "object": kind, "choices": [choices.whole(run, p) for run, p in zip(runs, pieces)],
                "usage": _usage(runs, body.n).body()}
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run):
            try:
                async for piece in run.pieces():
                    await queue.put((run, piece))
            finally:
                queue.put_nowait((run, None))

        tasks = [asyncio.create_task(pump(run)) for run in runs]
        watcher = asyncio.create_task(_watch(http, runs))
        try:
            left = len(runs)
            while left:
                run, piece = await queue.get()
                left -= piece is None
                yield _sse({**head, "object": chunk_kind,
                            "choices": [choices.chunk(run, piece, None if piece else run.finish_reason)]})
            if include_usage:
                yield _sse({**head, "object": chunk_kind, "choices": [], "usage": _usage(runs, body.n).body()})
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for task in tasks:  # a client gone mid-stream: each choice's generator closes, aborting it in the pool
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return StreamingResponse(events(), media_type="text/event-stream")


async def _watch(http: Request, runs: list[Generation]) -> None:
    """Cancels the runs when the client disconnects (the request body is read: the next message is that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for run in runs:
        run.cancel()
