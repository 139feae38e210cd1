"""Kept-alive requests to every server plies makes answer without a delayed-ACK stall.

Without TCP_NODELAY on the listening socket (accepted connections inherit it), a response
written in two parts waits out the client's delayed ACK: about 40 ms per request on Linux
loopback, against well under a millisecond with it.
"""

from __future__ import annotations

import statistics
import sys
import time

import httpx
import pytest

from plies.gateway import Gateway, GatewayServer
from plies.testing import serve_process
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

STALL_S = 0.020


async def median_round_trip(url: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        await client.get(url)  # connect; the first exchanges may be quick-ACKed anyway
        await client.get(url)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            await client.get(url)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class NoSampler:
    async def sample(self, *args, **kwargs):
        raise AssertionError("not sampled in this test")


async def test_the_gateway_answers_kept_alive_requests_without_a_stall(qwen3_tokenizer):
    async with (
        Gateway(NoSampler(), ChatRenderer(qwen3_tokenizer)) as gateway,
        GatewayServer(gateway) as server,
    ):
        assert await median_round_trip(server.url.removesuffix("/v1") + "/health") < STALL_S


async def test_the_openenv_server_answers_kept_alive_requests_without_a_stall(tmp_path):
    argv = [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0"]
    async with serve_process(argv, log=tmp_path / "openenv.log") as server:
        assert await median_round_trip(server.url + "/health") < STALL_S


async def test_the_reference_server_answers_kept_alive_requests_without_a_stall(policy_server):
    assert await median_round_trip(policy_server.url + "/health") < STALL_S
