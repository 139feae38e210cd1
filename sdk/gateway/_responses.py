"""OpenAI Responses (`POST /v1/responses`), as Codex, the Agents SDK and litellm speak it.

The request becomes the gateway's internal chat request:

- `instructions` becomes the first system message; `input` a string (one user message) or
  items. A `message` item (also an item without `type`, as the Agents SDK sends its first
  one) keeps its role (`developer` and `system` are system messages), its `input_text` /
  `output_text` parts joined; `function_call`, `reasoning` and assistant `message` items
  that follow one another make one assistant turn (its tool calls, reasoning and text; a
  reasoning item's `encrypted_content` and `id` are looked up as handles the gateway
  minted, and a turn with no reasoning item dropped its reasoning on purpose);
  `function_call_output` becomes a tool message. Images, files and other item kinds are
  refused by name.
- `previous_response_id` puts the stored conversation of that response (the request's
  history and its reply) before `input`; an id this session did not serve is a 400.
- `function` tools are served (`strict` accepted), and so are the functions inside a
  `namespace` tool (Codex groups each MCP server's tools and its sub-agent tools that way):
  the model sees each as `<namespace>__<name>`, the name Claude Code gives MCP tools too,
  and its call goes back as a `function_call` with `namespace` and `name` apart; a replayed
  call with a `namespace` is read the same way. `web_search`, `custom` and every other tool
  kind (in a namespace too) are dropped and counted in the session's metrics
  (`dropped_tool.<kind>`), so Codex, which always sends a `web_search` tool, still works.
  `tool_choice` `required` or a named tool is refused.
- `store`, `include`, `reasoning`, `text`, `metadata`, `prompt_cache_key` and unknown keys
  (null or not) are accepted and do not change sampling.

The reply: a `reasoning` item (summary text, and `encrypted_content`: a handle plies minted
for the sampled turn), an assistant `message` with `output_text`, and `function_call` items;
streamed with `type` and `sequence_number` on every event, from `response.created` to
`response.completed` (or `response.incomplete` at the token limit, `response.failed` after an
error). While the completion samples, `response.in_progress` is repeated as the keepalive.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._exceptions import GatewayRequestError
from ._chat import Dialect, text_pieces
from ._errors import classify, forced_tool_choice, validated, validation_error
from ._schemas import ChatCompletionRequest, FunctionSpec, RequestMessage, ToolSpec
from ._session import MAX_HANDLE_CHARS, PreparedTurn, Session
from ._stream import TextKind

__all__ = ["MAX_STORED_RESPONSES", "ResponsesDialect"]

REASONING_ID_PREFIX = "rs_"
"""A reasoning item's id is this + the turn's handle, so an echoed id names the turn too."""
MAX_STORED_RESPONSES = 64
"""Responses per session that `previous_response_id` can name (the most recent ones)."""

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class ResponsesRequest(BaseModel):
    """The fields of `POST /v1/responses` that decide the turn; the rest are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None


