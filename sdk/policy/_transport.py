"""How a policy client's requests reach an engine: one seam over the HTTP library.

`HTTPPolicyClient` speaks to engines only through a `Transport`: one request in, a `Reply`
(status and body) or a `TransportFailure` out. A transport translates its library's
exceptions into the four `FailureKind`s at this edge, and the client turns each kind into a
plies error by one rule for every transport (`_http.py`): what never reached an engine may be
retried, what may have run never is. Everything else a transport must do the same way: keep
connections alive for `CLIENT_KEEPALIVE_S`, set TCP_NODELAY, send the client's headers, and
bound each request by the `Timeout` phases.

Transports, by name (`HTTPPolicyClient(transport=...)`):

- "httptools" (default): plies' own keep-alive HTTP/1.1 connections on asyncio's protocols,
  parsed by httptools (`_h1.py`, which says why).
- "aiohttp": one `aiohttp.ClientSession`, a connection per request in flight, up
  to `connection_limit()` (half the process's open-file limit): beyond it a request waits up
  to `Timeout.pool` for a free connection, rather than failing for want of a file descriptor.
  Its pool finds a free connection in O(1), so cost per request stays flat as thousands wait
  on the engine. aiohttp has no write timeout: a body over 64 KiB bounds its whole request by the
  sum of the phases instead; a smaller one is buffered whole, so its write cannot stall.
- "httpx", "httpx2": `AsyncClient`s in lanes of `LANE_REQUESTS` requests each. httpcore's
  pool scans its connections against its waiting requests on every change, so one client
  shared by C requests costs O(C) per request; lanes keep each pool small.

`bench/runtime_bench.py` and `bench/queue_bench.py` measure each against a minimal client;
docs/scaling.md quotes them.
"""

from __future__ import annotations

import json
import resource
import ssl
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import httpx

from .._exceptions import PolicyError
from .._net import CLIENT_KEEPALIVE_S
from ._config import Timeout

__all__ = [
    "LANE_REQUESTS",
    "AiohttpTransport",
    "FailureKind",
    "Headers",
    "LanedHttpxTransport",
    "Reply",
    "StreamReply",
    "Transport",
    "TransportFailure",
    "connection_limit",
]

Headers = Mapping[str, str] | None
"""A request's own headers, beside the client's."""

LANE_REQUESTS = 8
"""Most requests one httpx client carries at once."""

FailureKind = Literal["refused", "no_connection", "timeout", "dropped"]
"""Why a request got no answer, which decides whether it may have run:

- "refused": no connection could be made (refused, connect timeout, unresolvable host);
  the engine never saw the request and is probably down.
- "no_connection": every allowed connection stayed busy for the pool timeout; never sent.
- "timeout": sent, and no whole answer came within the read (or write) timeout.
- "dropped": the connection failed or garbled the answer mid-request.
"""


