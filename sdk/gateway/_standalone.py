"""`plies gateway`: a standalone gateway process, announced by one JSON line on stdout.

Scripts and tests start it as a subprocess and read the line for the URL and the admin
token; sessions are then created and finished over HTTP. Logs go to stderr. SIGINT and
SIGTERM stop it; open sessions are dropped and logged.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
from pathlib import Path

import anyio
import httpx

from .._exceptions import ConfigError, GatewayError
from .._net import is_loopback
from ..runtime import long_run_collector
from ._gateway import Gateway
from ._server import DEFAULT_HOST, GatewayServer

__all__ = ["serve"]

log = logging.getLogger("plies.gateway")


def serve(
    *,
    sampler: str,
    tokenizer: Path,
    host: str = DEFAULT_HOST,
    port: int = 0,
    model: str | None = None,
    max_tokens: int | None = None,
    token: str | None = None,
    sampler_token: str | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; return the exit code (130 after a signal, 2 on bad options).

    Args:
        token: the admin token; by default a random one, announced on the ready line (a
            token given here is never printed). It must be given (at least 16 characters)
            to bind beyond loopback.
        sampler_token: the policy server's token, sent as `Authorization: Bearer`.
    """
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"--token needs at least {MIN_TOKEN_LENGTH} characters")
        if token is None and not is_loopback(host):
            raise ConfigError(
                f"--host {host} reaches beyond this machine: set the admin token yourself "
                "(--token or PLIES_GATEWAY_TOKEN; see docs/operations.md) or bind 127.0.0.1"
            )
        return anyio.run(
            _serve, sampler, tokenizer, host, port, model, max_tokens, token, sampler_token
        )
    except (ConfigError, GatewayError) as err:
        log.error("cannot serve the gateway: %s", err)
        return 2


MIN_TOKEN_LENGTH = 16
"""Shorter secrets can be guessed over the network."""


async def _serve(
    sampler_url: str,
    tokenizer_dir: Path,
    host: str,
    port: int,
    model: str | None,
    max_tokens: int | None,
    token: str | None,
    sampler_token: str | None,
) -> int:
    from transformers import AutoTokenizer

    from ..policy import SamplingParams, VLLMClient
    from ..tokens import ChatRenderer

    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(tokenizer_dir))
    headers = {"Authorization": f"Bearer {sampler_token}"} if sampler_token else {}
    if model is None:
        model = await _served_model(sampler_url, headers)
    renderer = ChatRenderer(tokenizer)
    admin_token = token or "plies-admin-" + secrets.token_urlsafe(24)
    sampling = SamplingParams(max_tokens=max_tokens) if max_tokens else None
    with (
        long_run_collector(),  # the tokenizer is loaded: no full collection scans it again
        anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        async with (
            VLLMClient([sampler_url], model, headers=headers) as client,
            Gateway(client, renderer, sampling=sampling, admin_token=admin_token) as gateway,
            GatewayServer(gateway, host=host, port=port) as server,
        ):
            line = {"url": server.url}
            if token is None:  # a token the user gave is never printed: they have it
                line["admin_token"] = admin_token
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            async for signum in signals:
                log.info("gateway stopping on %s", signal.Signals(signum).name)
                return 130
    raise AssertionError("unreachable: the signal loop only ends by returning")


async def _served_model(url: str, headers: dict[str, str]) -> str:
    """The first model the policy server lists, for when `--model` is not given."""
    try:
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            cards = (await client.get(url.rstrip("/") + "/v1/models")).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot list the models of {url}; pass --model: {err!r}") from err
    if not cards:
        raise ConfigError(f"{url} serves no model; pass --model")
    return cards[0]["id"]
