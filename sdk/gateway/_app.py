"""`create_app`: the gateway's HTTP face, an ASGI app speaking three model wire formats.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages are translated into one
internal request (`ChatCompletionRequest`) over the same sessions, and the reply is written
back by the request's `Dialect`. Each endpoint does its work inside the response object
rather than before it, because a turn may only be recorded once its reply went out: one task
holds the session, samples, sends, and then commits. A watcher beside it listens for the
client leaving; a client that leaves before the reply is sent cancels the sampling request,
and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import uuid
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .._exceptions import GatewayRequestError, GatewaySessionError, PliesError
from ..trajectory import Status
from ._anthropic import AnthropicDialect
from ._chat import ChatDialect, Dialect
from ._errors import HTTPError, validated
from ._gateway import Gateway
from ._responses import ResponsesDialect
from ._schemas import ChatCompletionRequest
from ._session import PreparedTurn, Session
from ._stream import ReplyStream, TextKind

__all__ = ["DEFAULT_KEEPALIVE_S", "MAX_BODY_BYTES", "create_app"]

log = logging.getLogger("plies.gateway")


MAX_BODY_BYTES = 8 << 20
"""The largest request body: a whole agent transcript is far smaller (Claude Code's first
request is about 78 KB, Codex's 41 KB); past it a client could make the gateway buffer
without bound."""
BRANCH_HEADERS = ("x-plies-branch", "x-openai-subagent")
"""Headers that name the agent or sub-agent a request came from (Codex sends the second)."""
MAX_BRANCH_NAME = 128
DEFAULT_KEEPALIVE_S = 5.0
"""Seconds between keepalive events of a stream whose completion is still sampling: well
inside Codex's 300 s stream idle timeout and the 10 s agents are promised."""


def create_app(
    gateway: Gateway,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
) -> Starlette:
    """The ASGI app for `gateway`; mount it on your own server or run `GatewayServer`.

    Routes: `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages` (with
    or without `?beta=true`), `POST /v1/messages/count_tokens`, `GET /v1/models` (a session
    key as the bearer token or `x-api-key`), `POST /v1/sessions`, `POST
    /v1/sessions/{key}/finish`, `DELETE /v1/sessions/{key}` (the gateway's admin token),
    `GET /health`, and `GET`/`HEAD` on `/` and `/v1` for agents' reachability probes. A body
    over `max_body_bytes` is refused with 413 before it is read whole.
    """

    async def _json(request: Request, *, empty_ok: bool = False) -> Any:
        return await _read_json(request, max_body_bytes, empty_ok=empty_ok)

    async def _turn(request: Request, dialect_type: type[Dialect]) -> Response:
        key = _session_key(request)
        gateway.session(key)
        dialect = dialect_type(gateway)
        chat = dialect.translate(await _json(request), gateway.session(key))
        branch = next((request.headers[h] for h in BRANCH_HEADERS if h in request.headers), None)
        return _TurnResponse(gateway, key, chat, dialect, keepalive_s, branch)

    async def chat_completions(request: Request) -> Response:
        return await _turn(request, ChatDialect)

    async def responses(request: Request) -> Response:
        return await _turn(request, ResponsesDialect)

    async def messages(request: Request) -> Response:
        return await _turn(request, AnthropicDialect)

    async def count_tokens(request: Request) -> Response:
        key = _session_key(request)
        gateway.session(key)
        body = await _json(request)
        dialect = AnthropicDialect(gateway)
        chat = dialect.translate({**body, "max_tokens": 1}, gateway.session(key))
        async with gateway.turn(key) as session:
            n = await gateway.count_tokens(session, chat)
        return JSONResponse({"input_tokens": n})

    async def models(request: Request) -> Response:
        key = _session_key(request)
        if not _is_admin(gateway, key):
            gateway.session(key)
        if "anthropic-version" in request.headers:
            card = {
                "type": "model",
                "id": gateway.model,
                "display_name": gateway.model,
                "created_at": "1970-01-01T00:00:00Z",
            }
            page = {"data": [card], "has_more": False, "first_id": card["id"]}
            return JSONResponse({**page, "last_id": card["id"]})
        card = {"id": gateway.model, "object": "model", "created": 0, "owned_by": "plies"}
        return JSONResponse({"object": "list", "data": [card]})

    async def probe(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def create_session(request: Request) -> Response:
        _admin(gateway, request)
        spec = validated(_SessionSpec, await _json(request, empty_ok=True))
        key = await gateway.create_session(spec.task_id, group_id=spec.group_id, info=spec.info)
        return JSONResponse({"key": key}, status_code=201)

    async def finish_session(request: Request) -> Response:
        _admin(gateway, request)
        outcome = validated(_Finish, await _json(request, empty_ok=True))
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
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/", probe, methods=["GET", "HEAD"]),
            Route("/v1", probe, methods=["GET", "HEAD"]),
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
    """Holds the session, samples, sends the reply, and only then records the turn.

    A streamed reply opens (status, headers and the dialect's opening events) with the first
    text the sampler streams (`ReplyStream`), or once sampling has taken `keepalive_s`, and
    sends the dialect's keepalive every `keepalive_s` from then on, so no agent's stream
    idle timer fires while a slow engine samples (or thinks, which streams nothing until its
    reasoning closes). A quick completion is sent whole, and a failure before the stream
    opened still gets its HTTP status.
    """

    def __init__(
        self,
        gateway: Gateway,
        key: str,
        request: ChatCompletionRequest,
        dialect: Dialect,
        keepalive_s: float,
        branch: str | None = None,
    ):
        self.gateway = gateway
        self.key = key
        self.request = request
        self.dialect = dialect
        self.keepalive_s = keepalive_s
        self.branch = None if branch is None else branch[:MAX_BRANCH_NAME]
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = finished = False

        async def send_tracked(message: Message) -> None:
            nonlocal started, finished
            started = True
            finished = not message.get("more_body", False) and message["type"].endswith("body")
            await send(message)

        failure: Exception | None = None
        try:
            async with self.gateway.turn(self.key) as session:
                await self._serve(session, receive, send_tracked)
        except Exception as exc:
            failure = exc
        if not started:
            if failure is None:  # finish_session or drop_session cut the turn off
                failure = GatewaySessionError(
                    "the session was finished or dropped during this request"
                )
            await self.dialect.error_response(failure)(scope, receive, send)
        elif not finished:
            failure = failure or GatewaySessionError("the session ended during this request")
            log.warning("turn failed after its stream opened: %r", failure)
            with contextlib.suppress(Exception):  # the client may be gone already
                await send(_body(self.dialect.error_record(failure), more=False))

    async def _serve(self, session: Session, receive: Receive, send: Send) -> None:
        """Sample, send and commit; a turn not delivered releases what it took."""
        gone = opened = False
        failure: Exception | None = None
        prepared: PreparedTurn | None = None
        messages: list[Message] = []
        prompt: tuple[int, int] = (0, 0)
        rendered = anyio.Event()
        sending = anyio.Lock()
        keeper = anyio.CancelScope()

        def on_prompt(n_prompt: int, cached: int) -> None:
            nonlocal prompt
            prompt = (n_prompt, cached)
            rendered.set()

        async def open_stream() -> None:  # under `sending`
            nonlocal opened
            if not opened:
                await send(_start(200, b"text/event-stream", None))
                opened = True
                for record in self.dialect.opening(*prompt):
                    await send(_body(record))

        async def keep_alive() -> None:
            with keeper:
                await anyio.sleep(self.keepalive_s)
                await rendered.wait()
                async with sending:
                    await open_stream()
                while True:
                    await anyio.sleep(self.keepalive_s)
                    async with sending:
                        await send(_body(self.dialect.keepalive()))

        async def emit(kind: TextKind, text: str) -> None:
            async with sending:
                await open_stream()
                for record in self.dialect.text_records(kind, text):
                    await send(_body(record))

        async with anyio.create_task_group() as tg:
            work = anyio.CancelScope()

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                work.cancel()

            tg.start_soon(watch)
            if self.dialect.stream:
                tg.start_soon(keep_alive)
            with work:
                try:
                    prepared = await self.gateway.prepare(
                        session,
                        self.request,
                        on_prompt=on_prompt,
                        branch_name=self.branch,
                        auxiliary=self.dialect.auxiliary,
                        stream=(
                            ReplyStream(emit, self.dialect.streamed)
                            if self.dialect.stream
                            else None
                        ),
                    )
                    keeper.cancel()
                    async with sending:
                        messages = self._messages(prepared, opened)
                        for message in messages[:-1]:
                            await send(message)
                except Exception as exc:  # re-raised below, outside the task group
                    failure = exc
            tg.cancel_scope.cancel()
        if prepared is None:  # `prepare` released what it took
            if failure is not None:
                raise failure
            return
        committed = False
        try:
            if failure is not None:
                raise failure
            if gone:
                return
            await send(messages[-1])
            session.commit(prepared)
            committed = True
        finally:
            if not committed:
                session.lose(prepared.taken)
        session.dropped_tools.update(self.dialect.dropped_tools)
        self.dialect.committed(session, prepared)

    def _messages(self, prepared: PreparedTurn, opened: bool) -> list[Message]:
        """The ASGI messages of the reply; the last one completes it."""
        if not self.dialect.stream:
            data = json.dumps(self.dialect.body(prepared), ensure_ascii=False).encode()
            return [_start(200, b"application/json", len(data)), _body(data, more=False)]
        out: list[Message] = []
        if not opened:
            out.append(_start(200, b"text/event-stream", None))
            out += [
                _body(r)
                for r in self.dialect.opening(prepared.prompt_tokens, prepared.cached_tokens)
            ]
        records = self.dialect.records(prepared)
        out += [_body(r) for r in records[:-1]]
        out.append(_body(records[-1], more=False))
        return out


def _body(data: bytes, *, more: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


def _start(status: int, content_type: bytes, length: int | None) -> Message:
    headers = [(b"content-type", content_type)]
    if length is None:
        headers.append((b"cache-control", b"no-cache"))
    else:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


# -- auth and parsing ------------------------------------------------------------------


def _session_key(request: Request) -> str:
    """The key an agent sends as its API key: `x-api-key` (Anthropic) or a bearer token."""
    api_key = request.headers.get("x-api-key", "").strip()
    if api_key:
        return api_key
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise GatewaySessionError(
            "missing bearer key: send the session key as the API key "
            "(Authorization: Bearer <key>, or x-api-key: <key>)"
        )
    return token.strip()


def _is_admin(gateway: Gateway, token: str) -> bool:
    admin = gateway.admin_token
    return admin is not None and hmac.compare_digest(token.encode(), admin.encode())


def _admin(gateway: Gateway, request: Request) -> None:
    if gateway.admin_token is None:
        raise HTTPError(403, "permission_error", "session administration over HTTP is disabled")
    if not _is_admin(gateway, _session_key(request)):
        raise HTTPError(401, "authentication_error", "this route needs the admin token")


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


def _too_large(size: int, limit: int) -> HTTPError:
    message = f"request body of {size} bytes or more exceeds the gateway's {limit}-byte limit"
    return HTTPError(413, "invalid_request_error", message)


# -- errors ----------------------------------------------------------------------------


async def _on_error(request: Request, exc: Exception) -> Response:
    return _dialect_of(request).error_response(exc)


def _dialect_of(request: Request) -> type[Dialect]:
    """Errors raised before a dialect was chosen are written in the route's dialect."""
    if request.url.path.startswith("/v1/messages"):
        return AnthropicDialect
    return ChatDialect


async def _not_found(request: Request, exc: Exception) -> Response:
    failure = HTTPError(404, "not_found_error", f"no route {request.url.path}")
    return _dialect_of(request).error_response(failure)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    message = f"{request.method} is not allowed on {request.url.path}"
    return _dialect_of(request).error_response(HTTPError(405, "invalid_request_error", message))