def _fail(message: str, param: str) -> GatewayRequestError:
    return GatewayRequestError(message, param=param)


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail("content must be a string or a list of parts", param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in _TEXT_PARTS:
            out.append(str(part.get("text") or ""))
        else:
            raise _fail(
                f"content part of type {kind!r} is not supported: the gateway serves "
                "text-only models",
                f"{param}.{j}",
            )
    return "".join(out)


class _Turn:
    """An assistant turn being assembled from consecutive output items."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.reasoning: list[str] = []
        self.handles: list[str] = []

    @property
    def has_output(self) -> bool:
        return bool(self.texts or self.calls)

    def message(self) -> RequestMessage:
        message = RequestMessage.model_validate(
            {
                "role": "assistant",
                "content": "".join(self.texts),
                "tool_calls": self.calls or None,
                # No reasoning item means the agent dropped it: "" (not None) says so.
                "reasoning_content": "".join(self.reasoning),
            }
        )
        message._handles = tuple(self.handles)
        return message


def _items(items: str | list[dict[str, Any]]) -> list[RequestMessage]:
    if isinstance(items, str):
        return [RequestMessage(role="user", content=items)]
    out: list[RequestMessage] = []
    turn: _Turn | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn.message())
            turn = None

    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type") or "message"
        role = item.get("role")
        if kind == "message" and role == "assistant":
            if turn is not None and turn.has_output:
                flush()
            turn = turn or _Turn()
            turn.texts.append(_text(item.get("content"), f"{param}.content"))
        elif kind == "reasoning":
            if turn is not None and turn.has_output:
                flush()
            turn = turn or _Turn()
            parts = item.get("content") or item.get("summary") or []
            turn.reasoning.append(_text(parts, f"{param}.summary"))
            turn.handles += _handles(item)
        elif kind == "function_call":
            turn = turn or _Turn()
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str | dict):
                raise _fail("a function_call needs a string 'name' and 'arguments'", param)
            namespace = item.get("namespace")
            if isinstance(namespace, str) and namespace:
                name = _flat_name(namespace, name)
            fn = {"name": name, "arguments": arguments}
            turn.calls.append({"id": item.get("call_id"), "type": "function", "function": fn})
        elif kind == "function_call_output":
            flush()
            call_id = item.get("call_id")
            text = _text(item.get("output"), f"{param}.output")
            out.append(RequestMessage(role="tool", content=text, tool_call_id=call_id))
        elif kind == "message":
            flush()
            if role not in ("user", "system", "developer"):
                raise _fail(f"unknown role {role!r}", f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            out.append(RequestMessage(role=role, content=text))
        else:
            raise _fail(f"input item of type {kind!r} is not supported", f"{param}.type")
    flush()
    return out


def _handles(item: dict[str, Any]) -> list[str]:
    """The handles a replayed reasoning item carries: its `encrypted_content`, and its `id`
    (`rs_` + the handle), which an agent that did not ask for encrypted content still echoes."""
    out = []
    sealed, id_ = item.get("encrypted_content"), item.get("id")
    if isinstance(sealed, str) and sealed:
        out.append(sealed[:MAX_HANDLE_CHARS])
    if isinstance(id_, str) and id_.startswith(REASONING_ID_PREFIX):
        out.append(id_.removeprefix(REASONING_ID_PREFIX)[:MAX_HANDLE_CHARS])
    return out


def _flat_name(namespace: str, name: str) -> str:
    """The one name the model sees for a function inside a namespace."""
    return f"{namespace}__{name}"


def _function(tool: dict[str, Any], param: str, namespace: str | None = None) -> ToolSpec:
    name = tool.get("name")
    if not isinstance(name, str):
        raise _fail("a function tool needs a string 'name'", f"{param}.name")
    spec = FunctionSpec(
        name=name if namespace is None else _flat_name(namespace, name),
        description=tool.get("description"),
        parameters=tool.get("parameters") or {"type": "object", "properties": {}},
    )
    return ToolSpec(function=spec)


def _tools(
    tools: list[dict[str, Any]] | None, dropped: Any
) -> tuple[list[ToolSpec] | None, dict[str, tuple[str, str]]]:
    """The served tools, and each namespaced one's flat name -> (namespace, name)."""
    out: list[ToolSpec] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for k, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, f"tools.{k}"))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools") or []
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
                raise _fail("a namespace needs a string 'name' and a list 'tools'", f"tools.{k}")
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    dropped[str(sub.get("type") if isinstance(sub, dict) else sub)] += 1
                    continue
                out.append(_function(sub, f"tools.{k}.tools.{j}", namespace))
                namespaced[out[-1].function.name] = (namespace, sub["name"])
        else:
            dropped[str(kind)] += 1  # web_search, custom, hosted: not served
    names = [t.function.name for t in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise _fail(f"tools named more than once (namespaces flattened): {twice[:8]}", "tools")
    return out or None, namespaced


def _tool_choice(choice: str | dict[str, Any] | None) -> Literal["auto", "none"] | None:
    if choice is None or choice in ("auto", "none"):
        return choice  # type: ignore[return-value]
    named = choice if isinstance(choice, str) else choice.get("type")
    raise forced_tool_choice(named, "tool_choice")


class ResponsesDialect(Dialect):
    """`POST /v1/responses`: the response object and its typed, numbered event stream."""

    def translate(self, body: Any, session: Session) -> ChatCompletionRequest:
        request = validated(ResponsesRequest, body)
        history: list[RequestMessage] = []
        if request.previous_response_id is not None:
            stored = session.responses.get(request.previous_response_id)
            if stored is None:
                raise _fail(
                    f"previous_response_id {request.previous_response_id[:64]!r} names no "
                    "response of this session (unknown, or past the last "
                    f"{MAX_STORED_RESPONSES})",
                    "previous_response_id",
                )
            history = list(stored)
        self.history = [*history, *_items(request.input)]
        messages = list(self.history)
        if request.instructions:
            messages.insert(0, RequestMessage(role="system", content=request.instructions))
        self.request = request
        self.stream = bool(request.stream)
        self.session = session
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._index = 0
        tools, self.namespaced = _tools(request.tools, self.dropped_tools)
        try:
            return ChatCompletionRequest(
                model=request.model,
                messages=messages,
                tools=tools,
                tool_choice=_tool_choice(request.tool_choice),
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_output_tokens,
            )
        except ValidationError as exc:
            raise validation_error(exc) from exc

    def committed(self, session: Session, prepared: PreparedTurn) -> None:
        session.responses[self.id] = [*self.history, RequestMessage.model_validate(prepared.reply)]
        while len(session.responses) > MAX_STORED_RESPONSES:
            del session.responses[next(iter(session.responses))]

    # -- the reply -----------------------------------------------------------------------

    def _output(self, prepared: PreparedTurn) -> list[dict[str, Any]]:
        reply = prepared.reply
        items: list[dict[str, Any]] = []
        if reply.get("reasoning_content"):
            handle = self.handle(prepared)
            items.append(
                {
                    "type": "reasoning",
                    "id": REASONING_ID_PREFIX + handle,
                    "summary": [{"type": "summary_text", "text": reply["reasoning_content"]}],
                    "encrypted_content": handle,
                }
            )
        if reply.get("content"):
            part = {"type": "output_text", "text": reply["content"], "annotations": []}
            items.append(
                {
                    "type": "message",
                    "id": self.message_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
            )
        for call in reply.get("tool_calls") or ():
            fn = call["function"]
            item = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
            if fn["name"] in self.namespaced:
                item["namespace"], item["name"] = self.namespaced[fn["name"]]
            items.append(item)
        return items

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.gateway.model,
            "output": output,
            "usage": usage,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "metadata": {},
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tool_choice": request.tool_choice or "auto",
            "tools": [],
            "previous_response_id": request.previous_response_id,
            "max_output_tokens": request.max_output_tokens,
        }

    def _usage(self, prepared: PreparedTurn) -> dict[str, Any]:
        output = len(prepared.turn.completion_ids)
        return {
            "input_tokens": prepared.prompt_tokens,
            "input_tokens_details": {"cached_tokens": prepared.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": prepared.reasoning_tokens},
            "total_tokens": prepared.prompt_tokens + output,
        }

    def _status(self, prepared: PreparedTurn) -> str:
        return "incomplete" if prepared.finish_reason == "length" else "completed"

    def body(self, prepared: PreparedTurn) -> dict[str, Any]:
        return self._response(self._status(prepared), self._output(prepared), self._usage(prepared))

    def _event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, ensure_ascii=False).encode()
        return b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n"

    def opening(self, prompt_tokens: int, cached_tokens: int) -> list[bytes]:
        response = self._response("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def keepalive(self) -> bytes:
        return self._event("response.in_progress", response=self._response("in_progress", []))

    def _text_item(self, kind: TextKind) -> dict[str, Any]:
        """The reasoning or message item holding the text streamed so far."""
        text = self.streamed[kind]
        if kind == "reasoning":
            handle = self.handle()
            return {
                "type": "reasoning",
                "id": REASONING_ID_PREFIX + handle,
                "summary": [{"type": "summary_text", "text": text}],
                "encrypted_content": handle,
            }
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }

    def _at(self, kind: TextKind) -> dict[str, Any]:
        item_id = REASONING_ID_PREFIX + self.handle() if kind == "reasoning" else self.message_id
        index = "summary_index" if kind == "reasoning" else "content_index"
        return {"output_index": self._index, "item_id": item_id, index: 0}

    def _start_text(self, kind: TextKind) -> list[bytes]:
        ev, item = self._event, self._text_item(kind)
        if kind == "reasoning":
            added = {**item, "summary": []}
            part = {"type": "summary_text", "text": ""}
            opened = "response.reasoning_summary_part.added"
        else:
            added = {**item, "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            opened = "response.content_part.added"
        return [
            ev("response.output_item.added", output_index=self._index, item=added),
            ev(opened, **self._at(kind), part=part),
        ]

    def _text_delta(self, kind: TextKind, text: str) -> list[bytes]:
        if kind == "reasoning":
            return [
                self._event("response.reasoning_summary_text.delta", **self._at(kind), delta=text)
            ]
        return [
            self._event("response.output_text.delta", **self._at(kind), delta=text, logprobs=[])
        ]

    def _end_text(self, kind: TextKind) -> list[bytes]:
        ev, at, item = self._event, self._at(kind), self._text_item(kind)
        text = self.streamed[kind]
        if kind == "reasoning":
            part = item["summary"][0]
            out = [
                ev("response.reasoning_summary_text.done", **at, text=text),
                ev("response.reasoning_summary_part.done", **at, part=part),
            ]
        else:
            part = item["content"][0]
            out = [
                ev("response.output_text.done", **at, text=text, logprobs=[]),
                ev("response.content_part.done", **at, part=part),
            ]
        out.append(ev("response.output_item.done", output_index=self._index, item=item))
        self._index += 1
        return out

    def records(self, prepared: PreparedTurn) -> list[bytes]:
        out = self._rest_of_text(prepared)
        items = self._output(prepared)
        for item in items:
            if item["type"] == "function_call":
                out += self._call_events(item)
        status = self._status(prepared)
        response = self._response(status, items, self._usage(prepared))
        out.append(self._event(f"response.{status}", response=response))
        return out

    def _call_events(self, item: dict[str, Any]) -> list[bytes]:
        ev, index = self._event, self._index
        at = {"output_index": index, "item_id": item["id"]}
        added = {**item, "status": "in_progress", "arguments": ""}
        out = [ev("response.output_item.added", output_index=index, item=added)]
        out += [
            ev("response.function_call_arguments.delta", **at, delta=p)
            for p in text_pieces(item["arguments"])
        ]
        out += [
            ev(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            ),
            ev("response.output_item.done", output_index=index, item=item),
        ]
        self._index += 1
        return out

    def error_record(self, exc: Exception) -> bytes:
        failure = classify(exc)
        error = {"code": failure.type_, "message": failure.message}
        return self._event("response.failed", response=self._response("failed", [], error=error))
