"""The FastAPI application: OpenAI's /v1/completions and /v1/chat/completions over a live pool, /v1/models,
/health and /metrics.

A request is checked (its model, prompt, lengths and settings; an OpenAI-style error body otherwise) and
submitted to the live pool; its tokens come back on the pool's thread and are handed to the request's
handler on the event loop, which detokenizes them (detokenizer.py) and answers whole or as server-sent
events. A stop string aborts the request in the pool; so does a client that disconnects mid-stream (the
response's generator is closed). While the server drains (`ServerState.draining`) new requests get 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from eagle3_jax.decoding.structured import Structured
from eagle3_jax.serving.detokenizer import Detokenizer, StopStrings
from eagle3_jax.serving.metrics import Metrics
from eagle3_jax.serving.protocol import ChatCompletionRequest, CompletionRequest, error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


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
    prompt_tokens: int
    completion_tokens: int = 0
    accepted: int = 0
    drafted: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens_details": {"accepted_prediction_tokens": self.accepted,
                                              "rejected_prediction_tokens": self.drafted - self.accepted}}


def _settings(state: ServerState, body, prompt: list[int], max_tokens: int | None) -> dict:
    """The live pool's arguments for a request, checked: ApiError(400) naming what is wrong."""
    if not prompt:
        raise ApiError(400, "the prompt is empty")
    max_len = state.pool.engine.max_len
    if max_tokens is None:
        max_tokens = max_len - len(prompt)
        if max_tokens < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens: it must be shorter than max_len={max_len}")
    elif len(prompt) + max_tokens > max_len:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together "
                            f"{len(prompt) + max_tokens}, past this server's max_len={max_len}")
    stops = list(body.stop_token_ids or []) + ([] if body.ignore_eos else list(state.eos))
    given = {"temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p}
    sampling = {k: state.defaults[k] if v is None else v for k, v in given.items()}
    return dict(prompt=prompt, max_new_tokens=max_tokens, stop_token_ids=list(dict.fromkeys(stops)),
                seed=body.seed, structured=_structured(body), **sampling)


async def _compile(state: ServerState, structured: Structured | None) -> None:
    """A new constraint compiled on a worker thread (up to its compile's bound), not on the event loop: the pool's
    check then finds it in the engine's cache. Its errors are the check's to report."""
    if structured is not None:
        try:
            await asyncio.to_thread(state.pool.engine.constraint, structured)
        except (ValueError, ImportError):
            pass  # raised again, as a 400 (or 501), by Generation's check


def _structured(body) -> Structured | None:
    """The request's constraint: response_format's or structured_outputs' (not both); ApiError(400) for a bad one.
    Compiling it (the pool's check) raises the 400s of a regex or schema that does not compile."""
    given = []
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type == "json_object":
        given.append(dict(json_object=True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs its json_schema")
        given.append(dict(json_schema=rf.json_schema.schema_))
    if so is not None:
        fields = {k: v for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("json_object", so.json_object)) if v not in (None, False)}
        if isinstance(fields.get("json_schema"), str):
            try:
                fields["json_schema"] = json.loads(fields["json_schema"])
            except json.JSONDecodeError as e:
                raise ApiError(400, f"structured_outputs.json is not valid JSON: {e}") from None
        given.append(fields)
    if len(given) > 1:
        raise ApiError(400, "give response_format or structured_outputs, not both")
    if not given:
        return None
    try:
        return Structured(**given[0])
    except ValueError as e:
        raise ApiError(400, str(e)) from None


class Generation:
    """One request's run through the pool: its text deltas (`deltas`), finish reason and usage."""

    def __init__(self, state: ServerState, settings: dict, stops: list[str]):
        self.state = state
        if state.pool.error is not None:
            raise ApiError(503, f"the pool failed: {state.pool.error!r}", "server_error")
        try:
            self.row = state.pool.check(**settings)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except ImportError as e:  # structured outputs' optional dependency is not installed
            raise ApiError(501, str(e), "server_error") from None
        self.usage = Usage(len(settings["prompt"]))
        self.finish_reason: str | None = None
        self._request_id: int | None = None
        self._detokenizer, self._stops = Detokenizer(state.tokenizer), StopStrings(stops)

    async def deltas(self):
        """The response's text, chunk by chunk; the request is aborted in the pool if this ends early."""
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
                text, hit, used = self._text(event.tokens, event.finished)
                self.usage.completion_tokens += used
                self.usage.accepted += event.accepted
                self.usage.drafted += event.drafted
                metrics.generation_tokens += used
                if hit:
                    state.pool.abort(request_id)
                    self.finish_reason = "stop"
                elif event.finished:
                    self.finish_reason = event.finish_reason
                if text:
                    yield text
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
    return list(prompt)


def _chat_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.tokenizer
    if not tokenizer.chat_template:
        raise ApiError(400, f"the model {state.served_name} has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                             add_generation_prompt=True, **(body.chat_template_kwargs or {}))
    except Exception as e:  # jinja raises many types for a template a message does not fit
        raise ApiError(400, f"the chat template failed on these messages: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="eagle3-jax", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(error_body(e.message, e.kind, e.status), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):  # FastAPI's 422, as OpenAI's 400
        parts = []
        for err in e.errors():
            if err.get("type") == "json_invalid":
                parts.append(f"malformed JSON: {err.get('ctx', {}).get('error', 'cannot parse the body')}")
                continue
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(error_body("; ".join(parts) or "invalid request", "invalid_request_error", 400),
                            status_code=400)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        """The API key (every path but /health), and no new requests while draining."""
        if request.url.path != "/health":
            given = request.headers.get("authorization") or ""
            if state.api_key is not None and not secrets.compare_digest(given, f"Bearer {state.api_key}"):
                return JSONResponse(error_body("a missing or wrong API key", "authentication_error", 401),
                                    status_code=401)
            if state.draining and request.url.path.startswith("/v1/"):
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_name, "object": "model", "created": 0,
                                            "owned_by": "eagle3-jax"}]}

    def check_model(name: str) -> None:
        if name != state.served_name:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves {state.served_name})",
                           "not_found_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        settings = _settings(state, body, _prompt_ids(state, body.prompt), body.max_tokens)
        await _compile(state, settings["structured"])
        run = Generation(state, settings, body.stop_strings())

        def chunk(text, finish):
            return {"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        return await _respond(state, body, http, run, "cmpl", "text_completion", chunk,
                              lambda text: {"index": 0, "text": text, "logprobs": None,
                                            "finish_reason": run.finish_reason})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        check_model(body.model)
        settings = _settings(state, body, _chat_ids(state, body), body.max_completion_tokens or body.max_tokens)
        await _compile(state, settings["structured"])
        run = Generation(state, settings, body.stop_strings())
        first = [True]

        def chunk(text, finish):
            delta = {"role": "assistant", "content": text} if first[0] else ({"content": text} if text else {})
            first[0] = False
            return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        return await _respond(state, body, http, run, "chatcmpl", "chat.completion", chunk,
                              lambda text: {"index": 0, "message": {"role": "assistant", "content": text},
                                            "logprobs": None, "finish_reason": run.finish_reason})

    return app


