"""Replies stream while the engine samples: the gateway forwards each dialect's text deltas as
the engine's tokens arrive, holds back tool calls until the turn is whole, and what the
agent assembled from the stream is what the next turn extends.

The engine is the recording engine of `gateway_kit`, streaming its (scripted) answers a few
ids at a time with a pause between chunks; the last test samples the real reference server
through its own stream.
"""

from __future__ import annotations

import time

import openai
import pytest
from gateway_kit import gateway_stack
from test_anthropic import client_for, think_ids
from test_gateway_http import assert_recorded_exactly, call_ids

from plies.gateway import Gateway, GatewayServer
from plies.policy import SamplingParams, VLLMClient
from plies.tokens import ChatRenderer

pytestmark = pytest.mark.anyio

PACE = 0.1
"""Seconds between the engine's chunks."""
SLOW_TEXT = " ".join(f"word{i}" for i in range(30)) + "."


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def before_the_end(arrivals: list[float], engine) -> int:
    """How many deltas arrived before the engine sent its last chunk."""
    return sum(t < engine.chunks_sent[-1] for t in arrivals)


async def test_chat_text_arrives_while_the_engine_samples(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=200) as stack:
        key = await stack.gateway.create_session("chat")
        client = stack.client(key)
        stack.engine.queue(encode(qwen3_tokenizer, SLOW_TEXT + "<|im_end|>"), pace=PACE)
        messages: list[dict] = [{"role": "user", "content": "count slowly"}]
        arrivals, text = [], ""
        stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                text += chunk.choices[0].delta.content
        assert text == SLOW_TEXT
        # 23 chunks 0.1 s apart: most of the text was on the agent's screen before the end.
        assert before_the_end(arrivals, stack.engine) >= 5

        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        stack.engine.queue(encode(qwen3_tokenizer, "Done.<|im_end|>"))
        await client.chat.completions.create(model="m", messages=messages)
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert_recorded_exactly(trajectory, stack.engine)


async def test_anthropic_thinking_text_then_a_whole_tool_call(policy_server, qwen3_tokenizer):
    sampled = encode(
        qwen3_tokenizer,
        f"<think>\nI should look first\n</think>\n\n{SLOW_TEXT}\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
        "<|im_end|>",
    )
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=200) as stack:
        key = await stack.gateway.create_session("cc")
        client = client_for(stack, key)
        stack.engine.queue(sampled, pace=PACE)
        tool = {"name": "Bash", "input_schema": {"type": "object"}}
        messages: list[dict] = [{"role": "user", "content": "look around"}]
        seen: list[tuple[str, int, float]] = []
        text_at: list[float] = []
        async with client.messages.stream(
            model="m", max_tokens=200, messages=messages, tools=[tool]
        ) as events:
            async for event in events:
                if event.type.startswith("content_block"):
                    seen.append((event.type, event.index, time.monotonic()))
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text_at.append(time.monotonic())
            final = await events.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        thinking, text, call = final.content
        assert thinking.thinking.strip() == "I should look first"
        assert thinking.signature.startswith("plies-turn-")
        assert text.text == SLOW_TEXT
        assert call.input == {"command": "ls -la"} and final.stop_reason == "tool_use"
        # Blocks in order, one at a time; the text was streamed, the call sent at the end.
        assert [(kind, index) for kind, index, _ in seen if kind != "content_block_delta"] == [
            ("content_block_start", 0),
            ("content_block_stop", 0),
            ("content_block_start", 1),
            ("content_block_stop", 1),
            ("content_block_start", 2),
            ("content_block_stop", 2),
        ]
        assert before_the_end(text_at, stack.engine) >= 5
        tool_started = next(t for kind, i, t in seen if kind == "content_block_start" and i == 2)
        assert tool_started >= stack.engine.chunks_sent[-1]

        # Claude Code sends the blocks back as it assembled them, then the tool's result.
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in final.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "a b"}],
            },
        ]
        stack.engine.queue(think_ids(qwen3_tokenizer, "seen", "Two files."))
        await client.messages.create(model="m", max_tokens=50, messages=messages, tools=[tool])
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert [t.fallback for t in trajectory.turns] == [None, None]
    assert_recorded_exactly(trajectory, stack.engine)


