"""Anthropic Messages (`POST /v1/messages`), as Claude Code and the `anthropic` SDK speak it.

The request becomes the gateway's internal chat request:

- `system` (a string or text blocks) becomes the first system message, minus Claude Code's
  per-request `x-anthropic-billing-header: ...` block, which changes on every request and
  would stop every turn from extending the previous prompt. Blocks are joined by a blank line.
- A `role: "system"` message inside `messages` (Claude Code's mid-conversation-system beta)
  is placed where it stands, as a system message the chat template renders in place.
- User `text` blocks become one user message (joined by a newline); `tool_result` blocks
  become tool messages, before it; an `is_error` result is prefixed `Error: `.
- Assistant `text`, `tool_use` and `thinking` blocks become one assistant message with
  content, tool calls and reasoning; a thinking block's `signature` is looked up as a handle
  the gateway minted (see `Gateway.prepare`); an assistant message with no thinking block
  dropped its thinking on purpose. `redacted_thinking` carries nothing plies can render.
- Images and documents are refused in one clear error; `tool_choice` `any` or `tool` is
  refused (the gateway samples the policy as it is and cannot force a call); tools with a
  `type` other than `custom` (Anthropic's server tools) are dropped and counted.
- `cache_control`, `metadata`, `thinking`, `context_management`, `output_config`, unknown
  `anthropic-beta` values and unknown fields are accepted and have no effect on sampling.

The reply: a `thinking` block (its `signature` a handle plies minted for the sampled turn),
a `text` block, `tool_use` blocks with `toolu_` ids; streamed as `message_start`, `ping`,
`content_block_start` / `content_block_delta` / `content_block_stop` per block,
`message_delta` with the stop reason and output tokens, and `message_stop`.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from .._exceptions import GatewayRequestError
from ._chat import Dialect, text_pieces
from ._errors import classify, forced_tool_choice, validated, validation_error
from ._schemas import ChatCompletionRequest, FunctionSpec, RequestMessage, ToolSpec
from ._session import MAX_HANDLE_CHARS, PreparedTurn, Session
from ._stream import TextKind

__all__ = ["BILLING_HEADER_PREFIX", "AnthropicDialect"]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
"""Claude Code's per-request system block (it carries a hash that changes every request)."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "overloaded_error",
}


class MessagesRequest(BaseModel):
    """The fields of `POST /v1/messages` that decide the turn; the rest are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_config: dict[str, Any] | None = None


def _fail(message: str, param: str) -> GatewayRequestError:
    return GatewayRequestError(message, param=param)


def _texts(content: Any, param: str) -> list[str]:
    """The text of a string or of text blocks; anything else is refused by name."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise _fail("content must be a string or a list of blocks", param)
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise _unsupported(kind, f"{param}.{j}")
        text = block.get("text")
        if not isinstance(text, str):
            raise _fail("a text block needs a string 'text'", f"{param}.{j}.text")
        out.append(text)
    return out


def _unsupported(kind: Any, param: str) -> GatewayRequestError:
    if kind in ("image", "document"):
        return _fail(
            f"{kind} content is not supported: the gateway serves text-only models; "
            "send the content as text",
            param,
        )
    return _fail(f"content block of type {kind!r} is not supported here", param)


