"""Publishing saved policies to samplers, and switching the policy behind a running fleet.

`publish(policy, loaders)` hands a policy the trainer saved to every `PolicyLoader`; the
trainer itself knows nothing about samplers. For every engine of a `VLLMClient` (then its
name -> policy map) there are two ways, both taking a policy that was already saved (an
immutable directory):

- `load_lora_adapter` (beside the client, in `_vllm`) serves it under a new name next to the
  old ones, so episodes started on the old name finish there. On vLLM the directory is a
  LoRA adapter; on the plies reference server it is a published policy directory with full
  weights.
- `reload_weights` swaps the weights behind one name in place (vLLM dev mode):
  `/pause?mode=wait` -> `/collective_rpc reload_weights` -> `/reset_prefix_cache` ->
  `/update_weight_version` -> `/resume`. Resume always runs, even when a step fails or the
  caller is cancelled midway, because a paused engine hangs every request. vLLM's in-place
  reload is exact for untied output layers only (a tied head keeps stale weights).

`VLLMClient.load_policy` is the first (under `served_name(version)`), `ReloadInPlace` the
second. The reference server answers a load with the `PolicyRef` of what it loaded, so there
the weights' digest is checked against the policy's; vLLM answers with plain text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from .._exceptions import ConfigError, PolicyError, PolicyUnavailable
from ..trajectory import PolicyRef
from ._paths import policy_path
from ._types import PolicyLoader

if TYPE_CHECKING:  # the helpers drive a client; they only name it
    from ._vllm import VLLMClient

__all__ = ["ReloadInPlace", "publish", "reload_weights"]

WAIT = {"mode": "wait"}
"""`/pause` lets requests in flight finish, so none is cut off or tagged with new weights."""

RESUME_TIMEOUT = 60.0
"""Seconds allowed to resume every paused engine, even after cancellation."""


async def publish(policy: PolicyRef, loaders: Iterable[PolicyLoader]) -> None:
    """Make `policy` servable on each sampler of `loaders`, one after another.

    Publishing a policy a sampler already serves is harmless, so a failed publish may be
    repeated as a whole.

    Args:
        policy: a saved policy, e.g. `await trainer.save_policy()`.
        loaders: samplers that load policies: a `VLLMClient` (vLLM, or a reference server's
            base URL opened as one), `ReloadInPlace(client)`, or any `PolicyLoader`.

    Raises:
        ConfigError: an entry is not a `PolicyLoader` (nothing is loaded then).
        PolicyError: a sampler could not load the policy or reports other weights; the
            samplers before it serve the policy, the ones after it were not asked.

    Example:
        async with VLLMClient(server_url, "policy-0") as sampler:
            await publish(await trainer.save_policy(), [sampler])
    """
    loaders = list(loaders)
    for loader in loaders:
        if not isinstance(loader, PolicyLoader):
            raise ConfigError(
                f"cannot publish to {loader!r}: not a PolicyLoader; for a server's base URL, "
                "open a VLLMClient(url, model) on it and pass that"
            )
    for loader in loaders:
        await loader.load_policy(policy)


class ReloadInPlace:
    """A `PolicyLoader` that swaps the weights behind one served name (`reload_weights`).

    For vLLM engines in dev mode that serve full weights under one name, where a new LoRA
    adapter per policy does not apply. Requests to that name wait while the swap runs.

    Args:
        client: the fleet; its name -> policy map follows the swap.
        name: the served name whose weights are swapped (default: the client's model).

    Example:
        await publish(policy, [ReloadInPlace(client)])
    """

    def __init__(self, client: VLLMClient, *, name: str | None = None):
        self.client = client
        self.name = name or client.model

    def __repr__(self) -> str:
        return f"ReloadInPlace({self.client.base_urls}, name={self.name!r})"

    async def load_policy(self, policy: PolicyRef) -> None:
        """Swap the weights behind `name` for `policy`'s, unless they already are."""
        if self.client.served().get(self.name) != policy:
            await reload_weights(self.client, policy, name=self.name)


async def reload_weights(
    client: VLLMClient,
    policy: PolicyRef,
    *,
    name: str | None = None,
    path: str | Path | None = None,
) -> None:
    """Swap the weights served as `name` (default: the client's model) for `policy`'s.

    Raises:
        PolicyError: a step failed (the weights behind `name` are then unknown to the client
            until a policy is registered), or an engine could not be resumed.
    """
    name = name or client.model
    target = str(path or policy_path(policy))
    paused: list[str] = []
    async with client.switching(name):
        try:
            for url in client.base_urls:
                paused.append(url)
                try:
                    await client._send(url, "/pause", None, params=WAIT, want_json=False)
                except PolicyUnavailable:
                    paused.remove(url)  # never reached: nothing to resume there
                    raise
            for url in client.base_urls:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": target}}
                await client._send(url, "/collective_rpc", rpc, want_json=False)
                await client._send(url, "/reset_prefix_cache", None, want_json=False)
                version = {"new_version": str(policy.version)}
                await client._send(url, "/update_weight_version", version, want_json=False)
            client.register(name, policy)
        finally:
            with anyio.CancelScope(shield=True), anyio.fail_after(RESUME_TIMEOUT):
                await _resume(client, paused)


async def _resume(client: VLLMClient, urls: list[str]) -> None:
    failed: list[str] = []
    for url in urls:
        try:
            await client._send(url, "/resume", None, want_json=False)
        except PolicyError as e:
            failed.append(f"{url}: {e}")
    if failed:
        raise PolicyError("engines left paused (every request to them hangs): " + "; ".join(failed))
