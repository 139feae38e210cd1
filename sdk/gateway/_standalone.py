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

from .._exceptions import ConfigError
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
) -> int:
    """Serve until SIGINT/SIGTERM; return the exit code (130 after a signal)."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    return anyio.run(_serve, sampler, tokenizer, host, port, model, max_tokens)


async def _serve(
    sampler_url: str,
    tokenizer_dir: Path,
    host: str,
    port: int,
    model: str | None,
    max_tokens: int | None,
) -> int:
    from transformers import AutoTokenizer

    from ..policy import SamplingParams, VLLMClient
    from ..tokens import ChatRenderer

    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(tokenizer_dir))
    if model is None:
        model = await _served_model(sampler_url)
    renderer = ChatRenderer(tokenizer)
    admin_token = "plies-admin-" + secrets.token_urlsafe(24)
    sampling = SamplingParams(max_tokens=max_tokens) if max_tokens else None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            VLLMClient([sampler_url], model) as client,
            Gateway(client, renderer, sampling=sampling, admin_token=admin_token) as gateway,
            GatewayServer(gateway, host=host, port=port) as server,
        ):
            line = {"url": server.url, "admin_token": admin_token}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            async for signum in signals:
                log.info("gateway stopping on %s", signal.Signals(signum).name)
                return 130
    raise AssertionError("unreachable: the signal loop only ends by returning")


async def _served_model(url: str) -> str:
    """The first model the policy server lists, for when `--model` is not given."""
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            cards = (await client.get(url.rstrip("/") + "/v1/models")).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot list the models of {url}; pass --model: {err!r}") from err
    if not cards:
        raise ConfigError(f"{url} serves no model; pass --model")
    return cards[0]["id"]
