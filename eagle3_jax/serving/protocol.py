"""The request bodies of the OpenAI-compatible endpoints, as pydantic models, the checks types cannot express,
reading a body into its model (`read_body`), and the OpenAI-style error.

Refuse, never ignore: a client that gets a 200 for a field the server ignored computes wrong results and never
knows. The models declare every field the server reads; a declared field the server does not honour is refused
at any value that would change the output (`refusal`), and so is every field the models do not declare (an
unknown field may change the output: it is named in the 400). Fields that change nothing (`user`, `metadata`,
`store`) are accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from eagle3_jax.decoding.logprobs import TOP as MAX_LOGPROBS
from eagle3_jax.decoding.penalties import BIAS_LIMIT, BIAS_WIDTH, PENALTY_LIMIT
from eagle3_jax.decoding.request import is_int
from eagle3_jax.decoding.structured import Structured

SEED_LIMIT = 2**64
MAX_N = 16  # choices per prompt (`n`)
MAX_CHOICES = 256  # choices per request: prompts x n
# Declared fields this server does not honour, refused whenever given a value that would change the output.
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema (always enforced, whatever `strict` says)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_with_its_type(cls, schema, info):
        if schema is not None and info.data.get("type") != "json_schema":
            raise ValueError(f"json_schema is given with type {info.data.get('type')!r}: give type json_schema")
        return schema


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extension: exactly one of json (a schema, or its text), regex, choice, or
    json_object; any other field (grammar, structural_tag, ...) is refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Generation(BaseModel):
    """Settings both endpoints take. None: the server's default (the target's generation_config.json). Extra fields
    are kept (`model_extra`) so that `refusal` can name them."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # an extension: 0 is no top-k filter
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # an extension, as vLLM names it
    ignore_eos: bool = False  # an extension: the tokenizer's end-of-sequence id does not stop the request
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # Accepted, changing nothing.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    # vLLM's semantics: counts over the output; repetition_penalty (an extension) over prompt and output
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-BIAS_LIMIT, le=BIAS_LIMIT)]] | None = None  # token id -> bias
    # Structured outputs (docs/structured.md).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # an extension, as vLLM names it
    # Refused at a value that changes the output (`refusal`).
    min_p: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: object = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        if bias is not None:
            if len(bias) > BIAS_WIDTH:
                raise ValueError(f"at most {BIAS_WIDTH} tokens, got {len(bias)}")
            for key in bias:
                if not (key.isascii() and key.isdecimal()):  # "²" is a digit to str.isdigit, not to int()
                    raise ValueError(f"keys are token ids, got {key!r}")
        return bias

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def structured(self) -> Structured | None:
        """The request's constraint: response_format's or structured_outputs' (not both); ApiError(400) for a bad
        one. Compiling it (the pool's check) raises the 400s of a regex or schema that does not compile."""
        given = []
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            given.append(dict(json_object=True))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError(400, "response_format of type json_schema needs its json_schema",
                               param="response_format")
            given.append(dict(json_schema=rf.json_schema.schema_))
        if so is not None:
            fields = {k: v for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                        ("json_object", so.json_object)) if v not in (None, False)}
            if isinstance(fields.get("json_schema"), str):
                try:
                    fields["json_schema"] = json.loads(fields["json_schema"])
                except json.JSONDecodeError as e:
                    raise ApiError(400, f"structured_outputs.json is not valid JSON: {e}",
                                   param="structured_outputs") from None
            given.append(fields)
        if len(given) > 1:
            raise ApiError(400, "give response_format or structured_outputs, not both")
        if not given:
            return None
        try:
            return Structured(**given[0])
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def output_settings(self, logprobs: int | None, prompt_logprobs: int | None = None) -> dict:
        """The live pool's penalty, logit_bias and logprobs arguments (LivePool.check)."""
        return dict(frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                    logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) for the first field given that would change the output and that this server does not
        honour; None when there is none."""
        for name in self.model_extra or {}:
            return name, (f"`{name}` is not a field this server honours: it is refused rather than ignored "
                          "(docs/serving.md lists the fields it takes)")
        for name in GUIDED:
            if getattr(self, name) is not None:
                return name, f"`{name}` (vLLM's older name) is not served: give `structured_outputs`"
        if self.min_p not in (None, 0):
            return "min_p", "`min_p` is not supported by this server (use top_p or top_k)"
        if self.min_tokens not in (None, 0):
            return "min_tokens", "`min_tokens` is not supported by this server"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs", "`prompt_logprobs` is not supported by this server (use echo with logprobs)"
        return None


class CompletionRequest(_Generation):
    prompt: str | list  # text, token ids, or a list of either (`prompts`)
    echo: bool = False  # the prompt before the completion (and with logprobs, the prompt's logprobs)
    # each token's logprob and the most likely tokens at its position, this many (OpenAI's legacy completions)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refusal(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "`best_of` > 1 (candidates ranked server-side) is not supported: use n"
        if self.suffix:
            return "suffix", "`suffix` (insertion) is not supported by this server"
        return super().refusal()

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a text or a list of token ids; a string is always text (["12", "34"] is two
        text prompts), a list of ints one prompt of token ids. ValueError for any other shape."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return [[]]
        if all(is_int(t) for t in prompt):
            return [[int(t) for t in prompt]]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            return [[int(t) for t in p] for p in prompt]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                         "lists")


class ChatMessage(BaseModel):
    """A message as the chat template reads it: its other fields (tool_calls, name, ...) are passed to the template
    as they are."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # newer clients' name for max_tokens
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": false} for Qwen3's template
    logprobs: StrictBool | None = None  # each token's logprob, and top_logprobs most likely tokens at its position
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict] | None = None  # given to the chat template; served only with tool_choice "none"
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None  # the deprecated form of tools
    function_call: str | dict | None = None

    def refusal(self) -> tuple[str, str] | None:
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            chosen = getattr(self, choice)
            if getattr(self, tools) and chosen != "none":
                return choice, (f"`{tools}` with `{choice}` {chosen!r} (tool calls) is not supported by this server: "
                                f"give `{choice}` \"none\"")
            if not getattr(self, tools) and chosen not in (None, "none", "auto"):
                return choice, f"`{choice}` {chosen!r} names a tool, and no `{tools}` were given"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "`top_logprobs` needs `logprobs` true"
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            return "max_completion_tokens", (f"`max_completion_tokens` {self.max_completion_tokens} and `max_tokens` "
                                             f"{self.max_tokens} disagree: give one")
        return super().refusal()

    def logprob_count(self) -> int | None:
        """The alternatives each token reports with its logprob, None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template renders (functions as tools), None without any."""
        tools = list(self.tools or []) + [{"type": "function", "function": f} for f in self.functions or []]
        return tools or None


class ApiError(Exception):
    """A request the server answers with OpenAI's error body (status, message, type, the field at fault)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


async def read_body(http, model: type[BaseModel]):
    """The body of `http` (a starlette Request) as `model`, checked: a body that is not JSON, or not labelled as
    JSON, is refused with a message saying so; a field of the wrong type or range, or one the server does not honour,
    is refused naming the field (ApiError, 400)."""
    kind = http.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise ApiError(400, f"the body must be JSON, sent with 'Content-Type: application/json' (got "
                            f"{kind or 'no content type'!r})")
    try:
        data = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as e:
        parts, params = [], []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
            params.append(str(err["loc"][0]) if err.get("loc") else None)
        raise ApiError(400, "; ".join(parts) or "invalid request", param=params[0] if params else None) from None
    refused = body.refusal()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    return body


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
