"""Creating a model that trains every weight, with the `tinker` SDK's own parts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tinker

__all__ = ["create_full_weights_client"]


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
