"""What every HTTP policy backend shares: lifetime, engine choice, retries, error mapping.

Engine choice: with a session key, rendezvous hashing over the engines that are up keeps a
session on one engine (its prefix cache holds the history) and moves only the sessions of an
engine that goes down. Without one, the engine with the fewest requests in flight is used.

An engine that refuses a connection is skipped for `RetryPolicy.down_for` seconds, then
probed with `GET /health` before it gets traffic again.

The session key also travels as a header (`X-Session-ID` unless the client names another),
so a router in front of many engines, shared by many rollout processes, can keep every
request of an episode on the engine whose prefix cache holds its history.

Requests travel in lanes: httpx clients that each carry at most `LANE_REQUESTS` requests at
once, a new lane opening when every lane is full. httpx places a request by scanning every
connection in its pool, so one client shared by C concurrent requests costs O(C) per request
(measured by `bench/runtime_bench.py` at C=256: 14 ms of CPU per request with one client,
1.3 ms with lanes, about what one request costs httpx alone).

Errors are translated at this edge, and whether a failure may be retried depends only on
whether the request provably never reached the engine:

- refused connection, connect timeout, pool timeout, HTTP 503: `PolicyUnavailable`, retried
  with tenacity (bounded, jittered), on another engine when there is one;
- read/write timeout, dropped connection, 502/504: `PolicyOutcomeUnknown`, never repeated;
- other 4xx/5xx answers and malformed bodies: `PolicyResponseError`.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Self

import anyio
import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from .._exceptions import (
    ConfigError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
)
from .._lifecycle import AsyncLifecycle
from .._net import CLIENT_KEEPALIVE_S
from ..trajectory import PolicyRef
from ._config import DEFAULT_RETRY, DEFAULT_TIMEOUT, RetryPolicy, Timeout
from ._types import Completion, SamplingParams

__all__ = ["HTTPPolicyClient"]

PolicyChoice = PolicyRef | str | None
"""The policy a caller asks `sample` for: a `PolicyRef`, a served name, or the default."""

LANE_REQUESTS = 8
"""Most requests one httpx client carries at once."""

SESSION_HEADER = "X-Session-ID"
"""The header that carries a request's session key (the episode id) to a router."""

_HEADER_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
"""Visible ASCII: what a session key may hold to travel as a header value unchanged."""


def _normalise(base_urls: str | Sequence[str]) -> list[str]:
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ConfigError("a policy client needs at least one base URL")
    out = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"base URL {url!r} must start with http:// or https://")
        out.append(url.rstrip("/"))
    if len(set(out)) != len(out):
        raise ConfigError(f"duplicate base URLs in {urls}")
    return out


def _error_message(resp: httpx.Response) -> str:
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


class _Lane:
    __slots__ = ("http", "in_flight")

    def __init__(self, http: httpx.AsyncClient):
        self.http = http
        self.in_flight = 0


class HTTPPolicyClient(AsyncLifecycle):
    """Base of the HTTP backends. Use as `async with Client(...) as client:`; opens once.

    Args:
        base_urls: one engine URL or several.
        timeout: HTTP timeouts per phase.
        retry: retries of requests that never reached an engine, and how long an engine
            that refused a connection is skipped.
        headers: sent with every request (e.g. an `Authorization` for a hosted engine).
        session_header: the header that carries `sample(session=...)` to a router in front
            of the engines; None sends none.
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
    ):
        self.base_urls = _normalise(base_urls)
        self.timeout = timeout
        self.retry = retry
        self.session_header = session_header
        self._headers = dict(headers or {})
        self._lanes: list[_Lane] = []
        self._ssl: ssl.SSLContext | None = None  # one for all lanes: each costs ~20 ms to load
        self._down_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = dict.fromkeys(self.base_urls, 0)
        self._turn = 0

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections. Safe to call more than once."""
        self._close()
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            await lane.http.aclose()

    @contextmanager
    def _lane(self) -> Iterator[httpx.AsyncClient]:
        """Carry one request in the first lane with room, or in a new one."""
        self._check_open("send a request")
        for lane in self._lanes:
            if lane.in_flight < LANE_REQUESTS:
                break
        else:
            lane = self._open_lane()
        lane.in_flight += 1
        try:
            yield lane.http
        finally:
            lane.in_flight -= 1

    def _open_lane(self) -> _Lane:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        lane = _Lane(
            httpx.AsyncClient(
                verify=self._ssl,
                timeout=self.timeout.to_httpx(),
                headers=self._headers,
                limits=httpx.Limits(
                    max_connections=LANE_REQUESTS,
                    max_keepalive_connections=LANE_REQUESTS,
                    keepalive_expiry=CLIENT_KEEPALIVE_S,
                ),
            )
        )
        self._lanes.append(lane)
        return lane

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
        try:
            with self._lane() as http:
                resp = await http.get(url + self._health_path)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self._down_until.pop(url, None)
        else:
            self._mark_down(url)
        return ok

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.retry.down_for

    async def _choose(self, session: str | None) -> str:
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

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        policy: PolicyRef | str | None = None,
        session: str | None = None,
    ) -> Completion:
        """Sample one completion; see `PolicyClient.sample`.

        Raises:
            ConfigError: `session` is not visible ASCII (it must travel as a header value).
        """
        self._check_open("sample")
        if session is not None and not (session and _HEADER_CHARS.issuperset(session)):
            raise ConfigError(
                f"session key {session!r:.80} must be non-empty visible ASCII: it is sent as "
                f"the {self.session_header or SESSION_HEADER} header"
            )
        return await self._sample(list(prompt_ids), params, policy, session)

    async def _sample(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """The backend's request and answer; `policy` is what the caller asked for."""
        raise NotImplementedError

    # -- requests -------------------------------------------------------------------------

    async def _post(self, path: str, payload: dict[str, Any], session: str | None) -> Any:
        """POST `payload` to one engine, retrying only what never reached an engine."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retry.attempts),
            wait=wait_random_exponential(
                multiplier=self.retry.initial_wait, max=self.retry.max_wait
            ),
            retry=retry_if_exception_type(PolicyUnavailable),
            sleep=anyio.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                url = await self._choose(session)
                return await self._send(url, path, payload, session=session)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

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
        headers = None
        if session is not None and self.session_header is not None:
            headers = {self.session_header: session}
        self._in_flight[url] += 1
        try:
            with self._lane() as http:
                resp = await http.request(
                    method, url + path, json=payload, params=params, headers=headers
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self._mark_down(url)
            raise PolicyUnavailable(f"cannot connect to {url}: {e!r}", url=url) from e
        except httpx.PoolTimeout as e:
            raise PolicyUnavailable(f"no free connection to {url}: {e!r}", url=url) from e
        except httpx.TimeoutException as e:
            raise PolicyOutcomeUnknown(
                f"{url}{path} gave no answer within the timeout ({type(e).__name__}); "
                "the request may have run",
                url=url,
            ) from e
        except httpx.TransportError as e:
            self._mark_down(url)
            raise PolicyOutcomeUnknown(
                f"connection to {url} failed mid-request ({type(e).__name__}: {e}); "
                "the request may have run",
                url=url,
            ) from e
        finally:
            self._in_flight[url] -= 1
        status = resp.status_code
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
        if not want_json:
            return resp.text
        try:
            return resp.json()
        except ValueError as e:
            raise PolicyResponseError(
                f"{url}{path} answered with invalid JSON: {resp.text[:200]!r}", url=url
            ) from e
