"""The request bodies of the OpenAI-compatible endpoints, as pydantic models (what FastAPI validates), and the
OpenAI-style error body. Fields a client sends that the server does not use are ignored, as OpenAI's clients
send some by default."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_LIMIT = 2**64


class StreamOptions(BaseModel):
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


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extension: exactly one of json (a schema, or its text), regex, choice, or
    json_object; any other field (grammar, structural_tag, ...) is refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Generation(BaseModel):
    """Settings both endpoints take. None: the server's default (the target's generation_config.json)."""

    model_config = ConfigDict(extra="ignore")

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
    n: Literal[1] = 1
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # an extension, as vLLM names it

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Generation):
    prompt: str | list[int]  # text, or token ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # newer clients' name for max_tokens
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": false} for Qwen3's template


def error_body(message: str, kind: str, code: int) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
