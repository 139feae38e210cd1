"""Who closes an idle connection first: plies' clients before any server, plies' servers after
any usual client.

A request sent on a kept-alive connection in the instant its server closes it fails
mid-flight: the client cannot know whether it ran, so a sample is `PolicyOutcomeUnknown` and
its episode is lost. That happened in demo runs, where the client's idle expiry (httpx's
5 s) equalled the server's (uvicorn's 5 s).
"""

from __future__ import annotations

import json
import sys
import time

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute, SocketStream

from plies import PolicyRef
from plies._net import CLIENT_KEEPALIVE_S
from plies.gateway import Gateway, GatewayServer
from plies.policy import SamplingParams, VLLMClient
from plies.testing import serve_process
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

REF = PolicyRef(uri="plies://test/policies/0", version=0)
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
HTTPX_DEFAULT_KEEPALIVE_S = httpx.Limits().keepalive_expiry


class ClosingEngine:
    """A loopback `/v1/completions` engine that loses the race every time: a request arriving
    on a connection idle for `idle_close` seconds or more is dropped unanswered, as a server
    closing that connection just then would."""

    def __init__(self, idle_close: float):
        self.idle_close = idle_close
        self.connections = 0
        self.dropped = 0

    async def handle(self, stream: SocketStream) -> None:
        self.connections += 1
        answered_at = time.monotonic()
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    buf += await stream.receive()
                if time.monotonic() - answered_at >= self.idle_close:
                    self.dropped += 1
                    return
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(rest) < length:
                    rest += await stream.receive()
                buf = rest[length:]
                body = json.dumps(
                    {
                        "choices": [
                            {
                                "token_ids": [7],
                                "logprobs": {"token_logprobs": [-0.5]},
                                "finish_reason": "stop",
                            }
                        ],
                        "plies_policy": REF.model_dump(mode="json"),
                    }
                ).encode()
                await stream.send(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                answered_at = time.monotonic()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        finally:
            await stream.aclose()


async def test_a_client_never_reuses_a_connection_its_server_may_be_closing():
    # A server that closes idle connections a little after the client's expiry, and below
    # httpx's default: the default client reuses the connection and loses the request.
    idle_close = CLIENT_KEEPALIVE_S + 0.5
    assert idle_close < HTTPX_DEFAULT_KEEPALIVE_S
    plain, ours = ClosingEngine(idle_close), ClosingEngine(idle_close)
    params = SamplingParams(max_tokens=1)
    outcome: dict[str, object] = {}
    async with anyio.create_task_group() as tg:
        urls = []
        for engine in (plain, ours):
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
            tg.start_soon(listener.serve, engine.handle)
            urls.append(f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}")

        async def with_httpx_defaults() -> None:
            body = {"prompt": PROMPT, "max_tokens": 1}
            async with httpx.AsyncClient() as http:
                await http.post(urls[0] + "/v1/completions", json=body)
                await anyio.sleep(idle_close + 0.3)
                try:
                    await http.post(urls[0] + "/v1/completions", json=body)
                except httpx.TransportError as err:
                    outcome["httpx"] = err

        async def with_plies_client() -> None:
            async with VLLMClient(urls[1], "policy-0", policy=REF) as client:
                await client.sample(PROMPT, params)
                await anyio.sleep(idle_close + 0.3)
                outcome["plies"] = await client.sample(PROMPT, params)

        async with anyio.create_task_group() as clients:
            clients.start_soon(with_httpx_defaults)
            clients.start_soon(with_plies_client)
        tg.cancel_scope.cancel()
    # The engine does model the race: the default client lost its second request...
    assert isinstance(outcome.get("httpx"), httpx.TransportError), outcome
    assert (plain.connections, plain.dropped) == (1, 1)
    # ...and plies' client opened a new connection instead, so nothing was lost.
    assert outcome["plies"].ids == [7]
    assert (ours.connections, ours.dropped) == (2, 0)


async def read_response(stream: SocketStream) -> bytes:
    """One whole HTTP/1.1 response (head and a content-length body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive()
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += await stream.receive()
    return head


async def kept_alive(url: str, path: str, idle: float) -> bytes:
    """The head of the second answer on one connection, asked `idle` s after the first; b""
    if the server closed the connection meanwhile."""
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(request)
        assert (await read_response(stream)).startswith(b"HTTP/1.1 200")
        await anyio.sleep(idle)
        try:
            await stream.send(request)
            return await read_response(stream)
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return b""


class NoSampler:
    async def sample(self, *args, **kwargs):
        raise AssertionError("not sampled in this test")


async def test_every_server_keeps_an_idle_connection_past_the_usual_client_expiry(
    policy_server, qwen3_tokenizer, tmp_path
):
    idle = HTTPX_DEFAULT_KEEPALIVE_S + 0.5
    argv = [sys.executable, "-m", "plies.environments.openenv_server", "--port", "0"]
    answers: dict[str, bytes] = {}
    async with (
        Gateway(NoSampler(), ChatRenderer(qwen3_tokenizer)) as gateway,
        GatewayServer(gateway) as gateway_server,
        serve_process(argv, log=tmp_path / "openenv.log") as openenv,
    ):
        servers = {
            "plies serve": policy_server.url,
            "plies gateway": gateway_server.url,
            "openenv server": openenv.url,
        }

        async def ask(name: str, url: str) -> None:
            answers[name] = await kept_alive(url, "/health", idle)

        async with anyio.create_task_group() as tg:
            for name, url in servers.items():
                tg.start_soon(ask, name, url)
    closed = [name for name, answer in answers.items() if not answer.startswith(b"HTTP/1.1 200")]
    assert closed == [], f"closed an idle connection within {idle} s: {closed}"
