"""Every transport under the policy clients behaves alike on the wire and in its failures.

A loopback engine misbehaves on request (the payload's `model` names how); each test runs on
aiohttp, httpx and httpx2 and checks what the caller sees and what the engine saw: whether a
request was repeated, which headers arrived, how connections were kept and configured.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream
from engine_wire import requests, response

from plies import (
    ConfigError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
    RetryPolicy,
)
from plies.policy import SamplingParams, Timeout, VLLMClient
from plies.testing import free_port

pytestmark = pytest.mark.anyio

TRANSPORTS = ["httptools", "aiohttp", "httpx", "httpx2"]
REF = {"uri": "plies://test/policies/0", "version": 0, "digest": ""}
ANSWER = json.dumps(
    {
        "choices": [
            {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}
        ],
        "plies_policy": REF,
    }
).encode()
PARAMS = SamplingParams(max_tokens=1)
FAST_RETRY = RetryPolicy(attempts=3, initial_wait=0.01, max_wait=0.02)


@dataclass
class Engine:
    """Answers `/v1/completions` as the payload's `model` says; records what it saw."""

    port: int = 0
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    requests: list[tuple[dict[str, str], dict]] = field(default_factory=list)
    peers: list[int] = field(default_factory=list)
    head_sent: int = 0

    async def handle(self, stream: SocketStream) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        self.peers.append(stream.extra(SocketAttribute.remote_port))
        try:
            async for request in requests(stream):
                body = request.json()
                self.requests.append((request.headers, body))
                how = body.get("model")
                if body.get("stream") and how in STREAMED:
                    await self.stream(stream, how)
                    if how != "ok":
                        return
                    continue
                if how == "hang":
                    await anyio.sleep_forever()
                if how == "slow":
                    await anyio.sleep(0.2)
                if how == "drop":
                    return
                if how == "endless-head":
                    await self.endless_head(stream)
                    return
                answer = {
                    "ok": response(200, ANSWER),
                    "slow": response(200, ANSWER),
                    "busy": response(503, b'{"error": {"message": "full"}}'),
                    "gateway": response(502, b"bad gateway"),
                    "not-json": response(200, b"<html>"),
                    "garble": b"HTTP/1.1 abc\r\n\r\n",
                    # An answer, then another that nothing asked for on the same connection.
                    "extra": response(200, ANSWER) + response(200, b'{"smuggled": true}'),
                    "close": response(200, ANSWER).replace(
                        b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1
                    ),
                }[how]
                await stream.send(answer)
                if how == "close":
                    return
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        finally:
            self.open_now -= 1
            await stream.aclose()

    async def endless_head(self, stream: SocketStream) -> None:
        """A status line, then header lines until `ENDLESS_HEAD` bytes or the client hangs up."""
        await stream.send(b"HTTP/1.1 200 OK\r\n")
        line = b"x-filler: " + b"a" * 90 + b"\r\n"
        while self.head_sent < ENDLESS_HEAD:
            await stream.send(line * 64)
            self.head_sent += len(line) * 64

    async def stream(self, stream: SocketStream, how: str) -> None:
        """A streamed answer in chunked transfer encoding: three runs of ids, 0.2 s apart,
        then the finish and `[DONE]`; or cut off, stalled or unterminated after the first."""
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            "transfer-encoding: chunked\r\n\r\n"
        )
        await stream.send(head.encode())
        for run in RUNS:
            choice = {"token_ids": run, "logprobs": {"token_logprobs": [-0.5] * len(run)}}
            await stream.send(chunk(b"data: " + json.dumps({"choices": [choice]}).encode()))
            if how == "cut":
                return
            if how == "stall":
                await anyio.sleep_forever()
            await anyio.sleep(PACE)
        if how == "no-done":
            await stream.send(b"0\r\n\r\n")
            return
        last = {"choices": [{"token_ids": [], "logprobs": None, "finish_reason": "stop"}]}
        await stream.send(chunk(b"data: " + json.dumps({**last, "plies_policy": REF}).encode()))
        await stream.send(chunk(b"data: [DONE]") + b"0\r\n\r\n")


STREAMED = ("ok", "cut", "stall", "no-done")
ENDLESS_HEAD = 16 * 1024 * 1024
"""Bytes of header lines the engine sends when told to send them without end."""
RUNS = [[7, 8], [9], [10, 11, 12]]
PACE = 0.2


def chunk(event: bytes) -> bytes:
    """One server-sent event as one HTTP chunk."""
    data = event + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.fixture