class TransportFailure(PolicyError):
    """A request got no HTTP answer; `kind` says whether it may have reached the engine.

    Raised by transports and translated by `HTTPPolicyClient._send`; callers never see it.
    """

    def __init__(self, kind: FailureKind, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Reply:
    """An engine's whole HTTP answer."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; `ValueError` if it is not."""
        return json.loads(self.body)


class StreamReply:
    """An engine's answer arriving in pieces: its status at once, then its body's lines.

    A failure while reading raises `TransportFailure` ("timeout" or "dropped": the request
    was sent, so it may have run).
    """

    def __init__(self, status: int, lines: AsyncIterator[bytes], read: Callable[[], Any]):
        self.status = status
        self._lines = lines
        self._read = read

    def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, line ends stripped, as they arrive."""
        return self._lines

    async def reply(self) -> Reply:
        """The rest of the body at once (an error answer), as a `Reply`."""
        return Reply(self.status, await self._read())


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_json(payload: Any) -> bytes:
    """The one JSON encoding every transport sends: compact, UTF-8, no NaN."""
    return _ENCODER.encode(payload).encode()


class Transport(ABC):
    """One HTTP library under a policy client. Opened lazily, closed by `aclose`."""

    def __init__(self, timeout: Timeout, headers: Mapping[str, str]):
        self.timeout = timeout
        self.headers = dict(headers)

    @abstractmethod
    async def request(self, method: str, url: str, body: bytes | None, headers: Headers) -> Reply:
        """Send one request (a JSON body when `body` is given) and read the whole answer.

        Raises:
            TransportFailure: no answer; its `kind` says whether the request may have run.
        """

    @abstractmethod
    def stream(
        self, method: str, url: str, body: bytes | None, headers: Headers
    ) -> AbstractAsyncContextManager[StreamReply]:
        """Send one request and hold its answer open to be read as it arrives.

        Raises:
            TransportFailure: no answer began; its `kind` says whether the request may have
                run.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection. Safe to call more than once."""


_JSON = {"content-type": "application/json"}


_WRITE_BUFFER = 2**16
"""Bytes asyncio and aiohttp buffer before a write waits for the socket: a smaller body
never stalls in the write, so only a larger one needs aiohttp's whole-request bound."""

_URLS_KEPT = 256
"""Parsed request URLs kept: engines x paths, so a handful in practice."""


def connection_limit() -> int:
    """Connections one aiohttp transport may hold: half the process's soft open-file limit.

    Each connection is a file descriptor: unbounded, a burst of thousands of requests fails
    on "Too many open files" (docs/scaling.md, `bench/queue_bench.py`). The other half is
    left to the run's files, pipes, sandboxes and any server in the process.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 20


class AiohttpTransport(Transport):
    """aiohttp's `ClientSession`, one connection per request in flight."""

    def __init__(self, timeout: Timeout, headers: Mapping[str, str]):
        import aiohttp
        import yarl

        super().__init__(timeout, headers)
        self._aiohttp = aiohttp
        self._yarl = yarl
        # aiohttp's `connect` bounds the wait for a pooled connection and making one, together.
        acquire = (
            None if None in (timeout.pool, timeout.connect) else timeout.pool + timeout.connect
        )
        self._timeout = aiohttp.ClientTimeout(
            connect=acquire, sock_connect=timeout.connect, sock_read=timeout.read
        )
        phases = (timeout.connect, timeout.write, timeout.read)
        self._bounded = aiohttp.ClientTimeout(
            total=None if None in phases else sum(p for p in phases if p is not None),
            connect=acquire,
            sock_connect=timeout.connect,
            sock_read=timeout.read,
        )
        self._limit = connection_limit()
        self._in_flight = 0
        self._urls: dict[str, Any] = {}
        self._session: Any = None
        self._ssl: ssl.SSLContext | None = None

    def _open(self) -> Any:
        aiohttp = self._aiohttp
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._limit, keepalive_timeout=CLIENT_KEEPALIVE_S, ssl=self._ssl
            ),
            timeout=self._timeout,
            headers=self.headers,
        )
        return self._session

    def _call(self, method: str, url: str, body: bytes | None, headers: Headers) -> Any:
        """The session's request context for one request, headers and bounds set."""
        session = self._session or self._open()
        options: dict[str, Any] = {}
        if body is not None:
            headers = _JSON if headers is None else {**_JSON, **headers}
            if len(body) > _WRITE_BUFFER:
                options["timeout"] = self._bounded
        target = self._urls.get(url)
        if target is None:  # parsing a URL costs more than the rest of a small request
            target = self._yarl.URL(url)
            if len(self._urls) < _URLS_KEPT:
                self._urls[url] = target
        return session.request(method, target, data=body, headers=headers, **options)

    def _failure(self, error: Exception, began: bool, queued: bool) -> TransportFailure:
        """The kind of a `TimeoutError` or `aiohttp.ClientError`; `began`: an answer began;
        `queued`: every allowed connection was busy when the request came.

        A connect timeout of a queued request was (at least partly) the wait for a
        connection: "no_connection", which does not mark the engine down."""
        aiohttp = self._aiohttp
        refused = (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError)
        if isinstance(error, refused) and not began:
            if isinstance(error, TimeoutError) and queued:
                return TransportFailure("no_connection", error)
            return TransportFailure("refused", error)
        if isinstance(error, TimeoutError):  # sock_read, or the whole request's bound
            return TransportFailure("timeout", error)
        return TransportFailure("dropped", error)

    async def request(self, method: str, url: str, body: bytes | None, headers: Headers) -> Reply:
        self._in_flight += 1
        queued = self._in_flight > self._limit
        try:
            async with self._call(method, url, body, headers) as resp:
                return Reply(resp.status, await resp.read())
        except (TimeoutError, self._aiohttp.ClientError) as e:
            raise self._failure(e, False, queued) from e
        finally:
            self._in_flight -= 1

    @asynccontextmanager
    async def stream(
        self, method: str, url: str, body: bytes | None, headers: Headers
    ) -> AsyncIterator[StreamReply]:
        errors = (TimeoutError, self._aiohttp.ClientError)
        began = False

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for line in resp.content:
                    yield line.rstrip(b"\r\n")
            except errors as e:
                raise self._failure(e, True, queued) from e

        self._in_flight += 1
        queued = self._in_flight > self._limit
        try:
            async with self._call(method, url, body, headers) as resp:
                began = True
                yield StreamReply(resp.status, lines(), resp.read)
        except errors as e:
            raise self._failure(e, began, queued) from e
        finally:
            self._in_flight -= 1

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class _Lane:
    __slots__ = ("http", "in_flight")

    def __init__(self, http: Any):
        self.http = http
        self.in_flight = 0


