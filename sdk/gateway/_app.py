"""`create_app`: the gateway's HTTP face, an ASGI app speaking OpenAI's chat wire format.

The chat endpoint does its work inside the response object rather than before it, because
a turn may only be recorded once its reply went out: one task holds the session, samples,
sends, and then commits. A watcher beside it listens for the client leaving; a client that
leaves before the reply is sent cancels the sampling request, and nothing is recorded.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .._exceptions import (
    GatewayRequestError,
    GatewaySessionError,
    PliesError,
    PolicyError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
    TokenizationError,
)
from ..trajectory import Status
from ._gateway import Gateway
from ._schemas import ChatCompletionRequest, ErrorType, chunk, completion, error_body
from ._session import PreparedTurn, Session

__all__ = ["create_app"]

log = logging.getLogger("plies.gateway")

_M = TypeVar("_M", bound=BaseModel)


MAX_BODY_BYTES = 8 << 20
"""The largest request body: a whole agent transcript is far smaller (32k tokens of text is
about 128 KiB); past it a client could make the gateway buffer without bound."""


def create_app(gateway: Gateway, *, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The ASGI app for `gateway`; mount it on your own server or run `GatewayServer`.

    Routes: `POST /v1/chat/completions`, `GET /v1/models` (bearer: a session key),
    `POST /v1/sessions`, `POST /v1/sessions/{key}/finish`, `DELETE /v1/sessions/{key}`
    (bearer: the gateway's admin token), and `GET /health`. A body over `max_body_bytes`
    is refused with 413 before it is read whole.
    """

    async def _json(request: Request, *, empty_ok: bool = False) -> Any:
        return await _read_json(request, max_body_bytes, empty_ok=empty_ok)

    async def chat_completions(request: Request) -> Response:
        key = _bearer(request)
        gateway.session(key)
        body = await _json(request)
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        return _TurnResponse(gateway, key, chat)

    async def models(request: Request) -> Response:
        key = _bearer(request)
        if not _is_admin(gateway, key):
            gateway.session(key)
        card = {"id": gateway.model, "object": "model", "created": 0, "owned_by": "plies"}
        return JSONResponse({"object": "list", "data": [card]})

    async def create_session(request: Request) -> Response:
        _admin(gateway, request)
        spec = _parse(_SessionSpec, await _json(request, empty_ok=True))
        key = await gateway.create_session(spec.task_id, group_id=spec.group_id, info=spec.info)
        return JSONResponse({"key": key}, status_code=201)

    async def finish_session(request: Request) -> Response:
        _admin(gateway, request)
        outcome = _parse(_Finish, await _json(request, empty_ok=True))
        trajectory = await gateway.finish_session(
            request.path_params["key"],
            reward=outcome.reward,
            status=outcome.status,
            error=outcome.error,
        )
        return Response(trajectory.model_dump_json(), media_type="application/json")

    async def drop_session(request: Request) -> Response:
        _admin(gateway, request)
        await gateway.drop_session(request.path_params["key"])
        return Response(status_code=204)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": gateway.open_sessions})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/sessions", create_session, methods=["POST"]),
            Route("/v1/sessions/{key}/finish", finish_session, methods=["POST"]),
            Route("/v1/sessions/{key}", drop_session, methods=["DELETE"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={
            PliesError: _on_error,
            Exception: _on_error,
            404: _not_found,
            405: _not_allowed,
        },
    )


class _SessionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    group_id: str = ""
    info: dict[str, Any] = Field(default_factory=dict)


class _Finish(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    status: Status = Status.COMPLETED
    error: str | None = None


# -- the turn --------------------------------------------------------------------------


class _TurnResponse(Response):
    """Holds the session, samples, sends the reply, and only then records the turn."""

    def __init__(self, gateway: Gateway, key: str, request: ChatCompletionRequest):
        self.gateway = gateway
        self.key = key
        self.request = request
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            async with self.gateway.turn(self.key) as session:
                try:
                    delivered = await self._serve(session, receive, send_tracked)
                except Exception:
                    session.lose_conversation()
                    raise
                if not delivered:
                    session.lose_conversation()
        except Exception as exc:
            if started:
                log.warning("turn failed after its reply started: %r", exc)
                return
            await _error_response(exc)(scope, receive, send)
            return
        if not started:  # finish_session or drop_session cut the turn off
            cut = GatewaySessionError("the session was finished or dropped during this request")
            await _error_response(cut)(scope, receive, send)

    async def _serve(self, session: Session, receive: Receive, send: Send) -> bool:
        """Returns whether the reply was delivered (and the turn committed)."""
        gone = False
        failure: Exception | None = None
        prepared: PreparedTurn | None = None
        messages: list[Message] = []
        async with anyio.create_task_group() as tg:
            work = anyio.CancelScope()

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                work.cancel()

            tg.start_soon(watch)
            with work:
                try:
                    prepared = await self.gateway.prepare(session, self.request)
                    messages = self._messages(prepared)
                    for message in messages[:-1]:
                        await send(message)
                except Exception as exc:  # re-raised below, outside the task group
                    failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if gone or prepared is None:
            return False
        await send(messages[-1])
        session.commit(prepared)
        return True

    def _messages(self, prepared: PreparedTurn) -> list[Message]:
        """The ASGI messages of the reply; the last one completes it."""
        model = self.gateway.model
        id_ = f"chatcmpl-{uuid.uuid4().hex}"
        usage = (prepared.prompt_tokens, len(prepared.turn.completion_ids))
        if not self.request.stream:
            body = completion(
                id_=id_,
                model=model,
                message=prepared.reply,
                finish_reason=prepared.finish_reason,
                prompt_tokens=usage[0],
                completion_tokens=usage[1],
            )
            data = json.dumps(body, ensure_ascii=False).encode()
            return [
                _start(200, b"application/json", len(data)),
                {"type": "http.response.body", "body": data, "more_body": False},
            ]
        created = int(time.time())
        events = [
            chunk(id_=id_, model=model, created=created, delta=d) for d in _deltas(prepared.reply)
        ]
        events.append(
            chunk(id_=id_, model=model, created=created, finish_reason=prepared.finish_reason)
        )
        options = self.request.stream_options
        if options is not None and options.include_usage:
            events.append(chunk(id_=id_, model=model, created=created, usage=usage))
        out: list[Message] = [_start(200, b"text/event-stream", None)]
        for event in events:
            line = b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"
            out.append({"type": "http.response.body", "body": line, "more_body": True})
        out.append({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return out


def _deltas(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as stream deltas: role, reasoning, content, then each tool call."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if reply.get("reasoning_content"):
        deltas.append({"reasoning_content": reply["reasoning_content"]})
    if reply.get("content"):
        deltas.append({"content": reply["content"]})
    for i, call in enumerate(reply.get("tool_calls") or ()):
        fn = call["function"]
        head = {"index": i, "id": call["id"], "type": "function"}
        deltas.append({"tool_calls": [{**head, "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return deltas


def _start(status: int, content_type: bytes, length: int | None) -> Message:
    headers = [(b"content-type", content_type)]
    if length is None:
        headers.append((b"cache-control", b"no-cache"))
    else:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


# -- auth and parsing ------------------------------------------------------------------


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise GatewaySessionError(
            "missing bearer key: send the session key as the API key (Authorization: Bearer <key>)"
        )
    return token.strip()


def _is_admin(gateway: Gateway, token: str) -> bool:
    admin = gateway.admin_token
    return admin is not None and hmac.compare_digest(token.encode(), admin.encode())


def _admin(gateway: Gateway, request: Request) -> None:
    if gateway.admin_token is None:
        raise _HTTPError(403, "permission_error", "session administration over HTTP is disabled")
    if not _is_admin(gateway, _bearer(request)):
        raise _HTTPError(401, "authentication_error", "this route needs the admin token")


async def _read_json(request: Request, limit: int, *, empty_ok: bool) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise _too_large(len(raw), limit)
    if not raw.strip() and empty_ok:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise GatewayRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise GatewayRequestError("the request body is nested too deeply") from None


def _too_large(size: int, limit: int) -> _HTTPError:
    message = f"request body of {size} bytes or more exceeds the gateway's {limit}-byte limit"
    return _HTTPError(413, "invalid_request_error", message)


def _parse(model: type[_M], body: Any) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def _validation_error(exc: ValidationError) -> GatewayRequestError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    where = f" at {param}" if param else ""
    return GatewayRequestError(f"invalid request{where}: {first['msg']}", param=param)


# -- errors as OpenAI's envelope ---------------------------------------------------------


class _HTTPError(PliesError):
    """An HTTP-only refusal (admin routes) with its status and OpenAI error type."""

    def __init__(self, status: int, type_: ErrorType, message: str):
        super().__init__(message)
        self.status = status
        self.type_ = type_


_CLIENT_FAULTS = frozenset({400, 413, 422})
"""Sampler statuses that blame the request (a context too long, a bad seed): passed on as a
400, since the same request would fail again; any other sampler error is the gateway's."""

_STATUS: list[tuple[type[Exception], int, ErrorType]] = [
    (GatewaySessionError, 401, "authentication_error"),
    (GatewayRequestError, 400, "invalid_request_error"),
    (TokenizationError, 400, "invalid_request_error"),
    (PolicyUnavailable, 503, "service_unavailable"),
    (PolicyOutcomeUnknown, 504, "server_error"),
    (PolicyError, 502, "server_error"),
]


async def _on_error(request: Request, exc: Exception) -> Response:
    return _error_response(exc)


def _error_response(exc: Exception) -> Response:
    """The OpenAI error envelope and status for any exception; unexpected ones are 500."""
    if isinstance(exc, _HTTPError):
        return JSONResponse(error_body(str(exc), exc.type_), status_code=exc.status)
    if isinstance(exc, PolicyResponseError) and exc.status in _CLIENT_FAULTS:
        message = f"the policy server refused the request: {exc}"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)
    for cls, status, type_ in _STATUS:
        if isinstance(exc, cls):
            param = getattr(exc, "param", None)
            return JSONResponse(error_body(str(exc), type_, param=param), status_code=status)
    log.error("gateway error: %r", exc, exc_info=exc)
    return JSONResponse(error_body(str(exc), "server_error"), status_code=500)


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse(
        error_body(f"no route {request.url.path}", "not_found_error"), status_code=404
    )


async def _not_allowed(request: Request, exc: Exception) -> Response:
    message = f"{request.method} is not allowed on {request.url.path}"
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=405)