async def _respond(state: ServerState, body, http: Request, run: Generation, prefix: str, kind: str, chunk, choice):
    """The whole response, or the stream of chunks (object kind + ".chunk" for chat, kind for completions).
    A streamed request is aborted as soon as its client disconnects (`_watch`), not at the next chunk's send."""
    head = {"id": f"{prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": state.served_name}
    if not body.stream:
        watcher = asyncio.create_task(_watch(http, run))  # a client gone before the answer: the request is aborted
        try:
            text = "".join([delta async for delta in run.deltas()])
        finally:
            watcher.cancel()
        if run.finish_reason == "error":
            raise ApiError(500, f"the pool failed: {state.pool.error!r}", "server_error")
        return {**head, "object": kind, "choices": [choice(text)], "usage": run.usage.body()}
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events():
        deltas = run.deltas()
        watcher = asyncio.create_task(_watch(http, run))
        try:
            async for delta in deltas:
                yield _sse({**head, "object": chunk_kind, **chunk(delta, None)})
            yield _sse({**head, "object": chunk_kind, **chunk("", run.finish_reason)})
            if include_usage:
                yield _sse({**head, "object": chunk_kind, "choices": [], "usage": run.usage.body()})
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            await deltas.aclose()  # a client gone mid-stream: the request is aborted in the pool

    return StreamingResponse(events(), media_type="text/event-stream")


async def _watch(http: Request, run: Generation) -> None:
    """Cancels the run when the client disconnects (the request body is read: the next message is that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    run.cancel()
