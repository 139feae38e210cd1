"""The training client's bridge to the `tinker` SDK: its futures, and full-weights models.

The SDK runs requests on an event loop of its own, in a thread, and hands back
`concurrent.futures.Future`s. `SdkFuture` is the one place those are awaited on the caller's
loop (the only raw asyncio in the training client: `asyncio.wrap_future` is what carries a
thread's future onto the running loop), so the client itself is anyio only.
`create_full_weights_client` creates a model that trains every weight, with the SDK's own
parts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tinker

__all__ = ["SdkFuture", "create_full_weights_client"]


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
