"""VLLMClient under many concurrent requests, against a loopback engine that holds each one.

The engine here answers `/v1/completions` after a fixed delay and counts connections, so the
test sees what the client does on the wire: no request waits for another, keep-alive
connections are reused, and closing the client closes every one of them.
"""

from __future__ import annotations

import json
import time

import anyio
import pytest
from anyio.abc import SocketStream
from engine_wire import requests, response

from plies import PolicyRef
from plies.policy import SamplingParams, VLLMClient

pytestmark = pytest.mark.anyio

HOLD = 0.3
CONCURRENT = 25  # more than three of the client's lanes
REF = PolicyRef(uri="plies://test/policies/0", version=0)


class HoldingEngine:
    """Answers every completion after `HOLD` seconds; counts connections and requests held."""

    def __init__(self) -> None:
        payload = json.dumps(
            {
                "choices": [
                    {
                        "token_ids": [7, 8],
                        "logprobs": {"token_logprobs": [-0.1, -0.2]},
                        "finish_reason": "length",
                    }
                ],
                "plies_policy": REF.model_dump(mode="json"),
            }
        ).encode()
        self.response = response(200, payload)
        self.opened = self.closed = self.held = self.peak = 0

    async def handle(self, stream: SocketStream) -> None:
        self.opened += 1
        try:
            async for _ in requests(stream):
                self.held += 1
                self.peak = max(self.peak, self.held)
                await anyio.sleep(HOLD)
                self.held -= 1
                await stream.send(self.response)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        finally:
            self.closed += 1
            await stream.aclose()


async def test_concurrent_requests_run_at_once_reuse_connections_and_all_close():
    engine = HoldingEngine()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as server:
        server.start_soon(listener.serve, engine.handle)
        async with VLLMClient(f"http://127.0.0.1:{port}", "m", policy=REF) as client:
            for burst in range(2):
                start = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for _ in range(CONCURRENT):
                        tg.start_soon(client.sample, [1, 2], SamplingParams(max_tokens=2))
                elapsed = time.monotonic() - start
                assert engine.peak == CONCURRENT, f"burst {burst}: only {engine.peak} at once"
                assert elapsed < 2 * HOLD, f"burst {burst} took {elapsed:.2f}s: requests queued"
            assert engine.opened == CONCURRENT  # the second burst reused every connection
        with anyio.fail_after(5):
            while engine.closed < engine.opened:
                await anyio.sleep(0.01)
        server.cancel_scope.cancel()
