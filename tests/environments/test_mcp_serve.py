"""A plies env's tools served over MCP, used by the `mcp` SDK's own client and by `McpEnv`.

The SDK's client is driven as each major line wants it (`.ci/mcp2-tier` runs this file on 2.x):
2.x takes an `httpx2` client, yields two streams, and names fields in snake_case.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from scripted_policy import ScriptedPolicy

from plies import Status
from plies.environments import BlackjackEnv, McpHost, McpServer, Task
from plies.environments.mcp_server import EnvMcpServer
from plies.harness import ToolCallingHarness
from plies.policy import SamplingParams
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

V2 = int(version("mcp").split(".")[0]) >= 2


def http_client(headers: dict[str, str]) -> Any:
    if V2:
        import httpx2

        return httpx2.AsyncClient(headers=headers)
    return httpx.AsyncClient(headers=headers)


def schema_of(tool: Any) -> Any:
    return tool.input_schema if V2 else tool.inputSchema


def is_error(result: Any) -> bool:
    return bool(result.is_error if V2 else result.isError)


async def test_the_mcp_sdk_client_plays_a_hand_of_blackjack_through_the_served_env():
    async with BlackjackEnv() as env:
        opening = await env.reset(Task(id="hand", seed=3))
        async with EnvMcpServer(env) as server:
            async with (
                http_client(server.headers) as http,
                streamable_http_client(server.url, http_client=http) as streams,
                ClientSession(streams[0], streams[1]) as client,
            ):
                await client.initialize()
                listed = await client.list_tools()
                assert {t.name for t in listed.tools} == {"hit", "stand"}
                schemas = {t.name: schema_of(t) for t in listed.tools}
                assert schemas == {t.name: t.parameters for t in env.tools()}
                bad = await client.call_tool("hit", {"cards": 3})
                assert is_error(bad) and "cards" in bad.content[0].text
                result = await client.call_tool("stand", {})
                assert not is_error(result)
                late = await client.call_tool("hit", {})
                assert is_error(late) and "done" in late.content[0].text
            assert env.done
            [refused, stood] = server.results
            assert refused.error and stood.done
            assert server.reward == stood.reward in (-1.0, 0.0, 1.0)
            assert result.content[0].text == stood.content
    assert "dealer" in opening.messages[-1]["content"].lower()


async def test_the_served_env_refuses_a_client_without_its_token():
    async with BlackjackEnv() as env:
        await env.reset(Task(id="hand", seed=1))
        async with EnvMcpServer(env) as server, httpx.AsyncClient() as http:
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
            headers = {"Accept": "application/json, text/event-stream"}
            for sent in ({}, {"Authorization": "Bearer wrong"}):
                response = await http.post(server.url, json=body, headers={**headers, **sent})
                assert response.status_code == 401
            big = await http.post(
                server.url, content=b"x" * (2 << 20), headers={**headers, **server.headers,
                                                               "Content-Type": "application/json"}
            )  # fmt: skip
            assert big.status_code == 413
            assert server.results == []


async def test_mcp_env_plays_a_served_env_over_http_through_the_harness(qwen3_tokenizer):
    """Both directions at once: plies' MCP client env drives plies' served env."""

    async def script(session: str, turn: int, prompt: str):
        return [("stand", {})] if turn == 0 else [("submit", {"answer": "stood"})]

    async with BlackjackEnv() as inner:
        await inner.reset(Task(id="hand", seed=5))
        harness = ToolCallingHarness(
            ChatRenderer(qwen3_tokenizer),
            ScriptedPolicy(qwen3_tokenizer, script),
            SamplingParams(max_tokens=64),
        )
        async with (
            EnvMcpServer(inner) as server,
            McpHost(McpServer.http(server.url, headers=server.headers)) as host,
            host.env() as env,
        ):
            traj = await harness.run(env, Task(id="t", data={"prompt": "Play."}))
    assert traj.status is Status.COMPLETED
    assert inner.done and server.results[0].done
    tool_text = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_text[0] == server.results[0].content


async def test_a_request_that_outlives_the_session_manager_is_answered_not_a_traceback(caplog):
    """Closing the server stops the SDK's session manager while uvicorn may still hold a
    request (an agent's call cut off by a cancelled episode): it gets a 503, and the run's log
    no SDK traceback."""
    async with BlackjackEnv() as env:
        await env.reset(Task(id="hand", seed=2))
        body = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
        async with EnvMcpServer(env) as server:
            port = int(server.url.rsplit(":", 1)[1].split("/")[0])
            stream = await anyio.connect_tcp("127.0.0.1", port)
            head = (
                f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Accept: application/json, text/event-stream\r\n"
                f"Authorization: {server.headers['Authorization']}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            await stream.send(head.encode() + body[:10])
            await anyio.sleep(0.2)  # the request is in uvicorn's hands, waiting on its body
        async with stream:
            await stream.send(body[10:])
            with anyio.fail_after(30):
                answer = await stream.receive()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert "closing" in answer.decode(errors="replace")
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [m for m in logged if "ASGI" in m], logged
