"""What a caller sees when an engine stops answering: typed errors within the timeout.

The tests share one disposable server and run in file order; the last one kills it.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import httpx
import pytest

from plies import PolicyOutcomeUnknown, PolicyUnavailable
from plies.policy import SamplingParams, Timeout, VLLMClient

pytestmark = pytest.mark.anyio

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def server(start_policy_server, tiny_model_dir, tmp_path_factory):
    with start_policy_server(tiny_model_dir, tmp_path_factory.mktemp("doomed") / "s") as s:
        yield s


async def stats(url: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/plies/stats")).json()


async def test_a_timed_out_request_is_not_repeated(server):
    # 2000 tokens take about 5 s here; the read timeout is a tenth of a faster machine's time.
    timeout = Timeout(read=0.25)
    async with VLLMClient(server.url, server.model, timeout=timeout) as client:
        start = time.monotonic()
        with pytest.raises(PolicyOutcomeUnknown, match="may have run"):
            await client.sample(PROMPT, SamplingParams(max_tokens=2000))
        assert time.monotonic() - start < 2
    with anyio.fail_after(60):
        while (await stats(server.url))["requests_finished"] < 1:
            await anyio.sleep(0.2)
    await anyio.sleep(0.5)
    assert (await stats(server.url))["requests_finished"] == 1


async def test_a_hung_server_raises_within_the_read_timeout(server):
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        async with VLLMClient(server.url, server.model, timeout=Timeout(read=1.5)) as client:
            start = time.monotonic()
            with pytest.raises(PolicyOutcomeUnknown):
                await client.sample(PROMPT, SamplingParams(max_tokens=2))
            assert 1.4 < time.monotonic() - start < 4
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


async def test_killing_the_server_mid_request_raises_a_typed_error_fast(server):
    async with VLLMClient(server.url, server.model, timeout=Timeout(read=60)) as client:

        async def kill_soon() -> None:
            await anyio.sleep(1.0)
            os.kill(server.process.pid, signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            start = time.monotonic()
            with pytest.raises(PolicyOutcomeUnknown, match="may have run"):
                await client.sample(PROMPT, SamplingParams(max_tokens=3000))
        assert time.monotonic() - start < 5
        # Once the process is reaped the engine is gone: the next request is refused, retried,
        # then unavailable. Before that its listening socket can still take a connection and
        # then drop it unanswered, which is an outcome nobody can know.
        await anyio.to_thread.run_sync(server.process.wait, 10)
        with pytest.raises(PolicyUnavailable):
            await client.sample(PROMPT, SamplingParams(max_tokens=2))
