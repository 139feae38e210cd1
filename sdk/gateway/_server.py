"""`GatewayServer`: the gateway's app served by uvicorn on the caller's event loop.

The socket is bound before uvicorn starts, so port 0 works and `url` is known the moment
the context is entered. With `uds` the same app is also served on a Unix socket (owner-only):
an agent in a sandbox without a network reaches the gateway through it (see
`plies.environments.Forward`). Signals stay with the caller: uvicorn would otherwise take SIGINT
and re-raise it after shutdown, fighting plies' own signal handling.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import uvicorn
from anyio.abc import TaskGroup

from .._exceptions import GatewayError, UsageError
from .._net import SERVER_HTTP, SERVER_KEEPALIVE_S
from ._app import DEFAULT_KEEPALIVE_S, create_app
from ._gateway import Gateway

__all__ = ["DEFAULT_HOST", "GatewayServer"]

DEFAULT_HOST = "127.0.0.1"
"""Loopback: a gateway hands out sampling to anyone holding a key, so it is not exposed
unless asked."""
_STARTUP_TIMEOUT = 30.0
_SHUTDOWN_GRACE = 5.0


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """Serve `gateway` over HTTP until the context exits.

    Args:
        gateway: an opened `Gateway` (enter it first, leave it after).
        host: bind address; loopback by default.
        port: 0 picks a free port.
        keepalive_s: seconds between keepalive events of a stream still sampling.
        uds: also serve on a Unix socket at this path (made owner-only; removed on close).

    Example::

        async with Gateway(client, renderer) as gw, GatewayServer(gw) as server:
            print(server.url)  # http://127.0.0.1:PORT/v1
    """

    def __init__(
        self,
        gateway: Gateway,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        uds: str | os.PathLike[str] | None = None,
    ):
        self.gateway = gateway
        self.keepalive_s = keepalive_s
        self.host = host
        self.port = port
        self.uds = None if uds is None else Path(uds)
        self._server: _Uvicorn | None = None
        self._tg: TaskGroup | None = None
        self._done = anyio.Event()
        self._closed = False

    @property
    def url(self) -> str:
        """The OpenAI base URL (ending in /v1), as `OPENAI_BASE_URL` wants it."""
        if self._server is None:
            raise UsageError("the server is not running; use `async with GatewayServer(...)`")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def __aenter__(self) -> GatewayServer:
        if self._server is not None or self._closed:
            raise UsageError("a GatewayServer can be started once")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit it: without it each kept-alive response waits out a
            # delayed ACK (about 40 ms on Linux loopback).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise GatewayError(
                f"cannot bind the gateway to {self.host}:{self.port}: {err}"
            ) from err
        self.port = sock.getsockname()[1]
        sockets = [sock]
        if self.uds is not None:
            sockets.append(self._bind_uds(self.uds, sock))
        config = uvicorn.Config(
            create_app(self.gateway, keepalive_s=self.keepalive_s),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(_SHUTDOWN_GRACE),
            timeout_keep_alive=SERVER_KEEPALIVE_S,
            http=SERVER_HTTP,
        )
        server = self._server = _Uvicorn(config)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()

        async def serve() -> None:
            try:
                await server.serve(sockets=sockets)
            finally:
                for s in sockets:
                    s.close()
                if self.uds is not None:
                    self.uds.unlink(missing_ok=True)
                self._done.set()

        self._tg.start_soon(serve)
        with anyio.move_on_after(_STARTUP_TIMEOUT):
            while not server.started and not server.should_exit:
                await anyio.sleep(0.005)
        if not server.started:
            await self.aclose()
            raise GatewayError(f"the gateway did not start on {self.host}:{self.port}")
        return self

    @staticmethod
    def _bind_uds(path: Path, tcp: socket.socket) -> socket.socket:
        usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if path.is_socket():  # a stale one of an earlier run; any other file is refused
                path.unlink()
            usock.bind(str(path))
            path.chmod(0o600)
            usock.listen(2048)
            usock.setblocking(False)
        except OSError as err:
            usock.close()
            tcp.close()
            raise GatewayError(f"cannot bind the gateway to {path}: {err}") from err
        return usock

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop serving: in-flight requests get a short grace, then are cut off. Idempotent."""
        if self._closed or self._tg is None or self._server is None:
            self._closed = True
            return
        self._closed = True
        server, tg = self._server, self._tg
        server.should_exit = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_GRACE * 2):
            await self._done.wait()
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)
