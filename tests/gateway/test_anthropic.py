"""Anthropic Messages on the gateway, driven by the official `anthropic` SDK.

Requests are shaped as Claude Code 2.1.197 sends them (docs/agent-wire notes): a system of
text blocks led by a per-request billing-header block, a `role: "system"` message inside
`messages`, `thinking`, `context_management`, `output_config`, `metadata`, eight betas,
`cache_control` on blocks; tool calls answered by a scripted engine in Qwen3's own format.
"""

from __future__ import annotations

import anthropic
import anyio
import httpx
import pytest
from gateway_kit import gateway_stack
from test_gateway_http import assert_recorded_exactly, call_ids

pytestmark = pytest.mark.anyio

BETAS = (
    "claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,effort-2025-11-24"
)
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
}
CACHE = {"type": "ephemeral"}


def system(n: int) -> list[dict]:
    """Claude Code's three system blocks; the first changes on every request."""
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197; cch={n:05d};"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": CACHE},
        {"type": "text", "text": "Use the Bash tool to act.", "cache_control": CACHE},
    ]


def claude_code_extras(n: int) -> dict:
    return {
        "system": system(n),
        "tools": [BASH, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": "u"},
        "extra_body": {
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": []},
            "output_config": {"effort": "high"},
        },
        "extra_headers": {"anthropic-beta": BETAS, "x-app": "cli"},
    }


def client_for(stack, key: str) -> anthropic.AsyncAnthropic:
    """An official anthropic client for `key`, closed with the stack."""
    base = stack.url.removesuffix("/v1")
    client = anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0)
    stack.clients.append(client)
    return client


def think_ids(tokenizer, reasoning: str, text: str) -> list[int]:
    return tokenizer.encode(
        f"<think>\n{reasoning}\n</think>\n\n{text}<|im_end|>", add_special_tokens=False
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_claude_code_tool_round_extends_the_stored_tokens(
    policy_server, qwen3_tokenizer, stream
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("cc")
        client = client_for(stack, key)
        messages: list[dict] = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                    {"type": "text", "text": "List the files.", "cache_control": CACHE},
                ],
            },
            {"role": "system", "content": "The working directory is /work."},
        ]

        async def ask(n: int):
            extras = claude_code_extras(n)
            if stream:
                async with client.messages.stream(
                    model="claude-opus", max_tokens=64000, messages=messages, **extras
                ) as events:
                    return await events.get_final_message()
            # The SDK insists on streaming for 64000 tokens; a non-streaming agent asks less.
            return await client.messages.create(
                model="claude-opus", max_tokens=4096, messages=messages, **extras
            )

        stack.engine.queue(call_ids(qwen3_tokenizer, "Bash", '{"command": "ls"}'))
        first = await ask(1)
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert use.type == "tool_use" and use.id.startswith("toolu_")
        assert use.name == "Bash" and use.input == {"command": "ls"}
        assert first.usage.cache_read_input_tokens == 0

        messages.append({"role": "assistant", "content": [use.model_dump()]})
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "a.txt\nb.txt"}
        messages.append(
            {"role": "user", "content": [{**result, "is_error": False, "cache_control": CACHE}]}
        )
        stack.engine.queue(think_ids(qwen3_tokenizer, "two files", "a.txt and b.txt"))
        second = await ask(2)  # a new billing header: stripped, so the turn still extends
        assert second.stop_reason == "end_turn"
        thinking, text = second.content
        assert thinking.type == "thinking" and thinking.thinking.strip() == "two files"
        assert thinking.signature.startswith("plies-turn-")
        assert text.type == "text" and text.text == "a.txt and b.txt"
        assert second.usage.cache_read_input_tokens > 0
        total = second.usage.input_tokens + second.usage.cache_read_input_tokens
        assert total == len(stack.engine.requests[1]["prompt"])

        # The thinking block is replayed as sent, with its signature: still an extension.
        messages.append({"role": "assistant", "content": [b.model_dump() for b in second.content]})
        messages.append({"role": "user", "content": "Thanks."})
        stack.engine.queue(think_ids(qwen3_tokenizer, "done", "Bye."))
        await ask(3)
        trajectory = await stack.gateway.finish_session(key, reward=1.0)
    # Qwen3's own template strips reasoning once a user speaks again, so the third prompt
    # is a full render and says why (TRL's training variant, template="auto", keeps it).
    assert [t.extends for t in trajectory.turns] == [False, True, False]
    assert [t.fallback for t in trajectory.turns] == [None, None, "reasoning_stripped"]
    assert trajectory.metrics["dropped_tool.web_search_20250305"] == 3
    assert_recorded_exactly(trajectory, stack.engine)
    prompt = qwen3_tokenizer.decode(trajectory.prompt_ids(0))
    assert "billing-header" not in prompt
    assert "You are Claude Code.\n\nUse the Bash tool to act." in prompt
    assert "The working directory is /work." in prompt