class LanedHttpxTransport(Transport):
    """httpx's (or httpx2's, the same API) `AsyncClient`s, `LANE_REQUESTS` requests each."""

    def __init__(self, timeout: Timeout, headers: Mapping[str, str], lib: ModuleType):
        super().__init__(timeout, headers)
        self._lib = lib
        self._lanes: list[_Lane] = []
        self._ssl: ssl.SSLContext | None = None  # one for all lanes: each costs ~20 ms to load

    def _open_lane(self) -> _Lane:
        lib = self._lib
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        t = self.timeout
        lane = _Lane(
            lib.AsyncClient(
                verify=self._ssl,
                timeout=lib.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
                headers=self.headers,
                limits=lib.Limits(
                    max_connections=LANE_REQUESTS,
                    max_keepalive_connections=LANE_REQUESTS,
                    keepalive_expiry=CLIENT_KEEPALIVE_S,
                ),
            )
        )
        self._lanes.append(lane)
        return lane

    def _lane(self) -> _Lane:
        for lane in self._lanes:
            if lane.in_flight < LANE_REQUESTS:
                return lane
        return self._open_lane()

    def _failure(self, error: Exception) -> TransportFailure:
        lib = self._lib
        if isinstance(error, lib.ConnectError | lib.ConnectTimeout):
            return TransportFailure("refused", error)
        if isinstance(error, lib.PoolTimeout):
            return TransportFailure("no_connection", error)
        if isinstance(error, lib.TimeoutException):
            return TransportFailure("timeout", error)
        return TransportFailure("dropped", error)

    async def request(self, method: str, url: str, body: bytes | None, headers: Headers) -> Reply:
        lane = self._lane()
        if body is not None:
            headers = _JSON if headers is None else {**_JSON, **headers}
        lane.in_flight += 1
        try:
            resp = await lane.http.request(method, url, content=body, headers=headers)
        except self._lib.TransportError as e:
            raise self._failure(e) from e
        finally:
            lane.in_flight -= 1
        return Reply(resp.status_code, resp.content)

    @asynccontextmanager
    async def stream(
        self, method: str, url: str, body: bytes | None, headers: Headers
    ) -> AsyncIterator[StreamReply]:
        lane = self._lane()
        if body is not None:
            headers = _JSON if headers is None else {**_JSON, **headers}
        errors = self._lib.TransportError

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for line in resp.aiter_lines():
                    yield line.encode()
            except errors as e:
                raise self._failure(e) from e

        lane.in_flight += 1
        try:
            async with lane.http.stream(method, url, content=body, headers=headers) as resp:
                yield StreamReply(resp.status_code, lines(), resp.aread)
        except errors as e:
            raise self._failure(e) from e
        finally:
            lane.in_flight -= 1

    async def aclose(self) -> None:
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            await lane.http.aclose()
