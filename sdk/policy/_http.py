"""What every HTTP policy backend shares: lifetime, engine choice, retries, error mapping.

Engine choice: with a session key, rendezvous hashing over the engines that are up keeps a
session on one engine (its prefix cache holds the history) and moves only the sessions of an
engine that goes down. Without one, the engine with the fewest requests in flight is used.

An engine that refuses a connection is skipped for `RetryPolicy.down_for` seconds, then
probed with `GET /health` before it gets traffic again.

The session key also travels as a header (`X-Session-ID` unless the client names another),
so a router in front of many engines, shared by many rollout processes, can keep every
request of an episode on the engine whose prefix cache holds its history.

Requests go through a `Transport` (`_transport.py`): plies' own on httptools' parser by
default (`_h1.py`), aiohttp, httpx or httpx2 on request. The transport only says whether a
request got an answer and, if not, which of four ways it failed; the rules below are applied
here, the same for every transport.

Errors are translated at this edge, and whether a failure may be retried depends only on
whether the request provably never reached the engine:

- refused connection, connect timeout, pool timeout, HTTP 503: `PolicyUnavailable`, retried
  with tenacity (bounded, jittered), on another engine when there is one;
- read/write timeout, dropped connection, garbled answer, 502/504: `PolicyOutcomeUnknown`,
  never repeated;
- other 4xx/5xx answers and malformed bodies: `PolicyResponseError`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal, Self, TypedDict, get_args
from urllib.parse import urlencode

import anyio

from .._exceptions import (
    ConfigError,
    PolicyError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
)
from .._lifecycle import AsyncCloseable
from .._net import http_base_url
from .._retry import RetryPolicy
from ._config import DEFAULT_RETRY, DEFAULT_TIMEOUT, Timeout
from ._h1 import HttptoolsTransport
from ._transport import (
    AiohttpTransport,
    LanedHttpxTransport,
    Reply,
    StreamReply,
    Transport,
    TransportFailure,
    encode_json,
)
from ._types import Completion, PolicyChoice, PolicyClientBase, SamplingParams

__all__ = ["HTTPOptions", "HTTPPolicyClient"]

TransportName = Literal["httptools", "aiohttp", "httpx", "httpx2"]
DEFAULT_TRANSPORT: TransportName = "httptools"

SESSION_HEADER = "X-Session-ID"
"""The header that carries a request's session key (the episode id) to a router."""

_HEADER_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
"""Visible ASCII: what a session key may hold to travel as a header value unchanged."""


def _normalise(base_urls: str | Sequence[str]) -> list[str]:
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ConfigError("a policy client needs at least one base URL")
    out = [http_base_url(url) for url in urls]
    if len(set(out)) != len(out):
        raise ConfigError(f"duplicate base URLs in {urls}")
    return out


def _check_status(url: str, path: str, resp: Reply) -> None:
    """An error answer as the plies error its status means; a 2xx/3xx passes."""
    status = resp.status
    if status == 503:
        raise PolicyUnavailable(f"{url} is overloaded (503): {_error_message(resp)}", url=url)
    if status in (502, 504):
        raise PolicyOutcomeUnknown(
            f"{url}{path} answered {status}; the request may have run: {_error_message(resp)}",
            url=url,
        )
    if status >= 400:
        raise PolicyResponseError(
            f"{url}{path} answered {status}: {_error_message(resp)}", url=url, status=status
        )


def _error_message(resp: Reply) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        if body.get("message") or body.get("detail"):
            return str(body.get("message") or body.get("detail"))
        return str(err)
    return str(body)[:500]


class HTTPOptions(TypedDict, total=False):
    """What every HTTP backend takes besides its engines, passed through to
    `HTTPPolicyClient` (see its arguments), so each backend names only its own."""

    timeout: Timeout
    retry: RetryPolicy
    headers: dict[str, str] | None
    session_header: str | None
    transport: TransportName


