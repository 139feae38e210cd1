"""The gateway end to end: the official openai client, uvicorn, VLLMClient, the reference server.

Every test compares the captured trajectory with what the engine answered (ids and logprobs,
turn for turn) and with what it was asked (each full prompt).
"""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest
from gateway_kit import TOOLS, gateway_stack

from plies import Status

pytestmark = pytest.mark.anyio


def call_ids(tokenizer, name: str, arguments: str) -> list[int]:
    """A tool call exactly as the Qwen3 template writes one, closed by <|im_end|>."""
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'
    return tokenizer.encode(text, add_special_tokens=False)


def assert_recorded_exactly(trajectory, engine) -> None:
    """Turn k holds exactly the engine's k-th answer, and was prompted with its k-th prompt."""
    assert len(trajectory.turns) == len(engine.answers)
    for k, turn in enumerate(trajectory.turns):
        ids, logprobs = engine.sampled(k)
        assert turn.completion_ids == ids
        assert turn.logprobs == logprobs
        assert trajectory.prompt_ids(k) == engine.requests[k]["prompt"]


async def collect_stream(stream) -> dict:
    """Reassemble a streamed reply into a message, the way agent frameworks do."""
    content, calls, finish = "", {}, None
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return {"message": message, "finish_reason": finish}


async def ask(client, messages, *, stream: bool, **kwargs) -> dict:
    if stream:
        chunks = await client.chat.completions.create(
            model="policy", messages=messages, stream=True, **kwargs
        )
        return await collect_stream(chunks)
    reply = await client.chat.completions.create(model="policy", messages=messages, **kwargs)
    return {
        "message": reply.choices[0].message.model_dump(exclude_none=True),
        "finish_reason": reply.choices[0].finish_reason,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_tool_calling_conversation_records_what_the_sampler_returned(
    policy_server, qwen3_tokenizer, stream
):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        engine = stack.engine
        key = await stack.gateway.create_session("hand-1")
        client = stack.client(key)
        messages = [{"role": "user", "content": "You hold 12. The dealer shows 7."}]

        engine.queue(call_ids(qwen3_tokenizer, "bet", '{"amount": 3}'))
        first = await ask(client, messages, stream=stream, tools=TOOLS)
        assert first["finish_reason"] == "tool_calls"
        (call,) = first["message"]["tool_calls"]
        assert call["id"].startswith("call_")
        assert call["function"]["name"] == "bet"
        assert json.loads(call["function"]["arguments"]) == {"amount": 3}

        # The agent echoes the call reformatted: a new id, other JSON spacing, "" content.
        echoed = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "agent-own-id",
                    "type": "function",
                    "function": {"name": "bet", "arguments": '{ "amount":3 }'},
                }
            ],
        }
        messages += [echoed, {"role": "tool", "tool_call_id": "agent-own-id", "content": "ok"}]
        engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"))
        second = await ask(client, messages, stream=stream, tools=TOOLS)
        assert second["message"]["tool_calls"][0]["function"]["name"] == "hit"

        # Third turn: the tiny model itself answers (random text, through the real server).
        messages += [second["message"], {"role": "tool", "content": "you drew a 4"}]
        messages[-1]["tool_call_id"] = second["message"]["tool_calls"][0]["id"]
        third = await ask(client, messages, stream=stream, tools=TOOLS)
        assert third["finish_reason"] in ("stop", "length", "tool_calls")

        trajectory = await stack.gateway.finish_session(key, reward=1.0)

    assert_recorded_exactly(trajectory, engine)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    assert [t.extends for t in trajectory.turns] == [False, True, True]
    assert [t.fallback for t in trajectory.turns] == [None, None, None]
    assert len(trajectory.segments()) == 1
    assert engine.answers[2].get("plies_policy") == policy_server.policy
    assert trajectory.turns[2].policy.model_dump() == policy_server.policy
    # The recorded message is what the agent was sent, and parsed from the sampled ids.
    assert trajectory.turns[0].message["tool_calls"][0]["function"]["name"] == "bet"
    assert trajectory.messages[-1]["role"] == "assistant"


