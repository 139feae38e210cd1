"""The "httptools" transport: keep-alive HTTP/1.1 on asyncio's protocols, parsed by llhttp.

Why a transport of plies' own: a policy client sends one small JSON request per turn and
reads one answer, thousands at once, and the CPU each costs caps a rollout process's turns
per second. aiohttp's `ClientSession` spends most of a small request's CPU on its request
and response objects, header multidicts, timers and traces (`bench/runtime_bench.py` sets the
two side by side; docs/scaling.md quotes it). This one does only what a policy client needs:
it writes the request in one call, hands every byte of the answer to httptools' parser
(llhttp, in C) in `data_received`, and wakes the request once, when the answer is complete
(or, streamed, when its head and each piece arrive). Parsing stays with the library; what is
plies' own is the connection pool and the failure kinds of the seam.

Bounds: an answer's head (status line and headers) over `MAX_HEAD_BYTES`, a parse error, or
bytes from an engine that was not asked anything drop the connection ("dropped"). `read` is
the longest silence while an answer is awaited, one timer per request however many pieces
arrive; `write` bounds a body that does not fit the socket's buffer; `pool` the wait for a
free connection past `connection_limit()`; `connect` making one.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from .._exceptions import ConfigError
from .._net import CLIENT_KEEPALIVE_S
from ._config import Timeout
from ._transport import (
    Headers,
    Reply,
    StreamReply,
    Transport,
    TransportFailure,
    connection_limit,
)

__all__ = ["MAX_HEAD_BYTES", "HttptoolsTransport"]

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes an answer's status line and headers may take; an engine's take a few
hundred. Past it the connection is dropped, so a hostile or broken peer cannot grow one."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""What a header's name may hold (RFC 9110's token)."""

Origin = tuple[str, str, int]
"""scheme, host, port: the connections a request may use."""


class _Failed(Exception):
    """Why a connection stopped mid-answer; the request says which failure kind it is."""