async def test_count_tokens_is_the_rendered_prompt_length(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("count")
        client = client_for(stack, key)
        messages: list[dict] = [{"role": "user", "content": "List the files."}]
        extras = {"system": system(1), "tools": [BASH]}
        counted = await client.messages.count_tokens(model="m", messages=messages, **extras)
        stack.engine.queue(call_ids(qwen3_tokenizer, "Bash", '{"command": "ls"}'))
        first = await client.messages.create(model="m", max_tokens=100, messages=messages, **extras)
        assert counted.input_tokens == len(stack.engine.requests[0]["prompt"])
        messages += [
            {"role": "assistant", "content": [first.content[0].model_dump()]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": first.content[0].id, "content": "x"}
                ],
            },
        ]
        # On the extension path too: counting forks the stored conversation, advancing none.
        counted = await client.messages.count_tokens(model="m", messages=messages, **extras)
        again = await client.messages.count_tokens(model="m", messages=messages, **extras)
        stack.engine.queue(think_ids(qwen3_tokenizer, "ok", "done"))
        await client.messages.create(model="m", max_tokens=100, messages=messages, **extras)
        assert counted.input_tokens == again.input_tokens == len(stack.engine.requests[1]["prompt"])
        trajectory = await stack.gateway.finish_session(key)
    assert [t.extends for t in trajectory.turns] == [False, True]


