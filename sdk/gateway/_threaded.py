"""`ThreadedGatewayServer`: a gateway on its own event loop, for synchronous trainers.

A synchronous training loop cannot host an event loop of its own, yet the gateway must keep
serving agents while the loop blocks on other work. So the gateway, its sampling client and
its uvicorn server live on an event loop in a daemon thread, and the session API is called
from the caller's thread through an anyio blocking portal. Async callers need none of this:
they enter `Gateway` and `GatewayServer` on their own loop.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from .._exceptions import GatewayError, UsageError
from ..trajectory import Status, Trajectory
from ._gateway import Gateway
from ._server import DEFAULT_HOST, GatewayServer

__all__ = ["ThreadedGatewayServer"]

_START_TIMEOUT = 60.0


class ThreadedGatewayServer:
    """Run a gateway in a daemon thread; call its session API from any other thread.

    Args:
        sampler: a zero-argument callable that builds the policy client. It is called on
            the gateway's own loop, because HTTP clients belong to the loop that made them;
            a client that is an async context manager is entered and left there too.
        renderer: a `plies.tokens.ChatRenderer`.
        host, port: where to listen; loopback and a free port by default.
        **gateway_options: passed to `Gateway` (model, sampling, settle_timeout, admin_token).

    Example::

        with ThreadedGatewayServer(lambda: VLLMClient([url], "m"), renderer) as server:
            key = server.create_session("task-1")
            run_agent(base_url=server.url, api_key=key)   # blocking, another process
            trajectory = server.finish_session(key, reward=1.0)
    """

    def __init__(
        self,
        sampler: Callable[[], Any],
        renderer: Any,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        **gateway_options: Any,
    ):
        self._make_sampler = sampler
        self._renderer = renderer
        self._host = host
        self._port = port
        self._options = gateway_options
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._portal: BlockingPortal | None = None
        self._stop: anyio.Event | None = None
        self._gateway: Gateway | None = None
        self._url: str | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The OpenAI base URL of the running gateway."""
        if self._url is None:
            raise UsageError("the threaded gateway is not running; use `with ...`")
        return self._url

    # -- lifetime ------------------------------------------------------------------------

    def __enter__(self) -> ThreadedGatewayServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the thread and wait until the gateway serves.

        Raises:
            GatewayError: it did not start; the cause is chained.
        """
        if self._thread is not None or self._closed:
            raise UsageError("a ThreadedGatewayServer can be started once")
        self._thread = threading.Thread(target=self._run, name="plies-gateway", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise GatewayError(f"the gateway thread did not start within {_START_TIMEOUT}s")
        if self._error is not None:
            self._thread.join()
            raise GatewayError(f"the gateway failed to start: {self._error}") from self._error

    def close(self) -> None:
        """Stop the gateway (open sessions are dropped and logged) and join the thread.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._portal is not None and self._stop is not None:
            self._portal.call(self._stop.set)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            anyio.run(self._main)
        except Exception as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stop = anyio.Event()
        async with BlockingPortal() as portal, AsyncExitStack() as stack:
            sampler = self._make_sampler()
            if hasattr(sampler, "__aenter__"):
                sampler = await stack.enter_async_context(sampler)
            gateway = await stack.enter_async_context(
                Gateway(sampler, self._renderer, **self._options)
            )
            server = await stack.enter_async_context(
                GatewayServer(gateway, host=self._host, port=self._port)
            )
            self._gateway, self._url, self._portal = gateway, server.url, portal
            self._ready.set()
            await self._stop.wait()

    # -- session API (any thread but the gateway's) ---------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._portal is None or self._gateway is None or self._closed:
            raise UsageError("the threaded gateway is not running")
        fn = getattr(self._gateway, method)
        return self._portal.call(functools.partial(fn, *args, **kwargs))

    def create_session(
        self, task_id: str, *, group_id: str = "", info: dict[str, Any] | None = None
    ) -> str:
        """Open a session; returns its bearer key. See `Gateway.create_session`."""
        return self._call("create_session", task_id, group_id=group_id, info=info)

    def finish_session(
        self,
        key: str,
        *,
        reward: float | None = None,
        status: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Trajectory:
        """Close a session and return its trajectory. See `Gateway.finish_session`."""
        return self._call("finish_session", key, reward=reward, status=status, error=error)

    def drop_session(self, key: str) -> None:
        """Discard a session. See `Gateway.drop_session`."""
        self._call("drop_session", key)
