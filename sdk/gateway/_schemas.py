"""The OpenAI wire shapes the gateway accepts and returns.

Requests are validated here so that a malformed one gets a 400 naming the offending field
before any session state is touched. Unknown request fields are ignored, as OpenAI-compatible
servers do, because agent frameworks send options the gateway has no use for; messages keep
their unknown fields only long enough to be canonicalised.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

__all__ = [
    "ChatCompletionRequest",
    "ErrorType",
    "FunctionCall",
    "FunctionSpec",
    "RequestMessage",
    "StreamOptions",
    "ToolCall",
    "ToolSpec",
    "chunk",
    "completion",
    "error_body",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "conflict_error",
    "server_error",
    "service_unavailable",
]


class FunctionCall(BaseModel):
    """A call as OpenAI sends it: arguments are a JSON string (some clients send an object)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(
                f"content part of type {value!r} is not supported; the gateway serves text only"
            )
        return value


class RequestMessage(BaseModel):
    """One message of a request. Reasoning may come back as `reasoning_content` or `reasoning`."""

    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    _handles: tuple[str, ...] = PrivateAttr(default=())
    """Handles the client replayed with this assistant message's thinking (an Anthropic
    `signature`, a Responses reasoning `encrypted_content` or `id`), set by those dialects;
    never read from a chat request."""

    def text(self) -> str:
        """The content as one string: None and "" are the same, text parts are joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: dict[str, Any]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The subset of `POST /v1/chat/completions` the gateway honours."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    messages: list[RequestMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="One choice per request: one turn.")
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """Tools in the shape chat templates render (OpenAI's, without unset fields)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def error_body(
    message: str, type_: ErrorType, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope, which the official client turns into a typed exception."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    *,
    id_: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object."""
    return {
        "id": id_,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def chunk(
    *,
    id_: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; a usage chunk has no choices, as OpenAI sends it."""
    body: dict[str, Any] = {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if usage is not None:
        body["usage"] = _usage(*usage)
    else:
        body["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        ]
    return body