async def test_history_rewrite_forks_a_new_segment_with_a_reason(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("hand-2")
        client = stack.client(key)
        messages = [{"role": "user", "content": "You hold 15."}]
        stack.engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"))
        first = await ask(client, messages, stream=False, tools=TOOLS)
        messages += [first["message"], {"role": "tool", "content": "you drew a 9"}]
        messages[-1]["tool_call_id"] = first["message"]["tool_calls"][0]["id"]

        # The agent summarises its history: the first user turn is rewritten.
        edited = [{"role": "user", "content": "Summary: you hold 15 and hit."}, *messages[1:]]
        stack.engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"))
        second = await ask(client, edited, stream=False, tools=TOOLS)
        assert second["message"]["tool_calls"][0]["function"]["name"] == "hit"

        # Extending the edited history is incremental again.
        edited += [second["message"], {"role": "tool", "content": "you drew a 2"}]
        edited[-1]["tool_call_id"] = second["message"]["tool_calls"][0]["id"]
        await ask(client, edited, stream=False, tools=TOOLS)
        trajectory = await stack.gateway.finish_session(key)

    assert_recorded_exactly(trajectory, stack.engine)
    assert [t.extends for t in trajectory.turns] == [False, False, True]
    assert trajectory.turns[1].fallback == "history_edited"
    assert trajectory.metrics["fallback.history_edited"] == 1
    assert [s.turns for s in trajectory.segments()] == [(0, 1), (1, 3)]
    # The forked prompt is the full render of the edited history, so the answer is correct.
    template_view = [
        edited[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "hit", "arguments": {}}}],
        },
        {"role": "tool", "content": "you drew a 9"},
    ]
    expected = qwen3_tokenizer.apply_chat_template(
        template_view, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert trajectory.prompt_ids(1) == list(expected)


async def test_ill_formed_completion_is_plain_text_not_an_error(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("hand-3")
        client = stack.client(key)
        broken = qwen3_tokenizer.encode(
            '<tool_call>\n{"name": "hit", "arguments": {oops\n</tool_call><|im_end|>',
            add_special_tokens=False,
        )
        stack.engine.queue(broken)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "go"}], tools=TOOLS
        )
        trajectory = await stack.gateway.finish_session(key)

    message = reply.choices[0].message
    assert message.tool_calls is None and "oops" in message.content
    assert trajectory.turns[0].ill_formed and trajectory.metrics["ill_formed"] == 1
    assert_recorded_exactly(trajectory, stack.engine)


async def test_keys_are_checked_and_sessions_isolated(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        gw = stack.gateway
        a, b = await gw.create_session("a"), await gw.create_session("b")
        client_a = stack.client(a)
        await client_a.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "only a"}]
        )
        for bad in ("plies-sk-not-a-key", b + "x", a[:-1]):
            client = stack.client(bad)
            with pytest.raises(openai.AuthenticationError, match="not recognised"):
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}]
                )
        async with httpx.AsyncClient() as raw:
            resp = await raw.post(f"{stack.url}/chat/completions", json={"messages": []})
            assert resp.status_code == 401
            assert "missing bearer key" in resp.json()["error"]["message"]
            resp = await raw.get(f"{stack.url}/models", headers={"authorization": f"Bearer {a}"})
            assert resp.json()["data"][0]["id"] == "plies-policy"

        traj_b = await gw.finish_session(b)
        assert traj_b.turns == [] and traj_b.messages == []
        traj_a = await gw.finish_session(a)
        assert traj_a.messages[0]["content"] == "only a"
        await gw.create_session("c")
        for finished in (a, b):
            client = stack.client(finished)
            with pytest.raises(openai.AuthenticationError, match="finished or dropped"):
                await client.models.list()
        dropped = await gw.create_session("d")
        await gw.drop_session(dropped)
        with pytest.raises(openai.AuthenticationError):
            client = stack.client(dropped)
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )


async def test_bad_requests_get_openai_errors(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("bad")
        client = stack.client(key)
        user = [{"role": "user", "content": "hi"}]
        cases = [
            ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
            ({"n": 2}, "n"),
            ({"stop": ["x"] * 17}, "stop"),
            ({"stop": ["y" * 129]}, "stop"),
            ({"temperature": 7}, "temperature"),
        ]
        for extra, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=user, **extra)
            assert err.value.body["param"] == param, err.value.body
        async with httpx.AsyncClient() as raw:
            resp = await raw.post(
                f"{stack.url}/chat/completions",
                content=b"{not json",
                headers={"authorization": f"Bearer {key}"},
            )
            assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
        # None of it was recorded, and the session still works.
        reply = await client.chat.completions.create(model="policy", messages=user, stop="\n\n")
        assert reply.choices[0].finish_reason in ("stop", "length")
        trajectory = await stack.gateway.finish_session(key)
    assert len(trajectory.turns) == 1
    assert_recorded_exactly(trajectory, stack.engine)


async def test_a_reply_the_client_never_got_is_not_recorded(policy_server, qwen3_tokenizer):
    async with gateway_stack(policy_server, qwen3_tokenizer) as stack:
        key = await stack.gateway.create_session("impatient")
        impatient = stack.client(key, timeout=0.5)
        stack.engine.queue(call_ids(qwen3_tokenizer, "hit", "{}"), delay=2.0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "go"}], tools=TOOLS
            )
        await anyio.sleep(2.5)  # the engine answers after the client left
        client = stack.client(key)
        stack.engine.queue(call_ids(qwen3_tokenizer, "stand", "{}"))
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "go"}], tools=TOOLS
        )
        trajectory = await stack.gateway.finish_session(key)

    assert len(stack.engine.answers) == 2
    assert len(trajectory.turns) == 1
    assert trajectory.turns[0].completion_ids == stack.engine.sampled(1)[0]
