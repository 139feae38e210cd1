"""Bounded waits on the blocking edges of the `tinker` SDK, shared by plies' Tinker clients.

The SDK runs its requests on a loop of its own in a background thread, and some of its calls
block the caller until they finish: opening a `ServiceClient`'s session (and the first
`client/config`) retries an unreachable service for five minutes, and so does closing one.
`blocking` runs such a call in a daemon thread and waits with a deadline, so a service that
is down is a clear error in seconds and never a hang, and an abandoned call cannot keep the
interpreter from exiting. `unreachable` tells, at once, that nothing listens at a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import httpx

__all__ = ["blocking", "unreachable"]

T = TypeVar("T")


async def blocking(fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
    """`fn(*args)` in a daemon thread; its result, or `TimeoutError` after `timeout` seconds.

    Cancelling the wait abandons the call (it finishes, or not, in its thread).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            value = fn(*args)
        except Exception as exc:
            outcome: tuple[Callable[[Any], None], Any] = (future.set_exception, exc)
        else:
            outcome = (future.set_result, value)
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody waits
            loop.call_soon_threadsafe(deliver, *outcome)

    threading.Thread(target=run, name=f"plies-tinker-{what}", daemon=True).start()
    with anyio.fail_after(timeout):
        return await future


async def unreachable(base_url: str, timeout: float) -> str | None:
    """Why nothing listens at `base_url` (refused, or no connection in time), else None.

    Only the connection is judged: whether the service speaks the Tinker API, the SDK finds
    out.
    """
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            await http.get(f"{base_url}/api/v1/healthz")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        return repr(exc)
    except httpx.HTTPError:
        pass
    return None