async def test_a_slow_completion_streams_pings_then_the_reply(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer, keepalive_s=0.2) as stack:
        key = await stack.gateway.create_session("slow")
        stack.engine.queue(think_ids(qwen3_tokenizer, "hmm", "Slow answer."), delay=1.5)
        body = {
            "model": "m",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with httpx.AsyncClient(timeout=30) as raw:
            resp = await raw.post(
                stack.url + "/messages?beta=true", json=body, headers={"x-api-key": key}
            )
        names = [line[7:] for line in resp.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start"
        assert names.count("ping") >= 4  # one at the opening, then every 0.2 s of 1.5 s
        assert names[-2:] == ["message_delta", "message_stop"]
        first_block = names.index("content_block_start")
        assert set(names[1:first_block]) == {"ping"}

        # The SDK's own stream parser accepts the same stream.
        stack.engine.queue(think_ids(qwen3_tokenizer, "hmm", "Again."), delay=0.6)
        client = client_for(stack, key)
        async with client.messages.stream(
            model="m",
            max_tokens=50,
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Slow answer."},
                {"role": "user", "content": "again"},
            ],
        ) as events:
            final = await events.get_final_message()
        assert final.content[-1].text == "Again."
        await stack.gateway.finish_session(key)


async def test_stop_sequences_cut_the_completion_and_the_next_turn_extends(
    policy_server, qwen3_tokenizer
):
    stop = "</answer>"
    assert len(qwen3_tokenizer.encode(stop, add_special_tokens=False)) > 1
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("stop")
        client = client_for(stack, key)
        sampled = qwen3_tokenizer.encode(
            "<answer>42</answer> and more text<|im_end|>", add_special_tokens=False
        )
        stack.engine.queue(sampled)
        messages: list[dict] = [{"role": "user", "content": "answer"}]
        reply = await client.messages.create(
            model="m", max_tokens=50, messages=messages, stop_sequences=[stop, "never"]
        )
        assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
        assert reply.content[0].text == "<answer>42"
        messages += [{"role": "assistant", "content": reply.content[0].text + stop}]
        messages += [{"role": "user", "content": "again"}]
        await client.messages.create(model="m", max_tokens=5, messages=messages)
        trajectory = await stack.gateway.finish_session(key)
    first = trajectory.turns[0]
    assert qwen3_tokenizer.decode(first.completion_ids).endswith("</answer>")
    assert first.completion_ids == sampled[: len(first.completion_ids)]
    assert first.logprobs == stack.engine.sampled(0)[1][: len(first.completion_ids)]
    assert first.finish_reason == "abort"


async def test_a_one_token_stop_inside_a_longer_token_still_stops(policy_server, qwen3_tokenizer):
    """`"\n"` is one token, handed to the engine as a stop id; the sampled token `".\n\n"`
    holds it without being it, so only the gateway's text match can stop there."""
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("stop-in-token")
        client = client_for(stack, key)
        text = "Line one.\n\nLine two<|im_end|>"
        sampled = qwen3_tokenizer.encode(text, add_special_tokens=False)
        assert ".\n\n" in [qwen3_tokenizer.decode([i]) for i in sampled]
        stack.engine.queue(sampled)
        messages = [{"role": "user", "content": "two lines"}]
        reply = await client.messages.create(
            model="m", max_tokens=50, messages=messages, stop_sequences=["\n"]
        )
        assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "\n"
        assert reply.content[0].text == "Line one."
        trajectory = await stack.gateway.finish_session(key)
    (turn,) = trajectory.turns
    assert qwen3_tokenizer.decode(turn.completion_ids) == "Line one.\n\n"
    assert turn.completion_ids == sampled[:3] and turn.finish_reason == "abort"


async def test_refusals_use_anthropic_errors(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("bad")
        client = client_for(stack, key)
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": ""},
        }
        cases = [
            ({"messages": [{"role": "user", "content": [image]}]}, "image content"),
            (
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [BASH],
                    "tool_choice": {"type": "any"},
                },
                "tool_choice 'any'",
            ),
            ({"messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 17}, "17"),
        ]
        for extra, needle in cases:
            with pytest.raises(anthropic.BadRequestError, match=needle) as err:
                await client.messages.create(model="m", max_tokens=5, **extra)
            assert err.value.body["type"] == "error"
        with pytest.raises(anthropic.AuthenticationError):
            await client_for(stack, "plies-sk-nope").messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        async with httpx.AsyncClient() as raw:
            assert (await raw.head(stack.url.removesuffix("/v1") + "/")).status_code == 200
            listed = await raw.get(
                stack.url + "/models", headers={"x-api-key": key, "anthropic-version": "2023-06-01"}
            )
            assert listed.json()["data"][0]["type"] == "model"
        await stack.gateway.finish_session(key)


async def test_a_stream_cut_off_after_it_opened_ends_with_an_error_event(
    policy_server, qwen3_tokenizer
):
    async with gateway_stack(policy_server, qwen3_tokenizer, keepalive_s=0.1) as stack:
        key = await stack.gateway.create_session("cut")
        stack.engine.queue(think_ids(qwen3_tokenizer, "x", "late"), delay=8.0)
        client = client_for(stack, key)
        seen: list[str] = []

        async def finish_soon() -> None:
            while "message_start" not in seen:  # the SDK skips pings
                await anyio.sleep(0.05)
            await stack.gateway.drop_session(key)

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_soon)
            with pytest.raises(anthropic.APIStatusError, match="session"):
                async with client.messages.stream(
                    model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
                ) as events:
                    async for event in events:
                        seen.append(event.type)
        assert seen[0] == "message_start"
