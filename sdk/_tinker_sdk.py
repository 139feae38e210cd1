"""The one bridge between plies' Tinker clients and the `tinker` SDK; its only raw asyncio.

The SDK runs its requests on a loop of its own in a background thread, and some of its calls
block the caller until they finish: opening a `ServiceClient`'s session (and the first
`client/config`) retries an unreachable service for five minutes, and so does closing one.
`blocking` runs such a call in a daemon thread and waits with a deadline, so a service that
is down is a clear error in seconds and never a hang, and an abandoned call cannot keep the
interpreter from exiting. `unreachable` tells, at once, that nothing listens at a URL.

Its other calls hand back `concurrent.futures.Future`s. `outcome` awaits one with a deadline
(giving up cancels it), for the sampler, whose abandoned request is simply lost; `SdkFuture`
awaits one that must survive a wait that gives up, for the trainer, which takes it up again
(`asyncio.wrap_future` is what carries a thread's future onto the running loop, so the
clients themselves are anyio only). `create_full_weights_client` creates a model that trains
every weight, with the SDK's own parts. `service_url` and `close_service` are where both
clients' sessions begin and end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import httpx

from ._exceptions import ConfigError

if TYPE_CHECKING:
    import tinker

__all__ = [
    "SdkFuture",
    "blocking",
    "close_service",
    "create_full_weights_client",
    "outcome",
    "service_url",
    "unreachable",
]

T = TypeVar("T")

log = logging.getLogger("plies.tinker")


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


def service_url(base_url: str | None, client: str) -> str:
    """The service `client` (a class name, for the errors) talks to: `base_url` as the SDK
    resolves it (`TINKER_BASE_URL`, then hosted Tinker when None).

    Raises:
        ConfigError: the tinker SDK is not installed, or the URL is not http(s).
    """
    try:
        from tinker.lib.base_url import resolve_base_url
    except ImportError as exc:
        raise ConfigError(f"{client} needs the tinker SDK: pip install 'plies[tinker]'") from exc
    url = resolve_base_url(base_url)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base URL {url!r} must start with http:// or https://")
    return url


async def close_service(service: Any) -> None:
    """End a `tinker.ServiceClient`'s session, waiting up to 30 s; what is saved stays.

    Best effort: a service that is gone or does not answer has nothing left to release on our
    side, so a failure here never hides the error (or the close) that led to it.
    """
    try:
        await blocking(lambda: service.close("success").result(), timeout=30.0, what="close")
    except Exception as exc:
        log.info("the Tinker session did not close cleanly: %s: %s", type(exc).__name__, exc)


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


async def outcome(submitted: Any, timeout: float | None) -> Any:
    """The result of an op the SDK submitted, or `TimeoutError` after `timeout` seconds (None:
    no limit). Giving up, by the deadline or a cancellation, cancels the op's future."""
    with anyio.fail_after(timeout):
        return await asyncio.wrap_future(submitted.future())


class SdkFuture:
    """An op the SDK submitted, awaited on the caller's loop; the SDK keeps polling it by
    its request id whether anyone waits or not, so a wait that gives up can be taken up
    again (`reconcile`)."""

    def __init__(self, submitted: Any) -> None:
        future: concurrent.futures.Future[Any] = submitted.future()
        self._waiter = asyncio.wrap_future(future)
        # Its failure is read by the client, or by nobody once the client closed: marked as
        # seen so an op abandoned at close logs no traceback.
        self._waiter.add_done_callback(_retrieved)

    async def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the outcome; whether it is known. Cancelling the
        wait leaves the op running."""
        done, _ = await asyncio.wait({self._waiter}, timeout=timeout)
        return bool(done)

    def exception(self) -> BaseException | None:
        """The op's failure, once known (None: it succeeded)."""
        return self._waiter.exception()

    def result(self) -> Any:
        return self._waiter.result()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def create_full_weights_client(
    service: tinker.ServiceClient, base_model: str
) -> tinker.TrainingClient:
    """A training client that trains every weight of `base_model` (no LoRA); blocking.

    The SDK's public constructor always sends a LoRA config. A full fine-tune (which
    `plies serve` offers, and which the native trainer does) is created with the SDK's own
    request type and future, the same steps `create_lora_training_client` takes, only with
    no `lora_config`. Services that train LoRA adapters only refuse it.
    """
    from tinker import TrainingClient, types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    holder = service.holder
    session_id, model_seq_id = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> TrainingClient:
        request = types.CreateModelRequest(
            session_id=session_id, model_seq_id=model_seq_id, base_model=base_model
        )
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            submitted = await client.models.create(request=request)
        created = await _APIFuture(
            types.CreateModelResponse,
            holder,
            submitted,
            request_start_time=time.time(),
            request_type="CreateModel",
        ).result_async()
        info = await fetch_training_info(holder, created.model_id)
        model_id = created.model_id
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()
