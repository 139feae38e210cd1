"""OpenAI Responses on the gateway, driven by the official `openai` SDK.

Requests are shaped as Codex 0.171.0 and the Agents SDK send them: the prompt as a
`developer` message, `type`-less items, `namespace` and `web_search` tools beside function
tools, `store: false`, `include: ["reasoning.encrypted_content"]`, the function call echoed
with its ids, its output as a plain string.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gateway_kit import gateway_stack
from test_anthropic import think_ids
from test_gateway_http import assert_recorded_exactly, call_ids

pytestmark = pytest.mark.anyio

TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a command.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {"type": "namespace", "name": "multi_agent_v1", "tools": []},
    {"type": "web_search"},
]
CODEX = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "reasoning": {"summary": "auto"},
    "extra_body": {"prompt_cache_key": "k", "client_metadata": {"a": "b"}},
}


async def run(client, stream: bool, **kwargs):
    if stream:
        async with client.responses.stream(model="codex", **kwargs) as events:
            kinds = [event.type async for event in events]
            final = await events.get_final_response()
        return final, kinds
    return await client.responses.create(model="codex", **kwargs), []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_codex_tool_round_extends_and_reasoning_round_trips(
    policy_server, qwen3_tokenizer, stream
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("codex")
        client = stack.client(key)
        items: list[dict] = [
            {
                "type": "message",
                "id": "m0",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {"role": "user", "content": "Write a file.", "extra": None},
        ]
        shell = (
            '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "touch a"}}\n</tool_call>'
        )
        stack.engine.queue(think_ids(qwen3_tokenizer, "use the shell", shell))
        first, kinds = await run(client, stream, input=items, tools=TOOLS, **CODEX)
        assert first.status == "completed"
        reasoning, call = first.output
        assert reasoning.type == "reasoning"
        assert reasoning.encrypted_content.startswith("plies-turn-")
        assert reasoning.summary[0].text.strip() == "use the shell"
        assert call.type == "function_call" and call.name == "exec_command"
        assert json.loads(call.arguments) == {"cmd": "touch a"}
        assert first.usage.input_tokens == len(stack.engine.requests[0]["prompt"])
        assert first.usage.output_tokens_details.reasoning_tokens > 0
        if stream:
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert "response.function_call_arguments.delta" in kinds
            assert kinds[-1] == "response.completed"

        # Codex echoes the reasoning and the call as it got them, then the output.
        items += [reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True)]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "ok"})
        stack.engine.queue(think_ids(qwen3_tokenizer, "done", "Wrote a."))
        second, kinds = await run(client, stream, input=items, tools=TOOLS, **CODEX)
        (message,) = [o for o in second.output if o.type == "message"]
        assert message.content[0].text == "Wrote a."
        assert second.output_text == "Wrote a."
        assert second.usage.input_tokens_details.cached_tokens > 0
        if stream:
            assert "response.output_text.delta" in kinds and "response.content_part.added" in kinds
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert [t.fallback for t in trajectory.turns] == [None, None]
    assert "dropped_tool.namespace" not in trajectory.metrics  # its functions are served
    assert trajectory.metrics["dropped_tool.web_search"] == 2
    assert_recorded_exactly(trajectory, stack.engine)


NAMESPACED = [
    *TOOLS,
    {
        "type": "namespace",
        "name": "mcp__files",
        "description": "Tools in the mcp__files namespace.",
        "tools": [
            {
                "type": "function",
                "name": "read",
                "description": "Read a file.",
                "strict": False,
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
            {"type": "custom", "name": "patch"},
        ],
    },
]


async def test_a_namespaced_function_is_served_flat_and_called_by_namespace(
    policy_server, qwen3_tokenizer
):
    """Codex sends each MCP server's tools as a namespace; the model sees `mcp__files__read`,
    Codex gets back `namespace="mcp__files", name="read"`, and its echo extends the stored turn."""
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("codex")
        client = stack.client(key)
        items: list[dict] = [{"role": "user", "content": "Read a."}]
        stack.engine.queue(call_ids(qwen3_tokenizer, "mcp__files__read", '{"path": "a"}'))
        first, _ = await run(client, True, input=items, tools=NAMESPACED, **CODEX)
        (call,) = first.output
        assert (call.type, call.namespace, call.name) == ("function_call", "mcp__files", "read")
        assert json.loads(call.arguments) == {"path": "a"}
        prompt = qwen3_tokenizer.decode(stack.engine.requests[0]["prompt"])
        assert '"name": "mcp__files__read"' in prompt and '"patch"' not in prompt

        items += [call.model_dump(exclude_none=True)]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "x"})
        stack.engine.queue(think_ids(qwen3_tokenizer, "done", "a holds x."))
        await run(client, False, input=items, tools=NAMESPACED, **CODEX)

        clash = [*NAMESPACED, {"type": "function", "name": "mcp__files__read"}]
        with pytest.raises(openai.BadRequestError, match="more than once"):
            await client.responses.create(model="codex", input="x", tools=clash)
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert trajectory.metrics["dropped_tool.custom"] == 2
    assert_recorded_exactly(trajectory, stack.engine)


async def test_agents_sdk_shape_and_previous_response_id(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("agents")
        client = stack.client(key)
        stack.engine.queue(call_ids(qwen3_tokenizer, "exec_command", '{"cmd": "ls"}'))
        first = await client.responses.create(
            model="gpt",
            instructions="Be brief.",
            input=[{"role": "user", "content": "List."}],
            tools=TOOLS[:1],
        )
        (call,) = first.output
        # The next request names the previous response and sends only the tool output.
        stack.engine.queue(think_ids(qwen3_tokenizer, "x", "Two files."))
        second = await client.responses.create(
            model="gpt",
            instructions="Be brief.",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a b"}],
            tools=TOOLS[:1],
        )
        assert second.output_text == "Two files."
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as err:
            await client.responses.create(model="gpt", previous_response_id="resp_nope", input="hi")
        assert err.value.body["param"] == "previous_response_id"
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert_recorded_exactly(trajectory, stack.engine)


async def test_refusals_and_a_slow_stream(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, keepalive_s=0.2) as stack:
        key = await stack.gateway.create_session("bad")
        client = stack.client(key)
        image = {"type": "input_image", "image_url": "data:image/png;base64,"}
        cases = [
            ({"input": [{"role": "user", "content": [image]}]}, "input_image"),
            ({"input": "hi", "tools": TOOLS[:1], "tool_choice": "required"}, "tool_choice"),
            ({"input": [{"type": "computer_call", "id": "c"}]}, "computer_call"),
        ]
        for extra, needle in cases:
            with pytest.raises(openai.BadRequestError, match=needle):
                await client.responses.create(model="m", **extra)

        stack.engine.queue(think_ids(qwen3_tokenizer, "slow", "Late."), delay=1.2)
        body = {"model": "m", "input": "hi", "stream": True}
        async with httpx.AsyncClient(timeout=30) as raw:
            resp = await raw.post(
                stack.url + "/responses", json=body, headers={"authorization": f"Bearer {key}"}
            )
        events = [
            json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")
        ]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.in_progress") >= 4  # the keepalive while sampling
        assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "Late."
        await stack.gateway.finish_session(key)