def _system(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None:
        return None
    texts = _texts(system, "system")
    kept = [t for t in texts if not t.startswith(BILLING_HEADER_PREFIX)]
    return "\n\n".join(kept) if kept else None


def _user(content: Any, i: int) -> list[RequestMessage]:
    param = f"messages.{i}.content"
    if isinstance(content, str):
        return [RequestMessage(role="user", content=content)]
    if not isinstance(content, list):
        raise _fail("content must be a string or a list of blocks", param)
    out: list[RequestMessage] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            text = "\n".join(_texts(block.get("content"), f"{param}.{j}.content"))
            if block.get("is_error"):
                text = "Error: " + text
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _fail("a tool_result needs a string 'tool_use_id'", f"{param}.{j}")
            out.append(RequestMessage(role="tool", content=text, tool_call_id=call_id))
        elif kind == "text":
            texts += _texts([block], param)
        else:
            raise _unsupported(kind, f"{param}.{j}")
    if texts:
        out.append(RequestMessage(role="user", content="\n".join(texts)))
    return out


def _assistant(content: Any, i: int) -> RequestMessage:
    param = f"messages.{i}.content"
    if isinstance(content, str):
        return RequestMessage(role="assistant", content=content, reasoning_content="")
    if not isinstance(content, list):
        raise _fail("content must be a string or a list of blocks", param)
    texts: list[str] = []
    thinking: list[str] = []
    handles: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts += _texts([block], param)
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
            signature = block.get("signature")
            if isinstance(signature, str) and signature:
                handles.append(signature[:MAX_HANDLE_CHARS])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise _fail("a tool_use needs a string 'name' and an object 'input'", param)
            fn = {"name": name, "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        else:
            raise _unsupported(kind, f"{param}.{j}")
    message = RequestMessage.model_validate(
        {
            "role": "assistant",
            "content": "".join(texts),
            "tool_calls": calls or None,
            # No thinking block means the agent dropped it: "" (not None) says so.
            "reasoning_content": "".join(thinking),
        }
    )
    message._handles = tuple(handles)
    return message


def _tools(tools: list[dict[str, Any]] | None, dropped: Any) -> list[ToolSpec] | None:
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            dropped[str(kind)] += 1  # a server tool (web search, code execution): not ours
            continue
        name = tool.get("name")
        if not isinstance(name, str):
            raise _fail("a tool needs a string 'name'", f"tools.{k}.name")
        spec = FunctionSpec(
            name=name,
            description=tool.get("description"),
            parameters=tool.get("input_schema") or {"type": "object", "properties": {}},
        )
        out.append(ToolSpec(function=spec))
    return out or None


def _tool_choice(choice: dict[str, Any] | None) -> Literal["auto", "none"] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    raise forced_tool_choice(kind, "tool_choice.type")


class AnthropicDialect(Dialect):
    """`POST /v1/messages`: Anthropic's message object and its event stream."""

    def translate(self, body: Any, session: Session) -> ChatCompletionRequest:
        request = validated(MessagesRequest, body)
        messages: list[RequestMessage] = []
        system = _system(request.system)
        if system is not None:
            messages.append(RequestMessage(role="system", content=system))
        for i, m in enumerate(request.messages):
            role, content = m.get("role"), m.get("content")
            if role == "user":
                messages += _user(content, i)
            elif role == "assistant":
                messages.append(_assistant(content, i))
            elif role == "system":
                text = "\n\n".join(_texts(content, f"messages.{i}.content"))
                messages.append(RequestMessage(role="system", content=text))
            else:
                raise _fail(f"unknown role {role!r}", f"messages.{i}.role")
        self.stream = request.stream
        self.auxiliary = request.output_config is not None and "format" in request.output_config
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.session = session
        self._index = 0
        try:
            return ChatCompletionRequest(
                model=request.model,
                messages=messages,
                tools=_tools(request.tools, self.dropped_tools),
                tool_choice=_tool_choice(request.tool_choice),
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                max_tokens=request.max_tokens,
                stop=request.stop_sequences,
            )
        except ValidationError as exc:
            raise validation_error(exc) from exc

    # -- the reply -----------------------------------------------------------------------

    def _blocks(self, prepared: PreparedTurn) -> list[dict[str, Any]]:
        reply = prepared.reply
        blocks: list[dict[str, Any]] = []
        if reply.get("reasoning_content"):
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": reply["reasoning_content"],
                    "signature": self.handle(prepared),
                }
            )
        if reply.get("content"):
            blocks.append({"type": "text", "text": reply["content"]})
        for call in reply.get("tool_calls") or ():
            fn = call["function"]
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError:
                arguments = {}
            if not isinstance(arguments, dict):
                arguments = {"value": arguments}
            blocks.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{secrets.token_hex(12)}",
                    "name": fn["name"],
                    "input": arguments,
                }
            )
        return blocks

    def _stop_reason(self, prepared: PreparedTurn) -> str:
        if prepared.finish_reason == "tool_calls":
            return "tool_use"
        if prepared.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if prepared.stop_sequence is not None else "end_turn"

    def _usage(self, prompt_tokens: int, cached: int, output: int) -> dict[str, int]:
        return {
            "input_tokens": prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output,
        }

    def body(self, prepared: PreparedTurn) -> dict[str, Any]:
        output = len(prepared.turn.completion_ids)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.gateway.model,
            "content": self._blocks(prepared),
            "stop_reason": self._stop_reason(prepared),
            "stop_sequence": prepared.stop_sequence,
            "usage": self._usage(prepared.prompt_tokens, prepared.cached_tokens, output),
        }

    def opening(self, prompt_tokens: int, cached_tokens: int) -> list[bytes]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.gateway.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(prompt_tokens, cached_tokens, 0),
        }
        return [_event({"type": "message_start", "message": message}), self.keepalive()]

    def keepalive(self) -> bytes:
        return _event({"type": "ping"})

    def _block_event(self, type_: str, **fields: Any) -> bytes:
        return _event({"type": type_, "index": self._index, **fields})

    def _start_text(self, kind: TextKind) -> list[bytes]:
        if kind == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        return [self._block_event("content_block_start", content_block=block)]

    def _text_delta(self, kind: TextKind, text: str) -> list[bytes]:
        if kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        return [self._block_event("content_block_delta", delta=delta)]

    def _end_text(self, kind: TextKind) -> list[bytes]:
        out = []
        if kind == "reasoning":
            delta = {"type": "signature_delta", "signature": self.handle()}
            out.append(self._block_event("content_block_delta", delta=delta))
        out.append(self._block_event("content_block_stop"))
        self._index += 1
        return out

    def records(self, prepared: PreparedTurn) -> list[bytes]:
        out = self._rest_of_text(prepared)
        for block in self._blocks(prepared):
            if block["type"] != "tool_use":
                continue
            start = {**block, "input": {}}
            arguments = json.dumps(block["input"], ensure_ascii=False)
            out.append(self._block_event("content_block_start", content_block=start))
            out += [
                self._block_event(
                    "content_block_delta", delta={"type": "input_json_delta", "partial_json": p}
                )
                for p in text_pieces(arguments)
            ]
            out.append(self._block_event("content_block_stop"))
            self._index += 1
        delta = {
            "stop_reason": self._stop_reason(prepared),
            "stop_sequence": prepared.stop_sequence,
        }
        usage = {"output_tokens": len(prepared.turn.completion_ids)}
        out.append(_event({"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(_event({"type": "message_stop"}))
        return out

    # -- errors --------------------------------------------------------------------------

    def error_record(self, exc: Exception) -> bytes:
        return _event(_error_body(exc)[1])

    @classmethod
    def error_response(cls, exc: Exception) -> Response:
        status, body = _error_body(exc)
        return JSONResponse(body, status_code=status)


def _error_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    """Anthropic's envelope, which the official SDK turns into its typed exceptions."""
    failure = classify(exc)
    type_ = _ERROR_TYPES.get(failure.status, "api_error")
    return failure.status, {"type": "error", "error": {"type": type_, "message": failure.message}}


def _event(payload: dict[str, Any]) -> bytes:
    name = payload["type"].encode()
    return (
        b"event: " + name + b"\ndata: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
    )
