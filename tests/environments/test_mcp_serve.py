"""A plies env's tools served over MCP, used by the `mcp` SDK's own client and by `McpEnv`."""

from __future__ import annotations

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from scripted_policy import ScriptedPolicy

from plies import Status
from plies.environments import BlackjackEnv, EnvMcpServer, McpHost, McpServer, Task
from plies.harness import ToolCallingHarness
from plies.policy import SamplingParams
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio


async def test_the_mcp_sdk_client_plays_a_hand_of_blackjack_through_the_served_env():
    async with BlackjackEnv() as env:
        opening = await env.reset(Task(id="hand", seed=3))
        async with EnvMcpServer(env) as server:
            async with (
                httpx.AsyncClient(headers=server.headers) as http,
                streamable_http_client(server.url, http_client=http) as (read, write, _),
                ClientSession(read, write) as client,
            ):
                await client.initialize()
                listed = await client.list_tools()
                assert {t.name for t in listed.tools} == {"hit", "stand"}
                schemas = {t.name: t.inputSchema for t in listed.tools}
                assert schemas == {t.name: t.parameters for t in env.tools()}
                bad = await client.call_tool("hit", {"cards": 3})
                assert bad.isError and "cards" in bad.content[0].text
                result = await client.call_tool("stand", {})
                assert not result.isError
                late = await client.call_tool("hit", {})
                assert late.isError and "done" in late.content[0].text
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
