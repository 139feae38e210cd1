"""`Dialect`, what every wire format does, and `ChatDialect`, OpenAI's Chat Completions.

A dialect translates its request into the gateway's one internal request (the Chat
Completions subset in `_schemas`) and writes the sampled turn back in its own shapes: a JSON
body, or the records of a stream, and errors in its own envelope.

A stream is: the opening (when the stream starts), keepalives while nothing else is sent,
the reply's reasoning and content as they are sampled (`text_records`, fed by the gateway's
`ReplyStream`), then the rest once the turn is whole (`records`): the text not sent yet, the
tool calls, and the end. One path writes both a streamed and a buffered reply: `records`
sends the text through `text_records` too, so a dialect writes each record kind once.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections import Counter
from typing import Any

from starlette.responses import JSONResponse, Response

from ._errors import classify, validated
from ._schemas import ChatCompletionRequest, chunk, completion, error_body
from ._session import PreparedTurn, Session
from ._stream import TEXT_FIELDS, TextKind

__all__ = ["ChatDialect", "Dialect", "text_pieces"]

TEXT_PIECE_CHARS = 64
"""Characters per text delta of what is sent once the turn is whole."""
HANDLE_PREFIX = "plies-turn-"
"""How a handle the gateway minted begins (they are looked up whole; this only names them)."""


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
        self.streamed: dict[TextKind, str] = {"reasoning": "", "content": ""}
        self._open: TextKind | None = None
        self._handle: str | None = None

    def handle(self, prepared: PreparedTurn | None = None) -> str:
        """The opaque handle of the turn this request samples: a thinking block's
        `signature` or a reasoning item's `encrypted_content`.

        Minted once per request (a stream sends it before the turn is whole) and given to
        `prepared`, so the session keeps it from commit on (`Session.handles`): it names the
        turn's stored ids in this session and means nothing anywhere else. A request that
        replays it is served from those ids; a handle the session does not hold is never
        trusted.
        """
        if self._handle is None:
            self._handle = HANDLE_PREFIX + secrets.token_urlsafe(18)
        if prepared is not None:
            prepared.handle = self._handle
        return self._handle

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

    def text_records(self, kind: TextKind, text: str) -> list[bytes]:
        """Records that send `text` as the next piece of the reply's reasoning or content,
        closing the other kind's block first when it is open."""
        out: list[bytes] = []
        if self._open != kind:
            out += self._close_text()
            out += self._start_text(kind)
            self._open = kind
        out += self._text_delta(kind, text)
        self.streamed[kind] += text
        return out

    def _rest_of_text(self, prepared: PreparedTurn) -> list[bytes]:
        """The reply's reasoning and content not streamed yet, their blocks then closed."""
        if self._handle is not None:
            self.handle(prepared)
        out: list[bytes] = []
        for kind, field in TEXT_FIELDS.items():
            rest = (prepared.reply.get(field) or "")[len(self.streamed[kind]) :]
            if rest:
                for piece in text_pieces(rest):
                    out += self.text_records(kind, piece)
        return out + self._close_text()

    def _close_text(self) -> list[bytes]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        return self._end_text(kind)

    def _start_text(self, kind: TextKind) -> list[bytes]:
        """Records that open the reply's reasoning or content block."""
        return []

    def _text_delta(self, kind: TextKind, text: str) -> list[bytes]:
        raise NotImplementedError

    def _end_text(self, kind: TextKind) -> list[bytes]:
        """Records that close the block; `self.streamed[kind]` holds its whole text."""
        return []

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
        request = validated(ChatCompletionRequest, body)
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

    def _chunk(self, **fields: Any) -> bytes:
        return _data(chunk(id_=self.id, model=self.gateway.model, created=self.created, **fields))

    def opening(self, prompt_tokens: int, cached_tokens: int) -> list[bytes]:
        return [self._chunk(delta={"role": "assistant", "content": ""})]

    def _text_delta(self, kind: TextKind, text: str) -> list[bytes]:
        field = "reasoning_content" if kind == "reasoning" else "content"
        return [self._chunk(delta={field: text})]

    def records(self, prepared: PreparedTurn) -> list[bytes]:
        out = self._rest_of_text(prepared)
        for i, call in enumerate(prepared.reply.get("tool_calls") or ()):
            fn = call["function"]
            head = {"index": i, "id": call["id"], "type": "function"}
            opened = {**head, "function": {"name": fn["name"], "arguments": ""}}
            out.append(self._chunk(delta={"tool_calls": [opened]}))
            arguments = {"index": i, "function": {"arguments": fn["arguments"]}}
            out.append(self._chunk(delta={"tool_calls": [arguments]}))
        out.append(self._chunk(finish_reason=prepared.finish_reason))
        options = self.request.stream_options
        if options is not None and options.include_usage:
            usage = (prepared.prompt_tokens, len(prepared.turn.completion_ids))
            out.append(self._chunk(usage=usage))
        return [*out, b"data: [DONE]\n\n"]
