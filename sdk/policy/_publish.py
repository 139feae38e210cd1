"""Switching the policy behind a running fleet: every engine of a `VLLMClient`, then its map.

Two ways, both taking a policy that was already published (an immutable directory):

- `load_lora_adapter` serves it under a new name next to the old ones, so episodes started
  on the old name finish there. On vLLM the directory is a LoRA adapter; on the plies
  reference server it is a published policy directory with full weights.
- `reload_weights` swaps the weights behind one name in place (vLLM dev mode):
  `/pause?mode=wait` -> `/collective_rpc reload_weights` -> `/reset_prefix_cache` ->
  `/update_weight_version` -> `/resume`. Resume always runs, even when a step fails or the
  caller is cancelled midway, because a paused engine hangs every request. vLLM's in-place
  reload is exact for untied output layers only (a tied head keeps stale weights).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

import anyio

from .._exceptions import ConfigError, PolicyError, PolicyUnavailable
from ..trajectory import PolicyRef
from ._vllm import VLLMClient

__all__ = ["load_lora_adapter", "policy_path", "reload_weights", "unload_lora_adapter"]

WAIT = {"mode": "wait"}
"""`/pause` lets requests in flight finish, so none is cut off or tagged with new weights."""

RESUME_TIMEOUT = 60.0
"""Seconds allowed to resume every paused engine, even after cancellation."""


def policy_path(policy: PolicyRef) -> Path:
    """The local directory of a policy with a `file://` URI.

    Raises:
        ConfigError: the URI is not a local file URI.
    """
    parsed = urlparse(policy.uri)
    if parsed.scheme != "file":
        raise ConfigError(
            f"policy {policy.uri} is not a file:// URI; pass the directory the engines can read"
        )
    return Path(unquote(parsed.path))


async def load_lora_adapter(
    client: VLLMClient,
    name: str,
    policy: PolicyRef,
    *,
    path: str | Path | None = None,
    replace: bool = False,
) -> None:
    """Serve `policy` as `name` on every engine of `client`, and register it there.

    Args:
        name: the served name to create (or replace with `replace=True`).
        policy: what is being loaded; every completion from `name` is tagged with it.
        path: the directory engines read; defaults to the policy's file URI.
        replace: swap an existing `name` in place (`load_inplace`); requests to `name` are
            held while it happens.
    """
    target = str(path or policy_path(policy))
    body = {"lora_name": name, "lora_path": target, "load_inplace": replace}

    async def load_everywhere() -> None:
        for url in client.base_urls:
            await client._send(url, "/v1/load_lora_adapter", body, want_json=False)
        client.register(name, policy)

    if replace:
        async with client.switching(name):
            await load_everywhere()
    else:
        await load_everywhere()


async def unload_lora_adapter(client: VLLMClient, name: str) -> None:
    """Stop serving `name` on every engine of `client` (frees its memory)."""
    for url in client.base_urls:
        await client._send(url, "/v1/unload_lora_adapter", {"lora_name": name}, want_json=False)
    client.forget(name)


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