async def engine():
    engine = Engine()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    engine.port = listener.extra(SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, engine.handle)
        yield engine
        tg.cancel_scope.cancel()


def client(port: int, how: str, transport: str, **kwargs) -> VLLMClient:
    from plies import PolicyRef

    return VLLMClient(
        f"http://127.0.0.1:{port}",
        how,
        policy=PolicyRef.model_validate(REF),
        retry=kwargs.pop("retry", FAST_RETRY),
        transport=transport,
        **kwargs,
    )


def nodelay_of_socket_to(port: int, local_port: int) -> int:
    """TCP_NODELAY of this process's socket from `local_port` to `port` on loopback."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                if sock.getsockname()[1] == local_port and sock.getpeername()[1] == port:
                    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            except (OSError, IndexError, TypeError):
                continue
    raise AssertionError(f"no socket from port {local_port} to {port}")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_answers_carry_headers_on_one_kept_alive_nodelay_connection(engine, transport):
    async with client(
        engine.port, "ok", transport, headers={"Authorization": "Bearer t0k"}
    ) as policy:
        for _ in range(3):
            completion = await policy.sample([1, 2], PARAMS, session="episode-7")
            assert completion.ids == [7] and completion.logprobs == [-0.5]
        assert engine.connections == 1
        assert nodelay_of_socket_to(engine.port, engine.peers[0]) != 0
    for headers, body in engine.requests:
        assert headers["x-session-id"] == "episode-7"
        assert headers["authorization"] == "Bearer t0k"
        assert headers["content-type"] == "application/json"
        assert body["prompt"] == [1, 2] and body["model"] == "ok"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_what_never_reached_an_engine_is_retried_and_unavailable(engine, transport):
    async with client(engine.port, "busy", transport) as policy:
        with pytest.raises(PolicyUnavailable, match="overloaded"):
            await policy.sample([1], PARAMS)
    assert len(engine.requests) == FAST_RETRY.attempts
    async with client(free_port(), "ok", transport) as policy:
        with pytest.raises(PolicyUnavailable, match="cannot connect"):
            await policy.sample([1], PARAMS)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("hang", "within the timeout"),
        ("drop", "failed mid-request"),
        ("garble", "failed mid-request"),
        ("gateway", "answered 502"),
    ],
)
async def test_what_may_have_run_is_never_repeated(engine, transport, how, says):
    async with client(engine.port, how, transport, timeout=Timeout(read=0.5)) as policy:
        start = time.monotonic()
        with pytest.raises(PolicyOutcomeUnknown, match=says) as caught:
            await policy.sample([1], PARAMS)
        assert time.monotonic() - start < 3
    assert "may have run" in str(caught.value)
    assert len(engine.requests) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_answer_that_is_not_json_is_a_response_error(engine, transport):
    async with client(engine.port, "not-json", transport) as policy:
        with pytest.raises(PolicyResponseError, match="invalid JSON"):
            await policy.sample([1], PARAMS)
    assert len(engine.requests) == 1


def test_an_unknown_transport_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"'curl'.*httptools, aiohttp, httpx, httpx2"):
        client(1, "ok", "curl")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stream_is_told_as_it_arrives_and_adds_up(engine, transport):
    told: list[tuple[float, list[int]]] = []

    async def on_tokens(ids) -> None:
        told.append((time.monotonic(), list(ids)))

    async with client(engine.port, "ok", transport) as policy:
        completion = await policy.sample_streaming([1], PARAMS, on_tokens, session="ep-1")
        done = time.monotonic()
    assert [ids for _, ids in told] == RUNS
    assert completion.ids == [7, 8, 9, 10, 11, 12] and completion.finish_reason == "stop"
    assert completion.logprobs == [-0.5] * 6 and completion.policy.uri == REF["uri"]
    assert done - told[0][0] >= 2 * PACE * 0.9  # the first run was told before the rest came
    ((headers, body),) = engine.requests
    assert body["stream"] is True and headers["x-session-id"] == "ep-1"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("cut", "failed mid-request"),
        ("stall", "within the timeout"),
        ("no-done", "before \\[DONE\\]"),
    ],
)
async def test_a_stream_that_stops_midway_is_never_repeated(engine, transport, how, says):
    told: list[list[int]] = []

    async def on_tokens(ids) -> None:
        told.append(list(ids))

    async with client(engine.port, how, transport, timeout=Timeout(read=0.5)) as policy:
        with pytest.raises(PolicyOutcomeUnknown, match=says):
            await policy.sample_streaming([1], PARAMS, on_tokens)
    assert told[0] == RUNS[0]
    assert len(engine.requests) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stream_that_never_began_is_retried(engine, transport):
    async def on_tokens(ids) -> None:
        raise AssertionError("nothing was streamed")

    async with client(engine.port, "busy", transport) as policy:
        with pytest.raises(PolicyUnavailable, match="overloaded"):
            await policy.sample_streaming([1], PARAMS, on_tokens)
    assert len(engine.requests) == FAST_RETRY.attempts


async def test_a_head_that_never_ends_is_cut_off_and_never_repeated(engine):
    """The default transport drops a connection whose answer's head passes 64 KiB (an
    engine's takes a few hundred bytes), rather than buffering what a broken or hostile
    peer sends; the request may have run, so it is not repeated."""
    async with client(engine.port, "endless-head", "httptools") as policy:
        with pytest.raises(PolicyOutcomeUnknown, match="failed mid-request"):
            await policy.sample([1], PARAMS)
    assert len(engine.requests) == 1
    assert engine.head_sent < ENDLESS_HEAD / 16


async def test_an_answer_nobody_asked_for_is_never_read_as_the_next_one(engine):
    """Bytes that follow a whole answer on a kept-alive connection were not asked for: the
    default transport drops that connection, so the next request opens another and reads
    its own answer, not the one an engine (or whatever is in between) slipped in."""
    async with client(engine.port, "extra", "httptools") as policy:
        for _ in range(2):
            completion = await policy.sample([1], PARAMS)
            assert completion.ids == [7]
    assert engine.connections == 2 and len(engine.requests) == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_engine_that_closes_after_its_answer_gets_a_new_connection(engine, transport):
    async with client(engine.port, "close", transport) as policy:
        for _ in range(3):
            assert (await policy.sample([1], PARAMS)).ids == [7]
    assert engine.connections == 3 and len(engine.requests) == 3


def test_a_header_that_would_break_its_line_is_refused():
    with pytest.raises(ConfigError, match="line break"):
        client(1, "ok", "httptools", headers={"Authorization": "Bearer t0k\r\nX-Admin: 1"})


FILE_LIMIT = 160
"""The soft open-file limit of the process the cap tests sample from (80 connections)."""


async def sample_from_a_small_process(port: int, timeout: str) -> list[str]:
    """300 samples at once from a process allowed `FILE_LIMIT` files, through the default
    transport with `timeout` (a `Timeout(...)` expression): the errors of those that failed."""
    script = textwrap.dedent(
        f"""
        import json, resource, anyio
        from plies import PolicyRef, RetryPolicy
        from plies.policy import SamplingParams, Timeout, VLLMClient
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, hard))

        async def main():
            failed = []
            ref = PolicyRef.model_validate({REF!r})
            async with VLLMClient(
                "http://127.0.0.1:{port}", "slow", policy=ref, timeout={timeout},
                retry=RetryPolicy(attempts=1),
            ) as policy:
                async def one():
                    try:
                        await policy.sample([1], SamplingParams(max_tokens=1))
                    except Exception as e:
                        failed.append(repr(e))
                async with anyio.create_task_group() as tg:
                    for _ in range(300):
                        tg.start_soon(one)
            print(json.dumps(failed))

        anyio.run(main)
        """
    )
    done = await anyio.run_process([sys.executable, "-c", script], check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout)


async def test_the_default_transport_holds_no_more_connections_than_the_file_limit_allows(engine):
    """The aiohttp transport opens at most half the process's file limit in connections, and
    the other samples wait for one instead of failing on "Too many open files" (which
    unbounded, about half of them did)."""
    assert await sample_from_a_small_process(engine.port, "Timeout()") == []
    assert len(engine.requests) == 300
    assert 0 < engine.most_open <= FILE_LIMIT // 2


async def test_a_sample_that_waited_too_long_for_a_connection_was_never_sent(engine):
    """Past the cap, a sample waits for a free connection up to `Timeout.pool` (with the
    connect); one that waited longer is unavailable for want of a connection (never sent, so
    retryable), not an engine that refused, which would mark the engine down."""
    failed = await sample_from_a_small_process(engine.port, "Timeout(connect=0.05, pool=0.05)")
    # Unavailable, never sent: the queued ones for want of a connection (a slow connect of
    # one that did not queue may still read as a refusal, as it should).
    assert all(e.startswith("PolicyUnavailable") for e in failed), [
        e for e in failed if not e.startswith("PolicyUnavailable")
    ][:3]
    assert any("no free connection" in e for e in failed), failed[:3]
    assert len(engine.requests) == 300 - len(failed)