async def test_responses_reasoning_then_streamed_text_and_the_replay_extends(
    policy_server, qwen3_tokenizer
):
    sampled = encode(
        qwen3_tokenizer,
        f"<think>\nplan it\n</think>\n\n{SLOW_TEXT}\n"
        '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
        "<|im_end|>",
    )
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=200) as stack:
        key = await stack.gateway.create_session("codex")
        client = stack.client(key)
        stack.engine.queue(sampled, pace=PACE)
        items: list[dict] = [{"role": "user", "content": "explain"}]
        kinds: list[str] = []
        text_at: list[float] = []
        async with client.responses.stream(model="m", input=items, tools=tools) as events:
            async for event in events:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text_at.append(time.monotonic())
            final = await events.get_final_response()
        assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
        assert final.output_text == SLOW_TEXT
        assert before_the_end(text_at, stack.engine) >= 5
        # Each item closed before the next opened, the call once the turn was whole.
        added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"]
        done = [i for i, k in enumerate(kinds) if k == "response.output_item.done"]
        assert added[0] < done[0] < added[1] < done[1] < added[2] < done[2]

        call = final.output[2]
        items += [o.model_dump(exclude_none=True) for o in final.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a b"})
        stack.engine.queue(think_ids(qwen3_tokenizer, "seen", "Two files."))
        await client.responses.create(model="m", input=items, tools=tools)
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]
    assert [t.fallback for t in trajectory.turns] == [None, None]
    assert_recorded_exactly(trajectory, stack.engine)


async def test_nothing_past_a_stop_string_is_streamed(policy_server, qwen3_tokenizer):
    sampled = encode(qwen3_tokenizer, f"{SLOW_TEXT} STOP and then {SLOW_TEXT}<|im_end|>")
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=200) as stack:
        key = await stack.gateway.create_session("stop")
        client = stack.client(key)
        stack.engine.queue(sampled, pace=0.01)
        pieces = []
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], stop=["STOP"], stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces).strip() == SLOW_TEXT
        assert len(pieces) > 1
        await stack.gateway.finish_session(key)


async def test_a_tool_call_alone_is_sent_whole_and_recorded_exactly(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, max_tokens=200) as stack:
        key = await stack.gateway.create_session("call")
        client = stack.client(key)
        stack.engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"), pace=0.05)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "play"}],
            tools=[{"type": "function", "function": {"name": "hit", "parameters": {}}}],
            stream=True,
        )
        contents, calls = [], []
        async for chunk in stream:
            if chunk.choices:
                contents.append(chunk.choices[0].delta.content)
                calls += chunk.choices[0].delta.tool_calls or []
        assert not any(contents)  # no marker text leaked out as content
        assert calls[0].function.name == "hit"
        trajectory = await stack.gateway.finish_session(key)
    assert_recorded_exactly(trajectory, stack.engine)


async def test_the_reference_server_streams_through_the_gateway_exactly(
    policy_server, qwen3_tokenizer
):
    """No recording engine: `VLLMClient` streams from `plies serve` itself; the turn the
    gateway records is the completion the same seeded request gets unstreamed."""
    params = SamplingParams(max_tokens=40, seed=7)
    async with (
        VLLMClient(policy_server.url, policy_server.model) as sampler,
        Gateway(sampler, ChatRenderer(qwen3_tokenizer), sampling=params) as gateway,
        GatewayServer(gateway) as server,
    ):
        key = await gateway.create_session("real")
        async with openai.AsyncOpenAI(base_url=server.url, api_key=key, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "say something"}], stream=True
            )
            chunks = [c async for c in stream]
        trajectory = await gateway.finish_session(key)
        (turn,) = trajectory.turns
        again = await sampler.sample(trajectory.prompt_ids(0), params)
    assert turn.completion_ids == again.ids and turn.logprobs == again.logprobs
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert turn.message is not None
    assert streamed == (turn.message["content"] or "")