class _Connection(asyncio.Protocol):
    """One connection: one request at a time, its answer parsed as the bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin):
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.last_data = 0.0
        # The answer in progress (reset by `begin`).
        self.in_head = False
        self.head_bytes = 0
        self.head_done: asyncio.Future[int] | None = None
        """Only for a stream, whose caller needs the status before the body."""
        self.done: asyncio.Future[None] | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.body_arrived: asyncio.Future[None] | None = None
        self.until_close = False
        self.keep_alive = False
        self.writable: asyncio.Future[None] | None = None

    # -- the exchange -----------------------------------------------------------------------

    def begin(self, streamed: bool) -> None:
        """Expect an answer to the request about to be written."""
        self.in_head = True
        self.head_bytes = 0
        self.head_done = self.loop.create_future() if streamed else None
        self.done = self.loop.create_future()
        self.body.clear()
        self.until_close = True
        self.keep_alive = False
        self.last_data = self.loop.time()

    def fail(self, why: BaseException) -> None:
        """Stop the answer in progress with `why`, and the connection with it."""
        for waiter in (self.head_done, self.done, self.body_arrived, self.writable):
            if waiter is not None and not waiter.done():
                waiter.set_exception(why)
                waiter.exception()  # a failure nobody awaits any more is not "never retrieved"
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport  # asyncio sets TCP_NODELAY on every TCP transport

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        if self.done is None or self.done.done():
            self.fail(_Failed("the engine sent bytes nobody asked for"))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.fail(_Failed(f"a malformed answer: {e}"))
            return
        if self.in_head:
            self.head_bytes += len(data)  # the parser holds at most one read beyond the bound
            if self.head_bytes > MAX_HEAD_BYTES:
                self.fail(_Failed(f"an answer's head passed {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.in_head and self.until_close:
            self.finished()  # an answer with neither a length nor chunks ends here
        self.fail(_Failed(f"the connection closed mid-exchange ({exc or 'by the engine'})"))

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done is None or self.done.done():  # a second answer in the same bytes
            raise _Failed("the engine sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value):
            self.until_close = False

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.body_arrived is not None and not self.body_arrived.done():
            self.body_arrived.set_result(None)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.finished()

    def finished(self) -> None:
        if self.done is None or self.done.done():
            return
        self.in_head = False
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_result(self.parser.get_status_code())
        self.done.set_result(None)
        if self.body_arrived is not None and not self.body_arrived.done():
            self.body_arrived.set_result(None)


class HttptoolsTransport(Transport):
    """Connections per origin on a free list, at most `connection_limit()` open at once."""

    def __init__(self, timeout: Timeout, headers: Mapping[str, str]):
        super().__init__(timeout, headers)
        self._own = _header_lines(headers)
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._opening = 0
        self._limit = connection_limit()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, tuple[Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    # -- connections --------------------------------------------------------------------------

    def _open_count(self) -> int:
        return len(self._busy) + self._opening + sum(len(c) for c in self._idle.values())

    async def _acquire(self, origin: Origin) -> _Connection:
        """A kept-alive connection to `origin`, or a new one once the limit allows."""
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout.pool is None else loop.time() + self.timeout.pool
        while self._waiters and self._waiters[0].done():  # gave up waiting
            self._waiters.popleft()
        wait = bool(self._waiters)  # others wait for a connection already: after them
        while True:
            if wait:
                await self._queue(loop, deadline)
            idle = self._idle.get(origin)
            now = loop.time()
            while idle:
                conn = idle.pop()
                if conn.closed or now - conn.idle_since > CLIENT_KEEPALIVE_S:
                    conn.abort()  # its engine may close it any moment now: not worth the race
                    continue
                self._busy.add(conn)
                return conn
            if self._open_count() >= self._limit:
                self._close_one_idle()
            if self._open_count() < self._limit:
                return await self._connect(loop, origin)
            wait = True

    async def _queue(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Wait for a connection to be released (or a slot to free), first come first served.

        Raises:
            TransportFailure: "no_connection", the pool timeout passed first.
        """
        waiter = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self._wake()  # woken as it gave up: the turn passes to the next one
            else:
                waiter.cancel()  # left in the queue, where `_wake` passes over it
            if isinstance(e, TimeoutError):
                raise TransportFailure("no_connection", e) from e
            raise

    def _close_one_idle(self) -> None:
        """Make room for a connection elsewhere: close the longest idle one, if any."""
        oldest = min(
            (c for conns in self._idle.values() for c in conns),
            key=lambda c: c.idle_since,
            default=None,
        )
        if oldest is not None:
            self._idle[oldest.origin].remove(oldest)
            oldest.abort()

    async def _connect(self, loop: asyncio.AbstractEventLoop, origin: Origin) -> _Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or httpx.create_ssl_context()
        self._opening += 1
        try:
            async with asyncio.timeout(self.timeout.connect):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, origin),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context else None,
                )
        except BaseException as e:
            self._opening -= 1
            self._wake()  # its slot is free again
            if isinstance(e, OSError | TimeoutError):  # refused, unreachable, TLS, too slow
                raise TransportFailure("refused", e) from e
            raise
        self._opening -= 1
        self._busy.add(conn)
        return conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        self._busy.discard(conn)
        if reusable and not conn.closed and not self._closed:
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.origin, []).append(conn)
        else:
            conn.abort()
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    # -- one request ---------------------------------------------------------------------------

    def _target(self, url: str) -> tuple[Origin, bytes]:
        """The origin and the request line's start (`path HTTP/1.1`, host) of `url`."""
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL with a host: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        host = parts.netloc.rpartition("@")[2]
        try:
            line = f" {path} HTTP/1.1\r\nhost: {host}\r\n".encode("ascii")
        except UnicodeEncodeError:
            raise ConfigError(f"not an ASCII URL (encode it first): {url!r}") from None
        known = ((parts.scheme, parts.hostname, port), line)
        if len(self._targets) < 256:  # engines x paths: a handful in practice
            self._targets[url] = known
        return known

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: Headers, streamed: bool
    ) -> _Connection:
        """A connection that has sent the request and awaits its answer."""
        if self._closed:
            raise TransportFailure("refused", RuntimeError("the transport is closed"))
        origin, line = self._target(url)
        head = method.encode("ascii") + line + self._own
        if headers:
            head += _header_lines(headers)
        if body is not None:
            head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        conn = await self._acquire(origin)
        conn.begin(streamed)
        assert conn.transport is not None
        conn.transport.write(head + b"\r\n" + body if body is not None else head + b"\r\n")
        if conn.writable is not None:  # past the socket's buffer: wait for it to drain
            try:
                async with asyncio.timeout(self.timeout.write):
                    await conn.writable
            except TimeoutError as e:
                self._release(conn, reusable=False)
                raise TransportFailure("timeout", e) from e
            except _Failed as e:
                self._release(conn, reusable=False)
                raise TransportFailure("dropped", e) from e
        return conn

    async def _wait(self, conn: _Connection, waiter: asyncio.Future[Any]) -> Any:
        """`waiter`'s result, while the answer is silent for at most `timeout.read`."""
        read = self.timeout.read
        if read is None:
            return await waiter
        loop = conn.loop
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal timer
            quiet_until = conn.last_data + read
            if loop.time() < quiet_until:
                timer = loop.call_at(quiet_until, check)
            elif not waiter.done():
                conn.fail(TimeoutError(f"no answer within {read} s"))

        timer = loop.call_at(conn.last_data + read, check)
        try:
            return await waiter
        finally:
            timer.cancel()

    def _failure(self, error: BaseException) -> TransportFailure:
        kind = "timeout" if isinstance(error, TimeoutError) else "dropped"
        return TransportFailure(kind, error)

    async def request(self, method: str, url: str, body: bytes | None, headers: Headers) -> Reply:
        conn = await self._send(method, url, body, headers, streamed=False)
        try:
            await self._wait(conn, conn.done)  # type: ignore[arg-type]
        except (_Failed, TimeoutError) as e:
            self._release(conn, reusable=False)
            raise self._failure(e) from e
        except BaseException:
            self._release(conn, reusable=False)  # cancelled: its answer may still come
            raise
        status = conn.parser.get_status_code()
        reply = Reply(status, b"".join(conn.body))
        conn.body.clear()
        self._release(conn, conn.keep_alive)
        return reply

    @asynccontextmanager
    async def stream(
        self, method: str, url: str, body: bytes | None, headers: Headers
    ) -> AsyncIterator[StreamReply]:
        conn = await self._send(method, url, body, headers, streamed=True)
        try:
            status = await self._wait(conn, conn.head_done)  # type: ignore[arg-type]
        except (_Failed, TimeoutError) as e:
            self._release(conn, reusable=False)
            raise self._failure(e) from e
        except BaseException:
            self._release(conn, reusable=False)
            raise

        async def pieces() -> AsyncIterator[bytes]:
            assert conn.done is not None
            while True:
                while conn.body:
                    yield conn.body.popleft()
                if conn.done.done():
                    error = conn.done.exception()
                    if error is not None:
                        raise self._failure(error) from error
                    return
                conn.body_arrived = conn.loop.create_future()
                try:
                    await self._wait(conn, conn.body_arrived)
                except (_Failed, TimeoutError) as e:
                    raise self._failure(e) from e
                finally:
                    conn.body_arrived = None

        async def lines() -> AsyncIterator[bytes]:
            rest = b""
            async for piece in pieces():
                *whole, rest = (rest + piece).split(b"\n")
                for line in whole:
                    yield line.rstrip(b"\r")
            if rest:
                yield rest.rstrip(b"\r")

        async def read() -> bytes:
            return b"".join([piece async for piece in pieces()])

        try:
            yield StreamReply(status, lines(), read)
        finally:
            done = conn.done is not None and conn.done.done() and conn.done.exception() is None
            self._release(conn, reusable=done and conn.keep_alive)

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
        for conn in list(self._busy):
            conn.fail(_Failed("the client was closed"))
        self._busy.clear()
        self._wake()


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """`name: value\\r\\n` for each header; a name or value that would end the line early is
    refused rather than sent (it would smuggle another header or request)."""
    lines = []
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or "\r" in value or "\n" in value:
            raise ConfigError(f"header {name!r} cannot be sent: a line break or a bad name")
        lines.append(f"{name}: {value}\r\n")
    try:
        return "".join(lines).encode("latin-1")
    except UnicodeEncodeError as e:
        raise ConfigError(f"a header is not Latin-1 text: {e}") from None