class HTTPPolicyClient(AsyncCloseable, PolicyClientBase):
    """Base of the HTTP backends. Use as `async with Client(...) as client:`; opens once.

    Args:
        base_urls: one engine URL or several.
        timeout: HTTP timeouts per phase.
        retry: retries of requests that never reached an engine, and how long an engine
            that refused a connection is skipped.
        headers: sent with every request (e.g. an `Authorization` for a hosted engine).
        session_header: the header that carries `sample(session=...)` to a router in front
            of the engines; None sends none.
        transport: the HTTP library under the client (`_transport.py`); the default is the
            one `bench/runtime_bench.py` measures fastest at thousands of requests in flight.
    """

    _health_path = "/health"

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        headers: dict[str, str] | None = None,
        session_header: str | None = SESSION_HEADER,
        transport: TransportName = DEFAULT_TRANSPORT,
    ):
        self.base_urls = _normalise(base_urls)
        if retry.attempts is None:
            raise ConfigError(
                "a policy client's RetryPolicy needs a number of attempts: a sample has no "
                "deadline to stop at"
            )
        self.timeout = timeout
        self.retry = retry
        self.session_header = session_header
        self._transport: Transport = open_transport(transport, timeout, headers or {})
        self._down_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = dict.fromkeys(self.base_urls, 0)
        self._turn = 0

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._open()
        return self

    async def aclose(self) -> None:
        """Close connections. Safe to call more than once."""
        self._close()
        await self._transport.aclose()

    # -- engine choice --------------------------------------------------------------------

    async def check_health(self) -> dict[str, bool]:
        """Probe every engine's health endpoint now; returns url -> healthy."""
        result: dict[str, bool] = {}

        async def probe(url: str) -> None:
            result[url] = await self._probe(url)

        async with anyio.create_task_group() as tg:
            for url in self.base_urls:
                tg.start_soon(probe, url)
        return result

    async def _probe(self, url: str) -> bool:
        self._check_open("send a request")
        try:
            reply = await self._transport.request("GET", url + self._health_path, None, None)
            ok = reply.status == 200
        except TransportFailure:
            ok = False
        if ok:
            self._down_until.pop(url, None)
        else:
            self._mark_down(url)
        return ok

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.retry.down_for

    async def _choose(self, session: str | None) -> str:
        if len(self.base_urls) == 1 and not self._down_until:
            return self.base_urls[0]
        now = time.monotonic()
        up = [u for u in self.base_urls if self._down_until.get(u, 0) <= now]
        # An engine whose down time has passed is probed before it gets traffic.
        for url in [u for u in up if u in self._down_until]:
            if not await self._probe(url):
                up.remove(url)
        if not up:  # all look down: try the one that has been down longest
            return min(self.base_urls, key=lambda u: self._down_until.get(u, 0))
        if session is not None:
            return max(up, key=lambda u: hashlib.sha256(f"{session}\0{u}".encode()).digest())
        self._turn += 1
        return min(
            up,
            key=lambda u: (self._in_flight[u], (self.base_urls.index(u) - self._turn) % len(up)),
        )

    # -- sampling -------------------------------------------------------------------------

    async def _draw(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """Raises `ConfigError` when `session` is not visible ASCII (it must travel as a
        header value)."""
        self._check_session(session)
        return await self._sample(prompt, params, policy, session)

    def _check_session(self, session: str | None) -> None:
        """Refuse a closed client, and a session key that cannot travel as a header."""
        self._check_open("sample")
        if session is not None and not (session and _HEADER_CHARS.issuperset(session)):
            raise ConfigError(
                f"session key {session!r:.80} must be non-empty visible ASCII: it is sent as "
                f"the {self.session_header or SESSION_HEADER} header"
            )

    async def _sample(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """The backend's request and answer; `policy` is what the caller asked for."""
        raise NotImplementedError

    # -- requests -------------------------------------------------------------------------

    async def _post(self, path: str, payload: dict[str, Any], session: str | None) -> Any:
        """POST `payload` to one engine, retrying only what never reached an engine.

        The first attempt runs outside tenacity, which costs tens of microseconds a request
        to set up; once it fails, tenacity's loop replays that failure as its own first
        attempt, so waits and the attempt count are what `RetryPolicy` says.
        """
        try:
            return await self._send(await self._choose(session), path, payload, session=session)
        except PolicyUnavailable as e:
            first: PolicyUnavailable | None = e
        async for attempt in self.retry.retrying(PolicyUnavailable):
            with attempt:
                if first is not None:
                    failure, first = first, None
                    raise failure
                url = await self._choose(session)
                return await self._send(url, path, payload, session=session)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    @asynccontextmanager
    async def _post_streaming(
        self, path: str, payload: dict[str, Any], session: str | None
    ) -> AsyncIterator[AsyncIterator[Any]]:
        """POST `payload` for a server-sent event stream; yields its `data` records, decoded.

        Until the answer begins, failures are retried as `_post` retries them; once it has
        begun, a failure is `PolicyOutcomeUnknown` (the request ran), and an error answer is
        translated as `_send` translates it.
        """
        async with AsyncExitStack() as stack:
            async for attempt in self.retry.retrying(PolicyUnavailable):
                with attempt:
                    url = await self._choose(session)
                    opened = self._open_stream(url, path, payload, session)
                    reply = await stack.enter_async_context(opened)
            yield self._events(reply, url, path)

    async def _events(self, reply: StreamReply, url: str, path: str) -> AsyncIterator[Any]:
        """The `data:` records of a server-sent event stream, decoded, up to `[DONE]`.

        A stream that ends without `[DONE]`, or a record that is not JSON, is an answer that
        stopped midway: the request ran, its outcome is unknown.
        """
        try:
            async for line in reply.lines():
                if not line.startswith(b"data:"):
                    continue  # event names, comments (keepalives), blank separators
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    yield json.loads(data)
                except ValueError as e:
                    raise PolicyOutcomeUnknown(
                        f"{url}{path} streamed a record that is not JSON: {data[:200]!r}",
                        url=url,
                    ) from e
        except TransportFailure as e:
            raise self._failure(url, path, e) from e.__cause__
        raise PolicyOutcomeUnknown(f"{url}{path} ended its stream before [DONE]", url=url)

    @asynccontextmanager
    async def _open_stream(
        self, url: str, path: str, payload: dict[str, Any], session: str | None
    ) -> AsyncIterator[StreamReply]:
        self._check_open("send a request")
        headers = None
        if session is not None and self.session_header is not None:
            headers = {self.session_header: session}
        self._in_flight[url] += 1
        try:
            async with self._transport.stream(
                "POST", url + path, encode_json(payload), headers
            ) as reply:
                if reply.status >= 400:
                    try:
                        whole = await reply.reply()
                    except TransportFailure as e:
                        raise self._failure(url, path, e) from e.__cause__
                    _check_status(url, path, whole)
                yield reply
        except TransportFailure as e:
            raise self._failure(url, path, e) from e.__cause__
        finally:
            self._in_flight[url] -= 1

    async def _send(
        self,
        url: str,
        path: str,
        payload: dict[str, Any] | None,
        *,
        params: dict[str, str] | None = None,
        want_json: bool = True,
        method: str = "POST",
        session: str | None = None,
    ) -> Any:
        """One request, errors translated; no retry. Returns the JSON body (or the text)."""
        self._check_open("send a request")
        headers = None
        if session is not None and self.session_header is not None:
            headers = {self.session_header: session}
        body = None if payload is None else encode_json(payload)
        target = url + path + ("?" + urlencode(params) if params else "")
        self._in_flight[url] += 1
        try:
            resp = await self._transport.request(method, target, body, headers)
        except TransportFailure as e:
            raise self._failure(url, path, e) from e.__cause__
        finally:
            self._in_flight[url] -= 1
        _check_status(url, path, resp)
        if not want_json:
            return resp.text
        try:
            return resp.json()
        except ValueError as e:
            raise PolicyResponseError(
                f"{url}{path} answered with invalid JSON: {resp.text[:200]!r}", url=url
            ) from e

    def _failure(self, url: str, path: str, failure: TransportFailure) -> PolicyError:
        """The plies error for a request that got no answer: retried only if never sent."""
        if failure.kind == "refused":
            self._mark_down(url)
            return PolicyUnavailable(f"cannot connect to {url}: {failure}", url=url)
        if failure.kind == "no_connection":
            return PolicyUnavailable(f"no free connection to {url}: {failure}", url=url)
        if failure.kind == "timeout":
            return PolicyOutcomeUnknown(
                f"{url}{path} gave no answer within the timeout ({failure}); "
                "the request may have run",
                url=url,
            )
        self._mark_down(url)
        return PolicyOutcomeUnknown(
            f"connection to {url} failed mid-request ({failure}); the request may have run",
            url=url,
        )


def open_transport(name: str, timeout: Timeout, headers: Mapping[str, str]) -> Transport:
    """The transport called `name`, configured alike whichever it is.

    Raises:
        ConfigError: `name` is not a known transport, or its package is not installed.
    """
    if name == "httptools":
        return HttptoolsTransport(timeout, headers)
    if name == "aiohttp":
        return AiohttpTransport(timeout, headers)
    if name in ("httpx", "httpx2"):
        try:
            lib = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"the {name} transport needs the {name} package: {e}") from e
        return LanedHttpxTransport(timeout, headers, lib)
    known = ", ".join(get_args(TransportName))
    raise ConfigError(f"unknown HTTP transport {name!r}; choose one of {known}")
