"""A plies `Env`'s tools served over MCP for one episode, so agents that speak MCP can use them.

`EnvMcpServer(env)` serves an env that was already reset: `tools/list` offers its tools with
their JSON schemas, `tools/call` runs `env.call_tool` and answers its `ToolResult` (an error
result has `isError`; a call after the episode is done is refused the same way). The server
speaks streamable HTTP through the official `mcp` SDK (its low-level `Server` and
`StreamableHTTPSessionManager`), on loopback, at `url`, behind a bearer token made for the
episode: an agent CLI is given the URL and the `Authorization` header, nothing else can call.
Request bodies are bounded (`max_request_bytes`) and so are concurrent MCP sessions.

The results the env gave, in order, are in `results`; `reward` is what they paid; the env's
`done` says whether the episode ended. The env stays the caller's to close.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
from typing import Any

import anyio
import uvicorn
from anyio.abc import TaskGroup

from plies import EnvError, UsageError
from plies._lifecycle import AsyncLifecycle
from plies._net import SERVER_HTTP

from ._env import Env, ToolResult
from .mcp_client import _sdk_major

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "EnvMcpServer"]

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""Largest request body accepted: far above any tool call, far below what hurts."""

_MAX_SESSIONS = 8
_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_GRACE_S = 2.0


class _EndedStreamFilter(logging.Filter):
    """Drops the SDK's traceback for an agent's event stream cut by the server's own shutdown.

    Agents keep a standalone event stream (an HTTP GET) open for the whole session; when the
    episode's server stops, the SDK's stream writer finds its memory stream closed and logs
    that as an error with a traceback, onto the user's terminal, on every episode's end.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, anyio.ClosedResourceError)


_SDK_LOG = logging.getLogger("mcp.server.streamable_http")


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:  # signals stay with plies' own handling
        yield


class EnvMcpServer(AsyncLifecycle):
    """Serve one episode's env over MCP (streamable HTTP) until the context exits.

    Args:
        env: an env that was reset (its tools are the episode's).
        name: the server name MCP clients see.
        max_request_bytes: larger request bodies get 413.

    Example:
        ```python
        async with BlackjackEnv() as env:
            await env.reset(Task(id="hand", seed=3))
            async with EnvMcpServer(env) as server:
                # an agent gets server.url and server.headers
                ...
            server.reward, env.done
        ```
    """

    def __init__(
        self,
        env: Env,
        *,
        name: str = "plies-env",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.env = env
        self.name = name
        self.max_request_bytes = max_request_bytes
        self.token = secrets.token_urlsafe(24)
        self.results: list[ToolResult] = []
        self._port = 0
        self._tg: TaskGroup | None = None
        self._server: _Uvicorn | None = None
        self._stopped = anyio.Event()
        self._sessions_open = False
        """Whether the MCP session manager runs: uvicorn may still hand a request over after
        it stopped, while a cancelled episode closes the server."""

    @property
    def url(self) -> str:
        """The MCP endpoint, e.g. `http://127.0.0.1:PORT/mcp`."""
        self._check_open("read its url")
        return f"http://127.0.0.1:{self._port}/mcp"

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends with every request."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def reward(self) -> float:
        """What the calls served so far paid (refused calls pay nothing)."""
        return sum(r.reward for r in self.results if not r.error)

    async def __aenter__(self) -> EnvMcpServer:
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        self._open()
        if not any(isinstance(f, _EndedStreamFilter) for f in _SDK_LOG.filters):
            _SDK_LOG.addFilter(_EndedStreamFilter())
        manager = StreamableHTTPSessionManager(
            self._mcp_server(),
            max_request_body_size=self.max_request_bytes,
            max_sessions=_MAX_SESSIONS,
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise EnvError(f"cannot bind an MCP server on 127.0.0.1: {err}") from err
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._asgi(manager),
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=SERVER_HTTP,
        )
        server = self._server = _Uvicorn(config)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()

        async def serve() -> None:
            try:
                async with manager.run():
                    self._sessions_open = True
                    try:
                        await server.serve(sockets=[sock])
                    finally:
                        self._sessions_open = False
            finally:
                sock.close()
                self._stopped.set()

        self._tg.start_soon(serve)
        with anyio.move_on_after(_STARTUP_TIMEOUT_S):
            while not server.started and not self._stopped.is_set():
                await anyio.sleep(0.005)
        if not server.started:
            await self.__aexit__(None, None, None)
            raise EnvError("the env's MCP server did not start")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._close() or self._tg is None or self._server is None:
            return
        self._server.should_exit = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_GRACE_S * 2):
            await self._stopped.wait()
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    def _mcp_server(self) -> Any:
        from mcp import types
        from mcp.server.lowlevel import Server

        def listed() -> list[types.Tool]:
            return [
                types.Tool(name=t.name, description=t.description, inputSchema=t.parameters)
                for t in self.env.tools()
            ]

        # The env validates arguments itself, with the same schema, and says what was wrong.
        async def called(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            try:
                result = await self.env.call_tool(name, arguments)
            except UsageError as err:
                text = types.TextContent(type="text", text=f"Error: {err}")
                return types.CallToolResult(content=[text], isError=True)
            self.results.append(result)
            text = types.TextContent(type="text", text=result.content)
            return types.CallToolResult(content=[text], isError=result.error)

        if _sdk_major() >= 2:  # 2.x: handlers are given to the constructor

            async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
                return types.ListToolsResult(tools=listed())

            async def on_call_tool(ctx: Any, params: Any) -> types.CallToolResult:
                return await called(params.name, dict(params.arguments or {}))

            return Server(self.name, on_list_tools=on_list_tools, on_call_tool=on_call_tool)

        server: Server[Any, Any] = Server(self.name)

        @server.list_tools()
        async def list_tools() -> list[types.Tool]:
            return listed()

        @server.call_tool(validate_input=False)
        async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            return await called(name, arguments)

        return server

    def _asgi(self, manager: Any) -> Any:
        from starlette.responses import PlainTextResponse

        expected = f"Bearer {self.token}".encode()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            if scope["path"].rstrip("/") != "/mcp":
                await PlainTextResponse("not found", status_code=404)(scope, receive, send)
                return
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, expected):
                await PlainTextResponse("unauthorized", status_code=401)(scope, receive, send)
                return
            try:
                await manager.handle_request(scope, receive, send)
            except RuntimeError:
                # The manager stopped before or while this request was handed over (the SDK
                # says so with a RuntimeError): an answer, not a traceback in the run's log.
                if self._sessions_open:
                    raise
                closing = PlainTextResponse("the env's MCP server is closing", status_code=503)
                await closing(scope, receive, send)

        return app
