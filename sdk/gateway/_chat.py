"""`Dialect`, what every wire format does, and `ChatDialect`, OpenAI's Chat Completions.

A dialect translates its request into the gateway's one internal request (the Chat
Completions subset in `_schemas`) and writes the sampled turn back in its own shapes: a JSON
body, or the records of a stream (the opening sent when the stream starts, keepalives while
the completion samples, then the reply as deltas), and errors in its own envelope.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from ._errors import classify, validation_error
from ._schemas import ChatCompletionRequest, chunk, completion, error_body
from ._session import PreparedTurn, Session

__all__ = ["ChatDialect", "Dialect", "text_pieces"]

TEXT_PIECE_CHARS = 64
"""Characters per streamed text delta: the completion is sampled whole, then streamed."""


def text_pieces(text: str) -> list[str]:
    """`text` in stream-sized pieces (at least one, so every block gets a delta)."""
    return [text[i : i + TEXT_PIECE_CHARS] for i in range(0, len(text), TEXT_PIECE_CHARS)] or [""]


class Dialect:
    """One wire format: request translation, reply, stream records and errors.

    One instance serves one request. `stream` is set by `translate`; `dropped_tools`
    counts tools the request offered that the gateway does not serve (added to the
    session's metrics when the turn is committed); `auxiliary` says the request is an
    auxiliary call by its shape (a title request asking for structured output).
    """

    def __init__(self, gateway: Any):
        self.gateway = gateway
        self.stream = False
        self.dropped_tools: Counter[str] = Counter()
        self.auxiliary = False

    def translate(self, body: Any, session: Session) -> ChatCompletionRequest:
        raise NotImplementedError

    def body(self, prepared: PreparedTurn) -> dict[str, Any]:
        raise NotImplementedError

    def committed(self, session: Session, prepared: PreparedTurn) -> None:
        """Called once the turn is recorded: keep what later requests may refer to."""

    def opening(self, prompt_tokens: int, cached_tokens: int) -> list[bytes]:
        """Records sent when the stream opens, before the completion is known."""
        return []

    def keepalive(self) -> bytes:
        """A record that keeps an agent's stream idle timer from firing; SSE comments are
        ignored by every SSE parser."""
        return b": keepalive\n\n"

    def records(self, prepared: PreparedTurn) -> list[bytes]:
        """The rest of the stream once the turn is sampled; the last record ends it."""
        raise NotImplementedError

    def error_record(self, exc: Exception) -> bytes:
        """A failure after the stream opened, as the dialect's clients expect to read it."""
        failure = classify(exc)
        return _data(error_body(failure.message, failure.type_, param=failure.param))

    @classmethod
    def error_response(cls, exc: Exception) -> Response:
        failure = classify(exc)
        body = error_body(failure.message, failure.type_, param=failure.param)
        return JSONResponse(body, status_code=failure.status)


def _data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class ChatDialect(Dialect):
    """`POST /v1/chat/completions`, OpenAI's `chat.completion` and its chunks."""

    def translate(self, body: Any, session: Session) -> ChatCompletionRequest:
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        self.request = request
        self.stream = request.stream
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        return request

    def body(self, prepared: PreparedTurn) -> dict[str, Any]:
        return completion(
            id_=self.id,
            model=self.gateway.model,
            message=prepared.reply,
            finish_reason=prepared.finish_reason,
            prompt_tokens=prepared.prompt_tokens,
            completion_tokens=len(prepared.turn.completion_ids),
        )

    def records(self, prepared: PreparedTurn) -> list[bytes]:
        model, id_, created = self.gateway.model, self.id, self.created
        events = [
            chunk(id_=id_, model=model, created=created, delta=d) for d in _deltas(prepared.reply)
        ]
        events.append(
            chunk(id_=id_, model=model, created=created, finish_reason=prepared.finish_reason)
        )
        options = self.request.stream_options
        if options is not None and options.include_usage:
            usage = (prepared.prompt_tokens, len(prepared.turn.completion_ids))
            events.append(chunk(id_=id_, model=model, created=created, usage=usage))
        return [*(_data(e) for e in events), b"data: [DONE]\n\n"]


def _deltas(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as stream deltas: role, reasoning, content, then each tool call."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if reply.get("reasoning_content"):
        deltas.append({"reasoning_content": reply["reasoning_content"]})
    if reply.get("content"):
        deltas += [{"content": piece} for piece in text_pieces(reply["content"])]
    for i, call in enumerate(reply.get("tool_calls") or ()):
        fn = call["function"]
        head = {"index": i, "id": call["id"], "type": "function"}
        deltas.append({"tool_calls": [{**head, "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return deltas
